"""The HTTP server: vLLM's OpenAI routes, ``/health``, ``/metrics``, and the lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import os
import secrets
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .answers import load_answer_lengths
from .config import EmulatorConfig
from .engine import EmulatedEngine, EngineStopped
from .metrics import EmulatorMetrics
from .model import SeqEvent, Sequence
from .openai_requests import RequestError, SamplingSpec, build_sequences, parse_request

# --------------------------------------------------------------------- HTTP: shapes


def usage(seqs: list[Sequence]) -> dict[str, int]:
    prompt = sum(s.prompt_tokens for s in seqs)
    completion = sum(s.output_tokens for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class ResponseShape:
    """The JSON of one request kind (completion or chat), whole or as stream chunks."""

    def __init__(self, chat: bool, model: str, token_ids: bool = False) -> None:
        self.chat = chat
        self.model = model
        self.token_ids = token_ids  # vLLM's ``return_token_ids``: per-choice ids (placeholders here)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, seqs: list[Sequence]) -> dict[str, Any]:
        choices = [self._choice(s) for s in seqs]
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage(seqs)
        return body

    def _choice(self, seq: Sequence) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": seq.index}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": seq.text}
        else:
            choice["text"] = seq.text
        choice |= {"logprobs": None, "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}
        if self.token_ids and not self.chat:
            choice["prompt_token_ids"] = list(range(seq.prompt_tokens))
            choice["token_ids"] = list(range(seq.output_tokens))
        return choice

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", choices)

    def role_chunk(self) -> dict[str, Any]:
        """Chat streams open with the assistant role, as vLLM's do."""
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])  # fmt: skip

    def token_chunk(self, event: SeqEvent, prompt_tokens: int | None = None) -> dict[str, Any]:
        """One token's chunk; with ``prompt_tokens`` (continuous usage stats) it
        carries the sequence's usage so far, as vLLM's do."""
        choice: dict[str, Any] = {"index": event.index}
        if self.chat:
            choice["delta"] = {"content": event.text}
        else:
            choice["text"] = event.text
        choice |= {"logprobs": None, "finish_reason": event.finish_reason}
        chunk = self._chunk([choice])
        if prompt_tokens is not None:
            chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": event.tokens,
                              "total_tokens": prompt_tokens + event.tokens}  # fmt: skip
        return chunk

    def usage_chunk(self, seqs: list[Sequence]) -> dict[str, Any]:
        body = self._chunk([])
        body["usage"] = usage(seqs)
        return body


# ------------------------------------------------------------------ HTTP: handlers

class ReceiptLog:
    """Prompts the engine accepted, appended to ``receipts_file`` as they arrive.

    One ``write`` per line into a file opened for append, so every line already
    written survives a SIGKILL of the emulator and a restarted emulator appends
    after it: the file counts receipts across the engine's lives.
    """

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1, encoding="utf-8") if path else None  # noqa: SIM115 - closed on app cleanup

    def record(self, keys: Iterable[str]) -> None:
        if self._file is not None:
            self._file.write("".join(json.dumps(k) + "\n" for k in keys))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


CONFIG_KEY = web.AppKey("emulator_config", EmulatorConfig)
RECEIPTS_KEY = web.AppKey("emulator_receipts", ReceiptLog)
ANSWERS_KEY = web.AppKey("emulator_answers", dict)  # recorded answer lengths by prompt key (answers.py)
ENGINE_KEY = web.AppKey("emulator_engine", EmulatedEngine)
METRICS_KEY = web.AppKey("emulator_metrics", EmulatorMetrics)


def _error_response(err: RequestError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


def _unavailable(message: str) -> RequestError:
    return RequestError(503, message, None, "ServiceUnavailableError")


@web.middleware
async def _openai_errors(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    """Domain errors become OpenAI-style JSON in one place."""
    try:
        return await handler(request)
    except RequestError as err:
        return _error_response(err)
    except EngineStopped as err:
        return _error_response(_unavailable(str(err)))


def _api_key_check(api_key: str) -> Callable[..., Any]:
    """vLLM's ``--api-key`` (its ``AuthenticationMiddleware``): a request under
    ``/v1`` needs ``Authorization: Bearer <key>``, compared in constant time, or
    gets 401 ``{"error": "Unauthorized"}``; OPTIONS and other paths pass."""
    wanted = hashlib.sha256(api_key.encode()).digest()

    @web.middleware
    async def check(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        if request.method != "OPTIONS" and request.path.startswith("/v1"):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            given = hashlib.sha256(token.encode()).digest()
            if scheme.lower() != "bearer" or not secrets.compare_digest(given, wanted):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


async def _read_json(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError(400, "the request body is not valid JSON") from None


async def handle_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    return await _generate(request, chat=False)


async def handle_chat(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    config, engine = request.app[CONFIG_KEY], request.app[ENGINE_KEY]
    body = await _read_json(request)
    parsed = parse_request(body, config, chat)
    events: asyncio.Queue[SeqEvent] = asyncio.Queue()
    seqs = build_sequences(parsed, config, asyncio.get_running_loop().time(), events, request.app[ANSWERS_KEY])
    engine.submit(seqs)
    request.app[RECEIPTS_KEY].record(p.key for p in parsed.prompts)
    shape = ResponseShape(chat, config.model, token_ids=body.get("return_token_ids") is True)
    try:
        if parsed.sampling.stream:
            return await _stream(request, shape, seqs, events, parsed.sampling)
        return await _whole(shape, seqs, events)
    finally:
        engine.abort(seqs)  # a client that went away frees its blocks; no-op when done


async def _whole(shape: ResponseShape, seqs: list[Sequence], events: asyncio.Queue[SeqEvent]) -> web.Response:
    open_seqs = len(seqs)
    while open_seqs:
        event = await events.get()
        if event.error is not None:
            raise _unavailable(event.error)
        if event.finish_reason is not None:
            open_seqs -= 1
    return web.json_response(shape.whole(seqs))


async def _stream(
    request: web.Request, shape: ResponseShape, seqs: list[Sequence], events: asyncio.Queue[SeqEvent],
    sampling: SamplingSpec,
) -> web.StreamResponse:  # fmt: skip
    """Server-sent events: one chunk per token, the error if the engine stops, [DONE]."""
    prompts = {s.index: s.prompt_tokens for s in seqs} if sampling.continuous_usage else {}
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        if shape.chat:
            await _sse(response, shape.role_chunk())
        open_seqs = len(seqs)
        while open_seqs:
            event = await events.get()
            if event.error is not None:
                await _sse(response, _unavailable(event.error).body())
                break
            await _sse(response, shape.token_chunk(event, prompts.get(event.index)))
            if event.finish_reason is not None:
                open_seqs -= 1
        else:
            if sampling.include_usage:
                await _sse(response, shape.usage_chunk(seqs))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left; _generate aborts its sequences
    return response


async def _sse(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


async def handle_health(request: web.Request) -> web.Response:
    """``GET /health``: 200 while the engine loop runs, 503 once it stopped."""
    if request.app[ENGINE_KEY].accepting:
        return web.Response(status=200)
    return web.Response(status=503)


async def handle_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the one served model."""
    config = request.app[CONFIG_KEY]
    card = {"id": config.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": config.model, "parent": None, "max_model_len": config.max_model_len}  # fmt: skip
    return web.json_response({"object": "list", "data": [card]})


async def handle_metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text exposition."""
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(config: EmulatorConfig) -> web.Application:
    """The aiohttp application; the engine loop starts with the app and stops on shutdown."""
    middlewares = [_api_key_check(config.api_key)] if config.api_key else []
    app = web.Application(middlewares=[*middlewares, _openai_errors], client_max_size=config.max_request_body_bytes)
    metrics = EmulatorMetrics(config)
    engine = EmulatedEngine(config, metrics)
    app[CONFIG_KEY], app[METRICS_KEY], app[ENGINE_KEY] = config, metrics, engine
    app[RECEIPTS_KEY] = ReceiptLog(config.receipts_file)
    app[ANSWERS_KEY] = load_answer_lengths(config.answer_lengths) if config.answer_lengths else {}
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/metrics", handle_metrics)

    async def start_engine(_: web.Application) -> None:
        engine.start()

    async def stop_engine(_: web.Application) -> None:
        # on_shutdown runs after the listening sockets closed and before open
        # connections are drained, so every pending request gets its 503.
        await engine.stop()

    async def close_receipts(_: web.Application) -> None:
        app[RECEIPTS_KEY].close()

    app.on_startup.append(start_engine)
    app.on_shutdown.append(stop_engine)
    app.on_cleanup.append(close_receipts)
    return app


# ---------------------------------------------------------------- server lifecycle


class CannotListen(Exception):
    """The emulator's port could not be bound (in use, no permission, unknown host):
    one line for a person, not a traceback.  The sidecar has its own
    (``binbatch_sidecar.server.ports``): the emulator imports no sidecar code."""

    def __init__(self, host: str, port: int, exc: OSError) -> None:
        setting = "--port"
        if exc.errno and exc.errno > 0 and not isinstance(exc, socket.gaierror):
            reason = os.strerror(exc.errno)
        else:  # an unknown host: getaddrinfo's message
            reason, setting = str(exc.strerror or exc), "--host"
        shown = f"[{host}]" if ":" in host else host
        super().__init__(f"cannot listen on {shown}:{port} ({setting}): {reason.lower()}")
        self.host, self.port, self.errno = host, port, exc.errno


class Emulator:
    """An emulator serving on ``host:port`` (port 0 picks a free one), as a context manager."""

    def __init__(self, config: EmulatorConfig | None = None, host: str = "127.0.0.1", port: int = 0,
                 shutdown_timeout: float = 5.0) -> None:  # fmt: skip
        self.config = config or EmulatorConfig()
        self.host = host
        self.app = build_app(self.config)
        self._requested_port = port
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=shutdown_timeout)  # fmt: skip
        self.port: int | None = None
        self._stopped = False

    @property
    def engine(self) -> EmulatedEngine:
        return self.app[ENGINE_KEY]

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the emulator is not serving")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> str:
        """Bind, start the engine loop; returns the base URL (with the bound port).
        Raises ``CannotListen`` (after stopping the engine loop) if the bind fails."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._requested_port)
        try:
            await site.start()
        except OSError as exc:
            self._stopped = True
            await self._runner.cleanup()
            raise CannotListen(self.host, self._requested_port, exc) from None
        self.port = int(self._runner.addresses[0][1])
        return self.base_url

    async def stop(self) -> None:
        """Stop listening, answer pending requests with 503, stop the loop, close.

        Idempotent: a test may stop the emulator inside its ``async with``.
        """
        if self._stopped:
            return
        self._stopped = True
        await self._runner.cleanup()

    async def __aenter__(self) -> Emulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


@contextlib.asynccontextmanager
async def running_emulator(config: EmulatorConfig | None = None, host: str = "127.0.0.1",
                           port: int = 0) -> AsyncIterator[str]:  # fmt: skip
    """``async with running_emulator(config) as base_url:`` -- an emulator for a test."""
    async with Emulator(config, host, port) as emulator:
        yield emulator.base_url


async def serve(host: str, port: int, config: EmulatorConfig) -> None:
    """Serve until SIGINT or SIGTERM, then shut down cleanly."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    async with Emulator(config, host, port) as emulator:
        print(f"binbatch emulate-engine: model {config.model!r} on {emulator.base_url} "
              f"(step {config.step_a * 1e3:g} ms + {config.step_c * 1e3:g} ms/seq "
              f"+ {config.prefill_per_token * 1e3:g} ms/prefilled token, "
              f"{config.num_gpu_blocks}x{config.block_size} KV tokens)", file=sys.stderr, flush=True)  # fmt: skip
        # as vLLM's API server does once started: the start-up heap is marked static, so the
        # oldest generation's collections (a stall of the whole loop) walk only what serving made
        gc.collect()
        gc.freeze()
        handled = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
                handled.append(sig)
        try:
            await stop.wait()
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)
