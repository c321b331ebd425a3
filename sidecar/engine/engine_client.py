"""An async client for vLLM's OpenAI-compatible HTTP API (aiohttp).

The dispatcher hands the client whole batches (``complete_batch``) or single
streaming requests (``stream``); the client turns them into as few engine calls as
is safe and gives every caller exactly one answer -- an ``EngineResult`` or an
``EngineError`` -- never an exception (except ``CancelledError``).

Per-request token counts in a multi-prompt call.  vLLM's ``usage`` covers the whole
``/v1/completions`` call.  vLLM (0.32: ``CompletionResponseChoice.token_ids`` and
``prompt_token_ids``, filled when the request sets ``return_token_ids``) returns the
ids of every choice, so a call with several prompts asks for them and counts
``len(choice["token_ids"])``.  An engine that ignores the field (the emulator, older
vLLM) gets exact counts where they follow from the reply -- a lone prompt takes
``usage``; ``finish_reason == "length"`` means ``max_tokens`` tokens (vLLM refuses a
prompt whose ``max_tokens`` does not fit the context); one unknown choice takes the
rest of ``usage`` -- and otherwise ``usage`` is apportioned by text length (logged
once per client).

Retries.  Only when the TCP connection could not be established
(``aiohttp.ClientConnectorError``): the request never reached the engine, so a
retry cannot duplicate work.  Once a request is sent it is never repeated.  An
``EngineError`` with ``sent=False`` says the engine never received the request
(the dispatcher may queue it again).

Body size.  vLLM's HTTP server refuses a body over its limit with 413 (aiohttp's
``client_max_size`` is 1 MiB), and a multi-prompt call would fail every prompt in
it for the size of all of them.  So a call is capped at ``max_body_bytes``: a
group of prompts whose list call would be larger goes as several calls, a 413 to
a list call splits it in halves, and only a request whose own body is too large
fails -- alone, with the sizes in the message.

Credentials.  An engine started with ``--api-key`` wants ``Authorization: Bearer
<key>``: ``api_key`` (an ``engine_key.EngineKey``, shared so a rotated key applies
to the next call) puts it on every call -- completions, chat, streams, list calls,
the health probe, ``/v1/models`` and passthrough requests -- and a caller's own
``Authorization`` is never sent on in its place.  An engine that refuses the
credentials (401/403) fails the call as "unauthorized", naming ``engine.apiKeyFile``.
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import yarl
from multidict import CIMultiDict

from .engine_key import FIELD as API_KEY_FIELD
from .engine_key import EngineKey

log = logging.getLogger(__name__)

CONNECT_BACKOFF_SECONDS = (0.05, 0.2)  # before connect retry 1, 2 (and later ones)
HEALTH_TIMEOUT_SECONDS = 5.0
MODELS_TIMEOUT_SECONDS = 10.0
# Below uvicorn's (vLLM's) 5 s keep-alive: a pooled connection the server already
# closed would fail a POST after it was sent, and a sent POST is never retried.
KEEPALIVE_SECONDS = 3.0
ERROR_TEXT_LIMIT = 500
# Below vLLM's (aiohttp's) default 1 MiB client_max_size, with room for headers of
# proxies that count them in.
DEFAULT_MAX_BODY_BYTES = 768 * 1024

EngineErrorKind = str  # "unavailable" | "invalid" | "timeout" | "internal" | "unauthorized"
Headers = tuple[tuple[str, str], ...]


# ------------------------------------------------------------------------ data types


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling fields of one request.  Hashable: requests with equal parameters may
    share one ``/v1/completions`` call."""

    model: str
    max_tokens: int | None  # None: the engine's default (the rest of the context)
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    priority: int | None = None  # vLLM's priority, lower first (batch.order EnginePriority); None: not sent

    def body(self) -> dict[str, Any]:
        """The OpenAI/vLLM JSON fields, without the unset ones (``ignore_eos`` and
        ``min_tokens`` are vLLM extras accepted at the top level of the body)."""
        out: dict[str, Any] = {"model": self.model}
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            out["temperature"] = self.temperature
        if self.top_p is not None:
            out["top_p"] = self.top_p
        if self.stop:
            out["stop"] = list(self.stop)
        if self.seed is not None:
            out["seed"] = self.seed
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.min_tokens is not None:
            out["min_tokens"] = self.min_tokens
        if self.priority is not None:
            out["priority"] = self.priority
        return out


@dataclass(slots=True)
class EngineRequest:
    """One caller's request: a text ``prompt`` or chat ``messages`` as (role, content).

    ``trace_headers``: the caller's W3C trace context (``traceparent``,
    ``tracestate``), sent with its engine call.  A multi-prompt call is one HTTP
    request with room for one trace context: it carries its first member's (the
    others' traces do not continue into the engine; vLLM takes one per request).
    """

    params: SamplingParams
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    trace_headers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("EngineRequest needs exactly one of prompt and messages")


@dataclass(frozen=True, slots=True)
class EngineResult:
    """One finished completion."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


# ``on_progress`` of a stream: (tokens generated so far, the prompt's tokens as the engine counted them or None)
Progress = Callable[[int, int | None], None]


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """A piece of generated text; the last item of a stream is an ``EngineResult``."""

    text: str


class EngineError(Exception):
    """Why the engine gave no result.

    ``kind``: "unavailable" (no connection, connection lost, 5xx, engine down),
    "invalid" (4xx: the engine refused the request; ``message`` is its error text),
    "timeout" (no answer in time), "internal" (a reply the client cannot read) or
    "unauthorized" (401/403: the engine refused the sidecar's credentials).
    ``status`` is the HTTP status when there was one.  ``sent`` is False only when
    the request certainly never reached the engine (the connection was refused).
    """

    def __init__(self, kind: EngineErrorKind, status: int | None, message: str, *, sent: bool = True) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.status = status
        self.message = message
        self.sent = sent

    def copy(self) -> EngineError:
        """A fresh instance: each caller gets its own exception object."""
        return EngineError(self.kind, self.status, self.message, sent=self.sent)

    def __repr__(self) -> str:
        return f"EngineError({self.kind!r}, {self.status!r}, {self.message!r}, sent={self.sent!r})"


# ----------------------------------------------------------------------------- client


class EngineClient:
    """Talks to one vLLM server (``base_url`` without the ``/v1`` suffix).

    ``timeout_seconds`` bounds each ``complete_batch``/``stream`` call unless the call
    passes its own ``timeout``.  ``max_body_bytes`` caps the JSON body of one call
    (module docstring).  A ``session`` passed in is used but not closed.
    ``api_key``: the engine's key, sent on every call (module docstring).
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout_seconds: float = 600,
        connect_retries: int = 2,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        session: aiohttp.ClientSession | None = None,
        api_key: EngineKey | None = None,
    ) -> None:
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds}")
        if connect_retries < 0:
            raise ValueError(f"connect_retries must be >= 0, got {connect_retries}")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.max_body_bytes = max_body_bytes
        self.context_lengths: dict[str, int] = {}  # model → max_model_len, from the last models()
        self.base_url = base_url.rstrip("/")
        self.timeout_seconds = float(timeout_seconds)
        self.connect_retries = connect_retries
        self._session = session
        self._owns_session = session is None
        self.api_key = api_key if api_key is not None else EngineKey()
        self._warned_estimated_counts = False
        self._warned_stream_usage = False

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session if the client made it."""
        if self._owns_session and self._session is not None and not self._session.closed:
            await self._session.close()
        if self._owns_session:
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or (self._owns_session and self._session.closed):
            # limit=0: every in-flight request needs its own connection; the
            # dispatcher, not the connection pool, decides how many there are.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS)
            self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    # -- batch -------------------------------------------------------------------------

    async def complete_batch(
        self, requests: Sequence[EngineRequest], *, timeout: float | None = None
    ) -> list[EngineResult | EngineError]:
        """Run ``requests`` on the engine; result ``i`` belongs to request ``i``.

        The contract the dispatcher relies on:

        * Prompt requests with equal ``params`` form a group sent as ONE
          ``/v1/completions`` call with ``"prompt": [...]``; choices are mapped back
          by ``choice["index"]``.  Chat requests go one ``/v1/chat/completions`` call
          each.  All calls run concurrently.
        * Every request gets its own ``EngineResult`` or ``EngineError``; nothing is
          raised except ``CancelledError``.  Cancelling the call cancels its HTTP
          requests; their connections close and vLLM aborts a request whose client
          disconnected.
        * A 400/422 answer to a multi-prompt call re-issues each of its prompts alone,
          so one bad prompt (e.g. too long) fails only its own caller (a 4xx means
          the engine did no work).  A group whose body would exceed
          ``max_body_bytes`` goes as several calls; a 413 splits a call in halves;
          a request too large on its own fails alone ("invalid", status 413).  Any
          other 4xx fails the call's members with "invalid".
        * 5xx, a lost connection or an unreachable engine fail every member of that
          call with "unavailable"; other calls of the batch are unaffected.
        * No answer within ``timeout`` (default ``timeout_seconds``) from the start
          of the batch: "timeout" for the members of the unfinished calls.
        * Only a connection that could not be established is retried (up to
          ``connect_retries`` times, 0.05 s then 0.2 s apart); a request that was
          sent is never sent again.
        """
        limit = self.timeout_seconds if timeout is None else timeout
        deadline = asyncio.get_running_loop().time() + limit
        groups: dict[SamplingParams, list[int]] = {}
        # (members, a factory of the call): coroutines are made only where awaited, so a
        # batch cancelled before its calls start leaves none un-awaited
        jobs: list[tuple[list[int], Callable[[], Awaitable[list[EngineResult | EngineError]]]]] = []
        for i, request in enumerate(requests):
            if request.messages is not None:
                jobs.append(([i], functools.partial(self._chat_call, request)))
            else:
                groups.setdefault(request.params, []).append(i)
        for params, members in groups.items():
            prompts = [requests[i].prompt or "" for i in members]
            trace = requests[members[0]].trace_headers  # one HTTP request, one trace context (EngineRequest)
            jobs.append((members, functools.partial(self._completions_call, params, prompts, trace)))
        if len(jobs) == 1:  # continuous mode: one request, no extra task for a gather
            members, call = jobs[0]
            answers = [await self._bounded(call, len(members), deadline, limit)]
        else:
            answers = await asyncio.gather(*(self._bounded(call, len(m), deadline, limit) for m, call in jobs))
        results: list[EngineResult | EngineError | None] = [None] * len(requests)
        for (members, _), outcome in zip(jobs, answers, strict=True):
            for i, r in zip(members, outcome, strict=True):
                results[i] = r
        return [r if r is not None else EngineError("internal", None, "no result") for r in results]

    async def _bounded(
        self, call: Callable[[], Awaitable[list[EngineResult | EngineError]]], n: int, deadline: float, limit: float
    ) -> list[EngineResult | EngineError]:
        """Run one engine call under the batch deadline; errors become values."""
        try:
            async with asyncio.timeout_at(deadline):
                return await call()
        except TimeoutError:
            return _fan_out(EngineError("timeout", None, f"the engine did not answer within {limit:g} s"), n)
        except EngineError as err:
            return _fan_out(err, n)
        except Exception as exc:  # noqa: BLE001 - a bug must not strand the other callers
            log.exception("engine call failed unexpectedly")
            return _fan_out(EngineError("internal", None, f"client error: {type(exc).__name__}: {exc}"), n)

    async def _completions_call(
        self, params: SamplingParams, prompts: list[str], trace: Headers = ()
    ) -> list[EngineResult | EngineError]:
        """One ``/v1/completions`` call for prompts sharing ``params`` (or several,
        when one would exceed ``max_body_bytes``)."""
        if len(prompts) > 1:
            chunks = _pack(params, prompts, self.max_body_bytes)
            if len(chunks) > 1:
                log.debug("%d prompts exceed %d bytes in one call: %d calls", len(prompts), self.max_body_bytes,
                          len(chunks))  # fmt: skip
                return await self._split(params, chunks, trace)
        encoded = _encode(_completions_body(params, prompts))
        size = len(encoded)
        if size > self.max_body_bytes:
            if len(prompts) > 1:  # _pack's arithmetic is exact; this is a safety net
                return await self._split(params, _halves(prompts), trace)
            return [_too_large(size, self.max_body_bytes)]
        try:
            data = await self._call_json("POST", "/v1/completions", encoded, trace)
        except EngineError as err:
            if len(prompts) > 1 and err.status == 413:
                log.info("engine refused a %d-prompt call of %d bytes as too large; splitting it in halves",
                         len(prompts), size)  # fmt: skip
                return await self._split(params, _halves(prompts), trace)
            if len(prompts) > 1 and err.status in (400, 422):
                log.info("engine refused a %d-prompt call (HTTP %d); sending its prompts one by one",
                         len(prompts), err.status)  # fmt: skip
                return await self._split(params, [[p] for p in prompts], trace)
            return _fan_out(err, len(prompts))
        try:
            return list(self._completion_results(data, params, prompts))
        except EngineError as err:
            return _fan_out(err, len(prompts))

    async def _split(
        self, params: SamplingParams, chunks: list[list[str]], trace: Headers = ()
    ) -> list[EngineResult | EngineError]:
        """Send each chunk as its own call, concurrently; results in prompt order."""
        parts = await asyncio.gather(*(self._completions_call(params, c, trace) for c in chunks))
        return [r for part in parts for r in part]

    def _completion_results(
        self, data: dict[str, Any], params: SamplingParams, prompts: list[str]
    ) -> list[EngineResult]:
        n = len(prompts)
        choices = data.get("choices")
        if not isinstance(choices, list) or len(choices) != n:
            got = len(choices) if isinstance(choices, list) else "no"
            raise EngineError("internal", 200, f"expected {n} choices from the engine, got {got}")
        ordered: list[dict[str, Any] | None] = [None] * n
        for pos, choice in enumerate(choices):
            if not isinstance(choice, dict):
                raise EngineError("internal", 200, "a choice is not an object")
            index = choice.get("index", pos)
            if not isinstance(index, int) or not 0 <= index < n or ordered[index] is not None:
                raise EngineError("internal", 200, f"bad or repeated choice index {index!r}")
            if not isinstance(choice.get("text"), str):
                raise EngineError("internal", 200, "a choice has no text")
            ordered[index] = choice
        chosen: list[dict[str, Any]] = [c for c in ordered if c is not None]
        usage_prompt, usage_completion = _usage(data)
        completion, exact_c = _completion_counts(chosen, params, usage_completion)
        prompt_counts, exact_p = _prompt_counts(chosen, prompts, usage_prompt)
        if not (exact_c and exact_p) and not self._warned_estimated_counts:
            self._warned_estimated_counts = True
            log.warning("the engine returned no per-choice token_ids for a multi-prompt call; "
                        "per-request token counts are apportioned from usage")  # fmt: skip
        return [
            EngineResult(c["text"], _finish_reason(c), p, t)
            for c, p, t in zip(chosen, prompt_counts, completion, strict=True)
        ]

    async def _chat_call(self, request: EngineRequest) -> list[EngineResult | EngineError]:
        """One ``/v1/chat/completions`` call."""
        encoded = _encode(_chat_body(request))
        if len(encoded) > self.max_body_bytes:
            raise _too_large(len(encoded), self.max_body_bytes)
        data = await self._call_json("POST", "/v1/chat/completions", encoded, request.trace_headers)
        choices = data.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise EngineError("internal", 200, "expected exactly one choice from the engine")
        message = choices[0].get("message")
        content = message.get("content") if isinstance(message, dict) else None
        if content is not None and not isinstance(content, str):
            raise EngineError("internal", 200, "the chat message content is not text")
        prompt_tokens, completion_tokens = _usage(data)
        return [EngineResult(content or "", _finish_reason(choices[0]), prompt_tokens, completion_tokens)]

    # -- stream ------------------------------------------------------------------------

    async def stream(
        self, request: EngineRequest, *, timeout: float | None = None, on_progress: Progress | None = None
    ) -> AsyncIterator[StreamDelta | EngineResult]:
        """Stream one request: a ``StreamDelta`` per non-empty text piece, then the
        ``EngineResult`` (the concatenated text, the last finish reason, the token
        counts of the usage chunk).  Failures raise ``EngineError``; leaving the loop
        early closes the connection, which makes vLLM abort the request.

        ``on_progress(generated, prompt_tokens)`` hears, at every chunk, how many
        tokens the engine has generated and how many it counted in the prompt: the
        stream asks for vLLM's ``continuous_usage_stats`` (usage in every chunk);
        from an engine that sends none, ``generated`` is the token chunks seen (at
        least one token each) and ``prompt_tokens`` None."""
        limit = self.timeout_seconds if timeout is None else timeout
        deadline = asyncio.get_running_loop().time() + limit
        timed_out = EngineError("timeout", None, f"the engine did not finish within {limit:g} s")
        if request.messages is not None:
            path, body = "/v1/chat/completions", _chat_body(request)
        else:
            path, body = "/v1/completions", request.params.body() | {"prompt": request.prompt}
        body |= {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        encoded = _encode(body)
        if len(encoded) > self.max_body_bytes:
            raise _too_large(len(encoded), self.max_body_bytes)
        try:
            async with asyncio.timeout_at(deadline):
                resp = await self._send("POST", path, encoded, headers=request.trace_headers)
        except TimeoutError:
            raise timed_out from None
        reader: _SSEReader | None = None
        try:
            if resp.status != 200:
                async with asyncio.timeout_at(deadline):
                    raw = await resp.read()
                raise _http_error(resp.status, raw)
            reader = _SSEReader(resp, deadline)
            pieces: list[str] = []
            finish: str | None = None
            usage: tuple[int, int] | None = None
            token_chunks = 0  # chunks that carried a token (the count without continuous usage)
            while True:
                payload = await reader.next()
                if payload is None or payload.strip() == b"[DONE]":
                    break
                event = _json_object(payload)
                if "error" in event:
                    raise _payload_error(event)
                chunk_usage = _usage(event) if event.get("usage") else None
                if chunk_usage is not None:
                    usage = chunk_usage
                for choice in event.get("choices") or ():
                    if not isinstance(choice, dict):
                        raise EngineError("internal", 200, "a stream choice is not an object")
                    piece = choice.get("text")
                    delta = choice.get("delta")
                    if piece is None and isinstance(delta, dict):
                        piece = delta.get("content")
                        if "role" not in delta:  # a chat stream's opening role chunk holds no token
                            token_chunks += 1
                    elif piece is not None:
                        token_chunks += 1
                    if piece:
                        if not isinstance(piece, str):
                            raise EngineError("internal", 200, "a stream piece is not text")
                        pieces.append(piece)
                        yield StreamDelta(piece)
                    if choice.get("finish_reason"):
                        finish = str(choice["finish_reason"])
                if on_progress is not None and event.get("choices"):
                    if chunk_usage is not None:
                        on_progress(chunk_usage[1], chunk_usage[0])
                    else:
                        on_progress(token_chunks, None)
            if finish is None:
                raise EngineError("unavailable", 200, "the engine ended the stream before the completion finished")
            if usage is None:
                if not self._warned_stream_usage:
                    self._warned_stream_usage = True
                    log.warning("the engine sent no usage chunk in a stream; counting one token per piece")
                usage = (0, len(pieces))
        except TimeoutError:
            resp.close()
            raise timed_out from None
        except aiohttp.ClientError as exc:
            resp.close()
            raise EngineError("unavailable", resp.status, f"the engine's stream broke off: {_describe(exc)}") from exc
        except BaseException:  # EngineError, cancellation, the consumer leaving early
            resp.close()
            raise
        finally:
            if reader is not None:
                reader.close()
        resp.release()
        yield EngineResult("".join(pieces), finish, usage[0], usage[1])

    # -- small calls -------------------------------------------------------------------

    async def health(self, path: str = "/health") -> bool:
        """True if ``GET path`` answers 200 (no retries; any failure is False)."""
        try:
            async with asyncio.timeout(min(HEALTH_TIMEOUT_SECONDS, self.timeout_seconds)):
                resp = await self._send("GET", path, retries=0)
                try:
                    await resp.read()
                finally:
                    resp.release()
                return resp.status == 200
        except (EngineError, TimeoutError, aiohttp.ClientError):
            return False

    async def models(self) -> list[str]:
        """The ids of the served models (``GET /v1/models``); raises ``EngineError``."""
        try:
            async with asyncio.timeout(min(MODELS_TIMEOUT_SECONDS, self.timeout_seconds)):
                data = await self._call_json("GET", "/v1/models")
        except TimeoutError:
            raise EngineError("timeout", None, "GET /v1/models did not answer in time") from None
        cards = data.get("data")
        if not isinstance(cards, list):
            raise EngineError("internal", 200, "GET /v1/models: no data list")
        cards = [c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)]
        # vLLM's cards carry the context length (prompt + output, tokens).
        self.context_lengths = {
            c["id"]: c["max_model_len"] for c in cards
            if type(c.get("max_model_len")) is int and c["max_model_len"] > 0
        }  # fmt: skip
        return [c["id"] for c in cards]

    # -- passthrough -------------------------------------------------------------------

    async def forward(
        self, method: str, path_qs: str, headers: Mapping[str, str] | Iterable[tuple[str, str]],
        body: aiohttp.StreamReader | AsyncIterator[bytes] | bytes | None,
    ) -> aiohttp.ClientResponse:  # fmt: skip
        """Send a request on to the engine as it came (the HTTP door's other paths:
        ``/metrics``, ``/tokenize``, ...) and return the response, headers read: the
        caller streams its body and releases it.

        Nothing else is added or rewritten: no default ``Accept-Encoding``/``User-Agent``,
        and a compressed reply stays compressed (its ``Content-Encoding`` holds).
        The one exception is ``Authorization``: the caller's is dropped and the
        engine's key (if any) is sent instead.
        Never retried (the request may not be idempotent), bounded by
        ``timeout_seconds`` as a whole.  An engine that cannot be reached raises
        ``EngineError`` ("unavailable")."""
        url = yarl.URL(self.base_url + path_qs, encoded=True)
        sent = CIMultiDict(headers)
        sent.popall("Authorization", None)
        sent.update(self.api_key.headers())
        try:
            return await self._http().request(
                method, url, headers=sent, data=body, allow_redirects=False, auto_decompress=False,
                skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
                timeout=aiohttp.ClientTimeout(total=self.timeout_seconds),
            )  # fmt: skip
        except aiohttp.ClientConnectorError as exc:
            message = f"cannot connect to the engine: {_describe(exc)}"
            raise EngineError("unavailable", None, message, sent=False) from exc
        except aiohttp.ClientError as exc:
            raise EngineError("unavailable", None, f"the engine connection failed: {_describe(exc)}") from exc

    # -- HTTP --------------------------------------------------------------------------

    async def _send(
        self, method: str, path: str, data: bytes | None = None, *, retries: int | None = None, headers: Headers = ()
    ) -> aiohttp.ClientResponse:
        """Send a request with the JSON body ``data`` (encoded once by the caller,
        so the bytes sent are the bytes ``max_body_bytes`` was checked on) and
        ``headers`` (the trace context), and return the response (headers read,
        body not).

        Retries only ``ClientConnectorError`` -- the connection was never made."""
        session = self._http()
        url = self.base_url + path
        attempts = self.connect_retries if retries is None else retries
        sent_headers = CIMultiDict(headers)
        sent_headers.popall("Authorization", None)
        sent_headers.update(self.api_key.headers())
        if data is not None:
            sent_headers["Content-Type"] = "application/json"
        for attempt in range(attempts + 1):
            try:
                # a file-like body: aiohttp warns about (and would block on) large raw bytes
                body_io = None if data is None else io.BytesIO(data)
                return await session.request(method, url, data=body_io, headers=sent_headers or None)
            except aiohttp.ClientConnectorError as exc:
                if attempt >= attempts:
                    message = f"cannot connect to the engine: {_describe(exc)}"
                    raise EngineError("unavailable", None, message, sent=False) from exc
                delay = CONNECT_BACKOFF_SECONDS[min(attempt, len(CONNECT_BACKOFF_SECONDS) - 1)]
                log.debug("connect to %s failed (%s); retry %d in %g s", url, type(exc).__name__, attempt + 1, delay)
                await asyncio.sleep(delay)
            except aiohttp.ClientError as exc:
                raise EngineError("unavailable", None, f"the engine connection failed: {_describe(exc)}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _call_json(
        self, method: str, path: str, data: bytes | None = None, headers: Headers = ()
    ) -> dict[str, Any]:
        """Send, read the whole reply, and return its JSON object (or raise EngineError)."""
        resp = await self._send(method, path, data, headers=headers)
        try:
            raw = await resp.read()
        except aiohttp.ClientError as exc:
            resp.close()
            raise EngineError("unavailable", resp.status, f"the engine's reply broke off: {_describe(exc)}") from exc
        except BaseException:
            resp.close()
            raise
        resp.release()
        if resp.status != 200:
            raise _http_error(resp.status, raw)
        return _json_object(raw)


# ------------------------------------------------------------------------------ helpers


class _SSEReader:
    """Server-sent events from a response: ``next()`` gives each event's data, as bytes.

    It takes whatever the connection holds (``readany``) and splits the lines itself:
    the engine sends an event per token, several often arriving in one read, where a
    ``readline`` per line (two per event) with a deadline armed around each cost more
    than the parsing.  The engine's usual event, one ``data: `` line and a blank one,
    is cut out of the buffer whole; any other shape (comments, ``\\r\\n``, several data
    lines) is read line by line.  One timer ends the stream at ``deadline`` (the loop's
    clock): it fails the connection's reader with TimeoutError, which the next wait
    for data raises (``close`` disarms it).  A line longer than aiohttp's own bound
    for ``readline`` fails the stream."""

    def __init__(self, resp: aiohttp.ClientResponse, deadline: float) -> None:
        self._content = resp.content
        self._limit = resp.content.get_read_buffer_limits()[1]  # what readline allows a line
        self._buf = b""
        self._pos = 0  # where the unread part of _buf starts
        self._eof = False
        self._timer = asyncio.get_running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._content.set_exception(TimeoutError("the stream's deadline passed"))

    def close(self) -> None:
        self._timer.cancel()

    async def _read(self) -> None:
        """What the connection holds next, after the unread part of the buffer."""
        chunk = await self._content.readany()
        self._buf, self._pos = self._buf[self._pos :] + chunk, 0
        self._eof = not chunk

    async def _line(self) -> bytes:
        """The next line with its newline (the last may lack it); b"" at the end."""
        while True:
            i = self._buf.find(b"\n", self._pos)
            if i >= 0 or self._eof:
                stop = len(self._buf) if i < 0 else i + 1
                line, self._pos = self._buf[self._pos : stop], stop
            elif len(self._buf) - self._pos > self._limit:
                line = self._buf[self._pos :]
            else:
                await self._read()
                continue
            if len(line) > self._limit:
                shown = f"{line[:100]!r}..."
                raise EngineError("internal", 200, f"unreadable stream line: over {self._limit} bytes: {shown}")
            return line

    async def next(self) -> bytes | None:
        """The next event's data (lines joined by newlines); None at the end."""
        while self._buf.find(b"\n", self._pos) < 0 and not self._eof and len(self._buf) - self._pos <= self._limit:
            await self._read()  # not a whole line yet
        buf, pos = self._buf, self._pos
        if buf.startswith(b"data: ", pos):  # the usual event, if whole in the buffer: b"data: {...}\n\n"
            end = buf.find(b"\n", pos)
            if 0 <= end < pos + self._limit and buf.startswith(b"\n", end + 1) and buf.find(b"\r", pos, end) < 0:
                self._pos = end + 2
                return buf[pos + 6 : end]
        data: list[bytes] = []
        while True:
            raw = await self._line()
            if not raw:
                return b"\n".join(data) if data else None
            line = raw.rstrip(b"\r\n")
            if not line:
                if data:
                    return b"\n".join(data)
                continue
            if line.startswith(b":"):
                continue  # a comment / keep-alive
            name, _, value = line.partition(b":")
            if name == b"data":
                data.append(value[1:] if value.startswith(b" ") else value)


def _encode(body: dict[str, Any]) -> bytes:
    """The JSON bytes of a request body (what aiohttp's ``json=`` would send)."""
    return json.dumps(body).encode()


def _completions_body(params: SamplingParams, prompts: list[str]) -> dict[str, Any]:
    body = params.body()
    if len(prompts) == 1:
        return body | {"prompt": prompts[0]}
    return body | {"prompt": prompts, "n": 1, "stream": False, "return_token_ids": True}


def _pack(params: SamplingParams, prompts: list[str], limit: int) -> list[list[str]]:
    """Consecutive chunks of ``prompts`` whose list call fits in ``limit`` bytes (a
    prompt too large alone gets a chunk of its own, to fail alone).  Exact for
    ``json.dumps``: the list costs its empty body plus each item's JSON, plus ", "
    between items."""
    empty = len(_encode(_completions_body(params, ["", ""]))) - 2 * len('""') - len(", ")
    chunks: list[list[str]] = []
    size = 0
    for p in prompts:
        cost = len(json.dumps(p).encode())
        if chunks and size + 2 + cost <= limit:
            chunks[-1].append(p)
            size += 2 + cost
        else:
            chunks.append([p])
            size = empty + cost
    return chunks


def _halves(prompts: list[str]) -> list[list[str]]:
    mid = len(prompts) // 2
    return [prompts[:mid], prompts[mid:]]


def _too_large(size: int, limit: int) -> EngineError:
    return EngineError("invalid", 413, f"the request body is {size} bytes, over the {limit}-byte limit of one "
                                       "engine call (engine.maxRequestBodyBytes); it was not sent")  # fmt: skip


def _chat_body(request: EngineRequest) -> dict[str, Any]:
    messages = [{"role": role, "content": content} for role, content in request.messages or ()]
    return request.params.body() | {"messages": messages}


def _fan_out(err: EngineError, n: int) -> list[EngineResult | EngineError]:
    return [err.copy() for _ in range(n)]


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _kind_for_status(status: int) -> EngineErrorKind:
    if status in (401, 403):
        return "unauthorized"
    if status == 408:
        return "timeout"
    if status == 429 or status >= 500:
        return "unavailable"
    if 400 <= status < 500:
        return "invalid"
    return "internal"


def _http_error(status: int, raw: bytes) -> EngineError:
    text = _error_text(raw) or f"HTTP {status}"
    if status in (401, 403):
        text = (f"the engine refused the sidecar's credentials (HTTP {status}: {text}); {API_KEY_FIELD} must "
                "name a file holding the key the engine was started with (--api-key)")  # fmt: skip
    return EngineError(_kind_for_status(status), status, text)


def _error_text(raw: bytes) -> str:
    """The message of an OpenAI/vLLM/FastAPI error body, or the body itself."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return text[:ERROR_TEXT_LIMIT]
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"][:ERROR_TEXT_LIMIT]
        if isinstance(err, str):
            return err[:ERROR_TEXT_LIMIT]
        if isinstance(obj.get("message"), str):
            return obj["message"][:ERROR_TEXT_LIMIT]
        detail = obj.get("detail")
        if isinstance(detail, str):
            return detail[:ERROR_TEXT_LIMIT]
        if isinstance(detail, list):  # FastAPI 422: [{"loc": [...], "msg": ...}]
            parts = [
                f"{'.'.join(map(str, d.get('loc', ())))}: {d.get('msg', '')}" for d in detail if isinstance(d, dict)
            ]
            return "; ".join(parts)[:ERROR_TEXT_LIMIT]
    return text[:ERROR_TEXT_LIMIT]


def _payload_error(event: dict[str, Any]) -> EngineError:
    """An error sent inside a stream (``data: {"error": {...}}``)."""
    err = event.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    status = code if isinstance(code, int) and not isinstance(code, bool) else None
    kind = _kind_for_status(status) if status is not None else "unavailable"
    message = _error_text(json.dumps(event).encode())
    return EngineError(kind, status, message)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:  # bytes that are not UTF-8 read as U+FFFD, as a text decoder would
        return _json_object(raw.decode("utf-8", errors="replace").encode())
    except ValueError:
        raise EngineError("internal", 200, "the engine's reply is not JSON") from None
    if not isinstance(obj, dict):
        raise EngineError("internal", 200, "the engine's reply is not a JSON object")
    return obj


def _usage(data: dict[str, Any]) -> tuple[int, int]:
    """(prompt_tokens, completion_tokens) of a reply's ``usage``."""
    usage = data.get("usage")
    if not isinstance(usage, dict):
        raise EngineError("internal", 200, "the engine's reply has no usage")
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        raise EngineError("internal", 200, "the engine's usage has no token counts")
    return prompt, completion


def _finish_reason(choice: dict[str, Any]) -> str:
    reason = choice.get("finish_reason")
    return str(reason) if reason else "unknown"


def _completion_counts(
    choices: list[dict[str, Any]], params: SamplingParams, usage_total: int
) -> tuple[list[int], bool]:
    """Per-choice completion tokens, and whether every count is exact (module docstring)."""
    if len(choices) == 1:
        return [usage_total], True
    known: list[int | None] = []
    for c in choices:
        ids = c.get("token_ids")
        if isinstance(ids, list):
            known.append(len(ids))
        elif c.get("finish_reason") == "length" and params.max_tokens is not None:
            known.append(params.max_tokens)
        else:
            known.append(None)
    return _fill_unknown(known, [len(c["text"]) for c in choices], usage_total)


def _prompt_counts(choices: list[dict[str, Any]], prompts: list[str], usage_total: int) -> tuple[list[int], bool]:
    """Per-choice prompt tokens, and whether every count is exact."""
    if len(choices) == 1:
        return [usage_total], True
    known: list[int | None] = []
    for c in choices:
        ids = c.get("prompt_token_ids")
        known.append(len(ids) if isinstance(ids, list) else None)
    return _fill_unknown(known, [len(p) for p in prompts], usage_total)


def _fill_unknown(known: list[int | None], weights: list[int], total: int) -> tuple[list[int], bool]:
    """Fill the unknown counts from ``total`` minus the known ones; exact when at most
    one is unknown, else apportioned by ``weights`` (largest remainders)."""
    unknown = [i for i, k in enumerate(known) if k is None]
    rest = max(0, total - sum(k for k in known if k is not None))
    out = [k or 0 for k in known]
    if not unknown:
        return out, True
    if len(unknown) == 1:
        out[unknown[0]] = rest
        return out, True
    w = [max(weights[i], 1) for i in unknown]
    shares = [rest * x / sum(w) for x in w]
    floors = [int(s) for s in shares]
    by_remainder = sorted(range(len(unknown)), key=lambda j: shares[j] - floors[j], reverse=True)
    for j in by_remainder[: rest - sum(floors)]:
        floors[j] += 1
    for i, v in zip(unknown, floors, strict=True):
        out[i] = v
    return out, False
