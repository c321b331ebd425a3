"""EngineClient against a tiny scripted aiohttp server on 127.0.0.1 (port 0).

Each test installs handlers for the paths it needs; the server records every call's
JSON body.  Synchronisation uses events, never sleeps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from binbatch_sidecar.engine.engine_client import (
    EngineClient,
    EngineError,
    EngineRequest,
    EngineResult,
    SamplingParams,
    StreamDelta,
)

Handler = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]


class ScriptedEngine:
    """An HTTP server whose answers each test scripts per path."""

    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}
        self.calls: list[tuple[str, dict[str, Any]]] = []
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self.server = TestServer(app, host="127.0.0.1", port=0)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else {}
        self.calls.append((request.path, body))
        handler = self.handlers.get(request.path)
        if handler is None:
            return web.json_response({"error": {"message": "no such path", "code": 404}}, status=404)
        return await handler(request, body)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [b for p, b in self.calls if p == path]


@pytest.fixture
async def engine() -> AsyncIterator[ScriptedEngine]:
    scripted = ScriptedEngine()
    await scripted.server.start_server()
    try:
        yield scripted
    finally:
        await scripted.server.close()


@pytest.fixture
async def client(engine: ScriptedEngine) -> AsyncIterator[EngineClient]:
    async with EngineClient(engine.url, timeout_seconds=30) as c:
        yield c


def completion_reply(body: dict[str, Any], *, token_ids: bool = True) -> dict[str, Any]:
    """A vLLM-shaped reply: prompt i answers "out:<prompt>" with len(prompt) tokens
    (as vLLM 0.32 does with return_token_ids), choices listed in reverse order."""
    prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
    choices = []
    for i, p in enumerate(prompts):
        choice: dict[str, Any] = {"index": i, "text": f"out:{p}", "finish_reason": "stop", "logprobs": None}
        if token_ids and body.get("return_token_ids"):
            choice["token_ids"] = list(range(len(p)))
            choice["prompt_token_ids"] = [7] * (i + 1)
        choices.append(choice)
    completion = sum(len(p) for p in prompts)
    prompt_tokens = sum(i + 1 for i in range(len(prompts)))
    return {"object": "text_completion", "choices": choices[::-1],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion}}  # fmt: skip


async def echo_completions(_: web.Request, body: dict[str, Any]) -> web.Response:
    return web.json_response(completion_reply(body))


def P(max_tokens: int = 16, **kw: Any) -> SamplingParams:
    return SamplingParams(model="m", max_tokens=max_tokens, **kw)


def prompt(text: str, params: SamplingParams | None = None) -> EngineRequest:
    return EngineRequest(params=params or P(), prompt=text)


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------ params


def test_sampling_params_body_omits_unset_fields() -> None:
    assert P(8).body() == {"model": "m", "max_tokens": 8}
    full = P(8, temperature=0.0, top_p=0.9, stop=("\n",), seed=3, ignore_eos=True, min_tokens=2).body()
    assert full == {"model": "m", "max_tokens": 8, "temperature": 0.0, "top_p": 0.9, "stop": ["\n"],
                    "seed": 3, "ignore_eos": True, "min_tokens": 2}  # fmt: skip


def test_request_needs_exactly_one_of_prompt_and_messages() -> None:
    with pytest.raises(ValueError):
        EngineRequest(params=P())
    with pytest.raises(ValueError):
        EngineRequest(params=P(), prompt="x", messages=(("user", "x"),))


# ----------------------------------------------------------------------- batches


async def test_equal_params_share_one_call_and_results_keep_request_order(
    engine: ScriptedEngine, client: EngineClient
) -> None:
    engine.handlers["/v1/completions"] = echo_completions
    a, b = P(16), P(16, temperature=0.5)
    requests = [prompt("a1", a), prompt("b1", b), prompt("a22", a), prompt("b222", b), prompt("a333", a)]
    results = await client.complete_batch(requests)
    bodies = engine.bodies("/v1/completions")
    assert len(bodies) == 2
    assert sorted(tuple(x["prompt"]) for x in bodies) == [("a1", "a22", "a333"), ("b1", "b222")]
    assert all(x["return_token_ids"] is True and x["n"] == 1 for x in bodies)
    assert [r.text for r in results] == ["out:a1", "out:b1", "out:a22", "out:b222", "out:a333"]  # type: ignore[union-attr]
    # per-choice counts from token_ids / prompt_token_ids, not the call's usage
    assert [r.completion_tokens for r in results] == [2, 2, 3, 4, 4]  # type: ignore[union-attr]
    assert [r.prompt_tokens for r in results] == [1, 1, 2, 2, 3]  # type: ignore[union-attr]


async def test_single_prompt_uses_usage_and_a_plain_string(engine: ScriptedEngine, client: EngineClient) -> None:
    engine.handlers["/v1/completions"] = echo_completions
    [result] = await client.complete_batch([prompt("hello", P(4, ignore_eos=True))])
    [body] = engine.bodies("/v1/completions")
    assert body == {"model": "m", "max_tokens": 4, "ignore_eos": True, "prompt": "hello"}
    assert result == EngineResult("out:hello", "stop", 1, 5)


async def test_counts_without_token_ids_are_exact_where_the_reply_says(
    engine: ScriptedEngine, client: EngineClient
) -> None:
    async def no_ids(_: web.Request, body: dict[str, Any]) -> web.Response:
        reply = completion_reply(body, token_ids=False)
        for c in reply["choices"]:
            if c["index"] == 0:
                c["finish_reason"] = "length"  # hit max_tokens: exactly 6 tokens
        reply["usage"]["completion_tokens"] = 6 + 9
        reply["usage"]["prompt_tokens"] = 10
        return web.json_response(reply)

    engine.handlers["/v1/completions"] = no_ids
    results = await client.complete_batch([prompt("x", P(6)), prompt("yyyy", P(6))])
    assert [r.completion_tokens for r in results] == [6, 9]  # type: ignore[union-attr]
    assert sum(r.prompt_tokens for r in results) == 10  # type: ignore[union-attr]


async def test_400_on_a_group_retries_each_prompt_alone(engine: ScriptedEngine, client: EngineClient) -> None:
    async def refuse_long(_: web.Request, body: dict[str, Any]) -> web.Response:
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        if any(len(p) > 5 for p in prompts):
            return web.json_response({"error": {"message": "prompt is too long", "code": 400}}, status=400)
        return web.json_response(completion_reply(body))

    engine.handlers["/v1/completions"] = refuse_long
    results = await client.complete_batch([prompt("ok"), prompt("much too long"), prompt("fine")])
    assert [b["prompt"] for b in engine.bodies("/v1/completions")][0] == ["ok", "much too long", "fine"]
    assert len(engine.bodies("/v1/completions")) == 4  # the group, then three singles
    assert isinstance(results[0], EngineResult) and results[0].text == "out:ok"
    assert isinstance(results[1], EngineError)
    assert (results[1].kind, results[1].status, results[1].message) == ("invalid", 400, "prompt is too long")
    assert isinstance(results[2], EngineResult) and results[2].text == "out:fine"


async def test_500_fails_every_member_of_that_call_only_and_is_not_retried(
    engine: ScriptedEngine, client: EngineClient
) -> None:
    async def fail_hot(_: web.Request, body: dict[str, Any]) -> web.Response:
        if body.get("temperature") == 1.0:
            return web.json_response({"error": {"message": "engine dead", "code": 500}}, status=500)
        return web.json_response(completion_reply(body))

    engine.handlers["/v1/completions"] = fail_hot
    hot = P(temperature=1.0)
    results = await client.complete_batch([prompt("a", hot), prompt("b"), prompt("c", hot)])
    assert isinstance(results[1], EngineResult)
    for r in (results[0], results[2]):
        assert isinstance(r, EngineError) and (r.kind, r.status, r.message) == ("unavailable", 500, "engine dead")
    assert results[0] is not results[2]  # each caller gets its own exception object
    hot_calls = [b for b in engine.bodies("/v1/completions") if b.get("temperature") == 1.0]
    assert len(hot_calls) == 1  # sent once: never retried


async def test_other_4xx_fails_the_group_as_invalid_without_singles(
    engine: ScriptedEngine, client: EngineClient
) -> None:
    async def not_found(_: web.Request, body: dict[str, Any]) -> web.Response:
        return web.json_response({"object": "error", "message": "The model `m` does not exist."}, status=404)

    engine.handlers["/v1/completions"] = not_found
    results = await client.complete_batch([prompt("a"), prompt("b")])
    assert [(r.kind, r.status) for r in results] == [("invalid", 404)] * 2  # type: ignore[union-attr]
    assert results[0].message == "The model `m` does not exist."  # type: ignore[union-attr]
    assert len(engine.bodies("/v1/completions")) == 1


async def test_connection_refused_is_retried_then_unavailable(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="binbatch_sidecar.engine.engine_client")
    async with EngineClient(f"http://127.0.0.1:{closed_port()}", connect_retries=2) as c:
        loop = asyncio.get_running_loop()
        start = loop.time()
        [result] = await c.complete_batch([prompt("a")])
        elapsed = loop.time() - start
    retries = [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert len(retries) == 2 and "in 0.05 s" in retries[0] and "in 0.2 s" in retries[1]
    assert elapsed >= 0.25  # both backoffs were taken
    assert isinstance(result, EngineError) and result.kind == "unavailable" and result.status is None
    assert "cannot connect" in result.message


async def test_malformed_reply_is_internal(engine: ScriptedEngine, client: EngineClient) -> None:
    async def garbage(_: web.Request, body: dict[str, Any]) -> web.Response:
        return web.Response(text="<html>oops</html>")

    engine.handlers["/v1/completions"] = garbage
    [r] = await client.complete_batch([prompt("a")])
    assert isinstance(r, EngineError) and r.kind == "internal"


async def test_timeout_gives_timeout_kind_and_closes_the_call(engine: ScriptedEngine, client: EngineClient) -> None:
    never = asyncio.Event()
    left = asyncio.Event()

    async def stall(_: web.Request, body: dict[str, Any]) -> web.Response:
        try:
            await never.wait()
        finally:
            left.set()
        raise AssertionError("unreachable")

    async def quick(_: web.Request, body: dict[str, Any]) -> web.Response:
        return web.json_response({"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1}})  # fmt: skip

    engine.handlers["/v1/completions"] = stall
    engine.handlers["/v1/chat/completions"] = quick
    chat = EngineRequest(params=P(), messages=(("user", "hello"),))
    results = await client.complete_batch([prompt("a"), chat, prompt("b")], timeout=0.2)
    assert [r.kind for r in (results[0], results[2])] == ["timeout", "timeout"]  # type: ignore[union-attr]
    assert results[1] == EngineResult("hi", "stop", 3, 1)  # a finished call keeps its result
    await left.wait()  # the server saw the client go away


async def test_chat_requests_go_one_call_each(engine: ScriptedEngine, client: EngineClient) -> None:
    async def chat(_: web.Request, body: dict[str, Any]) -> web.Response:
        last = body["messages"][-1]["content"]
        return web.json_response({"object": "chat.completion",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": last.upper()},
                                               "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}})  # fmt: skip

    engine.handlers["/v1/chat/completions"] = chat
    params = P(2, min_tokens=1)
    requests = [
        EngineRequest(params=params, messages=(("system", "be loud"), ("user", "one"))),
        EngineRequest(params=params, messages=(("user", "two"),)),
    ]
    results = await client.complete_batch(requests)
    assert results == [EngineResult("ONE", "length", 5, 2), EngineResult("TWO", "length", 5, 2)]
    bodies = engine.bodies("/v1/chat/completions")
    assert len(bodies) == 2
    first = next(b for b in bodies if len(b["messages"]) == 2)
    assert first == {"model": "m", "max_tokens": 2, "min_tokens": 1,
                     "messages": [{"role": "system", "content": "be loud"}, {"role": "user", "content": "one"}]}  # fmt: skip


async def test_cancelling_a_batch_propagates_and_closes_the_connection(
    engine: ScriptedEngine, client: EngineClient
) -> None:
    arrived, closed, never = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def hang(_: web.Request, body: dict[str, Any]) -> web.Response:
        arrived.set()
        try:
            await never.wait()
        except asyncio.CancelledError:  # the test server cancels a handler whose client left
            closed.set()
            raise
        raise AssertionError("unreachable")

    engine.handlers["/v1/completions"] = hang
    task = asyncio.create_task(client.complete_batch([prompt("a"), prompt("b")]))
    await arrived.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await closed.wait()
    assert len(engine.bodies("/v1/completions")) == 1


# ------------------------------------------------------------------------ stream


def sse(*events: dict[str, Any] | str) -> bytes:
    out = b""
    for e in events:
        out += b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n"
    return out


async def test_stream_yields_deltas_then_a_result_with_usage(engine: ScriptedEngine, client: EngineClient) -> None:
    async def stream(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b": keep-alive comment\n\n")
        await resp.write(sse({"choices": [{"index": 0, "text": " Hel", "finish_reason": None}]}))
        await resp.write(sse({"choices": [{"index": 0, "text": "", "finish_reason": None}]}))
        # one event split over two writes, with CRLF line ends
        await resp.write(b'data: {"choices": [{"index": 0, "text": "lo",\r\n')
        await resp.write(b'data:  "finish_reason": "length"}]}\r\n\r\n')
        await resp.write(sse({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2,
                                                       "total_tokens": 6}}, "[DONE]"))  # fmt: skip
        await resp.write_eof()
        return resp

    engine.handlers["/v1/completions"] = stream
    progress: list[tuple[int, int | None]] = []
    items = [item async for item in client.stream(prompt("hi", P(2)), on_progress=lambda *a: progress.append(a))]
    assert items == [StreamDelta(" Hel"), StreamDelta("lo"), EngineResult(" Hello", "length", 4, 2)]
    # no usage in its chunks: each token chunk (the empty one too) counts one, the prompt's count unknown
    assert progress == [(1, None), (2, None), (3, None)]


async def test_stream_progress_is_the_engines_own_count_when_every_chunk_has_usage(
    engine: ScriptedEngine, client: EngineClient
) -> None:
    def usage(prompt: int, done: int) -> dict[str, int]:
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    async def stream(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse(  # vLLM's continuous_usage_stats; two tokens in one chunk (its stream interval)
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
             "usage": usage(7, 0)},
            {"choices": [{"index": 0, "delta": {"content": "ab"}, "finish_reason": None}], "usage": usage(7, 2)},
            {"choices": [{"index": 0, "delta": {"content": "c"}, "finish_reason": "length"}], "usage": usage(7, 3)},
            {"choices": [], "usage": usage(7, 3)},
            "[DONE]",
        ))  # fmt: skip
        return resp

    engine.handlers["/v1/chat/completions"] = stream
    progress: list[tuple[int, int | None]] = []
    request = EngineRequest(params=P(3), messages=(("user", "hey"),))
    items = [i async for i in client.stream(request, on_progress=lambda *a: progress.append(a))]
    assert items == [StreamDelta("ab"), StreamDelta("c"), EngineResult("abc", "length", 7, 3)]
    assert progress == [(0, 7), (2, 7), (3, 7)]


async def test_chat_stream_reads_delta_content(engine: ScriptedEngine, client: EngineClient) -> None:
    async def stream(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
            {"choices": [{"index": 0, "delta": {"content": "Yo"}, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 1}},
            "[DONE]",
        ))  # fmt: skip
        return resp

    engine.handlers["/v1/chat/completions"] = stream
    items = [i async for i in client.stream(EngineRequest(params=P(), messages=(("user", "hey"),)))]
    assert items == [StreamDelta("Yo"), EngineResult("Yo", "stop", 9, 1)]


async def test_stream_errors_raise_engine_error(engine: ScriptedEngine, client: EngineClient) -> None:
    async def refused(_: web.Request, body: dict[str, Any]) -> web.Response:
        return web.json_response({"error": {"message": "max_tokens too large", "code": 400}}, status=400)

    async def dies(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
                             {"error": {"message": "engine stopped", "code": 503}}, "[DONE]"))  # fmt: skip
        return resp

    engine.handlers["/v1/completions"] = refused
    with pytest.raises(EngineError) as err:
        [i async for i in client.stream(prompt("x"))]
    assert (err.value.kind, err.value.status, err.value.message) == ("invalid", 400, "max_tokens too large")

    engine.handlers["/v1/completions"] = dies
    seen = []
    with pytest.raises(EngineError) as err:
        async for item in client.stream(prompt("x")):
            seen.append(item)
    assert seen == [StreamDelta("a")]
    assert (err.value.kind, err.value.status, err.value.message) == ("unavailable", 503, "engine stopped")


async def test_stream_timeout(engine: ScriptedEngine, client: EngineClient) -> None:
    never = asyncio.Event()

    async def slow(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"choices": [{"index": 0, "text": "a", "finish_reason": None}]}))
        await never.wait()
        return resp

    engine.handlers["/v1/completions"] = slow
    with pytest.raises(EngineError) as err:
        [i async for i in client.stream(prompt("x"), timeout=0.2)]
    assert err.value.kind == "timeout"


# ------------------------------------------------------------------ small calls


async def test_health_and_models(engine: ScriptedEngine, client: EngineClient) -> None:
    async def ok(_: web.Request, body: dict[str, Any]) -> web.Response:
        return web.Response(status=200)

    async def models(_: web.Request, body: dict[str, Any]) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]})

    engine.handlers["/health"] = ok
    engine.handlers["/v1/models"] = models
    assert await client.health() is True
    assert await client.health("/nope") is False  # 404
    assert await client.models() == ["m1", "m2"]
    async with EngineClient(f"http://127.0.0.1:{closed_port()}") as down:
        assert await down.health() is False
        with pytest.raises(EngineError) as err:
            await down.models()
        assert err.value.kind == "unavailable"
