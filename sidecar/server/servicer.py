"""gRPC servicers: ``binbatch.v1.Inference`` and ``binbatch.v1.Admin``.

Thin by design: parse a ``GenerateRequest`` and its metadata into the
door-neutral ``front.Fields``, hand them to ``front.Front`` (shared with the
OpenAI-compatible HTTP door: same bounds, same submit into the same dispatcher),
await the outcome, translate back.  A servicer is given the few collaborators
it calls (the dispatcher, a clock, getters for the running config and the
default model; the Admin servicer its ``AdminReplies``), never the process
object, so this module does not import ``app`` and a unit test builds one from
fakes.
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
W3C ``traceparent``/``tracestate`` metadata travel on to the engine's request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc

from ..config import SidecarConfig
from ..core.clock import Clock
from ..core.request import Request
from ..core.stages import RequestDispatcher
from ..engine.dispatcher import Call, Completion, Rejected
from ..engine.engine_client import EngineError
from ..engine.external_predictor import ExternalPredictor
from ..engine.sidecar_metrics import SidecarMetrics
from .front import (  # noqa: F401 - the bounds and helpers are re-exported: binbatch.proto documents them here
    MODEL_LIMIT,
    PRIORITY_LIMIT,
    PRIORITY_SPAN,
    REQUEST_ID_LIMIT,
    SLO_KEYS,
    SLO_LIMITS,
    STOP_COUNT_LIMIT,
    STOP_LENGTH_LIMIT,
    TEMPERATURE_LIMIT,
    TEMPLATE_TOKENS,
    Fields,
    Front,
    InvalidRequest,
    Ticket,
    estimate_prompt_tokens,
    read_slo,
    read_tenant,
    unset_max_tokens,
)
from .caller_auth import AdminGate, CallerAuth, Unauthenticated
from .trace_context import read_trace_context

log = logging.getLogger("binbatch.api")
GRPC_NAMES = {"messages": "chat.messages"}  # front's neutral names as GenerateRequest spells them

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
    "unauthorized": grpc.StatusCode.INTERNAL,  # the sidecar's engine key is wrong or missing: not the caller's fault
}


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
            "ExportTrainingRecords": grpc.unary_unary_rpc_method_handler(
                admin.ExportTrainingRecords, request_deserializer=_decoder(pb.ExportTrainingRecordsRequest),
                response_serializer=pb.TrainingRecords.SerializeToString,
            ),
        },
    }  # fmt: skip
    for name, handlers in services.items():
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)
    logging.getLogger("grpc._cython.cygrpc").addFilter(_GONE_CLIENTS_FILTER)  # adding it again is a no-op


class _GoneClientsAtDebug(logging.Filter):
    """gRPC's core logs ERROR with a traceback when it cannot send a status to a client that has
    already gone (a call with a 1 ms deadline to a method that does not exist: found by
    ``binbatch bench fuzz``).  Nothing is lost: there is no one to answer.  Such records go to
    DEBUG, one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.levelno < logging.ERROR or type(exc).__name__ != "ExecuteBatchError":
            return True
        record.msg, record.args = "gRPC could not answer a client that had gone: %s", (record.getMessage()[:200],)
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.exc_info = record.exc_text = None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


_GONE_CLIENTS_FILTER = _GoneClientsAtDebug()


def add_health(server: grpc.aio.Server, servicer: Any) -> None:
    """grpc_health's ``add_HealthServicer_to_server`` with deserializers that never raise: a corrupt
    health request was UNKNOWN with an ERROR traceback per call (found by ``binbatch bench fuzz``)."""
    from grpc_health.v1 import health_pb2

    def tolerant(method: Callable[..., Any]) -> Callable[..., Any]:
        async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await method(request, context)

        return call

    unary = {"Check": (health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse)}
    if hasattr(servicer, "List") and hasattr(health_pb2, "HealthListRequest"):
        unary["List"] = (health_pb2.HealthListRequest, health_pb2.HealthListResponse)
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(tolerant(getattr(servicer, name)), request_deserializer=_decoder(req),
                                                  response_serializer=resp.SerializeToString)
        for name, (req, resp) in unary.items()
    }  # fmt: skip
    handlers["Watch"] = grpc.unary_stream_rpc_method_handler(
        tolerant(servicer.Watch), request_deserializer=_decoder(health_pb2.HealthCheckRequest),
        response_serializer=health_pb2.HealthCheckResponse.SerializeToString,
    )  # fmt: skip
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("grpc.health.v1.Health", handlers),))


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place where errors become gRPC statuses."""
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, Unauthenticated):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, Rejected):
        return _REJECTED_CODES.get(exc.kind, grpc.StatusCode.INTERNAL), exc.message
    if isinstance(exc, EngineError):
        return _ENGINE_CODES.get(exc.kind, grpc.StatusCode.INTERNAL), f"engine: {exc.message}"
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"


class AdminReplies(Protocol):
    """What the Admin servicer answers with (``replies.Replies``)."""

    def stats(self) -> pb.Stats: ...

    def config_view(self) -> pb.ConfigView: ...

    def training_records(self, since: int, epoch: str, max_records: int) -> pb.TrainingRecords | None: ...


class InferenceServicer(pb_grpc.InferenceServicer):
    """Given the few things it calls: the dispatcher, the clock, a getter for the
    running config (a reload replaces it) and one for the default model (learned
    from the engine after start-up).  ``front`` (the same for the HTTP door) does
    the door-neutral work."""

    def __init__(
        self, dispatcher: RequestDispatcher, clock: Clock, *, config: Callable[[], SidecarConfig],
        default_model: Callable[[], str], context_length: Callable[[str], int | None] = lambda model: None,
        on_completion: Callable[[float, int, int], None] = lambda engine_seconds, batch_size, output_tokens: None,
        external: ExternalPredictor | None = None, metrics: SidecarMetrics | None = None,
        auth: CallerAuth | None = None,
    ) -> None:  # fmt: skip
        self.auth = auth  # auth.callerTokensDir: who the caller is (None: nobody is asked)
        self.front = Front(dispatcher, clock, config=config, default_model=default_model,
                           context_length=context_length, on_completion=on_completion, external=external,
                           metrics=metrics)  # fmt: skip
        self.dispatcher = dispatcher

    def _fields(self, msg: pb.GenerateRequest | Undecodable, context: grpc.aio.ServicerContext) -> Fields:
        """What only gRPC knows: the oneof input, the proto's optional fields, the
        metadata and the RPC's deadline."""
        if isinstance(msg, Undecodable):
            raise InvalidRequest(msg.message, "request")
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
        metadata = tuple(context.invocation_metadata() or ())
        return Fields(
            body_bytes=msg.ByteSize(),
            prompt=msg.prompt if which == "prompt" else None,
            messages=messages,
            model=msg.model,
            max_tokens=msg.max_tokens,
            temperature=msg.temperature if msg.HasField("temperature") else None,
            top_p=msg.top_p if msg.HasField("top_p") else None,
            stop=tuple(msg.stop),
            seed=msg.seed if msg.HasField("seed") else None,
            ignore_eos=msg.ignore_eos,
            min_tokens=msg.min_tokens if msg.HasField("min_tokens") else None,
            expected_output_tokens=msg.expected_output_tokens if msg.HasField("expected_output_tokens") else None,
            priority=msg.priority,
            request_class=msg.request_class,
            request_id=msg.request_id,
            slo=read_slo(metadata),
            tenant=read_tenant(metadata),
            timeout=context.time_remaining(),
            trace=read_trace_context(metadata),
        )

    def _build(
        self, msg: pb.GenerateRequest | Undecodable, context: grpc.aio.ServicerContext, stream: bool
    ) -> tuple[Request, Call]:
        """Validate ``msg`` and make the core request and the caller's handle."""
        ticket = self.front.build(self._fields(msg, context), stream, GRPC_NAMES)
        return ticket.req, ticket.call

    def _caller(self, context: grpc.aio.ServicerContext) -> str:
        """The authenticated caller ("" with caller authentication off); raises ``Unauthenticated``."""
        if self.auth is None:
            return ""
        values = [v for k, v in (context.invocation_metadata() or ()) if k == "authorization" and isinstance(v, str)]
        return self.auth.authenticate("grpc", values, "authorization")

    async def _accept(self, msg, context, stream: bool) -> Ticket | None:
        """Submit the request; None if it was refused (the RPC is aborted then).  The caller is
        authenticated first: an unknown one is refused before its request is even read."""
        try:
            caller = self._caller(context)
            f = self._fields(msg, context)
            f.caller = caller
            ticket = await self.front.submit(f, stream, GRPC_NAMES)
        except (InvalidRequest, Rejected, Unauthenticated) as exc:
            await _abort(context, exc)
            return None
        context.add_done_callback(lambda _: self.front.withdraw(ticket))
        return ticket

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse | None:
        ticket = await self._accept(request, context, stream=False)
        if ticket is None:
            return None
        try:
            completion = await asyncio.shield(ticket.call.future)
        except asyncio.CancelledError:
            self.front.withdraw(ticket)
            raise
        except Exception as exc:  # noqa: BLE001 - every outcome becomes a status
            await _abort(context, exc)
            return None
        self.front.finished(ticket, completion)
        return _response(ticket.req, completion)

    async def GenerateStream(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        ticket = await self._accept(request, context, stream=True)
        if ticket is None:
            return
        call = ticket.call
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
            self.front.withdraw(ticket)  # cancelled, or closed while gRPC sent a chunk (GeneratorExit)
        self.front.finished(ticket, completion)
        if index == 0 and completion.result.text:
            yield pb.GenerateChunk(text=completion.result.text, index=0)  # gang mode: one chunk
            index = 1
        # The chunks carried the text: the final chunk's is empty (binbatch.proto,
        # GenerateChunk), so a client that concatenates every chunk gets it once.
        final = _response(ticket.req, completion)
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


class AdminServicer(pb_grpc.AdminServicer):
    """Every RPC asks ``gate`` first (``caller_auth.AdminGate``: loopback, or a credential) and
    answers nothing to a caller it refuses (UNAUTHENTICATED)."""

    def __init__(self, replies: AdminReplies, gate: AdminGate | None = None) -> None:
        self.replies = replies
        self.gate = gate

    async def _admit(self, context: Any) -> None:
        if self.gate is None:
            return
        try:
            self.gate.check(context.peer(), tuple(context.invocation_metadata() or ()))
        except Unauthenticated as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))

    async def GetStats(self, request: pb.GetStatsRequest | Undecodable, context: Any) -> pb.Stats:
        await self._admit(context)
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return self.replies.stats()

    async def GetConfig(self, request: pb.GetConfigRequest | Undecodable, context: Any) -> pb.ConfigView:
        await self._admit(context)
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return self.replies.config_view()

    async def ExportTrainingRecords(
        self, request: pb.ExportTrainingRecordsRequest | Undecodable, context: Any
    ) -> pb.TrainingRecords:
        await self._admit(context)
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        reply = self.replies.training_records(request.since, request.epoch, request.max_records)
        if reply is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "predictor.kind is not Learned: only the learned predictor keeps training records")  # fmt: skip
        return reply

