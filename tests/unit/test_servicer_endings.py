"""How the Inference servicer ends RPCs, with a fake gRPC context (no sockets).

The race of issue 9, defect 12: a request's deadline passes in the sidecar (it
expires in its bin and the handler aborts the RPC with DEADLINE_EXCEEDED) at the
same moment as in gRPC core, which has then already finished the call, so
``context.abort`` fails with an internal batch error.  The handler let that
error escape, and gRPC logged it as an ERROR with a traceback, per request.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc._cython import cygrpc  # the batch error gRPC's own server raises; no public name exists

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar.config import SidecarConfig
from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.former import BatchFormer
from binbatch_sidecar.core.predictor import HintPredictor
from binbatch_sidecar.core.sizer import BatchSizer
from binbatch_sidecar.engine.dispatcher import Core, Dispatcher
from binbatch_sidecar.engine.sidecar_metrics import SidecarMetrics
from binbatch_sidecar.server.servicer import InferenceServicer


class FinishedContext:
    """An RPC that gRPC core has already finished: abort cannot send a status."""

    def __init__(self, remaining: float) -> None:
        self.remaining = remaining
        self.aborts: list[grpc.StatusCode] = []
        self.done_callbacks: list = []

    def invocation_metadata(self):
        return ()

    def time_remaining(self) -> float:
        return self.remaining

    def add_done_callback(self, callback) -> None:
        self.done_callbacks.append(callback)

    async def abort(self, code, details=""):
        self.aborts.append(code)
        raise cygrpc.ExecuteBatchError('Failed "execute_batch": (<grpc._cython.cygrpc.SendStatusFromServerOperation>,)')


def servicer() -> tuple[InferenceServicer, Dispatcher, ManualClock]:
    clock = ManualClock()
    binner = FixedBinner(())
    former = BatchFormer(binner, clock, target_size=8, max_wait=60.0)
    core = Core(HintPredictor(), binner, former, BatchSizer(mode="static", static_size=8))
    d = Dispatcher(core, None, clock, SidecarMetrics(), mode="continuous")  # type: ignore[arg-type]
    config = SidecarConfig()
    return InferenceServicer(d, clock, config=lambda: config, default_model=lambda: "m"), d, clock


async def test_a_deadline_racing_abort_ends_the_rpc_quietly(caplog):
    svc, d, clock = servicer()
    ctx = FinishedContext(remaining=0.5)
    with caplog.at_level(logging.DEBUG):
        handler = asyncio.ensure_future(svc.Generate(pb.GenerateRequest(prompt="hi", max_tokens=4), ctx))
        while d.totals["accepted"] == 0:
            await asyncio.sleep(0)  # ok-sleep: a bare yield until the handler has submitted
        clock.advance(0.5)
        d._step()  # the request expires in its bin as gRPC core ends the call
        assert await handler is None  # no exception escapes for gRPC to log
    assert ctx.aborts == [grpc.StatusCode.DEADLINE_EXCEEDED]
    assert d.totals["expired"] == 1
    assert not [r for r in caplog.records if r.levelno > logging.DEBUG]


async def test_the_end_of_the_rpc_withdraws_a_request_still_queued():
    """Defect 6's guard for every path: the RPC's done-callback withdraws the request
    even when the handler never saw CancelledError."""
    svc, d, _ = servicer()
    ctx = FinishedContext(remaining=30.0)
    handler = asyncio.ensure_future(svc.Generate(pb.GenerateRequest(prompt="hi", max_tokens=4), ctx))
    while d.totals["accepted"] == 0:
        await asyncio.sleep(0)  # ok-sleep: a bare yield until the handler has submitted
    assert d.core.former.queued() == 1 and ctx.done_callbacks
    for callback in ctx.done_callbacks:
        callback(ctx)  # gRPC ends the RPC (the caller went away)
    assert d.core.former.queued() == 0 and d.totals["cancelled"] == 1
    assert await handler is None  # the handler's abort finds the RPC ended, quietly
    assert d.totals["failed"] == 0


async def test_pieces_that_arrived_while_the_stream_was_busy_go_as_one_chunk():
    # issue 11: one gRPC message per engine piece is the sidecar's main cost per
    # token; a stream behind the engine sends what has arrived at once.
    svc, d, _ = servicer()
    ctx = FinishedContext(remaining=30.0)
    stream = svc.GenerateStream(pb.GenerateRequest(prompt="hi", max_tokens=4), ctx)
    first = asyncio.ensure_future(stream.__anext__())
    while d.totals["accepted"] == 0:
        await asyncio.sleep(0)  # ok-sleep: a bare yield until the handler has submitted
    (call,) = d._calls.values()
    for piece in ("a", "b", "c"):
        call.deltas.put_nowait(piece)
    chunk = await first
    assert (chunk.text, chunk.index) == ("abc", 0)
    call.deltas.put_nowait("d")
    assert (await stream.__anext__()).text == "d"
    await stream.aclose()
