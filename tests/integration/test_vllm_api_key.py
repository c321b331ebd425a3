"""The sidecar in front of a REAL vLLM 0.32 CPU server started with ``--api-key``.

The emulator's ``--api-key`` copies vLLM's behaviour; this checks it on vLLM
itself: ``/v1/*`` answers 401 ``{"error": "Unauthorized"}`` without the key while
``/health`` and ``/metrics`` stay open, and a sidecar given the key in
``engine.apiKeyFile`` serves a completion, a chat and a stream, scrapes the
engine's metrics, and without the key fails a request at once naming the setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from sidecar_harness import prompt_request, running_sidecar, sidecar_config
from vllm_support.server import API_KEY

from binbatch_api.v1 import binbatch_pb2 as pb

pytestmark = pytest.mark.vllm

TIMEOUT = aiohttp.ClientTimeout(total=120)


async def _status(url: str, method: str = "GET", **kwargs: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as http, http.request(method, url, **kwargs) as resp:
        return resp.status, await resp.text()


@pytest.mark.parametrize("vllm_server", ["api_key"], indirect=True)
async def test_a_vllm_with_an_api_key_serves_through_a_sidecar_given_the_key(vllm_server, tmp_path: Path) -> None:
    url = vllm_server.base_url
    body = {"model": vllm_server.model, "prompt": "Hello", "max_tokens": 2}
    status, text = await _status(f"{url}/v1/completions", "POST", json=body)
    assert status == 401 and '"Unauthorized"' in text  # vLLM's own answer, which the emulator copies
    assert (await _status(f"{url}/health"))[0] == 200
    assert (await _status(f"{url}/metrics"))[0] == 200

    key_file = tmp_path / "api-key"
    key_file.write_text(f"{API_KEY}\n")
    doc = sidecar_config(url, engine={"apiKeyFile": str(key_file)}, batch={"mode": "Continuous"})
    async with running_sidecar(doc, tmp_path) as sc:
        resp = await sc.inference.Generate(prompt_request(1, 8), timeout=120)
        assert resp.completion_tokens == 8 and resp.finish_reason == "length"
        chat = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]),
                                  max_tokens=6, ignore_eos=True)  # fmt: skip
        assert (await sc.inference.Generate(chat, timeout=120)).completion_tokens == 6
        chunks = [c async for c in sc.inference.GenerateStream(prompt_request(2, 32), timeout=120)]
        assert chunks[-1].HasField("final") and chunks[-1].final.completion_tokens == 32
        assert "".join(c.text for c in chunks[:-1])
        await sc.sidecar.feed.poll_once()
        assert (await sc.stats()).metrics_source.state == pb.METRICS_STATE_FRESH
        view = await sc.admin.GetConfig(pb.GetConfigRequest())
        assert str(key_file) in view.config_json and API_KEY not in str(view)

    no_key = sidecar_config(url, engine={"model": vllm_server.model}, batch={"mode": "Continuous"})
    async with running_sidecar(no_key, tmp_path) as sc:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sc.inference.Generate(prompt_request(3, 4), timeout=120)
        assert err.value.code() == grpc.StatusCode.INTERNAL and "engine.apiKeyFile" in err.value.details()
