"""The sidecar's front door as intake: what reaches the engine (the passthrough
allowlist), what is refused before it is held (lone surrogates, bodies over
``server.maxRequestBytes``, queued bytes over ``batch.maxQueuedBytes``), on both
doors, against the engine emulator with a recording middleware -- so "the engine
saw nothing" is read from what the engine received.  All on 127.0.0.1, port 0;
every wait is on a condition, bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sidecar_harness import Running, prompt_request, running_sidecar, sidecar_config

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar.emulator import Emulator, EmulatorConfig

FAST = EmulatorConfig(step_a=0.001, step_c=0.0001, num_gpu_blocks=512, block_size=16)
WAIT = 20.0
MIB = 1024 * 1024


class Door:
    def __init__(self, emulator: Emulator, sc: Running, received: list[dict[str, Any]]) -> None:
        self.emulator = emulator
        self.sc = sc
        self.received = received
        self.base = f"http://127.0.0.1:{sc.sidecar.http_port}"
        self.client = openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=WAIT)
        self.model = emulator.config.model

    def engine_paths(self) -> list[str]:
        return [r["path"] for r in self.received]


@contextlib.asynccontextmanager
async def door(tmp_path, **sections: dict[str, Any]) -> AsyncIterator[Door]:
    received: list[dict[str, Any]] = []

    @web.middleware
    async def record(request: web.Request, handler):
        received.append({"method": request.method, "path": request.path})
        return await handler(request)

    emulator = Emulator(FAST)
    emulator.app.middlewares.append(record)
    async with emulator:
        doc = sidecar_config(emulator.base_url, **sections)
        doc["metrics"]["source"] = "None"  # the emulator's log of calls holds only what requests caused
        async with running_sidecar(doc, tmp_path) as sc:
            d = Door(emulator, sc, received)
            try:
                yield d
            finally:
                await d.client.close()


def holding(**batch: Any) -> dict[str, Any]:
    """Gang batches that never fill and never time out: requests stay in their bin."""
    return {"batch": {"mode": "Gang", "sizing": "Static", "staticSize": 64, "maxWaitMilliseconds": 600000, **batch},
            "bins": {"count": 1}}  # fmt: skip


async def until(sc: Running, condition) -> None:
    """Until ``condition()`` holds; each GetStats round trip lets the sidecar's loop run."""
    async with asyncio.timeout(WAIT):
        while not condition():
            await sc.stats()


def queued_bytes_gauge(families: dict[str, Any]) -> float:
    return families["binbatch_queued_bytes"].samples[0].value


def no_errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# ------------------------------------------------------------ what reaches the engine


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/pause"), ("POST", "/invocations"), ("POST", "/pooling"), ("POST", "/score"),
     ("POST", "/tokenize"), ("GET", "/is_paused"), ("POST", "/v1/load_lora_adapter"), ("GET", "/v1/models/../pause")],
)  # fmt: skip
async def test_a_path_off_the_allowlist_is_404_naming_the_setting_and_never_reaches_the_engine(tmp_path, method, path):
    async with door(tmp_path) as d, aiohttp.ClientSession() as http:
        baseline = list(d.received)  # the sidecar's own start-up calls (health, models)
        async with http.request(method, f"{d.base}{path}", data=b"{}") as resp:
            assert resp.status == 404
            err = (await resp.json())["error"]
        assert set(err) == {"message", "type", "param", "code"}  # OpenAI's error shape
        assert err["type"] == "invalid_request_error" and err["code"] == "not_found"
        assert "server.passthroughPaths" in err["message"]
        assert d.received == baseline  # the engine received nothing


async def test_the_default_paths_pass_for_get_and_a_listed_path_also_for_post(tmp_path):
    async with door(tmp_path, server={"passthroughPaths": ["/tokenize"]}) as d, aiohttp.ClientSession() as http:
        assert [m.id for m in (await d.client.models.list()).data] == [d.model]  # GET /v1/models, the client's way
        async with http.get(f"{d.base}/metrics") as resp:
            assert resp.status == 200 and "vllm:num_requests_running" in await resp.text()
        body = {"model": d.model, "prompt": "hi there"}
        async with http.post(f"{d.base}/tokenize", json=body) as through:
            got = (through.status, through.content_type, await through.read())
        async with http.post(f"{d.emulator.base_url}/tokenize", json=body) as direct:  # the emulator has none
            assert got == (direct.status, direct.content_type, await direct.read())  # the engine's own answer
        assert d.engine_paths().count("/tokenize") == 2  # through the sidecar, and direct
        before = list(d.received)
        async with http.post(f"{d.base}/v1/models", data=b"{}") as resp:  # a default path is read-only
            assert resp.status == 405 and resp.headers["Allow"] == "GET, HEAD"
            assert (await resp.json())["error"]["code"] == "method_not_allowed"
        assert d.received == before


async def test_a_reload_opens_a_listed_path_without_a_restart(tmp_path):
    async with door(tmp_path) as d, aiohttp.ClientSession() as http:
        async with http.post(f"{d.base}/tokenize", json={"model": d.model, "prompt": "x"}) as resp:
            assert resp.status == 404 and resp.content_type == "application/json"  # the sidecar's 404
        assert "/tokenize" not in d.engine_paths()
        doc = sidecar_config(d.emulator.base_url, server={"passthroughPaths": ["/tokenize"]})
        doc["metrics"]["source"] = "None"
        generation = d.sc.sidecar.loaded.generation
        d.sc.write_config(doc)
        await until(d.sc, lambda: d.sc.sidecar.loaded.generation > generation)
        async with http.post(f"{d.base}/tokenize", json={"model": d.model, "prompt": "x"}) as resp:
            assert resp.content_type == "text/plain"  # the emulator's own 404: it has no /tokenize
        assert d.engine_paths().count("/tokenize") == 1


# ------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ('{"model": "%s", "prompt": "x", "stop": ["ok", "\\udfff"], "max_tokens": 2}', "stop[1]"),
        ('{"model": "%s", "prompt": "x", "user": "\\ud83d", "max_tokens": 2}', "user"),
    ],
)
async def test_a_lone_surrogate_in_a_completion_is_400_naming_the_field_with_no_error_logged(tmp_path, caplog, body,
                                                                                              param):  # fmt: skip
    async with door(tmp_path) as d, aiohttp.ClientSession() as http:
        raw = (body % d.model).encode()  # the JSON escape: no client library would encode the character itself
        async with http.post(f"{d.base}/v1/completions", data=raw, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
        assert err["param"] == param and err["message"].startswith(f"{param}: ") and "surrogate" in err["message"]
        assert "/v1/completions" not in d.engine_paths()
    assert no_errors(caplog) == []


async def test_a_lone_surrogate_in_a_chat_message_is_400_naming_the_message(tmp_path, caplog):
    async with door(tmp_path) as d, aiohttp.ClientSession() as http:
        raw = json.dumps({"model": d.model, "messages": [{"role": "user", "content": "ok"},
                                                         {"role": "user", "content": "bad \ud800"}]}).encode()  # fmt: skip
        async with http.post(f"{d.base}/v1/chat/completions", data=raw) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "messages[1].content"
    assert no_errors(caplog) == []


def _with_raw_prompt(raw_prompt: bytes) -> bytes:
    """A GenerateRequest whose prompt field holds ``raw_prompt`` as it is (the
    Python protobuf library will not encode a lone surrogate itself)."""
    placeholder = b"P" * len(raw_prompt)
    wire = pb.GenerateRequest(prompt=placeholder.decode(), max_tokens=2).SerializeToString()
    return wire.replace(placeholder, raw_prompt)


async def test_grpc_a_lone_surrogate_is_invalid_argument_and_a_message_over_max_request_bytes_resource_exhausted(
    tmp_path, caplog
):  # fmt: skip
    async with door(tmp_path, server={"maxRequestBytes": MIB}, batch={"maxQueuedBytes": MIB}) as d:
        generate = d.sc.channel.unary_unary("/binbatch.v1.Inference/Generate",
                                            response_deserializer=pb.GenerateResponse.FromString)  # fmt: skip
        surrogate = "\ud800".encode("utf-8", "surrogatepass")  # b"\xed\xa0\x80": what a lone surrogate becomes
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(_with_raw_prompt(b"a" + surrogate + b"b"), timeout=WAIT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as big:
            await d.sc.inference.Generate(pb.GenerateRequest(prompt="x" * (MIB + 1), max_tokens=2), timeout=WAIT)
        assert big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "/v1/completions" not in d.engine_paths()
        ok = await d.sc.inference.Generate(prompt_request(1, 2), timeout=WAIT)  # the door still serves
        assert ok.completion_tokens == 2
    assert no_errors(caplog) == []


# ------------------------------------------------------------------- bounded memory


async def test_a_body_over_max_request_bytes_is_413_json_naming_the_setting(tmp_path):
    async with door(tmp_path) as d, aiohttp.ClientSession() as http:
        body = json.dumps({"model": d.model, "prompt": "x" * (5 * MIB), "max_tokens": 2}).encode()
        async with http.post(f"{d.base}/v1/completions", data=io.BytesIO(body)) as resp:  # with its Content-Length
            assert resp.status == 413
            err = (await resp.json())["error"]
        assert err["code"] == "request_too_large" and "server.maxRequestBytes" in err["message"]

        async def chunks():  # no Content-Length: read up to the limit, then refused
            for i in range(0, len(body), MIB):
                yield body[i:i + MIB]

        async with http.post(f"{d.base}/v1/completions", data=chunks()) as resp:
            assert resp.status == 413 and resp.content_type == "application/json"
            assert (await resp.json())["error"]["param"] == "body"
        with pytest.raises(openai.APIStatusError) as err:  # the client sees the status and OpenAI's error
            await d.client.completions.create(model=d.model, prompt="x" * (5 * MIB), max_tokens=2)
        assert err.value.status_code == 413 and err.value.code == "request_too_large"
        assert "/v1/completions" not in d.engine_paths()


async def test_max_queued_bytes_is_429_with_retry_after_and_the_gauge_returns_to_zero(tmp_path):
    sections = holding(maxQueuedBytes=MIB)
    sections["server"] = {"maxRequestBytes": MIB}
    async with door(tmp_path, **sections) as d:
        big = "x" * (600 * 1024)
        held = asyncio.ensure_future(d.client.completions.create(model=d.model, prompt=big, max_tokens=2))
        scheduler = d.sc.sidecar.dispatcher.scheduler
        await until(d.sc, lambda: scheduler.totals["accepted"] == 1)
        first = queued_bytes_gauge(await d.sc.scrape())
        assert 600 * 1024 < first < 601 * 1024  # the body as it came
        with pytest.raises(openai.RateLimitError) as err:
            await d.client.completions.create(model=d.model, prompt=big, max_tokens=2)
        assert err.value.status_code == 429 and err.value.response.headers["retry-after"] == "1"
        assert "batch.maxQueuedBytes" in err.value.message
        grpc_refused = d.sc.inference.Generate(pb.GenerateRequest(prompt=big, max_tokens=2), timeout=WAIT)
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await grpc_refused
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert queued_bytes_gauge(await d.sc.scrape()) == first  # refusals hold nothing
        held.cancel()  # the caller leaves: its request leaves the queue, its bytes with it
        with contextlib.suppress(asyncio.CancelledError):
            await held
        await until(d.sc, lambda: scheduler.totals["cancelled"] == 1)
        assert queued_bytes_gauge(await d.sc.scrape()) == 0


async def test_a_body_being_read_holds_its_room_in_max_queued_bytes_so_others_are_429_before_being_read(tmp_path):
    """Many clients sending large bodies at once: the bodies being read count against
    batch.maxQueuedBytes with the queued ones, so a body that would not fit beside them is
    refused before it is read (not read whole and then refused)."""
    sections = holding(maxQueuedBytes=MIB)
    sections["server"] = {"maxRequestBytes": MIB}
    async with door(tmp_path, **sections) as d:
        front = d.sc.sidecar.front
        body = json.dumps({"model": d.model, "prompt": "x" * (700 * 1024), "max_tokens": 2}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", d.sc.sidecar.http_port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:1024])  # fmt: skip
        await writer.drain()
        await until(d.sc, lambda: front.reading_bytes == len(body))  # its whole announced size, from the start
        other = json.dumps({"model": d.model, "prompt": "y" * (600 * 1024), "max_tokens": 2}).encode()
        async with aiohttp.ClientSession() as http, http.post(f"{d.base}/v1/completions", data=other) as resp:
            assert resp.status == 429 and resp.headers["Retry-After"] == "1"
            assert "batch.maxQueuedBytes" in (await resp.json())["error"]["message"]
        grpc_refused = d.sc.inference.Generate(pb.GenerateRequest(prompt="y" * (600 * 1024), max_tokens=2), timeout=WAIT)
        with pytest.raises(grpc.aio.AioRpcError) as full:  # the other door counts the bodies being read too
            await grpc_refused
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        scheduler = d.sc.sidecar.dispatcher.scheduler
        assert scheduler.totals["accepted"] == 0 and "/v1/completions" not in d.engine_paths()
        writer.write(body[1024:])  # the rest arrives: the request is queued, its room now the queue's
        await writer.drain()
        await until(d.sc, lambda: scheduler.totals["accepted"] == 1)
        assert front.reading_bytes == 0 and scheduler.queued_bytes == len(body)
        writer.close()  # the caller leaves: its request leaves the queue
        await until(d.sc, lambda: scheduler.queued_bytes == 0 and scheduler.totals["cancelled"] == 1)


async def test_a_served_request_frees_its_queued_bytes_when_it_is_sent(tmp_path):
    async with door(tmp_path) as d:
        out = await d.client.completions.create(model=d.model, prompt="hello " * 100, max_tokens=3,
                                                extra_body={"ignore_eos": True})  # fmt: skip
        assert out.usage.completion_tokens == 3
        assert queued_bytes_gauge(await d.sc.scrape()) == 0
        assert d.sc.sidecar.dispatcher.scheduler.queued_bytes == 0


# ------------------------------------------------------------------------- a property

_SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) \
    | st.text(max_size=20)  # fmt: skip
_JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=4), max_leaves=12)
SERVED = "<the served model>"  # an example's model, replaced by the door's
_FIELDS = ("model", "messages", "max_tokens", "temperature", "top_p", "stop", "seed", "stream",
           "stream_options", "n", "logprobs", "ignore_eos", "min_tokens", "user", "echo", "best_of", "logit_bias")
_TEXT = st.text(max_size=30) | st.sampled_from(["\ud800", "ok\udfff", "x"])
_BODY = st.one_of(
    _JSON,
    st.fixed_dictionaries({"prompt": _TEXT | _JSON}, optional={k: _JSON for k in _FIELDS}),
    st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries({"role": _TEXT}, optional={"content": _JSON | _TEXT}),
                                                max_size=3)},
                          optional={"max_tokens": st.integers(-3, 6), "stream": st.booleans(), "model": _TEXT}),
)  # fmt: skip


async def test_any_json_body_is_answered_2xx_or_4xx_never_5xx_nor_a_traceback(tmp_path, caplog):
    async with door(tmp_path, bins={"maxOutputTokens": 8}) as d, aiohttp.ClientSession() as http:
        loop = asyncio.get_running_loop()
        seen: list[int] = []

        async def send(path: str, body: Any) -> tuple[int, str]:
            if isinstance(body, dict) and body.get("model") == SERVED:
                body = {**body, "model": d.model}
            raw = json.dumps(body).encode()  # ensure_ascii: surrogates travel as \\ud800 escapes, as JSON allows
            async with asyncio.timeout(WAIT):
                async with http.post(f"{d.base}{path}", data=raw, headers={"Content-Type": "application/json"}) as r:
                    return r.status, await r.text()

        @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=_BODY, chat=st.booleans())
        @example(body={"model": SERVED, "prompt": "x", "max_tokens": 2}, chat=False)  # both kinds, whatever is drawn
        @example(body=[], chat=False)
        def check(body: Any, chat: bool) -> None:
            path = "/v1/chat/completions" if chat else "/v1/completions"
            status, text = asyncio.run_coroutine_threadsafe(send(path, body), loop).result(WAIT + 5)
            seen.append(status)
            assert 200 <= status < 500, (status, text[:300])
            assert "Traceback" not in text

        await asyncio.to_thread(check)
        assert any(s == 200 for s in seen) and any(400 <= s < 500 for s in seen)  # both kinds were exercised
    assert no_errors(caplog) == []
