"""The engine circuit breaker: its state machine, and the dispatcher holding the
queue through an outage (fake engine client, manual clock)."""

from __future__ import annotations

import asyncio

import pytest

from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.former import BatchFormer
from binbatch_sidecar.core.predictor import HintPredictor
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.core.sizer import BatchSizer
from binbatch_sidecar.engine.breaker import EngineBreaker, is_outage, outage_reason
from binbatch_sidecar.engine.dispatcher import Call, Core, Dispatcher, Rejected
from binbatch_sidecar.engine.engine_client import EngineError, EngineRequest, EngineResult, SamplingParams
from binbatch_sidecar.engine.sidecar_metrics import SidecarMetrics

OK = EngineResult("x", "length", 1, 4)
RESET = EngineError("unavailable", None, "the engine connection failed: ServerDisconnectedError")
REFUSED = EngineError("unavailable", None, "cannot connect to the engine: refused", sent=False)


@pytest.mark.parametrize(
    ("result", "outage"),
    [
        (OK, False),
        (RESET, True),
        (REFUSED, True),
        (EngineError("unavailable", 503, "stopping"), True),
        (EngineError("unavailable", 429, "too many requests"), False),  # alive, busy
        (EngineError("unavailable", 500, "one request broke"), False),  # alive
        (EngineError("invalid", 400, "too long"), False),
        (EngineError("timeout", None, "slow"), False),
    ],
)
def test_only_an_unreachable_engine_is_an_outage(result, outage):
    assert is_outage(result) is outage


def test_breaker_opens_probes_half_open_and_closes_on_an_answer():
    b = EngineBreaker()
    assert b.allows_dispatch(inflight=100) and b.state == "closed"
    assert b.on_result(outage_reason(RESET), now=1.0) and b.state == "open" and b.opens == 1
    assert not b.allows_dispatch(inflight=0)
    assert not b.on_probe(False, now=2.0)  # still down: no change
    assert b.describe(3.0) == "the engine is unavailable (open for 2.0 s: health probe failed)"  # the latest reason
    assert b.on_probe(True, now=3.0) and b.state == "half_open"
    assert b.allows_dispatch(inflight=0) and not b.allows_dispatch(inflight=1)  # one trial at a time
    assert b.on_result(outage_reason(RESET), now=3.5) and b.state == "open" and b.opens == 1  # same outage
    b.on_probe(True, now=4.0)
    assert b.on_result(outage_reason(EngineError("invalid", 400, "bad")), now=4.1)  # any answer: the engine is back
    assert b.state == "closed" and b.open_seconds(5.0) == 0.0 and b.allows_dispatch(inflight=7)
    b.on_result(outage_reason(RESET), now=5.0)
    b.on_probe(True, now=5.5)
    assert b.on_probe(True, now=6.5) and b.state == "closed"  # two good probes: the trial may be a long one
    assert b.on_probe(False, now=7.0, reason="GET /health failed") and b.opens == 3 and b.reason == "GET /health failed"


class FakeClient:
    """Each complete_batch call waits until the test answers it."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[EngineRequest], asyncio.Future]] = []

    async def complete_batch(self, requests, *, timeout=None):
        fut = asyncio.get_running_loop().create_future()
        self.calls.append((list(requests), fut))
        return await fut

    def answer(self, i: int, result: EngineResult | EngineError) -> None:
        reqs, fut = self.calls[i]
        fut.set_result([result] * len(reqs))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)  # ok-sleep: a bare yield to the event loop; no time passes


def make(mode: str = "continuous", max_queue: int = 100):
    clock = ManualClock()
    binner = FixedBinner(())
    former = BatchFormer(binner, clock, target_size=2, max_wait=0.0, max_queue=max_queue)
    core = Core(HintPredictor(), binner, former, BatchSizer(mode="static", static_size=2, max_size=8))
    client = FakeClient()
    d = Dispatcher(core, client, clock, SidecarMetrics(), mode=mode, max_inflight_batches=1)  # type: ignore[arg-type]
    return d, client, clock


def submit(d: Dispatcher, i: int, deadline: float | None = 60.0) -> Call:
    call = Call(EngineRequest(params=SamplingParams(model="m", max_tokens=4), prompt=f"p{i}"),
                asyncio.get_running_loop().create_future())  # fmt: skip
    now = d.clock.now()
    d.submit(Request(id=str(i), arrival=now, max_tokens=4, deadline=None if deadline is None else now + deadline), call)
    return call


def state(d: Dispatcher, name: str) -> float:
    return d.metrics.breaker_state.labels(name)._value.get()


@pytest.mark.parametrize("mode", ["continuous", "gang"])
async def test_queued_requests_are_held_through_an_outage_and_complete_after_it(mode):
    """Issue 9: the whole queue used to be flushed into the dead engine and fail
    in half a second although its deadlines outlived the outage."""
    d, client, clock = make(mode)
    sent = [submit(d, i) for i in range(2)]
    d._step()
    await settle()
    assert sum(len(r) for r, _ in client.calls) == 2
    queued = [submit(d, i) for i in range(2, 12)]
    for i in range(len(client.calls)):  # the engine dies under the requests it holds
        client.answer(i, RESET)
    await settle()
    for call in sent:  # sent before the engine died: UNAVAILABLE, never sent again
        with pytest.raises(EngineError, match="ServerDisconnectedError"):
            await call.future
    assert d.breaker.state == "open" and state(d, "open") == 1
    calls_before = len(client.calls)
    for _ in range(5):  # 5 s of outage: nothing is dispatched, nothing queued fails
        clock.advance(1.0)
        d.on_engine_health(False)
        d._step()
        await settle()
    assert len(client.calls) == calls_before and not any(c.future.done() for c in queued)
    assert d.backlog() == 10
    # a new call without a deadline gets UNAVAILABLE at once; with one it is held too
    with pytest.raises(Rejected) as refused:
        submit(d, 99, deadline=None)
    assert refused.value.kind == "unavailable" and "engine is unavailable (open for 5.0 s" in refused.value.message
    queued.append(submit(d, 100))
    # the engine is back: one trial first (half-open), then everything
    d.on_engine_health(True)
    assert d.breaker.state == "half_open" and state(d, "half_open") == 1
    d._step()
    await settle()
    assert len(client.calls) == calls_before + 1
    d._step()
    await settle()
    assert len(client.calls) == calls_before + 1  # still one trial only
    client.answer(calls_before, OK)
    await settle()
    assert d.breaker.state == "closed" and state(d, "closed") == 1
    while not all(c.future.done() for c in queued):
        d._step()
        await settle()
        for i in range(calls_before + 1, len(client.calls)):
            if not client.calls[i][1].done():
                client.answer(i, OK)
        await settle()
    assert all(c.future.result().result == OK for c in queued)
    assert d.totals["completed"] == 11 and d.totals["failed"] == 2
    assert d.metrics.breaker_opens._value.get() == 1


async def test_a_request_the_engine_never_received_is_queued_again_not_failed():
    d, client, _ = make()
    call = submit(d, 1)
    d._step()
    await settle()
    client.answer(0, REFUSED)  # connection refused: it never left the sidecar
    await settle()
    assert not call.future.done() and d.core.former.queued() == 1 and d.breaker.state == "open"
    assert d.metrics.requeued._value.get() == 1
    d.on_engine_health(True)
    d._step()
    await settle()
    assert [r.prompt for reqs, _ in client.calls for r in reqs] == ["p1", "p1"]  # sent once: the first never arrived
    client.answer(1, OK)
    assert (await call.future).result == OK


async def test_full_queue_while_the_engine_is_down_answers_unavailable_at_once():
    d, client, _ = make(max_queue=3)
    submit(d, 0)
    d._step()
    await settle()
    client.answer(0, RESET)
    await settle()
    held = [submit(d, i) for i in range(1, 4)]
    with pytest.raises(Rejected) as refused:
        submit(d, 4)
    assert refused.value.kind == "unavailable" and "queue full" in refused.value.message
    assert not any(c.future.done() for c in held)
    for c in held:
        c.future.cancel()


async def test_a_held_request_ends_at_its_deadline_while_the_engine_stays_down():
    d, client, clock = make()
    submit(d, 0)
    d._step()
    await settle()
    client.answer(0, RESET)
    await settle()
    short, long_ = submit(d, 1, deadline=2.0), submit(d, 2, deadline=60.0)
    wake = d.core.former.next_wake()
    assert wake is not None and wake <= clock.now() + 2.0  # an armed timer, not a busy loop
    clock.advance(2.0)
    d._step()
    with pytest.raises(Rejected, match="deadline passed while queued"):
        await short.future
    assert not long_.future.done() and len(client.calls) == 1
    long_.future.cancel()
