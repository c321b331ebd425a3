"""Property test of the dispatcher's bookkeeping (issue 9, defect 1).

Hypothesis drives random sequences of submits, caller cancellations, deadlines
passing, engine answers, engine errors and dispatch-side crashes, in gang and
continuous mode (plain and streaming calls), against the real dispatcher with a
deterministic fake engine: every engine call is a future the test resolves, and
time is a manual clock, so nothing sleeps.  After everything settles, every
caller's future is done exactly once and nothing is left in flight, overall and
per bin.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.former import BatchFormer
from binbatch_sidecar.core.predictor import HintPredictor
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.core.sizer import BatchSizer
from binbatch_sidecar.engine.dispatcher import Call, Core, Dispatcher, Rejected
from binbatch_sidecar.engine.engine_client import EngineError, EngineRequest, EngineResult, SamplingParams, StreamDelta
from binbatch_sidecar.engine.sidecar_metrics import SidecarMetrics

OUTCOMES = ("completed", "failed", "cancelled", "expired", "unavailable", "rejected")


@dataclass(eq=False)
class EngineCall:
    requests: list
    answer: asyncio.Future = field(repr=False)


class FakeEngine:
    """Engine calls that wait until the test answers them (``calls`` holds the open ones)."""

    def __init__(self) -> None:
        self.calls: list[EngineCall] = []

    async def _wait(self, requests) -> list:
        call = EngineCall(list(requests), asyncio.get_running_loop().create_future())
        self.calls.append(call)
        try:
            return await call.answer
        finally:
            self.calls.remove(call)

    async def complete_batch(self, requests, *, timeout=None):
        return await self._wait(requests)

    async def stream(self, request, *, timeout=None, on_progress=None):
        yield StreamDelta("x")
        (result,) = await self._wait([request])
        if isinstance(result, EngineError):
            raise result
        yield result

    def resolve(self, i: int, how: str) -> None:
        call = self.calls[i % len(self.calls)]
        if call.answer.done():
            return
        if how == "crash":  # a bug in the client: an exception that is no engine answer
            call.answer.set_exception(RuntimeError("client bug"))
        elif how == "error":
            call.answer.set_result([EngineError("invalid", 400, "refused") for _ in call.requests])
        else:
            call.answer.set_result([EngineResult("x", "length", 3, r.params.max_tokens or 1) for r in call.requests])


ops = st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 100), st.one_of(st.none(), st.floats(0.1, 3.0)), st.booleans()),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("step")),
    st.tuples(st.just("settle")),
    st.tuples(st.just("advance"), st.floats(0.05, 2.0)),
    st.tuples(st.just("callers_time_out")),
    st.tuples(st.just("answer"), st.integers(0, 50), st.sampled_from(["ok", "ok", "error", "crash"])),
    st.tuples(st.just("resize"), st.integers(1, 3)),
)


async def settle() -> None:
    for _ in range(8):
        await asyncio.sleep(0)  # ok-sleep: bare yields so engine tasks reach their next await


async def scenario(mode: str, k: int, size: int, inflight: int, program: list[tuple], drain: bool = False) -> None:
    clock = ManualClock()
    binner = FixedBinner.uniform(k, 1, 100) if k > 1 else FixedBinner(())
    former = BatchFormer(binner, clock, target_size=size, max_wait=1.0, max_queue=20)
    core = Core(HintPredictor(), binner, former, BatchSizer(mode="static", static_size=size))
    engine = FakeEngine()
    metrics = SidecarMetrics()
    d = Dispatcher(core, engine, clock, metrics, mode=mode, max_inflight_batches=inflight)  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    callers: list[tuple[Request, Call]] = []
    refused = 0  # submits answered "queue full" at once (counted as rejected, never accepted)

    def cancel_if(pred) -> None:
        for req, call in callers:
            if not call.future.done() and pred(req):
                d.cancel(req)

    for op in program:
        match op:
            case ("submit", tokens, deadline, stream):
                req = Request(
                    id=str(len(callers)), arrival=clock.now(), max_tokens=tokens,
                    deadline=None if deadline is None else clock.now() + deadline,
                )  # fmt: skip
                engine_req = EngineRequest(SamplingParams(model="m", max_tokens=tokens), prompt="p")
                call = Call(engine_req, loop.create_future(), asyncio.Queue() if stream else None)
                try:
                    d.submit(req, call)
                except Rejected:
                    refused += 1
                    continue
                callers.append((req, call))
            case ("cancel", i) if callers:
                cancel_if(lambda r, target=callers[i % len(callers)][0]: r is target)
            case ("step",):
                d._step()
            case ("settle",):
                await settle()
            case ("advance", dt):
                clock.advance(dt)
            case ("callers_time_out",):  # what gRPC does when a caller's deadline passes
                cancel_if(lambda r: r.expired(clock.now()))
            case ("answer", i, how) if engine.calls:
                engine.resolve(i, how)
            case ("resize", n):
                former.set_target_sizes(n)
        # binbatch_requests_waiting's sidecar part is exactly the open requests in bins and pending
        assert sum(d.waiting_by_model().values()) == sum(former.bin_depths()) + d.pending_requests()

    if drain:  # SIGTERM with no grace left: every caller is answered; "cut off" counts those the drain answered
        before = d.totals["unavailable"]
        cut = await d.drain(grace=0.0)
        assert all(call.future.done() for _, call in callers)
        assert cut == d.totals["unavailable"] - before
    for _ in range(200):  # everything settles: the engine answers, max_wait passes, the loop steps
        await settle()
        for i in range(len(engine.calls)):
            engine.resolve(i, "ok")
        clock.advance(1.0)
        d._step()
        await settle()
        if all(c.future.done() for _, c in callers) and not engine.calls and d.inflight_requests == 0:
            break

    assert all(call.future.done() for _, call in callers), "a caller never got an answer"
    ended = sum(d.totals[o] for o in OUTCOMES) - refused
    assert ended == d.totals["accepted"] == len(callers), "each accepted request ends exactly once"
    assert (d.inflight_requests, d.inflight_batches) == (0, 0)
    assert all(d.ledger.requests_in(b) == d.ledger.batches_in(b) == 0 for b in range(k))
    assert d.ledger.held() == [] and d.pending_requests() == 0 and former.queued() == 0
    assert engine.calls == [], "an engine call was left running"
    for _, call in callers:  # every answer was read: nothing logs "exception never retrieved"
        call.future.exception()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["gang", "continuous"]),
    k=st.integers(1, 3),
    size=st.integers(1, 3),
    inflight=st.integers(1, 3),
    program=st.lists(ops, min_size=20, max_size=80),
    drain=st.booleans(),
)
def test_every_request_ends_once_and_in_flight_counts_return_to_zero(mode, k, size, inflight, program, drain):
    asyncio.run(scenario(mode, k, size, inflight, program, drain))
