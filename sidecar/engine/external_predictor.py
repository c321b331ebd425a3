"""An external length-predictor service a team runs with its own model (README
"Bring your own predictor"; config ``predictor.external``).

The contract, HTTP/JSON.  Each request without a hint is asked about before it
is queued::

    POST <url>
    {"id": "req-42", "model": "m", "prompt": "..."  (or "messages": [{"role": "user", "content": "..."}]),
     "request_class": "", "max_tokens": 1024}

    200 {"quantiles": [{"level": 0.5, "tokens": 120}, {"level": 0.9, "tokens": 410}]}

The answer is the output length as quantiles at levels the service names: levels
strictly rising within (0, 1), one of them 0.5 (the median: order and bin), tokens
not falling as the level rises; other keys are ignored.  ``LengthDist.from_quantiles``
maps them onto the core's levels (two quantiles make a log-normal, one a point
mass), capped at the ``max_tokens`` the engine is sent.

Every call has a deadline (``timeoutMilliseconds``, and never past the request's
own).  Its outcome is counted (``binbatch_external_predictor_calls_total``):
``answered``; ``timeout``; ``error`` (no answer, or a status other than 200);
``invalid`` (a 200 whose body breaks the contract: logged once per kind of
problem, with what was wrong); ``skipped`` (the breaker is open).  On all but
``answered`` the built-in predictor places the request.  A timeout, no answer
or a 5xx opens the breaker (the engine's, ``core/breaker.py``): for
``breakerOpenMilliseconds`` no call is made, then one request tries the service
and its answer closes the breaker again.

Optionally (``feedbackUrl``) the service is told how long the answers it was asked
about came out, in batches, by a background task -- never on the request path;
when the service falls behind the oldest reports are dropped (counted)::

    POST <feedbackUrl>
    {"completions": [{"id": "req-42", "output_tokens": 137}, ...]}
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..config import ExternalPredictorConfig
from ..core.breaker import EngineBreaker
from ..core.clock import Clock
from ..core.length_dist import LengthDist
from ..core.request import Request
from .engine_client import EngineRequest
from .sidecar_metrics import SidecarMetrics

log = logging.getLogger("binbatch.predictor.external")

ANSWER_LIMIT = 64 * 1024  # bytes of an answer; a longer one is invalid
FEEDBACK_BATCH = 256  # completions per feedback POST
FEEDBACK_BUFFER = 4096  # completions waiting to be reported; beyond it the oldest are dropped
FEEDBACK_TIMEOUT = 5.0  # seconds for one feedback POST


class Quantile(BaseModel):
    model_config = ConfigDict(strict=True)

    level: float = Field(gt=0, lt=1)
    tokens: float = Field(ge=0, allow_inf_nan=False)


class Answer(BaseModel):
    """The service's answer (the module docstring's contract)."""

    model_config = ConfigDict(strict=True)

    quantiles: list[Quantile] = Field(min_length=1, max_length=32)

    @field_validator("quantiles")
    @classmethod
    def _has_median(cls, value: list[Quantile]) -> list[Quantile]:
        if not any(q.level == 0.5 for q in value):
            raise ValueError("must include level 0.5 (the median)")
        return value


class Invalid(Exception):
    """A 200 answer that breaks the contract; ``kind`` tells problems apart for logging once."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def query(req: Request, engine_request: EngineRequest) -> dict[str, Any]:
    """The JSON asked for ``req``: what it asks, its class, the max_tokens the engine is sent, its id."""
    body: dict[str, Any] = {"id": req.id, "model": engine_request.params.model}
    if engine_request.messages is not None:
        body["messages"] = [{"role": role, "content": content} for role, content in engine_request.messages]
    else:
        body["prompt"] = engine_request.prompt
    body["request_class"] = req.request_class
    body["max_tokens"] = engine_request.params.max_tokens
    return body


def parse_answer(raw: bytes, cap: float) -> LengthDist:
    """The length ``raw`` gives, capped at ``cap``; raises ``Invalid`` naming what is wrong."""
    if len(raw) > ANSWER_LIMIT:
        raise Invalid("size", f"the body is over {ANSWER_LIMIT} bytes")
    try:
        answer = Answer.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        kind = ";".join(sorted({f"{_where(e['loc'], indices=False)}:{e['type']}" for e in errors}))
        raise Invalid(kind, "; ".join(f"{_where(e['loc'])}: {e['msg']}" for e in errors)) from None
    try:
        return LengthDist.from_quantiles([(q.level, q.tokens) for q in answer.quantiles], cap)
    except ValueError as exc:  # levels or tokens out of order
        raise Invalid("quantiles:order", str(exc)) from None


async def _read_bounded(resp: aiohttp.ClientResponse) -> bytes:
    """The body, or its first chunks once they pass ``ANSWER_LIMIT`` (``parse_answer`` refuses it then)."""
    raw = bytearray()
    async for chunk in resp.content.iter_any():
        raw += chunk
        if len(raw) > ANSWER_LIMIT:
            break
    return bytes(raw)


def _where(loc: tuple[int | str, ...], indices: bool = True) -> str:
    """A pydantic error location as the JSON path: ``quantiles[1].tokens``; "body" for the whole."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]" if indices else "[]"
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


class ExternalPredictor:
    """The client of the service ``config()`` names (read at each call: a reload applies
    at once; a new URL starts with a closed breaker).  ``predict`` is awaited by the front
    door before a request is queued; ``run`` reports completions in the background."""

    def __init__(self, config: Callable[[], ExternalPredictorConfig], clock: Clock, metrics: SidecarMetrics) -> None:
        self.config = config
        self.clock = clock
        self.metrics = metrics
        self.breaker = EngineBreaker()
        self._url = ""
        self._retry_at = 0.0  # while open: when one call may try the service again
        self._calls = 0  # in flight (half-open lets one through only when none is)
        self._told: set[str] = set()  # kinds of malformed answer already logged
        self._feedback: deque[dict[str, Any]] = deque(maxlen=FEEDBACK_BUFFER)
        self._feedback_ready = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    # -- the call on the request path ---------------------------------------------------

    @property
    def enabled(self) -> bool:
        """A service is configured (``predictor.external.url``)."""
        return bool(self.config().url)

    async def predict(self, req: Request, engine_request: EngineRequest, deadline: float | None) -> LengthDist | None:
        """The service's length for ``req``, or None (breaker open, or the call failed: the
        built-in predictor places it); only when ``enabled``.  ``deadline``: the seconds
        the caller still waits, if it said."""
        cfg = self.config()
        now = self.clock.now()
        if cfg.url != self._url:
            self._url, self.breaker = cfg.url, EngineBreaker()
        if self.breaker.state == "open" and now >= self._retry_at:
            self.breaker.on_probe(True, now)  # the pause is over: the next call is the trial
        if not self.breaker.allows_dispatch(self._calls):
            self.metrics.external_predictor_calls.labels("skipped").inc()
            return None
        timeout, cut_short = cfg.timeout_milliseconds / 1000, False
        if deadline is not None and deadline < timeout:  # the caller's deadline, not the service, bounds it
            timeout, cut_short = max(0.0, deadline), True
        self._calls += 1
        try:
            with self.metrics.external_predictor_seconds.time():
                outcome, length = await self._call(cfg.url, query(req, engine_request), timeout, cut_short,
                                                   float(engine_request.params.max_tokens))  # fmt: skip
        finally:
            self._calls -= 1
        self.metrics.external_predictor_calls.labels(outcome).inc()
        return length

    async def _call(
        self, url: str, body: dict[str, Any], timeout: float, cut_short: bool, cap: float
    ) -> tuple[str, LengthDist | None]:
        """One POST: its outcome, and the length if answered.  A timeout the caller's
        deadline ``cut_short`` says nothing of the service and leaves the breaker alone."""
        try:
            async with asyncio.timeout(timeout):
                async with self._http().post(url, json=body) as resp:
                    status = resp.status
                    raw = await _read_bounded(resp)
        except TimeoutError:
            if not cut_short:
                self._outage(f"no answer within {timeout * 1000:g} ms", url)
            return "timeout", None
        except aiohttp.ClientError as exc:
            self._outage(f"no answer ({exc.__class__.__name__}: {exc})", url)
            return "error", None
        if status >= 500:
            self._outage(f"HTTP {status}", url)
            return "error", None
        self._alive(url)
        if status != 200:
            self._problem(f"status {status}", f"HTTP {status} (the contract answers 200)", url)
            return "error", None
        try:
            return "answered", parse_answer(raw, cap)
        except Invalid as exc:
            self._problem(exc.kind, f"malformed answer: {exc}", url)
            return "invalid", None

    def _outage(self, reason: str, url: str) -> None:
        """No usable answer: open the breaker (or keep it open) for ``breakerOpenMilliseconds``."""
        now = self.clock.now()
        pause = self.config().breaker_open_milliseconds / 1000
        self._retry_at = now + pause
        was = self.breaker.state
        self.breaker.on_result(reason, now)
        if was == "closed":
            self.metrics.external_predictor_breaker_opens.inc()
            log.warning("external predictor %s: %s; the built-in predictor places requests, the service is tried "
                        "again in %g s", url, reason, pause)  # fmt: skip

    def _alive(self, url: str) -> None:
        if self.breaker.on_result(None, self.clock.now()):
            log.info("external predictor %s answers again", url)

    def _problem(self, kind: str, message: str, url: str) -> None:
        """Log a kind of problem once (at warning; after that at debug): the counter has the rest."""
        first = kind not in self._told
        self._told.add(kind)
        log.log(logging.WARNING if first else logging.DEBUG,
                "external predictor %s: %s; the built-in predictor placed the request%s", url, message,
                " (further answers like it are only counted)" if first else "")  # fmt: skip

    # -- feedback, off the request path ---------------------------------------------------

    def completed(self, request_id: str, output_tokens: int) -> None:
        """A request the service was asked about completed: report it (``feedbackUrl`` set)."""
        if not self.config().feedback_url:
            return
        if len(self._feedback) == FEEDBACK_BUFFER:
            self.metrics.external_predictor_feedback.labels("dropped").inc()  # the deque drops the oldest
        self._feedback.append({"id": request_id, "output_tokens": output_tokens})
        self._feedback_ready.set()

    async def run(self) -> None:
        """Post the completions reported, in batches, as long as the sidecar runs."""
        while True:
            await self._feedback_ready.wait()
            self._feedback_ready.clear()
            while self._feedback:
                batch = [self._feedback.popleft() for _ in range(min(FEEDBACK_BATCH, len(self._feedback)))]
                outcome = "sent" if await self._post_feedback(batch) else "failed"
                self.metrics.external_predictor_feedback.labels(outcome).inc(len(batch))

    async def _post_feedback(self, batch: list[dict[str, Any]]) -> bool:
        url = self.config().feedback_url
        if not url:
            return False
        try:
            async with asyncio.timeout(FEEDBACK_TIMEOUT):
                async with self._http().post(url, json={"completions": batch}) as resp:
                    ok = 200 <= resp.status < 300
        except (TimeoutError, aiohttp.ClientError) as exc:
            log.debug("external predictor feedback to %s failed: %r", url, exc)
            return False
        if not ok:
            log.debug("external predictor feedback to %s: HTTP %d", url, resp.status)
        return ok
