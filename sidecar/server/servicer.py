"""gRPC servicers: ``binbatch.v1.Inference`` and ``binbatch.v1.Admin``.

Thin by design: translate a ``GenerateRequest`` into a core ``Request`` plus an
engine request, hand it to the dispatcher, await the outcome, translate back.
A servicer is given the few collaborators it calls (the dispatcher, a clock,
getters for the running config and the default model; the Admin servicer its
``AdminReplies``), never the process object, so this module does not import
``app`` and a unit test builds one from fakes.
Every error becomes a gRPC status in one place, ``_status_of``.  The gRPC deadline
becomes the request's deadline (it leaves its bin when it passes).  When an RPC
ends for any reason (the caller cancelled, its deadline passed, the stream was
dropped while gRPC was sending a chunk) a done-callback on the RPC withdraws the
request: from its bin, or by aborting its engine call.  Reacting only to
``CancelledError`` in the handler missed the dropped streams, whose engine
requests then ran to ``max_tokens``.

Input is parsed strictly, within the bounds the proto documents: every bad input
(a field, a metadata value, or a body that is not a GenerateRequest at all) is
INVALID_ARGUMENT naming what is wrong, and is not logged above DEBUG, so no
client can flood the logs or reach a traceback with its input.  The request
deserializer never raises for that reason (``add_inference_servicer``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc

from ..config import CLASS_PRIORITY_LIMIT, SidecarConfig
from ..core.clock import Clock
from ..core.request import Request
from ..core.stages import RequestDispatcher
from ..engine.dispatcher import Call, Completion, Rejected
from ..engine.engine_client import EngineError, EngineRequest, SamplingParams

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
_DIGITS = re.compile(r"[0-9]{1,9}")  # plain ASCII digits; longer is beyond every bound anyway

_REJECTED_CODES = {
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
    "cancelled": grpc.StatusCode.CANCELLED,
}
_ENGINE_CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "timeout": grpc.StatusCode.DEADLINE_EXCEEDED,
    "internal": grpc.StatusCode.INTERNAL,
}


class InvalidRequest(Exception):
    """A request field is wrong; the message starts with the field's name."""


class Undecodable:
    """A request body that does not parse as its message (corrupt protobuf, a
    string field that is not UTF-8): the servicer answers INVALID_ARGUMENT."""

    def __init__(self, message_type: str, error: str) -> None:
        self.message = (
            f"request: the body is not a valid {message_type} "
            f"(corrupt protobuf, or a string field that is not UTF-8): {error}"
        )


def _decoder(message_cls):
    """A request deserializer that never raises: gRPC would answer UNKNOWN and log
    an ERROR traceback per call, which any client could use to flood the logs."""

    def decode(data: bytes):
        try:
            return message_cls.FromString(data)
        except DecodeError as exc:
            return Undecodable(message_cls.DESCRIPTOR.full_name, str(exc))

    return decode


decode_request = _decoder(pb.GenerateRequest)


def add_servicers(server: grpc.aio.Server, inference: InferenceServicer, admin: AdminServicer) -> None:
    """The generated ``add_*Servicer_to_server``, with deserializers that never raise."""
    services = {
        "binbatch.v1.Inference": {
            "Generate": grpc.unary_unary_rpc_method_handler(
                inference.Generate, request_deserializer=decode_request,
                response_serializer=pb.GenerateResponse.SerializeToString,
            ),
            "GenerateStream": grpc.unary_stream_rpc_method_handler(
                inference.GenerateStream, request_deserializer=decode_request,
                response_serializer=pb.GenerateChunk.SerializeToString,
            ),
        },
        "binbatch.v1.Admin": {
            "GetStats": grpc.unary_unary_rpc_method_handler(
                admin.GetStats, request_deserializer=_decoder(pb.GetStatsRequest),
                response_serializer=pb.Stats.SerializeToString,
            ),
            "GetConfig": grpc.unary_unary_rpc_method_handler(
                admin.GetConfig, request_deserializer=_decoder(pb.GetConfigRequest),
                response_serializer=pb.ConfigView.SerializeToString,
            ),
        },
    }  # fmt: skip
    for name, handlers in services.items():
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place where errors become gRPC statuses."""
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, Rejected):
        return _REJECTED_CODES.get(exc.kind, grpc.StatusCode.INTERNAL), exc.message
    if isinstance(exc, EngineError):
        return _ENGINE_CODES.get(exc.kind, grpc.StatusCode.INTERNAL), f"engine: {exc.message}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


# Tokens a chat template may add around the messages (roles, special tokens).
TEMPLATE_TOKENS = 64


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


def estimate_prompt_tokens(text: str) -> int:
    """A tokenizer-free estimate (~4 bytes per token) used only to bucket prompts
    for the online predictor before the engine reports the true count."""
    return max(1, len(text.encode()) // 4)


class AdminReplies(Protocol):
    """What the Admin servicer answers with (``replies.Replies``)."""

    def stats(self) -> pb.Stats: ...

    def config_view(self) -> pb.ConfigView: ...


class InferenceServicer(pb_grpc.InferenceServicer):
    """Given the few things it calls: the dispatcher, the clock, a getter for the
    running config (a reload replaces it) and one for the default model (learned
    from the engine after start-up)."""

    def __init__(
        self, dispatcher: RequestDispatcher, clock: Clock, *, config: Callable[[], SidecarConfig],
        default_model: Callable[[], str], context_length: Callable[[str], int | None] = lambda model: None,
        on_completion: Callable[[float, int, int], None] = lambda engine_seconds, batch_size, output_tokens: None,
    ) -> None:
        self.dispatcher = dispatcher
        self.clock = clock
        self.config = config
        self.default_model = default_model
        self.context_length = context_length  # the engine's max_model_len for a model, if it said
        self.on_completion = on_completion  # (engine seconds, batch size, output tokens): Stats.throughput, Smdp fit

    def _build(
        self, msg: pb.GenerateRequest | Undecodable, context: grpc.aio.ServicerContext, stream: bool
    ) -> tuple[Request, Call]:
        """Validate ``msg`` and make the core request and the caller's handle."""
        cfg = self.config()
        if isinstance(msg, Undecodable):
            raise InvalidRequest(msg.message)
        which = msg.WhichOneof("input")
        if which is None:
            raise InvalidRequest("input: set either prompt or chat")
        if which == "prompt" and not msg.prompt:
            raise InvalidRequest("prompt: must not be empty")
        messages = None
        if which == "chat":
            if not msg.chat.messages:
                raise InvalidRequest("chat.messages: at least one message is required")
            for i, m in enumerate(msg.chat.messages):
                if not m.role:
                    raise InvalidRequest(f"chat.messages[{i}].role: must not be empty")
            messages = tuple((m.role, m.content) for m in msg.chat.messages)
        if len(msg.model) > MODEL_LIMIT:
            raise InvalidRequest(f"model: at most {MODEL_LIMIT} characters")
        model = msg.model or self.default_model()
        if not model:
            raise InvalidRequest("model: required (the sidecar has no default model: set engine.model)")
        cap = cfg.bins.max_output_tokens
        max_tokens = msg.max_tokens  # 0: unset; the engine is sent the cap
        if max_tokens > cap:
            raise InvalidRequest(f"max_tokens: {max_tokens} exceeds the limit of {cap} (bins.maxOutputTokens)")
        if msg.HasField("temperature") and not 0 <= msg.temperature <= TEMPERATURE_LIMIT:
            raise InvalidRequest(f"temperature: must be in [0, {TEMPERATURE_LIMIT:g}], got {msg.temperature:g}")
        if msg.HasField("top_p") and not 0 < msg.top_p <= 1:
            raise InvalidRequest(f"top_p: must be in (0, 1], got {msg.top_p:g}")
        if msg.HasField("min_tokens") and msg.min_tokens > (max_tokens or cap):
            raise InvalidRequest(f"min_tokens: {msg.min_tokens} exceeds max_tokens {max_tokens or cap}")
        if msg.HasField("expected_output_tokens") and not 1 <= msg.expected_output_tokens <= cap:
            raise InvalidRequest(f"expected_output_tokens: must be in [1, {cap}] (bins.maxOutputTokens), got {msg.expected_output_tokens}")  # fmt: skip
        if not -PRIORITY_LIMIT <= msg.priority <= PRIORITY_LIMIT:
            raise InvalidRequest(f"priority: must be in [{-PRIORITY_LIMIT}, {PRIORITY_LIMIT}], got {msg.priority}")
        if len(msg.stop) > STOP_COUNT_LIMIT:
            raise InvalidRequest(f"stop: at most {STOP_COUNT_LIMIT} sequences, got {len(msg.stop)}")
        for i, seq in enumerate(msg.stop):
            if not 1 <= len(seq) <= STOP_LENGTH_LIMIT:
                raise InvalidRequest(f"stop[{i}]: must be 1 to {STOP_LENGTH_LIMIT} characters, got {len(seq)}")
        if len(msg.request_id) > REQUEST_ID_LIMIT:
            raise InvalidRequest(f"request_id: at most {REQUEST_ID_LIMIT} characters")
        class_priority = 0
        if msg.request_class:
            found = cfg.classes.priority_of(msg.request_class)
            if found is None:
                names = ", ".join(c.name for c in cfg.classes.classes) or "none"
                shown = msg.request_class if len(msg.request_class) <= 64 else msg.request_class[:64] + "..."
                raise InvalidRequest(f"request_class: unknown class {shown!r} (the policy's classes.classes defines: {names})")  # fmt: skip
            class_priority = found
        slo = _read_slo(context)
        text = msg.prompt if which == "prompt" else "".join(c for _, c in messages or ())
        params = SamplingParams(
            model=model,
            # never unset: bins.maxOutputTokens is the cap the docs promise, within the engine's context
            max_tokens=max_tokens or unset_max_tokens(cap, self.context_length(model), text),
            temperature=msg.temperature if msg.HasField("temperature") else None,
            top_p=msg.top_p if msg.HasField("top_p") else None,
            stop=tuple(msg.stop),
            seed=msg.seed if msg.HasField("seed") else None,
            ignore_eos=msg.ignore_eos,
            min_tokens=msg.min_tokens if msg.HasField("min_tokens") else None,
        )
        engine_request = EngineRequest(params=params, prompt=msg.prompt if which == "prompt" else None, messages=messages)
        now = self.clock.now()
        remaining = context.time_remaining()
        budget = cfg.queue_budget_seconds(slo.get("x-slo-ttft-ms"))  # TTFT SLO: bounds the wait in a bin
        req = Request(
            id=msg.request_id or uuid.uuid4().hex,
            arrival=now,
            prompt_tokens=estimate_prompt_tokens(text),
            max_tokens=max_tokens,
            hint_tokens=float(msg.expected_output_tokens) if msg.HasField("expected_output_tokens") else None,
            priority=class_priority * PRIORITY_SPAN + msg.priority,
            deadline=None if remaining is None else now + remaining,
            send_by=None if budget is None else now + budget,
            tpot_slo=slo["x-slo-tpot-ms"] / 1000 if "x-slo-tpot-ms" in slo else None,  # TpotGate
            request_class=msg.request_class,
        )
        if cfg.logging.log_prompts:
            prompt_log.info("request %s prompt: %s", req.id, text, extra={"request_id": req.id})
        loop = asyncio.get_running_loop()
        call = Call(engine_request, loop.create_future(), asyncio.Queue() if stream else None)
        return req, call

    async def _accept(self, msg, context, stream: bool) -> tuple[Request, Call] | None:
        """Submit the request; None if it was refused (the RPC is aborted then)."""
        try:
            req, call = self._build(msg, context, stream)
            self.dispatcher.submit(req, call)
        except (InvalidRequest, Rejected) as exc:
            log.debug("refused: %s", exc)
            await _abort(context, exc)
            return None
        context.add_done_callback(lambda _: self._withdraw(req, call))
        return req, call

    def _withdraw(self, req: Request, call: Call) -> None:
        """The RPC ended: a request still unanswered has nobody waiting for it."""
        if not call.future.done():
            self.dispatcher.cancel(req)

    def _log_completion(self, req: Request, completion: Completion) -> None:
        self.on_completion(completion.engine_seconds, completion.batch_size, completion.result.completion_tokens)
        if self.config().logging.log_prompts:
            prompt_log.info("request %s completion: %s", req.id, completion.result.text,
                            extra={"request_id": req.id})  # fmt: skip

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse | None:
        accepted = await self._accept(request, context, stream=False)
        if accepted is None:
            return None
        req, call = accepted
        try:
            completion = await asyncio.shield(call.future)
        except asyncio.CancelledError:
            self.dispatcher.cancel(req)
            raise
        except Exception as exc:  # noqa: BLE001 - every outcome becomes a status
            await _abort(context, exc)
            return None
        self._log_completion(req, completion)
        return _response(req, completion)

    async def GenerateStream(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        accepted = await self._accept(request, context, stream=True)
        if accepted is None:
            return
        req, call = accepted
        assert call.deltas is not None
        index = 0
        try:
            while not call.future.done() or not call.deltas.empty():
                piece = await call.deltas.get()
                # The engine ran ahead of this stream (a busy sidecar): what has
                # arrived goes as one chunk, "text since the previous chunk"
                # (binbatch.proto), one gRPC message instead of one per piece.
                while not call.deltas.empty():
                    piece += call.deltas.get_nowait()
                if piece:
                    yield pb.GenerateChunk(text=piece, index=index)
                    index += 1
            completion = call.future.result()
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)
            return
        finally:
            self._withdraw(req, call)  # cancelled, or closed while gRPC sent a chunk (GeneratorExit)
        self._log_completion(req, completion)
        if index == 0 and completion.result.text:
            yield pb.GenerateChunk(text=completion.result.text, index=0)  # gang mode: one chunk
            index = 1
        # The chunks carried the text: the final chunk's is empty (binbatch.proto,
        # GenerateChunk), so a client that concatenates every chunk gets it once.
        final = _response(req, completion)
        final.text = ""
        yield pb.GenerateChunk(final=final, index=index)


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the RPC with ``exc``'s status.

    If the RPC has already ended (its deadline passed, or the caller left, just as
    the sidecar gave up on the request) gRPC cannot send the status and
    ``abort`` raises an internal batch error, which the server would log as an
    ERROR with a traceback; the caller already has its status, so this is logged
    at DEBUG and the handler returns (gRPC then ends it as aborted, quietly).
    """
    code, text = _status_of(exc)
    try:
        await context.abort(code, text)
    except grpc.aio.AbortError:
        raise  # the normal way abort ends a handler
    except Exception as err:  # noqa: BLE001 - see the docstring
        log.debug("RPC ended before its status %s (%s) could be sent: %r", code.name, text, err)


def _response(req: Request, c: Completion) -> pb.GenerateResponse:
    r = c.result
    return pb.GenerateResponse(
        text=r.text,
        finish_reason=r.finish_reason,
        prompt_tokens=r.prompt_tokens,
        completion_tokens=r.completion_tokens,
        queue_seconds=c.queue_seconds,
        engine_seconds=c.engine_seconds,
        bin=c.bin,
        batch_size=c.batch_size,
        predicted_output_tokens=c.predicted_tokens,
        request_id=req.id,
    )


def _read_slo(context: grpc.aio.ServicerContext) -> dict[str, int]:
    """The Gateway API Inference Extension's SLO headers, validated strictly: plain
    ASCII digits (``int()`` would take " 7 ", "1_000" and any length), within
    ``SLO_LIMITS``, at most once each."""
    out: dict[str, int] = {}
    for key, value in context.invocation_metadata() or ():
        if key not in SLO_LIMITS:
            continue
        limit = SLO_LIMITS[key]
        if key in out:
            raise InvalidRequest(f"{key}: given more than once")
        if not isinstance(value, str) or not _DIGITS.fullmatch(value) or not 1 <= int(value) <= limit:
            shown = value if len(value) <= 32 else value[:32] + "..."
            raise InvalidRequest(f"{key}: must be a whole number of milliseconds in [1, {limit}], got {shown!r}")
        out[key] = int(value)
    return out


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(self, replies: AdminReplies) -> None:
        self.replies = replies

    async def GetStats(self, request: pb.GetStatsRequest | Undecodable, context: Any) -> pb.Stats:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return self.replies.stats()

    async def GetConfig(self, request: pb.GetConfigRequest | Undecodable, context: Any) -> pb.ConfigView:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return self.replies.config_view()

