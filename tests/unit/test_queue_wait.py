"""The queue-wait bound: the service rate on a manual clock, and the dispatcher
refusing at once a request whose predicted wait exceeds its deadline."""

from __future__ import annotations

import asyncio

import pytest

from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.former import BatchFormer
from binbatch_sidecar.core.predictor import HintPredictor
from binbatch_sidecar.core.queue_wait import ServiceRate, refusal
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.core.sizer import BatchSizer
from binbatch_sidecar.engine.dispatcher import Call, Core, Dispatcher, Rejected
from binbatch_sidecar.engine.engine_client import EngineRequest, EngineResult, SamplingParams
from binbatch_sidecar.engine.sidecar_metrics import SidecarMetrics


def test_rate_counts_only_time_the_engine_was_saturated():
    clock = ManualClock()
    rate = ServiceRate(min_samples=4)
    for _ in range(3):  # a quiet period: nothing waiting, 1 completion per 10 s
        clock.advance(10)
        rate.completed(clock.now(), saturated=False)
    assert rate.rate(clock.now()) is None
    for _ in range(8):  # saturated: 20 completions/s
        rate.completed(clock.now(), saturated=True)
        clock.advance(0.05)
    assert rate.rate(clock.now()) == pytest.approx(20.0)


def test_simultaneous_completions_of_a_batch_share_its_interval():
    clock = ManualClock()
    rate = ServiceRate(min_samples=8)
    rate.completed(clock.now(), saturated=True)
    for _ in range(2):
        clock.advance(1.0)
        for _ in range(4):  # a gang batch of 4 finishing at once, every second
            rate.completed(clock.now(), saturated=True)
    assert rate.rate(clock.now()) == pytest.approx(4.0)


def test_old_samples_age_out():
    clock = ManualClock()
    rate = ServiceRate(min_samples=2, max_age=30)
    for _ in range(5):
        rate.completed(clock.now(), saturated=True)
        clock.advance(1)
    assert rate.rate(clock.now()) == pytest.approx(1.0)
    clock.advance(60)
    assert rate.rate(clock.now()) is None


def test_refusal_names_the_predicted_wait_and_the_deadline():
    assert refusal(ahead=100, rate=20.0, remaining=None) is None  # no deadline
    assert refusal(ahead=0, rate=20.0, remaining=0.1) is None  # nothing ahead
    assert refusal(ahead=100, rate=None, remaining=0.1) is None  # no estimate yet
    assert refusal(ahead=100, rate=20.0, remaining=5.0) is None  # 5 s wait fits
    why = refusal(ahead=100, rate=20.0, remaining=2.0)
    assert why == ("predicted queue wait 5.00 s (100 requests ahead, served at 20.0/s) "
                   "plus 0.00 s in the engine exceeds the request's deadline of 2.00 s")  # fmt: skip


def test_refusal_counts_the_time_in_the_engine_after_the_queue():
    """Found by the chaos bench: under 10x overload with 120 requests in the engine, a
    request spends ~4.4 s in the engine; a bound on the queue wait alone accepted
    requests with 4 s of queue ahead, and 63% of calls then ran out their 5 s deadline."""
    assert refusal(ahead=80, rate=20.0, remaining=5.0) is None  # 4 s of queue fits 5 s
    why = refusal(ahead=80, rate=20.0, remaining=5.0, service=4.4)
    assert why is not None and "plus 4.40 s in the engine" in why


def test_service_time_is_the_recent_mean_once_there_are_enough_samples():
    rate = ServiceRate(window=8, max_age=10.0, min_samples=4)
    for i in range(3):
        rate.completed(float(i), saturated=True, service_seconds=2.0)
    assert rate.service_seconds(3.0) == 0.0  # too few: unknown, nothing added
    rate.completed(3.0, saturated=True, service_seconds=4.0)
    assert rate.service_seconds(3.0) == pytest.approx(2.5)
    assert rate.service_seconds(20.0) == 0.0  # aged out


class FakeClient:
    """Each complete_batch call waits until the test answers it."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[EngineRequest], asyncio.Future]] = []

    async def complete_batch(self, requests, *, timeout=None):
        fut = asyncio.get_running_loop().create_future()
        self.calls.append((list(requests), fut))
        return await fut


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)  # ok-sleep: a bare yield to the event loop; no time passes


async def test_overload_is_refused_at_once_when_the_predicted_wait_exceeds_the_deadline():
    """Issue 9: a 10,000-request queue (~40 s) let requests wait out their whole
    deadline; now the refusal comes at submit time, with the numbers."""
    clock = ManualClock()
    binner = FixedBinner(())
    former = BatchFormer(binner, clock, target_size=1, max_wait=0.0, max_queue=10_000)
    core = Core(HintPredictor(), binner, former, BatchSizer(mode="static", static_size=1, max_size=8))
    client = FakeClient()
    d = Dispatcher(core, client, clock, SidecarMetrics(), mode="gang", max_inflight_batches=1)
    params = SamplingParams(model="m", max_tokens=4)
    loop = asyncio.get_running_loop()

    def submit(i: int, deadline: float | None) -> Call:
        call = Call(EngineRequest(params=params, prompt=f"p{i}"), loop.create_future())
        d.submit(Request(id=str(i), arrival=clock.now(), max_tokens=4, deadline=deadline), call)
        return call

    calls = [submit(i, None) for i in range(100)]
    for i in range(40):  # one at a time, 0.1 s each: 10 completions/s, saturated
        d._step()
        await settle()
        clock.advance(0.1)
        client.calls[i][1].set_result([EngineResult("x", "length", 1, 4)])
        await settle()
    assert all(c.future.done() for c in calls[:40])
    d._step()
    assert d.core.former.queued() == 59  # one more is in flight
    # 59 ahead at 10/s: 5.9 s.  A 2 s deadline is refused at once, with the numbers
    with pytest.raises(Rejected) as refused:
        submit(1000, clock.now() + 2.0)
    assert refused.value.kind == "resource_exhausted"
    assert "predicted queue wait 5.90 s" in refused.value.message
    assert "deadline of 2.00 s" in refused.value.message
    assert d.totals["rejected"] == 1 and d.core.former.queued() == 59
    # a deadline the wait fits in is accepted
    submit(1001, clock.now() + 10.0)
    assert d.core.former.queued() == 60
    for _, fut in client.calls[40:]:
        fut.cancel()


def test_running_sums_equal_a_fresh_pass_over_the_window_after_evictions_and_age_outs():
    """The windows keep their sums as samples enter, are evicted (the window is
    full) and age out, so reading the rate and the mean service time costs O(1)
    per submit; they must equal the plain mean over what the window holds."""
    import random

    rng = random.Random(7)
    rate = ServiceRate(window=16, max_age=5.0, min_samples=1)
    t, last, kept = 0.0, None, []  # kept: (time, service, busy) as the old deques held them
    for i in range(2000):
        t += rng.choice((0.0, rng.random() * 0.3, 7.0 if i % 400 == 399 else 0.01))
        s = rng.random() * 3
        rate.completed(t, saturated=True, service_seconds=s)
        kept.append((t, s, None if last is None else max(0.0, t - last)))
        last = t
        window = [k for k in kept[-16:] if t - k[0] <= 5.0]
        services = [k[1] for k in window]
        assert rate.service_seconds(t) == pytest.approx(sum(services) / len(services), rel=1e-9, abs=1e-9)
        busy = [k[2] for k in kept[1:][-16:] if t - k[0] <= 5.0]
        expected = len(busy) / sum(busy) if busy and sum(busy) > 0 else None
        assert rate.rate(t) == (None if expected is None else pytest.approx(expected, rel=1e-6))
