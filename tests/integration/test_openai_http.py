"""The OpenAI-compatible HTTP door, driven by the official ``openai`` client, in
front of the engine emulator (all on 127.0.0.1, port 0).

Every wait is on a condition or an answer, bounded by a timeout; nothing
sleeps to synchronise.  The emulator gets a recording middleware, so a test can
see what reached the engine (headers, body) without a fake engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import yaml
from aiohttp import web
from sidecar_harness import Running, prompt_request, running_sidecar, sidecar_config

from binbatch_sidecar.emulator import Emulator, EmulatorConfig

FAST = EmulatorConfig(step_a=0.001, step_c=0.0001, num_gpu_blocks=512, block_size=16)
SLOW = EmulatorConfig(step_a=0.003, step_c=0.0001, num_gpu_blocks=40_000, block_size=16, max_model_len=16_384)
LONG = 8000  # tokens: > 20 s of engine time at SLOW
WAIT = 20.0
PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


class Door:
    """A sidecar on the emulator, the openai client on its HTTP port, and what the engine received."""

    def __init__(self, emulator: Emulator, sc: Running, received: list[dict[str, Any]]) -> None:
        self.emulator = emulator
        self.sc = sc
        self.received = received
        self.base = f"http://127.0.0.1:{sc.sidecar.http_port}"
        self.client = openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=WAIT)
        self.model = emulator.config.model

    def engine_calls(self, path: str) -> list[dict[str, Any]]:
        return [r for r in self.received if r["path"].split("?")[0] == path]


@contextlib.asynccontextmanager
async def door(tmp_path, engine: EmulatorConfig = FAST, **sections: dict[str, Any]) -> AsyncIterator[Door]:
    received: list[dict[str, Any]] = []

    @web.middleware
    async def record(request: web.Request, handler):
        received.append({"method": request.method, "path": request.path_qs, "headers": dict(request.headers),
                         "body": await request.read()})  # fmt: skip
        return await handler(request)

    emulator = Emulator(engine)
    emulator.app.middlewares.append(record)
    async with emulator, running_sidecar(sidecar_config(emulator.base_url, **sections), tmp_path) as sc:
        d = Door(emulator, sc, received)
        try:
            yield d
        finally:
            await d.client.close()


def samples(families, name: str, sample: str, **labels: str) -> float:
    return sum(s.value for s in families[name].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))  # fmt: skip


async def accepted(sc: Running, n: int) -> None:
    """Until the sidecar has accepted ``n`` requests (each GetStats round trip lets its loop run)."""
    async with asyncio.timeout(WAIT):
        while (await sc.stats()).totals.accepted < n:
            pass


def holding(**batch: Any) -> dict[str, Any]:
    """Gang batches that never fill and never time out: requests stay in their bin."""
    return {"batch": {"mode": "Gang", "sizing": "Static", "staticSize": 64, "maxWaitMilliseconds": 600000, **batch},
            "bins": {"count": 1}}  # fmt: skip


# --------------------------------------------------------------------- the happy paths


async def test_completion_goes_through_the_bins_and_says_where_it_went(tmp_path):
    async with door(tmp_path) as d:
        raw = await d.client.completions.with_raw_response.create(
            model=d.model, prompt="tell me something", max_tokens=5, extra_body={"ignore_eos": True},
            extra_headers={"x-request-id": "req-1", "x-expected-output-tokens": "5"},
        )  # fmt: skip
        done = raw.parse()
        assert raw.headers["x-request-id"] == "req-1"
        assert raw.headers["x-binbatch-predicted-tokens"] == "5"  # the hint, as gRPC's predicted_output_tokens
        assert raw.headers["x-binbatch-bin"] == "0"
        assert float(raw.headers["x-binbatch-queue-ms"]) >= 0
        assert done.id == "cmpl-req-1" and done.object == "text_completion" and done.model == d.model
        assert done.choices[0].text and done.choices[0].finish_reason == "length"
        assert done.usage.completion_tokens == 5 and done.usage.prompt_tokens > 0
        stats = await d.sc.stats()  # the same scheduler the gRPC door feeds
        assert stats.totals.accepted == 1 and stats.totals.completed == 1
        sent = d.engine_calls("/v1/completions")
        assert len(sent) == 1 and b'"max_tokens": 5' in sent[0]["body"]


async def test_chat_is_answered_with_a_generated_request_id(tmp_path):
    async with door(tmp_path) as d:
        raw = await d.client.chat.completions.with_raw_response.create(
            model=d.model, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            max_completion_tokens=4, extra_body={"ignore_eos": True},
        )  # fmt: skip
        done = raw.parse()
        rid = raw.headers["x-request-id"]
        assert len(rid) == 32 and done.id == f"chatcmpl-{rid}"
        assert done.object == "chat.completion"
        assert done.choices[0].message.role == "assistant" and done.choices[0].message.content
        assert done.usage.completion_tokens == 4


async def test_completion_stream_ends_with_the_usage_chunk(tmp_path):
    async with door(tmp_path) as d:
        raw = await d.client.completions.with_raw_response.create(
            model=d.model, prompt="count", max_tokens=6, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert raw.headers["content-type"].startswith("text/event-stream")
        assert raw.headers["x-binbatch-bin"] == "0" and "x-binbatch-queue-ms" in raw.headers
        chunks = [c async for c in raw.parse()]
        texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
        assert len(texts) >= 2  # streamed piece by piece, not one blob
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
        assert all(c.usage is None for c in chunks[:-1])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


async def test_a_streams_headers_go_out_with_its_first_event_and_its_end_in_one_write(tmp_path, monkeypatch):
    """What the door's socket is handed, write by write: the status line and headers never alone
    (a socket call more a request), and the last chunk, the usage, [DONE] and the chunked body's
    end together."""
    writes: list[tuple[int, bytes]] = []
    transport = asyncio.selector_events._SelectorSocketTransport  # type: ignore[attr-defined]
    write, writelines = transport.write, transport.writelines

    def port_of(t) -> int:
        name = t.get_extra_info("sockname")
        return name[1] if isinstance(name, tuple) else -1

    def recording_write(self, data):
        writes.append((port_of(self), bytes(data)))
        return write(self, data)

    def recording_writelines(self, lines):
        lines = list(lines)
        writes.append((port_of(self), b"".join(bytes(x) for x in lines)))
        return writelines(self, lines)

    monkeypatch.setattr(transport, "write", recording_write)
    monkeypatch.setattr(transport, "writelines", recording_writelines)
    async with door(tmp_path) as d:
        raw = await d.client.completions.with_raw_response.create(
            model=d.model, prompt="count", max_tokens=6, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = [c async for c in raw.parse()]
        port = d.sc.sidecar.http_port
    sent = [data for p, data in writes if p == port]
    assert chunks[-1].usage.completion_tokens == 6
    assert sent[0].startswith(b"HTTP/1.1 200") and b"\r\n\r\n" in sent[0]
    assert b"data: {" in sent[0].partition(b"\r\n\r\n")[2]  # the first event rode with the headers
    assert all(not data.startswith(b"HTTP/") for data in sent[1:])
    assert b'"finish_reason":"length"' in sent[-1] and b'"usage":' in sent[-1]
    assert sent[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    texts = [c for c in chunks if c.choices and c.choices[0].text]
    assert len(sent) <= len(texts) + 1  # a write a piece of text, and the end's (with the last piece, if together)


async def test_chat_stream_opens_with_the_assistant_role_and_ends_with_usage(tmp_path):
    async with door(tmp_path) as d:
        stream = await d.client.chat.completions.create(
            model=d.model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert deltas[0].role == "assistant"
        assert "".join(x.content or "" for x in deltas)
        assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.total_tokens > 5


async def test_a_stream_without_include_usage_has_no_usage_chunk(tmp_path):
    async with door(tmp_path) as d:
        stream = await d.client.completions.create(model=d.model, prompt="x", max_tokens=3, stream=True,
                                                   extra_body={"ignore_eos": True})  # fmt: skip
        chunks = [c async for c in stream]
        assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


async def test_the_sidecars_metrics_count_http_requests_per_bin(tmp_path):
    """Short and long hints land in bins 0 and 1 -- batches and batch sizes per bin."""
    async with door(tmp_path, bins={"count": 2, "maxOutputTokens": 64}) as d:

        async def one(hint: int, i: int) -> str:
            raw = await d.client.completions.with_raw_response.create(
                model=d.model, prompt=f"p{i}", max_tokens=hint, extra_body={"ignore_eos": True},
                extra_headers={"x-expected-output-tokens": str(hint)},
            )  # fmt: skip
            return raw.headers["x-binbatch-bin"]

        bins = await asyncio.gather(*(one(4, i) for i in range(3)), *(one(60, i) for i in range(3, 6)))
        assert bins == ["0"] * 3 + ["1"] * 3
        fams = await d.sc.scrape()
        for b in ("0", "1"):
            assert samples(fams, "binbatch_batches", "binbatch_batches_total", bin=b) >= 1
            assert samples(fams, "binbatch_batch_size", "binbatch_batch_size_sum", bin=b) == 3
        assert samples(fams, "binbatch_requests", "binbatch_requests_total", outcome="completed") == 6


async def test_models_and_listed_paths_pass_through_to_the_engine(tmp_path):
    async with door(tmp_path, server={"passthroughPaths": ["/tokenize"]}) as d:
        models = await d.client.models.list()
        assert [m.id for m in models.data] == [d.model]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{d.base}/metrics") as resp:
                assert resp.status == 200 and "vllm:num_requests_running" in await resp.text()
            headers = {"x-custom": "kept", "Connection": "keep-alive, x-hop", "x-hop": "dropped"}
            async with http.post(f"{d.base}/tokenize?echo=1", data=b'{"prompt": "hi"}', headers=headers) as resp:
                status, body = resp.status, await resp.read()
            async with http.post(f"{d.emulator.base_url}/tokenize?echo=1", data=b'{"prompt": "hi"}') as direct:
                assert (status, body) == (direct.status, await direct.read())  # the engine's own answer
        forwarded = [r for r in d.engine_calls("/tokenize") if r["headers"].get("x-custom")]
        assert len(forwarded) == 1
        got = forwarded[0]
        assert (got["method"], got["path"], got["body"]) == ("POST", "/tokenize?echo=1", b'{"prompt": "hi"}')
        assert "x-hop" not in {k.lower() for k in got["headers"]}  # listed in Connection: hop-by-hop


# --------------------------------------------------------------------------- the errors


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 999999}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"extra_body": {"frobnicate": True}}, "frobnicate"),
        ({"extra_body": {"prompt": ["a", "b"]}}, "prompt"),
        ({"extra_headers": {"x-slo-tpot-ms": "fast"}}, "x-slo-tpot-ms"),
        ({"extra_headers": {"x-expected-output-tokens": "0"}}, "x-expected-output-tokens"),
    ],
)
async def test_a_bad_request_is_400_naming_the_field(tmp_path, fields, param):
    async with door(tmp_path) as d:
        with pytest.raises(openai.BadRequestError) as err:
            await d.client.completions.create(model=d.model, prompt="x", **{"max_tokens": 3, **fields})
        assert err.value.status_code == 400
        assert err.value.param == param
        assert err.value.message.startswith(f"Error code: 400 - ") and param in err.value.message
        assert d.engine_calls("/v1/completions") == []  # refused before the engine


async def test_chat_content_other_than_text_is_400_naming_the_part(tmp_path):
    async with door(tmp_path) as d:
        image = [{"type": "image_url", "image_url": {"url": "http://example.invalid/x.png"}}]
        with pytest.raises(openai.BadRequestError) as err:
            await d.client.chat.completions.create(model=d.model, messages=[{"role": "user", "content": image}])
        assert err.value.param == "messages[0].content[0].type"


async def test_a_body_that_is_not_json_is_400_in_openais_error_shape(tmp_path):
    async with door(tmp_path) as d, aiohttp.ClientSession() as http:
        async with http.post(f"{d.base}/v1/completions", data=b"{not json") as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
        assert err["param"] == "body" and err["type"] == "invalid_request_error"
        assert set(err) == {"message", "type", "param", "code"}


async def test_a_full_queue_is_429_with_retry_after(tmp_path):
    async with door(tmp_path, **holding(maxQueuedRequests=1)) as d:
        held = asyncio.ensure_future(d.client.completions.create(model=d.model, prompt="first", max_tokens=3))
        await accepted(d.sc, 1)
        with pytest.raises(openai.RateLimitError) as err:
            await d.client.completions.create(model=d.model, prompt="second", max_tokens=3)
        assert err.value.status_code == 429
        assert err.value.response.headers["retry-after"] == "1"
        assert err.value.code == "queue_full"
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held


async def test_past_the_deadline_header_is_504_and_the_request_leaves_its_bin(tmp_path):
    async with door(tmp_path, **holding()) as d:
        with pytest.raises(openai.APIStatusError) as err:
            await d.client.completions.create(model=d.model, prompt="x", max_tokens=3,
                                              extra_headers={"x-request-timeout-ms": "300"})  # fmt: skip
        assert err.value.status_code == 504 and err.value.code == "deadline_exceeded"
        stats = await d.sc.stats()
        assert stats.totals.expired == 1 and sum(b.queue_depth for b in stats.bins) == 0


async def test_draining_is_503_and_health_says_so(tmp_path):
    async with door(tmp_path) as d, aiohttp.ClientSession() as http:
        async with http.get(f"{d.base}/health") as resp:
            assert resp.status == 200
        assert await d.sc.sidecar.dispatcher.drain(5) == 0  # what SIGTERM starts; the listeners stay up
        with pytest.raises(openai.APIStatusError) as err:
            await d.client.completions.create(model=d.model, prompt="x", max_tokens=3)
        assert err.value.status_code == 503 and "shutting down" in err.value.message
        async with http.get(f"{d.base}/health") as resp:
            assert resp.status == 503
        await d.sc.sidecar.stop(grace=1)


async def test_the_engine_down_is_503_and_health_says_so(tmp_path):
    async with door(tmp_path) as d, aiohttp.ClientSession() as http:
        await d.emulator.stop()
        await d.sc.sidecar._check_engine()  # the probe the health loop runs every second
        with pytest.raises(openai.APIStatusError) as err:
            await d.client.completions.create(model=d.model, prompt="x", max_tokens=3)
        assert err.value.status_code == 503
        async with http.get(f"{d.base}/health") as resp:
            assert resp.status == 503
        async with http.get(f"{d.base}/metrics") as resp:  # a passthrough with nowhere to go
            assert resp.status == 503 and (await resp.json())["error"]["code"] == "engine_unavailable"


# ------------------------------------------------------------------- callers that leave


async def _nothing_left(d: Door) -> None:
    async with asyncio.timeout(WAIT):
        await d.emulator.engine.wait_for(lambda e: e.idle)
        while True:
            s = await d.sc.stats()
            if (s.inflight_requests, s.pending_requests, sum(b.queue_depth for b in s.bins)) == (0, 0, 0):
                return


async def test_a_client_that_leaves_mid_stream_aborts_its_engine_request(tmp_path):
    cfg = {"batch": {"mode": "Continuous", "sizing": "Static", "staticSize": 4, "maxWaitMilliseconds": 0},
           "bins": {"count": 1, "maxOutputTokens": LONG}}  # fmt: skip
    async with door(tmp_path, SLOW, **cfg) as d:
        async with aiohttp.ClientSession() as http:
            body = {"model": d.model, "prompt": "long", "max_tokens": LONG, "ignore_eos": True, "stream": True}
            async with http.post(f"{d.base}/v1/completions", json=body) as resp:
                assert resp.status == 200
                assert (await resp.content.readline()).startswith(b"data: ")  # the engine is generating
        # the connection is closed here, thousands of tokens early
        await _nothing_left(d)
        stats = await d.sc.stats()
        assert stats.totals.cancelled == 1 and stats.totals.completed == 0
        assert d.emulator.engine.stats.finished == 0  # nothing generated to max_tokens


async def test_a_client_that_leaves_before_the_answer_aborts_its_engine_request(tmp_path):
    cfg = {"batch": {"mode": "Continuous", "sizing": "Static", "staticSize": 4, "maxWaitMilliseconds": 0},
           "bins": {"count": 1, "maxOutputTokens": LONG}}  # fmt: skip
    async with door(tmp_path, SLOW, **cfg) as d:
        call = asyncio.ensure_future(d.client.completions.create(
            model=d.model, prompt="long", max_tokens=LONG, extra_body={"ignore_eos": True}))  # fmt: skip
        async with asyncio.timeout(WAIT):
            await d.emulator.engine.wait_for(lambda e: e.stats.submitted == 1)
        call.cancel()  # closes the connection
        with contextlib.suppress(asyncio.CancelledError):
            await call
        await _nothing_left(d)
        assert (await d.sc.stats()).totals.cancelled == 1
        assert d.emulator.engine.stats.finished == 0


# ------------------------------------------------------------------------ trace context


async def test_traceparent_reaches_the_engine_from_http_and_from_grpc(tmp_path):
    async with door(tmp_path) as d:
        await d.client.completions.create(model=d.model, prompt="h", max_tokens=2,
                                          extra_headers={"traceparent": PARENT, "tracestate": "vendor=1"})  # fmt: skip
        await d.sc.inference.Generate(prompt_request(1, 2), metadata=(("traceparent", PARENT),), timeout=WAIT)
        await d.client.chat.completions.create(model=d.model, messages=[{"role": "user", "content": "c"}],
                                               max_tokens=2, extra_headers={"traceparent": "00-bogus"})  # fmt: skip
        http_call, grpc_call = d.engine_calls("/v1/completions")
        assert (http_call["headers"]["traceparent"], http_call["headers"]["tracestate"]) == (PARENT, "vendor=1")
        assert grpc_call["headers"]["traceparent"] == PARENT and "tracestate" not in grpc_call["headers"]
        (chat_call,) = d.engine_calls("/v1/chat/completions")
        assert "traceparent" not in chat_call["headers"]  # invalid: ignored, as W3C asks


async def test_request_log_lines_carry_the_request_id_and_trace_id(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="binbatch.api")
    async with door(tmp_path) as d:
        with pytest.raises(openai.BadRequestError):
            await d.client.completions.create(model=d.model, prompt="x", max_tokens=3, top_p=2.0,
                                              extra_headers={"traceparent": PARENT, "x-request-id": "r-9"})  # fmt: skip
    refused = [r for r in caplog.records if r.getMessage().startswith("refused")]
    assert [(r.request_id, r.trace_id) for r in refused] == [("r-9", TRACE_ID)]


async def test_a_gang_batch_carries_one_members_traceparent_and_streams_its_text_in_one_piece(tmp_path):
    """Several prompts go as one engine call: it can carry one trace context (EngineRequest)."""
    other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    gang = {"batch": {"mode": "Gang", "sizing": "Static", "staticSize": 2, "maxWaitMilliseconds": 600000},
            "bins": {"count": 1}}  # fmt: skip
    async with door(tmp_path, **gang) as d:

        async def streamed(parent: str) -> tuple[list[str], str]:
            stream = await d.client.completions.create(model=d.model, prompt="g", max_tokens=4, stream=True,
                                                       extra_body={"ignore_eos": True},
                                                       extra_headers={"traceparent": parent})  # fmt: skip
            chunks = [c async for c in stream]
            return [c.choices[0].text for c in chunks if c.choices[0].text], chunks[-1].choices[0].finish_reason

        answers = await asyncio.gather(streamed(PARENT), streamed(other))
        assert [(len(texts), finish) for texts, finish in answers] == [(1, "length"), (1, "length")]
        (call,) = d.engine_calls("/v1/completions")
        assert call["headers"]["traceparent"] in (PARENT, other)


async def test_the_http_port_in_use_is_one_line_naming_the_setting_and_exit_2(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = tmp_path / "sidecar.yaml"
        path.write_text(yaml.safe_dump(sidecar_config("http://127.0.0.1:9")))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "binbatch_sidecar.cli", "sidecar", "--config", str(path), "--host", "127.0.0.1",
            "--grpc-port", "0", "--metrics-port", "0", env={"BINBATCH_HTTP_PORT": str(port), "PATH": ""},
            stderr=asyncio.subprocess.PIPE, cwd=tmp_path,
        )  # fmt: skip
        async with asyncio.timeout(60):
            _, err = await proc.communicate()
    assert proc.returncode == 2
    lines = err.decode().strip().splitlines()
    assert lines == [f"binbatch sidecar: cannot listen on 127.0.0.1:{port} (--http-port or $BINBATCH_HTTP_PORT): address already in use"]


async def test_the_take_over_port_is_a_second_door_onto_the_same_scheduler(tmp_path):
    """The operator's port take-over: vLLM's serving port (--take-over-port) and httpPort (the policy
    Service's bb-http) both serve the door, so each is declared once in the pod and both names resolve."""
    async with Emulator(FAST) as emulator, running_sidecar(sidecar_config(emulator.base_url), tmp_path,
                                                           take_over_port=0) as sc:  # fmt: skip
        doors = (sc.sidecar.http_port, sc.sidecar.take_over_port)
        assert doors[1] not in (None, doors[0])
        async with aiohttp.ClientSession() as http:
            for port in doors:
                body = {"model": emulator.config.model, "prompt": "hello", "max_tokens": 3}
                async with asyncio.timeout(WAIT), http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    assert (await resp.json())["choices"][0]["finish_reason"] in ("stop", "length")
        assert (await sc.stats()).totals.accepted == 2  # both through the bins


async def test_the_take_over_port_in_use_names_its_flag_and_exits_2(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "binbatch_sidecar.cli", "sidecar", "--host", "127.0.0.1", "--grpc-port", "0",
            "--metrics-port", "0", "--http-port", "0", "--take-over-port", str(port), env={"PATH": ""},
            stderr=asyncio.subprocess.PIPE, cwd=tmp_path,
        )  # fmt: skip
        async with asyncio.timeout(60):
            _, err = await proc.communicate()
    assert proc.returncode == 2
    assert err.decode().strip().splitlines() == [f"binbatch sidecar: cannot listen on 127.0.0.1:{port} (--take-over-port): address already in use"]


async def test_the_engines_own_refusal_keeps_its_status(tmp_path):
    """An engine 4xx maps like gRPC's INVALID_ARGUMENT, with the engine's status (404: no such model)."""
    async with door(tmp_path) as d:
        with pytest.raises(openai.NotFoundError) as err:
            await d.client.completions.create(model="no-such-model", prompt="x", max_tokens=3)
        assert err.value.status_code == 404 and err.value.code == "engine_refused"
        assert "engine: The model `no-such-model` does not exist." in err.value.message


async def test_a_burst_reaches_the_engine_while_the_door_still_reads_the_rest(tmp_path):
    """32 requests written to the door before its loop runs once (so aiohttp starts all their
    handlers in the same turn): the first reaches the engine -- here in the same event loop, a
    few turns after the door sent it -- while the door has taken in under half of them, not
    after all 32 (turns.py: before it, the engine saw nothing until the door had queued the
    whole burst)."""
    n, seen = 32, []
    sidecar: list[Any] = []

    @web.middleware
    async def first_arrival(request: web.Request, handler):
        if request.path == "/v1/completions" and not seen:
            seen.append(sidecar[0].dispatcher.totals["accepted"])  # what the door had taken in by then
        return await handler(request)

    emulator = Emulator(FAST)
    emulator.app.middlewares.append(first_arrival)
    async with emulator, running_sidecar(sidecar_config(emulator.base_url), tmp_path) as sc:
        sidecar.append(sc.sidecar)
        body = json.dumps({"model": emulator.config.model, "prompt": "hello", "max_tokens": 2, "ignore_eos": True})
        raw = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}").encode()  # fmt: skip
        socks = [socket.create_connection(("127.0.0.1", sc.sidecar.http_port), timeout=WAIT) for _ in range(n)]
        for s in socks:  # blocking writes, the loop not running: the kernel holds them all for it
            s.sendall(raw)
        answers = []
        async with asyncio.timeout(WAIT):
            for s in socks:
                s.setblocking(False)
                reader, writer = await asyncio.open_connection(sock=s)
                answers.append(await reader.read())
                writer.close()
        assert all(a.startswith(b"HTTP/1.1 200") for a in answers), answers[0][:200]
        assert (await sc.stats()).totals.accepted == n
    assert seen and seen[0] <= n // 2, f"the engine's first request came after the door took in {seen[0]} of {n}"
