"""The door-neutral half of a request's way in, shared by both front doors.

The gRPC servicer (``servicer``) and the OpenAI-compatible HTTP door
(``openai_http``) each parse their own wire format into ``Fields``; everything
after that is here, once: the bounds every field is checked against, the core
``Request`` and the ``EngineRequest`` built from them, the submit into the one
dispatcher (so both doors go through the same predictor, bins, sizer and
admission), the withdraw when the caller is gone, and the bookkeeping of a
completion.  A rule changed here changes for both doors alike.

Every bad value raises ``InvalidRequest`` whose message starts with the field's
name as the caller spelled it (``names`` maps the neutral name to the door's:
the HTTP door's hint is the header ``x-expected-output-tokens``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from ..config import (
    ALL_INPUTS_ALLOWED,
    CALLER_INPUTS,
    CLASS_PRIORITY_LIMIT,
    AuthCaller,
    CallerInput,
    DefaultClass,
    RequestClass,
    SidecarConfig,
)
from ..core.clock import Clock
from ..core.hint_trust import HintTrust, TrustChange
from ..core.request import Request, chat_text
from ..core.stages import RequestDispatcher
from ..engine.dispatcher import Call, Completion, Rejected
from ..engine.engine_client import EngineRequest, SamplingParams
from ..engine.external_predictor import ExternalPredictor
from ..engine.sidecar_metrics import SidecarMetrics
from .trace_context import TraceContext

log = logging.getLogger("binbatch.api")
prompt_log = logging.getLogger("binbatch.prompts")  # only with logging.logPrompts

# Bounds of the request's fields and metadata (documented in binbatch.proto).
SLO_LIMITS = {"x-slo-ttft-ms": 600_000, "x-slo-tpot-ms": 100_000}  # milliseconds, like latency.*Milliseconds
SLO_KEYS = tuple(SLO_LIMITS)
REQUEST_ID_LIMIT = 128
MODEL_LIMIT = 512
TEMPERATURE_LIMIT = 100.0
STOP_COUNT_LIMIT = 16
STOP_LENGTH_LIMIT = 1024
PRIORITY_LIMIT = CLASS_PRIORITY_LIMIT
PRIORITY_SPAN = 2 * PRIORITY_LIMIT + 1  # a class's priority ranks before the request's own
DIGITS = re.compile(r"[0-9]{1,9}")  # plain ASCII digits; longer is beyond every bound anyway
# The tenant a request is served for (core/fair_share.py), as the llm-d router reads it: its current name first,
# then the Gateway API Inference Extension's (the router's deprecated alias).  HTTP header or gRPC metadata.
TENANT_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
TENANT_LIMIT = 256  # bytes (= characters: printable ASCII only)
TENANT_VALUE = re.compile(r"[ -~]*")

# Tokens a chat template may add around the messages (roles, special tokens).
TEMPLATE_TOKENS = 64
# A lone UTF-16 surrogate: a str Python holds (JSON's "\ud800" escape decodes to one) but no UTF-8 can carry
SURROGATE = re.compile("[\ud800-\udfff]")


class InvalidRequest(Exception):
    """A request field is wrong; the message starts with the field's name, which
    ``param`` holds apart (the HTTP door's error JSON names it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param if param is not None else message.partition(":")[0]


@dataclass(slots=True)
class Fields:
    """One request as either door parsed it: exactly one of ``prompt`` and
    ``messages``; 0 / None / empty mean "not given"."""

    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    model: str = ""
    max_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    expected_output_tokens: int | None = None
    priority: int = 0
    request_class: str = ""
    request_id: str = ""
    slo: dict[str, int] = field(default_factory=dict)  # SLO_LIMITS' keys, validated (read_slo)
    timeout: float | None = None  # seconds the caller waits at most, from acceptance
    trace: TraceContext | None = None
    body_bytes: int = 0  # the request's size as it came (batch.maxQueuedBytes counts it while it is queued)
    caller: str = ""  # the authenticated caller (auth.callerTokensDir); "" with caller authentication off
    tenant: str = ""  # who it is served for (read_tenant); "": the shared tenant


@dataclass(slots=True)
class Steering:
    """What of a request's hint, priority and SLO headers steers it (``Front.admit_inputs``)."""

    priority: int = 0
    slo: dict[str, int] = field(default_factory=dict)
    hint: int | None = None  # None: the predictor places it
    judged_hint: int | None = None  # the hint its class's trust is judged on (Ticket.judged_hint)
    ignored: tuple[CallerInput, ...] = ()
    contradiction: str = ""  # why the request says its hint is too short: refused


@dataclass(slots=True)
class Ticket:
    """An accepted request: the core's view, the caller's handle, and what its log lines carry."""

    req: Request
    call: Call
    trace_id: str = ""
    asked_external: bool = False  # the external predictor was asked about it (it is told the outcome)
    # the hint a caller allowed to send one sent, as it would place the request (capped at max_tokens), whether
    # it did or its class had lost its hints: what the class's hint trust is judged on
    judged_hint: int | None = None
    ignored: tuple[CallerInput, ...] = ()  # what the caller sent and its class may not steer with
    caller: str = ""  # the authenticated caller (Fields.caller): whose hint trust a completion feeds

    @property
    def log_extra(self) -> dict[str, str]:
        return {"request_id": self.req.id, "trace_id": self.trace_id}


def log_extra(fields: Fields) -> dict[str, str]:
    """The logging extras of a request not (yet) accepted."""
    return {"request_id": fields.request_id, "trace_id": fields.trace.trace_id if fields.trace else ""}


def read_slo(pairs: Iterable[tuple[str, str]]) -> dict[str, int]:
    """The Gateway API Inference Extension's SLO headers (gRPC metadata or HTTP
    headers, keys matched without case), validated strictly: plain ASCII digits
    (``int()`` would take " 7 ", "1_000" and any length), within ``SLO_LIMITS``,
    at most once each."""
    out: dict[str, int] = {}
    for raw_key, value in pairs:
        key = raw_key.lower()
        if key not in SLO_LIMITS:
            continue
        limit = SLO_LIMITS[key]
        if key in out:
            raise InvalidRequest(f"{key}: given more than once")
        if not isinstance(value, str) or not DIGITS.fullmatch(value) or not 1 <= int(value) <= limit:
            shown = value if len(value) <= 32 else value[:32] + "..."
            raise InvalidRequest(f"{key}: must be a whole number of milliseconds in [1, {limit}], got {shown!r}")
        out[key] = int(value)
    return out


def read_tenant(pairs: Iterable[tuple[str, str]]) -> str:
    """The request's tenant from its headers or metadata (``TENANT_HEADERS``, keys
    matched without case; the first name wins when both are given, as in the
    llm-d router): at most ``TENANT_LIMIT`` printable ASCII characters, each name
    at most once.  None given (or empty): "", the shared tenant."""
    found: dict[str, str] = {}
    for raw_key, value in pairs:
        key = raw_key.lower()
        if key not in TENANT_HEADERS:
            continue
        if key in found:
            raise InvalidRequest(f"{key}: given more than once")
        if not isinstance(value, str) or len(value) > TENANT_LIMIT or not TENANT_VALUE.fullmatch(value):
            shown = repr(value[:32] + ("..." if len(value) > 32 else "")) if isinstance(value, str) else "binary"
            raise InvalidRequest(f"{key}: must be at most {TENANT_LIMIT} printable ASCII characters, got {shown}")
        found[key] = value
    return next((found[k] for k in TENANT_HEADERS if k in found), "")


def unset_max_tokens(cap: int, context_length: int | None, prompt: str) -> int:
    """What to send as ``max_tokens`` when the caller set none: the policy's cap
    (``bins.maxOutputTokens``), but no more than the engine's context leaves after
    the prompt -- vLLM refuses prompt + max_tokens over ``max_model_len``, while a
    request that names no limit expects whatever the context allows.  The prompt's
    byte count bounds its token count (byte-level tokenizers give a token at least
    one byte); when that bound leaves no room, the usual ~4 bytes per token does."""
    if context_length is None:
        return cap
    for prompt_tokens in (len(prompt.encode()), estimate_prompt_tokens(prompt)):
        room = context_length - prompt_tokens - TEMPLATE_TOKENS
        if room >= 1:
            return min(cap, room)
    return cap  # the prompt alone fills the context: the engine says so


UNENCODABLE = "holds a lone UTF-16 surrogate (such as \\ud800), which is no character and cannot be sent as UTF-8"


def _texts(f: Fields) -> Iterable[tuple[str, str]]:
    """Every text field of ``f`` with the name it is reported by (``messages[1].content``)."""
    if f.prompt is not None:
        yield "prompt", f.prompt
    for i, (role, content) in enumerate(f.messages or ()):
        yield f"messages[{i}].role", role
        yield f"messages[{i}].content", content
    for i, seq in enumerate(f.stop):
        yield f"stop[{i}]", seq
    yield "model", f.model
    yield "request_class", f.request_class
    yield "request_id", f.request_id


def estimate_prompt_tokens(text: str) -> int:
    """A tokenizer-free estimate (~4 bytes per token) used only to bucket prompts
    for the online predictor before the engine reports the true count."""
    return max(1, len(text.encode()) // 4)


class Front:
    """Given the few things both doors call: the dispatcher, the clock, a getter
    for the running config (a reload replaces it), one for the default model
    (learned from the engine after start-up), the engine's context length per
    model, what to tell of each completion (Stats.throughput, the Smdp fit), the
    external length predictor (``predictor.external``), if any, the metrics the
    ignored caller inputs are counted in, and the per-class hint trust.

    What a caller sends to steer its place in the queue is earned (``admit_inputs``):
    a hint the request contradicts is refused; a hint, priority or SLO header its
    class may not send (``classes.*.allow*``) is ignored and counted; a hint of a
    class whose hints keep running short (``HintTrust``) is ignored too."""

    def __init__(
        self, dispatcher: RequestDispatcher, clock: Clock, *, config: Callable[[], SidecarConfig],
        default_model: Callable[[], str], context_length: Callable[[str], int | None] = lambda model: None,
        on_completion: Callable[[float, int, int], None] = lambda engine_seconds, batch_size, output_tokens: None,
        external: ExternalPredictor | None = None, metrics: SidecarMetrics | None = None,
        hint_trust: HintTrust | None = None,
    ) -> None:  # fmt: skip
        self.dispatcher = dispatcher
        self.clock = clock
        self.config = config
        self.default_model = default_model
        self.context_length = context_length
        self.on_completion = on_completion
        self.external = external
        self.metrics = metrics  # binbatch_ignored_inputs_total, binbatch_hints_distrusted
        self.hint_trust = hint_trust if hint_trust is not None else HintTrust(clock)
        self.reading_bytes = 0  # bodies a door is reading (body_room), counted against batch.maxQueuedBytes

    @contextlib.contextmanager
    def body_room(self, size: int) -> Iterator[None]:
        """Room for a body of up to ``size`` bytes a door is about to read: from now until the
        request is queued or refused, it counts against batch.maxQueuedBytes beside the queued
        bodies, so the bodies being read and those queued together stay within it (without this,
        many clients sending at once held every body in memory before the queue refused any).
        ``Rejected`` (resource_exhausted: 429 with Retry-After) when they would not fit; the
        door then passes ``size`` to ``submit`` as its ``reading``."""
        self._fits(size, 0)
        self.reading_bytes += size
        try:
            yield
        finally:
            self.reading_bytes -= size

    def _fits(self, size: int, reading: int) -> None:
        """``Rejected`` unless ``size`` more bytes fit batch.maxQueuedBytes beside the queued bodies and
        those being read by others (all of ``reading_bytes`` but the caller's own ``reading``)."""
        room = self.dispatcher.byte_room()
        others = self.reading_bytes - reading
        if room is not None and size + others > room:
            raise Rejected("resource_exhausted", f"queue full: batch.maxQueuedBytes reached by the bodies queued and "
                                                 f"the {others} bytes of bodies being read; retry later")  # fmt: skip

    def build(self, f: Fields, stream: bool, names: Mapping[str, str] | None = None) -> Ticket:
        """Check ``f`` against the bounds both doors share and make the core request
        and the caller's handle (nothing is submitted)."""
        cfg = self.config()

        def name(key: str) -> str:
            return (names or {}).get(key, key)

        def bad(key: str, problem: str) -> InvalidRequest:
            return InvalidRequest(f"{name(key)}: {problem}", name(key))

        if (f.prompt is None) == (f.messages is None):
            raise ValueError("Fields needs exactly one of prompt and messages")  # a door's bug, not the caller's
        for key, value in _texts(f):
            if SURROGATE.search(value):
                base, bracket, rest = key.partition("[")
                where = name(base) + bracket + rest
                raise InvalidRequest(f"{where}: {UNENCODABLE}", where)
        if len(f.model) > MODEL_LIMIT:
            raise bad("model", f"at most {MODEL_LIMIT} characters")
        model = f.model or self.default_model()
        if not model:
            raise bad("model", "required (the sidecar has no default model: set engine.model)")
        cap = cfg.bins.max_output_tokens
        max_tokens = f.max_tokens  # 0: unset; the engine is sent the cap
        if max_tokens > cap:
            raise bad("max_tokens", f"{max_tokens} exceeds the limit of {cap} (bins.maxOutputTokens)")
        if f.temperature is not None and not 0 <= f.temperature <= TEMPERATURE_LIMIT:
            raise bad("temperature", f"must be in [0, {TEMPERATURE_LIMIT:g}], got {f.temperature:g}")
        if f.top_p is not None and not 0 < f.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {f.top_p:g}")
        if f.min_tokens is not None and f.min_tokens > (max_tokens or cap):
            raise bad("min_tokens", f"{f.min_tokens} exceeds max_tokens {max_tokens or cap}")
        hint = f.expected_output_tokens
        if hint is not None and not 1 <= hint <= cap:
            raise bad("expected_output_tokens", f"must be in [1, {cap}] (bins.maxOutputTokens), got {hint}")
        if not -PRIORITY_LIMIT <= f.priority <= PRIORITY_LIMIT:
            raise bad("priority", f"must be in [{-PRIORITY_LIMIT}, {PRIORITY_LIMIT}], got {f.priority}")
        if len(f.stop) > STOP_COUNT_LIMIT:
            raise bad("stop", f"at most {STOP_COUNT_LIMIT} sequences, got {len(f.stop)}")
        for i, seq in enumerate(f.stop):
            if not 1 <= len(seq) <= STOP_LENGTH_LIMIT:
                raise InvalidRequest(f"{name('stop')}[{i}]: must be 1 to {STOP_LENGTH_LIMIT} characters, got {len(seq)}")  # fmt: skip
        if len(f.request_id) > REQUEST_ID_LIMIT:
            raise bad("request_id", f"at most {REQUEST_ID_LIMIT} characters")
        inputs = cfg.classes.inputs_of(f.request_class)
        if inputs is None:
            names_ = ", ".join(c.name for c in cfg.classes.classes) or "none"
            shown = f.request_class if len(f.request_class) <= 64 else f.request_class[:64] + "..."
            raise bad("request_class", f"unknown class {shown!r} (the policy's classes.classes defines: {names_})")
        class_priority = cfg.classes.priority_of(f.request_class) or 0
        text = f.prompt if f.prompt is not None else chat_text(f.messages or ())
        # never unset: bins.maxOutputTokens is the cap the docs promise, within the engine's context
        engine_max_tokens = max_tokens or unset_max_tokens(cap, self.context_length(model), text)
        steer = self.admit_inputs(f, inputs, engine_max_tokens, cfg.auth.inputs_of(f.caller))
        if steer.contradiction:
            raise bad("expected_output_tokens", steer.contradiction)
        hint, slo = steer.hint, steer.slo
        params = SamplingParams(
            model=model,
            max_tokens=engine_max_tokens,
            temperature=f.temperature,
            top_p=f.top_p,
            stop=f.stop,
            seed=f.seed,
            ignore_eos=f.ignore_eos,
            min_tokens=f.min_tokens,
        )
        trace_headers = f.trace.headers() if f.trace else ()
        engine_request = EngineRequest(params=params, prompt=f.prompt, messages=f.messages, trace_headers=trace_headers)
        now = self.clock.now()
        budget = cfg.queue_budget_seconds(slo.get("x-slo-ttft-ms"))  # TTFT SLO: bounds the wait in a bin
        req = Request(
            id=f.request_id or uuid.uuid4().hex,
            arrival=now,
            prompt_tokens=estimate_prompt_tokens(text),
            max_tokens=max_tokens,
            hint_tokens=float(hint) if hint is not None else None,
            priority=class_priority * PRIORITY_SPAN + steer.priority,
            deadline=None if f.timeout is None else now + f.timeout,
            send_by=None if budget is None else now + budget,
            tpot_slo=slo["x-slo-tpot-ms"] / 1000 if "x-slo-tpot-ms" in slo else None,  # TpotGate
            request_class=f.request_class,
            tenant=f.caller or f.tenant,  # the authenticated caller, else the fairness header, else the shared one
            prompt_text=text,  # for predictor.kind Learned; min_tokens, stop and ignore_eos are never handed on
            body_bytes=f.body_bytes,
        )
        call = Call(engine_request, asyncio.get_running_loop().create_future(), asyncio.Queue() if stream else None)
        ticket = Ticket(req, call, f.trace.trace_id if f.trace else "", judged_hint=steer.judged_hint,
                        ignored=steer.ignored, caller=f.caller)  # fmt: skip
        if cfg.logging.log_prompts:
            prompt_log.info("request %s prompt: %s", req.id, text, extra=ticket.log_extra)
        return ticket

    def admit_inputs(self, f: Fields, inputs: RequestClass | DefaultClass, engine_max_tokens: int,
                     caller_inputs: AuthCaller = ALL_INPUTS_ALLOWED) -> Steering:  # fmt: skip
        """What of ``f``'s hint, priority and SLO headers steers the request: each both its class (``inputs``)
        and its caller (``caller_inputs``, ``auth.callers``) may send, and the hint only if the request does not
        contradict it (``Steering.contradiction``) and its class, from this caller, has not lost its hints
        (``HintTrust``)."""
        sent: dict[CallerInput, bool] = {"hint": f.expected_output_tokens is not None, "priority": f.priority != 0,
                                         "slo": bool(f.slo)}  # fmt: skip
        ignored = [what for what in CALLER_INPUTS
                   if sent[what] and not (inputs.allows(what) and caller_inputs.allows(what))]  # fmt: skip
        steer = Steering(priority=0 if "priority" in ignored else f.priority, slo={} if "slo" in ignored else f.slo)
        hint = f.expected_output_tokens
        if hint is not None and "hint" not in ignored:
            steer.contradiction = contradicted_hint(hint, f.min_tokens, f.ignore_eos, f.stop, engine_max_tokens)
            steer.judged_hint = min(hint, engine_max_tokens)
            if self.hint_trust.trusted(f.request_class, f.caller):
                steer.hint = hint
            else:
                ignored.append("hint")
            self._trust_changed()
        steer.ignored = tuple(ignored)
        return steer

    async def submit(self, f: Fields, stream: bool, names: Mapping[str, str] | None = None, *,
                     reading: int = 0) -> Ticket:  # fmt: skip
        """Build the request, ask the external predictor about it (no hint given), and
        queue it; raises ``InvalidRequest`` or ``Rejected`` (draining, full queue,
        engine down) -- logged at DEBUG only, so no client can flood the logs with its input.
        ``reading``: the bytes the door reserved for this body (``body_room``)."""
        try:
            ticket = self.build(f, stream, names)
            await self._ask_external(ticket, f.timeout)
            if f.body_bytes:
                self._fits(f.body_bytes, reading)  # the bodies others are reading count too
            self.dispatcher.submit(ticket.req, ticket.call)
        except Exception as exc:
            log.debug("refused: %s", exc, extra=log_extra(f))
            raise
        if ticket.ignored:
            log.debug("ignored what its class may not steer with: %s", ", ".join(ticket.ignored), extra=ticket.log_extra)
            if self.metrics is not None:
                for what in ticket.ignored:
                    self.metrics.ignored_inputs.labels(what).inc()
        log.debug("accepted into bin %s", ticket.req.bin, extra=ticket.log_extra)
        return ticket

    async def _ask_external(self, ticket: Ticket, deadline: float | None) -> None:
        """The external service's length for a request without a hint (the hint wins: not asked)."""
        req = ticket.req
        if self.external is None or not self.external.enabled or req.hint_tokens is not None:
            return
        ticket.asked_external = True
        req.external_length = await self.external.predict(req, ticket.call.engine_request, deadline)

    def withdraw(self, ticket: Ticket) -> None:
        """The caller is gone (cancelled, disconnected, past its deadline): a
        request still unanswered leaves its bin, or its engine call is aborted."""
        if not ticket.call.future.done():
            log.debug("withdrawn: the caller left", extra=ticket.log_extra)
            self.dispatcher.cancel(ticket.req)

    def finished(self, ticket: Ticket, completion: Completion) -> None:
        """A completion reached its caller: feed the throughput window and the
        batch-time fit; log the text only with ``logging.logPrompts``."""
        self.on_completion(completion.engine_seconds, completion.batch_size, completion.result.completion_tokens)
        if ticket.judged_hint is not None:
            self.hint_trust.record(ticket.req.request_class, ticket.judged_hint, completion.result.completion_tokens,
                                   ticket.caller)  # fmt: skip
            self._trust_changed()
        if ticket.asked_external and self.external is not None:
            self.external.completed(ticket.req.id, completion.result.completion_tokens)
        if self.config().logging.log_prompts:
            prompt_log.info("request %s completion: %s", ticket.req.id, completion.result.text, extra=ticket.log_extra)

    def _trust_changed(self) -> None:
        """Log and count each class that lost or regained its hints: one line per flip."""
        for change in self.hint_trust.take_changes():
            _log_trust(change)
            if self.metrics is not None:
                self.metrics.hints_distrusted.labels(class_label(change.request_class), change.caller).set(
                    0 if change.trusted else 1)  # fmt: skip


NO_CLASS_LABEL = "_default"  # requests naming no class (no class name can hold "_")


def class_label(request_class: str) -> str:
    return request_class or NO_CLASS_LABEL


def _log_trust(change: TrustChange) -> None:
    who = f"request class {change.request_class!r}" if change.request_class else "requests naming no class"
    if change.caller:
        who += f" from caller {change.caller!r}"
    if not change.trusted:
        log.warning("%s: length hints ignored, the predictor places these requests: their answers ran %.1fx the "
                    "hint (median of the latest %d hinted completions)", who, change.median_ratio, change.samples)  # fmt: skip
    elif change.median_ratio is not None:
        log.warning("%s: length hints honoured again: answers back to %.2fx the hint (median of the latest %d)",
                    who, change.median_ratio, change.samples)  # fmt: skip
    else:
        log.warning("%s: length hints honoured again: the evidence against them aged out", who)


def contradicted_hint(hint: int, min_tokens: int | None, ignore_eos: bool, stop: tuple[str, ...], max_tokens: int) -> str:
    """Why the request itself says ``hint`` is too short ("" if it does not): the answer runs to at least
    ``min_tokens``, and with ``ignore_eos`` and no stop sequence to ``max_tokens`` (as sent to the engine)."""
    if min_tokens is not None and hint < min_tokens:
        return f"{hint} is below min_tokens {min_tokens}: the answer is at least min_tokens long"
    if ignore_eos and not stop and hint < max_tokens:
        return (f"{hint} is below max_tokens {max_tokens}: with ignore_eos and no stop sequence the answer runs "
                "to max_tokens")  # fmt: skip
    return ""
