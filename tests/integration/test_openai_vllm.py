"""The OpenAI-compatible HTTP door in front of a REAL vLLM CPU server (tiny local
model), driven by the official ``openai`` client: complete, chat and stream go
through the sidecar's bins and come back in vLLM's own shape; other paths
(``/v1/models``, ``/tokenize``) reach vLLM unchanged."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from sidecar_harness import running_sidecar, sidecar_config

pytestmark = pytest.mark.vllm

TIMEOUT = 120.0


def _client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def _sidecar_client(sc) -> openai.AsyncOpenAI:
    return _client(f"http://127.0.0.1:{sc.sidecar.http_port}")


async def test_openai_client_completes_chats_and_streams_through_the_sidecar_to_vllm(vllm_server, tmp_path):
    doc = sidecar_config(vllm_server.base_url, batch={"mode": "Continuous"}, bins={"count": 2, "maxOutputTokens": 64})
    async with running_sidecar(doc, tmp_path) as sc:
        client = _sidecar_client(sc)
        try:
            raw = await client.completions.with_raw_response.create(
                model=vllm_server.model, prompt="Hello, my name is", max_tokens=8, extra_body={"ignore_eos": True},
                extra_headers={"x-expected-output-tokens": "8"},
            )  # fmt: skip
            done = raw.parse()
            assert done.usage.completion_tokens == 8 and done.choices[0].text
            assert raw.headers["x-binbatch-bin"] == "0" and raw.headers["x-binbatch-predicted-tokens"] == "8"

            chat = await client.chat.completions.create(
                model=vllm_server.model, messages=[{"role": "user", "content": "Say hi"}], max_completion_tokens=6,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 6

            greedy = {"model": vllm_server.model, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0.0,
                      "extra_body": {"ignore_eos": True}}  # fmt: skip
            stream = await client.completions.create(
                **greedy, stream=True, stream_options={"include_usage": True},
                extra_headers={"x-expected-output-tokens": "40"},  # past the middle of [1, 64]: bin 1
            )  # fmt: skip
            chunks = [c async for c in stream]
            # vLLM merges tokens its HTTP loop has not sent yet into one chunk, so how many text chunks
            # arrive depends on the CPU's pace; what must hold is the SSE shape and every token's text.
            assert chunks[-1].usage.completion_tokens == 40 and not chunks[-1].choices
            assert any(c.choices for c in chunks[:-1])
            direct = _client(vllm_server.base_url)
            try:
                alone = await direct.completions.create(**greedy)
            finally:
                await direct.close()
            assert "".join(c.choices[0].text for c in chunks if c.choices) == alone.choices[0].text

            chat_stream = await client.chat.completions.create(
                model=vllm_server.model, messages=[{"role": "user", "content": "Count"}], max_tokens=6, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            chat_chunks = [c async for c in chat_stream]
            assert chat_chunks[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices)
            assert chat_chunks[-1].usage.completion_tokens == 6

            fams = await sc.scrape()
            per_bin = {s.labels["bin"]: s.value for s in fams["binbatch_batch_size"].samples
                       if s.name == "binbatch_batch_size_sum"}  # fmt: skip
            assert per_bin.get("0", 0) >= 1 and per_bin.get("1", 0) >= 1  # the 40-token hint went to bin 1
            assert (await sc.stats()).totals.completed == 4
        finally:
            await client.close()


async def test_models_and_tokenize_pass_through_to_vllm(vllm_server, tmp_path):
    doc = sidecar_config(vllm_server.base_url, server={"passthroughPaths": ["/tokenize"]})  # POST: listed only
    async with running_sidecar(doc, tmp_path) as sc:
        client = _sidecar_client(sc)
        try:
            assert [m.id for m in (await client.models.list()).data] == [vllm_server.model]
        finally:
            await client.close()
        body = {"model": vllm_server.model, "prompt": "hello world"}
        async with aiohttp.ClientSession() as http:
            through, direct = await asyncio.gather(
                http.post(f"http://127.0.0.1:{sc.sidecar.http_port}/tokenize", json=body),
                http.post(f"{vllm_server.base_url}/tokenize", json=body),
            )
            async with through, direct:
                assert through.status == direct.status == 200
                assert (await through.json())["tokens"] == (await direct.json())["tokens"]
