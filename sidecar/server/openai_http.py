"""The OpenAI-compatible HTTP door: a second way into the same scheduler.

Clients, gateways and routers that speak vLLM's OpenAI API (the production-stack
router, the Gateway API Inference Extension, KServe, the ``openai`` package)
reach the sidecar here unchanged.  This module only translates: the JSON body
(``openai_bodies``) and headers into ``front.Fields``, the outcome back into
OpenAI JSON or server-sent events.  Submitting, bins, the deadline in the queue
and withdrawing are ``front.Front``'s, exactly as for gRPC.

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (whole, or SSE with
``stream: true``); ``GET /health`` (the sidecar's readiness: 200 while it serves,
503 while draining or with the engine down); ``GET``/``HEAD`` of the engine paths
of ``/v1/models``, ``/metrics``, ``/version``, and ``GET``/``HEAD``/``POST`` of a
path in ``server.passthroughPaths``, go to the engine unqueued, minus the hop-by-hop
headers, and its answer comes back streamed.  Every other path -- vLLM's
``/pause``, ``/invocations``, ``/pooling``, ``/score``, ``/tokenize``, any admin
route -- is a 404 naming ``server.passthroughPaths`` and never reaches the engine.
A listed path also takes POST (``/tokenize`` and ``/v1/embeddings`` are POST only).

Slow clients are bounded in time (``connection_limits``): a request's headers must
arrive within ``server.httpRequestReadTimeoutMilliseconds`` of the connection opening
(or of its previous answer), its body within as long again (one streamed on to the
engine too), else the connection is closed (a late body is a 408 first); at most ``server.maxConnections`` connections are
open, one past it is closed as it is made.

Memory is bounded in bytes: a body over ``server.maxRequestBytes`` is a 413 (aiohttp's
``client_max_size``, answered as OpenAI JSON), and the queue's bodies together are
bounded by ``batch.maxQueuedBytes`` (429 with ``Retry-After``, from the scheduler).
A string holding a lone UTF-16 surrogate (JSON's ``"\\ud800"``) is a 400 naming its field.

Headers in: ``x-request-id`` (else one is made; echoed on every answer),
``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` (as gRPC metadata), ``x-expected-output-tokens``
(gRPC's ``expected_output_tokens``), ``x-request-class`` / ``x-request-priority``
(gRPC's ``request_class`` / ``priority``), ``x-request-timeout-ms`` (the deadline,
as gRPC's: a request still queued then leaves its bin, one running is aborted;
504), ``traceparent`` / ``tracestate`` (passed to the engine).  Headers out:
``x-request-id``, ``x-binbatch-predicted-tokens``, ``x-binbatch-bin``,
``x-binbatch-queue-ms`` -- on a stream they go with its first chunk, when the
request has left its bin, so all three are known then.  The hint, priority and SLO
headers steer a request only as ``front.Front.admit_inputs`` lets them (a hint the
body contradicts is a 400 naming ``x-expected-output-tokens``; what the request's
class may not send is ignored).

Errors are OpenAI's error JSON with the status gRPC's code maps to: 400 naming the
field (``param``), 429 with ``Retry-After`` on a full queue (RESOURCE_EXHAUSTED),
503 while draining or with the engine down, 504 past the deadline, the engine's
own 4xx, 500 for an engine reply the sidecar cannot read.  An error after a
stream began is an ``error`` event, then ``[DONE]``.

Caller authentication (``auth.callerTokensDir``, ``caller_auth``): when on, every path but
``/health`` needs ``Authorization: Bearer <token>`` of a known caller, else 401 in OpenAI's error
shape with ``WWW-Authenticate: Bearer`` (the ``openai`` package's ``AuthenticationError``), before
the body is read; the caller's token is never forwarded to the engine (``EngineClient.forward``).

A burst's requests are taken in two per turn of the event loop (``turns``), so the
engine starts on its first requests while the rest are read.

A client that disconnects is gone for good: the runner cancels its handler
(``handler_cancellation``) and the request is withdrawn -- out of its bin, or
its engine call aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ..config import DEFAULT_PASSTHROUGH_PATHS
from ..engine.dispatcher import Completion, Rejected
from ..engine.engine_client import EngineClient, EngineError
from .caller_auth import CallerAuth, Unauthenticated
from .connection_limits import BodyTooLarge, StreamedBody, read_body
from .front import DIGITS, REQUEST_ID_LIMIT, Fields, Front, InvalidRequest, Ticket, read_slo, read_tenant
from .openai_bodies import ChatBody, CompletionBody, include_usage, parse_body, read_json, to_fields
from .trace_context import read_trace_context
from .turns import Turns

log = logging.getLogger("binbatch.http")

CALLER_KEY = web.RequestKey("caller", str)  # the authenticated caller, set by OpenAIDoor._authenticate
REQUEST_ID = "x-request-id"
TIMEOUT = "x-request-timeout-ms"
TIMEOUT_LIMIT_MS = 3_600_000
HINT = "x-expected-output-tokens"
CLASS = "x-request-class"
PRIORITY = "x-request-priority"
PREDICTED, BIN, QUEUE_MS = "x-binbatch-predicted-tokens", "x-binbatch-bin", "x-binbatch-queue-ms"
RETRY_AFTER_SECONDS = 1  # a full queue drains in about a batch's time; the client's retry comes back then
READ_METHODS = ("GET", "HEAD")  # the default passthrough paths: reads only
# a path listed in server.passthroughPaths is an explicit opt-in; vLLM's /tokenize, /detokenize and
# /v1/embeddings take POST only, so a listed path takes POST too (its body streams through, never held)
LISTED_METHODS = ("GET", "HEAD", "POST")
# RFC 9110 §7.6.1 hop-by-hop headers, and Host (the engine's is its own)
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
                        "te", "trailer", "transfer-encoding", "upgrade", "host"})  # fmt: skip
_VISIBLE = re.compile(r"[!-~]{1,%d}" % REQUEST_ID_LIMIT)  # an id safe to echo in a header
_SIGNED = re.compile(r"-?[0-9]{1,9}")

# names the door reports a neutral field by (front.build's ``names``)
HEADER_NAMES = {"expected_output_tokens": HINT, "request_class": CLASS, "priority": PRIORITY,
                "request_id": REQUEST_ID}  # fmt: skip

_REJECTED = {  # Rejected.kind -> (status, type, code)
    "resource_exhausted": (429, "rate_limit_error", "queue_full"),
    "unavailable": (503, "service_unavailable_error", "unavailable"),
    "deadline": (504, "timeout_error", "deadline_exceeded"),
    "cancelled": (499, "cancelled_error", "cancelled"),  # nobody reads it: the client left
}
_ENGINE = {  # EngineError.kind -> (status, type, code); "invalid" keeps the engine's 4xx
    "invalid": (400, "invalid_request_error", "engine_refused"),
    "unavailable": (503, "service_unavailable_error", "engine_unavailable"),
    "timeout": (504, "timeout_error", "engine_timeout"),
    "internal": (500, "server_error", "engine_reply_unreadable"),
    # the engine refused the sidecar's own key (engine.apiKeyFile): a bad gateway, never the caller's 401
    "unauthorized": (502, "server_error", "engine_unauthorized"),
}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def status_of(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The one place where errors become HTTP statuses (gRPC's ``_status_of``)."""
    if isinstance(exc, InvalidRequest):
        return 400, error_body(str(exc), "invalid_request_error", exc.param)
    if isinstance(exc, Rejected):
        status, type_, code = _REJECTED.get(exc.kind, (500, "server_error", exc.kind))
        return status, error_body(exc.message, type_, None, code)
    if isinstance(exc, EngineError):
        status, type_, code = _ENGINE.get(exc.kind, (500, "server_error", exc.kind))
        if exc.kind == "invalid" and exc.status is not None and 400 <= exc.status < 500:
            status = exc.status
        return status, error_body(f"engine: {exc.message}", type_, None, code)
    return 500, error_body(f"internal error: {type(exc).__name__}", "server_error")


def too_large(limit: int, request_id: str | None) -> web.Response:
    """413 for a body over ``server.maxRequestBytes``, as OpenAI error JSON."""
    message = (f"body: larger than the sidecar's limit of {limit} bytes (server.maxRequestBytes, "
               "spec.sidecar.maxRequestBytes)")  # fmt: skip
    headers = {REQUEST_ID: request_id} if request_id else {}
    return web.json_response(error_body(message, "invalid_request_error", "body", "request_too_large"), status=413,
                             headers=headers)  # fmt: skip


def body_too_slow(seconds: float, request_id: str | None) -> web.Response:
    """408 for a body that did not arrive within ``server.httpRequestReadTimeoutMilliseconds``
    of its headers; the connection is closed after it (the rest of the body is not waited for)."""
    message = (f"body: not received within {seconds * 1000:.0f} ms of the headers "
               "(server.httpRequestReadTimeoutMilliseconds, spec.sidecar.httpRequestReadTimeoutMilliseconds)")  # fmt: skip
    headers = {REQUEST_ID: request_id} if request_id else {}
    response = web.json_response(error_body(message, "invalid_request_error", "body", "request_timeout"), status=408,
                                 headers=headers)  # fmt: skip
    response.force_close()
    return response


def error_response(exc: BaseException, request_id: str | None) -> web.Response:
    status, body = status_of(exc)
    headers = {REQUEST_ID: request_id} if request_id else {}
    if status == 429:
        headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return web.json_response(body, status=status, headers=headers)


def _header(request: web.Request, name: str) -> str | None:
    values = request.headers.getall(name, [])
    if len(values) > 1:
        raise InvalidRequest(f"{name}: given more than once")
    return values[0] if values else None


def read_headers(request: web.Request, f: Fields) -> None:
    """The door's headers into ``f`` (the request id is read before, to echo it)."""
    pairs = tuple(request.headers.items())
    f.slo = read_slo(pairs)
    f.tenant = read_tenant(pairs)
    f.trace = read_trace_context(pairs)
    if (hint := _header(request, HINT)) is not None:
        if not DIGITS.fullmatch(hint):
            raise InvalidRequest(f"{HINT}: must be a whole number of tokens, got {hint[:32]!r}")
        f.expected_output_tokens = int(hint)
    if (priority := _header(request, PRIORITY)) is not None:
        if not _SIGNED.fullmatch(priority):
            raise InvalidRequest(f"{PRIORITY}: must be a whole number, got {priority[:32]!r}")
        f.priority = int(priority)
    f.request_class = _header(request, CLASS) or ""
    if (timeout := _header(request, TIMEOUT)) is not None:
        if not DIGITS.fullmatch(timeout) or not 1 <= int(timeout) <= TIMEOUT_LIMIT_MS:
            raise InvalidRequest(f"{TIMEOUT}: must be a whole number of milliseconds in [1, {TIMEOUT_LIMIT_MS}], "
                                 f"got {timeout[:32]!r}")  # fmt: skip
        f.timeout = int(timeout) / 1000


class _Shape:
    """The reply JSON of one request, completion or chat, whole or as chunks."""

    def __init__(self, chat: bool, request_id: str, model: str, usage_chunks: bool) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.usage_chunks = usage_chunks  # include_usage: chunks carry "usage": null, the last one the counts
        self.first = True
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"  # a stream's chunks' "object"
        # a piece of text's event is the same envelope every time: rendered once, the text put in between
        head = _json({"id": self.id, "object": self.chunk_object, "created": self.created, "model": model})[:-1]
        self._text_head = b"data: " + head + (b',"choices":[{"index":0,"delta":{"content":' if chat
                                              else b',"choices":[{"index":0,"text":')  # fmt: skip
        self._text_tail = ((b"}" if chat else b"") + b',"logprobs":null,"finish_reason":null}]'
                           + (b',"usage":null' if usage_chunks else b"") + b"}\n\n")  # fmt: skip

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, c: Completion) -> dict[str, Any]:
        r = c.result
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": r.text}
        else:
            choice["text"] = r.text
        choice |= {"logprobs": None, "finish_reason": r.finish_reason}
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        return body | {"usage": _usage(c)}

    def chunk(self, text: str | None, finish_reason: str | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if self.first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        self.first = False
        choice |= {"logprobs": None, "finish_reason": finish_reason}
        out = self._envelope(self.chunk_object, [choice])
        return out | {"usage": None} if self.usage_chunks else out

    def text_event(self, text: str) -> bytes:
        """The server-sent event of ``chunk(text)``: the envelope rendered once, around the text
        (a chat's first chunk, which names the role, is built whole)."""
        if self.first and self.chat:
            return _event(self.chunk(text))
        self.first = False
        return self._text_head + json.dumps(text).encode() + self._text_tail

    def usage_chunk(self, c: Completion) -> dict[str, Any]:
        return self._envelope(self.chunk_object, []) | {"usage": _usage(c)}


def _usage(c: Completion) -> dict[str, int]:
    r = c.result
    return {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens}  # fmt: skip


def _json(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def _event(payload: dict[str, Any]) -> bytes:
    """One server-sent event of a JSON payload."""
    return b"data: " + _json(payload) + b"\n\n"


DONE = b"data: [DONE]\n\n"


class OpenAIDoor:
    """Given what it calls: the shared ``front``, the engine client in use (a
    reload may replace it), and the sidecar's readiness."""

    def __init__(self, front: Front, *, engine: Callable[[], EngineClient], ready: Callable[[], bool],
                 auth: CallerAuth | None = None) -> None:  # fmt: skip
        self.auth = auth  # auth.callerTokensDir: who the caller is (None: nobody is asked)
        self.front = front
        self.engine = engine
        self.ready = ready
        self.max_request_bytes = front.config().server.max_request_bytes  # app() reads it again, as it builds
        self.read_timeout = front.config().server.http_request_read_timeout_milliseconds / 1000
        self.turns = Turns()

    def app(self) -> web.Application:
        """The routes; ``server.maxRequestBytes`` and ``server.httpRequestReadTimeoutMilliseconds``
        are read here, once (restart keys: the runner's header deadline is the same setting)."""
        server = self.front.config().server
        self.max_request_bytes = limit = server.max_request_bytes
        self.read_timeout = server.http_request_read_timeout_milliseconds / 1000
        app = web.Application(client_max_size=limit, middlewares=[_http_errors, self._authenticate])
        app.router.add_post("/v1/completions", self.completions, expect_handler=_expect)
        app.router.add_post("/v1/chat/completions", self.chat, expect_handler=_expect)
        app.router.add_get("/health", self.health, expect_handler=_expect)
        app.router.add_route("*", "/{tail:.*}", self.passthrough, expect_handler=_expect)  # the allowlist, else 404
        quiet_bad_requests()
        return app

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        """With caller authentication on, every path but ``/health`` (probes) needs a known caller's token:
        else 401 before anything else is read.  The caller's name is ``request[CALLER_KEY]``."""
        request[CALLER_KEY] = ""
        if self.auth is None or request.path == "/health":
            return await handler(request)
        try:
            request[CALLER_KEY] = self.auth.authenticate("http", request.headers.getall("Authorization", []),
                                                       "Authorization")  # fmt: skip
        except Unauthenticated as exc:
            sent = "Authorization" in request.headers
            challenge = 'Bearer realm="binbatch"' + (', error="invalid_token"' if sent else "")
            code = "invalid_api_key" if sent else "missing_api_key"
            return web.json_response(error_body(str(exc), "invalid_request_error", None, code), status=401,
                                     headers={"WWW-Authenticate": challenge})  # fmt: skip
        return await handler(request)

    def passthrough_methods(self, path: str) -> tuple[str, ...]:
        """The methods ``path`` passes to the engine with: GET/HEAD for the default paths, also POST
        for one listed in ``server.passthroughPaths`` (read live); none for any other path."""
        if path in self.front.config().server.passthrough_paths:
            return LISTED_METHODS
        return READ_METHODS if path in DEFAULT_PASSTHROUGH_PATHS else ()

    async def health(self, _: web.Request) -> web.Response:
        ready = self.ready()
        return web.Response(text="ok" if ready else "not serving (draining, or the engine is down)",
                            status=200 if ready else 503)  # fmt: skip

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        await self.turns.take()  # a burst's requests go on two per turn of the loop (turns.py)
        given = request.headers.getall(REQUEST_ID, [])
        if len(given) > 1 or (given and not _VISIBLE.fullmatch(given[0])):
            problem = f"{REQUEST_ID}: one value of 1 to {REQUEST_ID_LIMIT} visible ASCII characters"
            return error_response(InvalidRequest(problem), None)
        request_id = given[0] if given else uuid.uuid4().hex
        limit = self.max_request_bytes  # server.maxRequestBytes, as the app was built with it
        if request.content_length is not None and request.content_length > limit:
            return too_large(limit, request_id)  # refused before a byte of it is read
        try:
            # the body counts against batch.maxQueuedBytes while it is read (the most a chunked one may be)
            reserved = limit if request.content_length is None else request.content_length
            with self.front.body_room(reserved):
                try:
                    raw = await read_body(request, self.read_timeout, limit)
                except BodyTooLarge:  # chunked, or a Content-Length that lied: stopped at the limit
                    return too_large(limit, request_id)
                if raw is None:  # a slow or stalled body: what arrived is dropped, and so is the connection
                    return body_too_slow(self.read_timeout, request_id)
                size = len(raw)
                parsed = read_json(raw)
                del raw  # the parsed body holds the text now: the bytes go before the request waits
                body = parse_body(parsed, chat)
                f, names = to_fields(body)
                f.request_id = request_id
                f.body_bytes = size
                f.caller = request[CALLER_KEY]
                read_headers(request, f)
                ticket = await self.front.submit(f, body.stream, HEADER_NAMES | names, reading=reserved)
        except (InvalidRequest, Rejected) as exc:
            return error_response(exc, request_id)
        model = ticket.call.engine_request.params.model
        shape = _Shape(chat, request_id, model, body.stream and include_usage(body))
        try:
            if body.stream:
                try:
                    return await self._stream(request, ticket, body, shape, f.timeout)
                except ConnectionResetError:  # the client left mid-stream; nothing more can reach it
                    log.debug("the client left mid-stream", extra=ticket.log_extra)
                    return web.Response(status=499)
            try:
                async with asyncio.timeout(f.timeout):
                    completion = await asyncio.shield(ticket.call.future)
            except TimeoutError:
                return error_response(Rejected("deadline", f"{TIMEOUT}: the deadline passed"), request_id)
            except (Rejected, EngineError) as exc:
                log.debug("failed: %s", exc, extra=ticket.log_extra)
                return error_response(exc, request_id)
            self.front.finished(ticket, completion)
            return web.json_response(shape.whole(completion), headers=_placement(ticket, completion))
        finally:
            self.front.withdraw(ticket)  # the client left (cancelled handler) or the deadline passed

    async def _stream(
        self, request: web.Request, ticket: Ticket, body: CompletionBody | ChatBody, shape: _Shape,
        timeout: float | None,
    ) -> web.StreamResponse:  # fmt: skip
        """Server-sent events: a chunk per piece of text as the engine makes it,
        the last one with the finish reason, the usage chunk if asked, ``[DONE]``.
        The response starts (status, headers) with the first chunk, so an error
        before it is still a plain error with its status."""
        call = ticket.call
        assert call.deltas is not None
        response: web.StreamResponse | None = None
        tail = ""  # text that arrived with the answer's end: it goes out in the end's write
        try:
            try:
                async with asyncio.timeout(timeout):
                    while not call.future.done() or not call.deltas.empty():
                        piece = await call.deltas.get()
                        while not call.deltas.empty():  # the engine ran ahead: one chunk for what arrived
                            piece += call.deltas.get_nowait()
                        if call.future.done():  # the last text and the end came in one turn: one write
                            tail = piece
                            break
                        if piece:
                            response = response or await self._open(request, ticket, None)
                            await response.write(shape.text_event(piece))
                    completion = call.future.result()
            except TimeoutError:
                raise Rejected("deadline", f"{TIMEOUT}: the deadline passed") from None
        except (Rejected, EngineError) as exc:
            log.debug("failed: %s", exc, extra=ticket.log_extra)
            if response is None and not tail:
                return error_response(exc, ticket.req.id)
            response = response or await self._open(request, ticket, None)
            await response.write((shape.text_event(tail) if tail else b"") + _event(status_of(exc)[1]) + DONE)
            return response
        self.front.finished(ticket, completion)
        if response is None:  # gang mode (the text comes whole), one turn's whole answer, or an empty one
            response = await self._open(request, ticket, completion)
            tail = tail or completion.result.text
        events = [shape.text_event(tail)] if tail else []  # the end goes in one write, with the last text
        events.append(_event(shape.chunk(None if shape.chat else "", completion.result.finish_reason)))
        if include_usage(body):
            events.append(_event(shape.usage_chunk(completion)))
        events.append(DONE)
        await response.write_eof(b"".join(events))
        return response

    async def _open(self, request: web.Request, ticket: Ticket, completion: Completion | None) -> web.StreamResponse:
        response = _EventStream(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                         **_placement(ticket, completion, self.front.clock.now())})  # fmt: skip
        await response.prepare(request)
        return response

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """An allowlisted engine path (``passthrough_methods``): to the engine unqueued,
        its answer streamed back.  Any other path or method: 404 / 405, and the
        engine sees nothing."""
        path = request.path  # decoded and normalised by aiohttp: "/v1/%6Dodels" is "/v1/models"
        methods = self.passthrough_methods(path)
        if not methods:
            shown = path if len(path) <= 128 else path[:128] + "..."
            message = (f"{request.method} {shown}: not found. The sidecar serves /v1/completions, "
                       f"/v1/chat/completions and /health; of the engine's own paths only GET of "
                       f"{', '.join(DEFAULT_PASSTHROUGH_PATHS)} and those listed in server.passthroughPaths "
                       "(spec.sidecar.passthroughPaths) pass through")  # fmt: skip
            return web.json_response(error_body(message, "invalid_request_error", None, "not_found"), status=404)
        if request.method not in methods:
            message = (f"{request.method} {path}: only {', '.join(methods)} reach the engine there "
                       "(GET and HEAD for the default paths, also POST for those in server.passthroughPaths)")  # fmt: skip
            return web.json_response(error_body(message, "invalid_request_error", None, "method_not_allowed"),
                                     status=405, headers={"Allow": ", ".join(methods)})  # fmt: skip
        listed = {t.strip().lower() for v in request.headers.getall("Connection", []) for t in v.split(",")}
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP | listed]
        query = request.rel_url.raw_query_string
        target = f"{path}?{query}" if query else path  # the path that matched, not the raw one: no encoded tricks
        body = StreamedBody(request.content, self.read_timeout) if request.body_exists else None
        try:
            upstream = await self.engine().forward(request.method, target, headers, body and body.chunks())
        except EngineError as exc:
            if body is not None and body.missed:  # the engine call was cut because the client's body was late
                return body_too_slow(self.read_timeout, None)
            return error_response(exc, None)
        try:
            listed = {t.strip().lower() for v in upstream.headers.getall("Connection", []) for t in v.split(",")}
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in HOP_BY_HOP | listed:
                    response.headers.add(k, v)
            await response.prepare(request)
            try:
                async for data in upstream.content.iter_any():
                    await response.write(data)
            except (aiohttp.ClientError, TimeoutError) as exc:  # the engine broke off: so does this answer
                log.debug("passthrough %s %s broke off: %r", request.method, request.path, exc)
                response.force_close()
                return response
            await response.write_eof()
            return response
        finally:
            upstream.release()


def _placement(ticket: Ticket, completion: Completion | None, now: float | None = None) -> dict[str, str]:
    """Where the request went: its id, predicted length, bin and time queued (from
    the completion, else -- a stream's first chunk -- from the request and its
    dispatch time)."""
    req, call = ticket.req, ticket.call
    if completion is not None:
        predicted, bin_, queued = completion.predicted_tokens, completion.bin, completion.queue_seconds
    else:
        predicted, bin_ = req.predicted_tokens or 0.0, req.bin or 0
        sent = call.dispatched_at if call.dispatched_at is not None else now
        queued = max(0.0, (sent or req.arrival) - req.arrival)
    return {REQUEST_ID: req.id, PREDICTED: f"{predicted:g}", BIN: str(bin_), QUEUE_MS: f"{queued * 1000:.3f}"}


class _EventStream(web.StreamResponse):
    """A stream of server-sent events whose status and headers go out with its first event, in one
    write: aiohttp's ``StreamResponse`` sends them alone when prepared (its ``Response`` holds them
    back the same way), a socket call more for every streamed request.  ``_open`` prepares it only
    when the first event is ready, so the client sees the headers no later."""

    _send_headers_immediately = False


@web.middleware
async def _http_errors(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    """aiohttp's own refusals (a body over the size limit) as OpenAI error JSON."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        body = error_body(exc.reason if exc.text is None else exc.text, "invalid_request_error", "body")
        return web.json_response(body, status=exc.status)


async def _expect(request: web.Request) -> None:
    """``Expect: 100-continue`` as aiohttp's default handler does; any other value a 417 that does not
    echo it (aiohttp's echo of a value that is not UTF-8 failed to encode: a 500, found by bench fuzz)."""
    if request.version != aiohttp.HttpVersion11:
        return
    if request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the 100 is not the answer's start
        return
    body = error_body("header 'expect': only 100-continue is understood", "invalid_request_error", "expect")
    raise web.HTTPExpectationFailed(text=json.dumps(body), content_type="application/json")


class _BadRequestsAtDebug(logging.Filter):
    """aiohttp logs a request it cannot parse (a bad header byte, a bad URL, a body after
    ``Connection: close``) at ERROR with a traceback, though it answers 400: the client's
    fault, not the sidecar's.  Such records go to DEBUG, one line, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError) or record.levelno < logging.ERROR:
            return True
        record.msg, record.args = "bad HTTP request: %s", (" ".join(str(exc).split())[:200],)
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.exc_info = record.exc_text = None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


_BAD_REQUESTS_FILTER = _BadRequestsAtDebug()


def quiet_bad_requests() -> None:
    """Install the filter on aiohttp's server logger (once)."""
    logging.getLogger("aiohttp.server").addFilter(_BAD_REQUESTS_FILTER)  # adding it again is a no-op
