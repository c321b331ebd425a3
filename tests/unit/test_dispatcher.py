"""The dispatcher with a fake engine client and a manual clock.

Tests drive the dispatcher one step at a time (``_step``) instead of running its
loop, so time moves only when the test advances the clock.
"""

from __future__ import annotations

import asyncio

import pytest

from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.former import BatchFormer
from binbatch_sidecar.core.kv_plan import KvPlan
from binbatch_sidecar.core.predictor import HintPredictor
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.core.scheduler import PROGRESS_LEARN
from binbatch_sidecar.core.sizer import BatchSizer, EngineSnapshot, SizeDecision
from binbatch_sidecar.engine.dispatcher import Call, Core, Dispatcher, Rejected
from binbatch_sidecar.engine.engine_client import EngineError, EngineRequest, EngineResult, SamplingParams, StreamDelta
from binbatch_sidecar.engine.sidecar_metrics import SidecarMetrics


class FakeClient:
    """Each complete_batch call waits until the test answers it."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[EngineRequest], asyncio.Future]] = []
        self.called = asyncio.Event()

    async def complete_batch(self, requests, *, timeout=None):
        fut = asyncio.get_running_loop().create_future()
        self.calls.append((list(requests), fut))
        self.called.set()
        return await fut

    def answer(self, i: int, tokens: int | None = None, error: EngineError | None = None) -> None:
        reqs, fut = self.calls[i]
        fut.set_result(
            [error or EngineResult("x" * 3, "length", 5, tokens or r.params.max_tokens) for r in reqs]
        )


def make(mode="gang", static=2, k=1, max_wait=1.0, max_inflight=2, max_queue=100, sizing="static", clock=None):
    clock = clock or ManualClock()
    binner = FixedBinner.uniform(k, 1, 100) if k > 1 else FixedBinner(())
    former = BatchFormer(binner, clock, target_size=static, max_wait=max_wait, max_queue=max_queue)
    sizer = BatchSizer(mode=sizing, static_size=static, max_size=256, min_samples=4)
    core = Core(HintPredictor(), binner, former, sizer)
    client = FakeClient()
    d = Dispatcher(core, client, clock, SidecarMetrics(), mode=mode, max_inflight_batches=max_inflight)
    return d, client, clock


def submit(d: Dispatcher, i: int, max_tokens: int = 10, deadline: float | None = None) -> tuple[Request, Call]:
    params = SamplingParams(model="m", max_tokens=max_tokens)
    req = Request(id=str(i), arrival=d.clock.now(), max_tokens=max_tokens, deadline=deadline)
    call = Call(EngineRequest(params=params, prompt=f"p{i}"), asyncio.get_running_loop().create_future())
    d.submit(req, call)
    return req, call


async def settle() -> None:
    """Let spawned engine tasks run up to their next await."""
    for _ in range(5):
        await asyncio.sleep(0)  # ok-sleep: a bare yield to the event loop; no time passes


async def test_full_gang_batch_dispatches_once_and_resolves_every_member():
    d, client, _ = make(static=2)
    (_, c1), (_, c2) = submit(d, 1, 7), submit(d, 2, 9)
    d._step()
    await settle()
    assert len(client.calls) == 1 and [r.prompt for r in client.calls[0][0]] == ["p1", "p2"]
    client.answer(0)
    r1, r2 = await c1.future, await c2.future
    assert (r1.result.completion_tokens, r2.result.completion_tokens) == (7, 9)
    assert r1.batch_size == r2.batch_size == 2
    assert d.totals["completed"] == 2


async def test_gang_holds_at_most_max_inflight_batches():
    d, client, _ = make(static=1, max_inflight=2)
    calls = [submit(d, i)[1] for i in range(3)]
    d._step()
    await settle()
    assert len(client.calls) == 2
    client.answer(0)
    await calls[0].future
    await settle()
    d._step()
    await settle()
    assert len(client.calls) == 3


async def test_partial_batch_waits_for_max_wait_then_goes():
    d, client, clock = make(static=4, max_wait=1.0)
    _, call = submit(d, 1)
    d._step()
    await settle()
    assert client.calls == []
    clock.advance(1.0)
    d._step()
    await settle()
    assert len(client.calls) == 1
    client.answer(0)
    assert (await call.future).batch_size == 1


async def test_continuous_admits_up_to_the_target_size_and_releases_per_request():
    d, client, _ = make(mode="continuous", static=2, max_wait=0.0)
    calls = [submit(d, i)[1] for i in range(3)]
    d._step()
    await settle()
    assert len(client.calls) == 2  # one engine call per request, two in flight
    assert d.inflight_requests == 2
    client.answer(0)
    await calls[0].future
    await settle()
    d._step()
    await settle()
    assert len(client.calls) == 3


async def test_cancelled_request_never_reaches_the_engine():
    d, client, clock = make(static=2)
    req, call = submit(d, 1)
    d.cancel(req)
    with pytest.raises(Rejected) as err:
        await call.future
    assert err.value.kind == "cancelled"
    clock.advance(5)
    d._step()
    await settle()
    assert client.calls == []
    assert d.totals["cancelled"] == 1


async def test_deadline_expires_a_queued_request():
    d, client, clock = make(static=4, max_wait=10.0)
    _, call = submit(d, 1, deadline=0.5)
    clock.advance(0.5)
    d._step()
    with pytest.raises(Rejected) as err:
        await call.future
    assert err.value.kind == "deadline"
    assert d.core.former.queued() == 0 and client.calls == []


async def test_engine_error_fails_only_its_callers():
    d, client, clock = make(static=1, max_inflight=2)
    _, bad = submit(d, 1)
    _, good = submit(d, 2)
    d._step()
    await settle()
    client.answer(0, error=EngineError("invalid", 400, "prompt too long"))
    client.answer(1)
    with pytest.raises(EngineError):
        await bad.future
    assert (await good.future).result.completion_tokens == 10
    assert d.totals["failed"] == 1 and d.totals["completed"] == 1


async def test_full_queue_is_rejected_at_once():
    d, _, _ = make(static=8, max_queue=2)
    submit(d, 1), submit(d, 2)
    with pytest.raises(Rejected) as err:
        submit(d, 3)
    assert err.value.kind == "resource_exhausted"


async def test_fresh_metrics_set_memory_sizes_and_record_the_adjustment():
    d, client, _ = make(static=2, sizing="memory", max_inflight=8)
    for i in range(4):  # min_samples completions to warm the length statistics
        submit(d, i, 10)
    d._step()
    await settle()
    for i in range(len(client.calls)):
        client.answer(i)
    await settle()
    decision = d.on_snapshot(EngineSnapshot(kv_capacity_tokens=1000, kv_usage_ratio=0.1, running=0, fresh=True))
    assert decision.reason == "memory"
    assert d.core.former.target_sizes[0] == decision.sizes[0] > 2
    assert d.adjustments[-1].field == "batchSize"


async def test_stale_metrics_never_grow_the_batch_and_fall_back_to_the_static_size():
    d, _, _ = make(static=8, sizing="memory")
    before = d.core.former.target_sizes[0]
    assert d.on_snapshot(EngineSnapshot(fresh=False)).reason == "stale-static"
    assert d.core.former.target_sizes[0] == before == 8
    assert d.metrics.sizer_fallback.labels("static")._value.get() == 1


async def test_drain_past_the_grace_period_ends_leftovers_unavailable():
    d, client, _ = make(static=1, max_inflight=1)
    runner = asyncio.ensure_future(d.run())
    calls = [submit(d, i)[1] for i in range(2)]
    await client.called.wait()
    cut = await d.drain(grace=0.05)
    assert cut == 2
    for call in calls:
        with pytest.raises(Rejected) as err:
            await call.future
        assert err.value.kind == "unavailable"
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner


async def test_replace_core_keeps_queued_requests():
    d, client, clock = make(static=4, max_wait=10.0)
    calls = [submit(d, i)[1] for i in range(3)]
    new_d, _, _ = make(static=3, max_wait=10.0, clock=clock)
    d.replace_core(new_d.core, mode="gang", max_inflight_batches=2, engine_timeout=None)
    d._step()
    await settle()
    assert len(client.calls) == 1 and len(client.calls[0][0]) == 3  # full under the new size
    client.answer(0)
    assert [(await c.future).batch_size for c in calls] == [3, 3, 3]


async def test_request_cancelled_after_admission_before_its_first_step_releases_its_slot():
    """Defect 1: the engine task was cancelled before it ever ran, so its ``finally``
    never released the slot; with B = 1 the sidecar then served nothing more."""
    d, client, _ = make(mode="continuous", static=1, max_wait=0.0)
    req, call = submit(d, 1)
    d._step()  # admitted: its engine task exists but has not run a single step
    assert d.inflight_requests == 1 and client.calls == []
    d.cancel(req)
    await settle()
    assert d.inflight_requests == 0
    assert (d.ledger.requests_in(0), d.ledger.held()) == (0, [])
    with pytest.raises(Rejected):
        await call.future
    _, nxt = submit(d, 2)
    d._step()
    await settle()
    assert len(client.calls) == 1  # the one slot is free again: the next request is served
    client.answer(0)
    assert (await nxt.future).result.completion_tokens == 10


async def test_drain_after_an_early_cancel_finishes_at_once_and_cuts_nothing():
    """Defect 1's consequence: a leaked slot made SIGTERM wait the whole grace and
    report a request "cut off" that no caller was waiting for (exit code 1)."""
    d, client, _ = make(mode="continuous", static=1, max_wait=0.0)
    req, _ = submit(d, 1)
    d._step()
    d.cancel(req)  # before the admitted task's first step
    runner = asyncio.ensure_future(d.run())
    cut = await asyncio.wait_for(d.drain(grace=30.0), timeout=5.0)
    assert cut == 0 and client.calls == []
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner


async def test_drain_counts_only_requests_it_ended():
    d, client, _ = make(mode="continuous", static=1, max_wait=0.0)
    runner = asyncio.ensure_future(d.run())
    (_, first), (late, second) = submit(d, 1), submit(d, 2)
    await client.called.wait()
    d.cancel(late)  # waiting for admission; its caller already has its answer
    cut = await d.drain(grace=0.01)
    assert cut == 1
    assert isinstance(first.future.exception(), Rejected) and second.future.exception().kind == "cancelled"
    assert (d.inflight_requests, d.pending_requests()) == (0, 0)
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner


@pytest.mark.parametrize("mode", ["continuous", "gang"])
async def test_every_outstanding_request_is_counted_queued_pending_or_in_flight(mode):
    """Defect 11: requests taken from their bins but not yet admitted were in no
    figure (500 outstanding showed 256 in flight and 0 queued)."""
    d, client, _ = make(mode=mode, static=4, k=2, max_wait=10.0, max_inflight=1)
    calls = [submit(d, i, max_tokens=10 if i % 3 else 90)[1] for i in range(15)]
    d._step()
    await settle()
    queued = sum(d.core.former.bin_depths())
    pending = d.pending_requests()
    assert client.calls and queued and pending  # each place holds some
    assert queued + pending + d.inflight_requests == len(calls)


async def test_batch_size_changes_are_logged_once_per_interval_unless_the_reason_changes(caplog):
    """Defect 12: under load the size moved on every scrape and each move was an INFO line."""
    d, _, clock = make(static=8, sizing="static")
    sizes = iter(range(2, 200))

    def update(snapshot, k, observed_batch=None):
        return SizeDecision(sizes=[next(sizes)] * k, reason=reason, detail="test", b_mem=[None] * k, b_sla=None)

    d.core.sizer.update = update  # type: ignore[method-assign]
    reason = "memory"
    with caplog.at_level("DEBUG", logger="binbatch.dispatcher"):
        for _ in range(40):  # 20 s of scrapes every 0.5 s, each a new size
            d.on_snapshot(None)
            clock.advance(0.5)
        reason = "stale-metrics"
        d.on_snapshot(None)
    info = [r for r in caplog.records if r.levelname == "INFO" and "batchSize" in r.getMessage()]
    debug = [r for r in caplog.records if r.levelname == "DEBUG" and "batchSize" in r.getMessage()]
    assert len(info) == 2 and "stale-metrics" in info[-1].getMessage()
    assert "39 more changes" in info[-1].getMessage() and len(debug) == 39
    assert len(d.adjustments) == 32  # Stats still keeps every recent change


async def test_gauges_read_the_queue_and_the_engine_as_they_are_when_scraped():
    """The depth, pending and in-flight gauges are read at scrape time (the loop no
    longer writes them on every pass): a scrape sees the state of that moment, and
    a bin a reload removed reads 0 rather than its last depth."""
    d, client, clock = make(mode="continuous", static=2, k=2, max_wait=10.0)
    reg = d.metrics.registry

    def value(name: str, **labels: str) -> float | None:
        return reg.get_sample_value(name, labels)

    for i in range(3):
        submit(d, i, max_tokens=90)  # bin 1 of 2; two of them form a full batch at once
    assert [value("binbatch_queue_depth", bin=b) for b in "01"] == [0, 1]
    assert value("binbatch_pending_requests") == 2 and value("binbatch_inflight_requests") == 0
    d._step()
    await settle()
    assert value("binbatch_inflight_requests") == 2 and value("binbatch_pending_requests") == 0
    client.answer(0)
    await settle()
    assert value("binbatch_inflight_requests") == 1
    assert value("binbatch_requests_total", outcome="completed") == 1
    new_d, _, _ = make(mode="continuous", static=2, k=1, max_wait=10.0, clock=clock)
    d.replace_core(new_d.core, mode="continuous", max_inflight_batches=2, engine_timeout=None)
    assert value("binbatch_queue_depth", bin="1") == 0  # bin 1 is gone: no stale depth
    assert value("binbatch_queue_depth", bin="0") == d.core.former.bin_depths()[0] == 1


async def test_wakeup_wakes_once_for_several_sets_and_times_out_without_one():
    from binbatch_sidecar.engine.dispatcher import Wakeup

    w = Wakeup()
    w.set()
    w.set()
    await asyncio.wait_for(w.wait(None), 1)  # already set: returns at once
    w.clear()
    waiter = asyncio.ensure_future(w.wait(None))
    await settle()
    assert not waiter.done()
    w.set()
    await asyncio.wait_for(waiter, 1)
    w.clear()
    await asyncio.wait_for(w.wait(0.001), 1)  # the armed timeout ends the wait (a real 1 ms)


class StreamingClient(FakeClient):
    """Also streams: two chunks of progress (3 then 7 tokens of a 40-token prompt), then the answer."""

    def __init__(self) -> None:
        super().__init__()
        self.progress_seen: list[tuple[int | None, int | None]] = []
        self.streamed: list[EngineRequest] = []

    async def stream(self, request, *, timeout=None, on_progress=None):
        self.streamed.append(request)
        for generated, piece in ((3, "ab"), (7, "cd")):
            on_progress(generated, 40)
            yield StreamDelta(piece)
        (result,) = await self.complete_batch([request])
        yield result


async def test_with_the_kv_plan_a_unary_call_streams_so_the_plan_sees_its_progress_and_is_reassembled():
    clock = ManualClock()
    binner = FixedBinner(())
    former = BatchFormer(binner, clock, target_size=4, max_wait=0.0, max_queue=100)
    core = Core(HintPredictor(), binner, former, BatchSizer(mode="static", static_size=4), kv_plan=KvPlan())
    client = StreamingClient()
    d = Dispatcher(core, client, clock, SidecarMetrics(), mode="continuous")
    req, call = submit(d, 1, max_tokens=10)  # unary: no deltas queue
    d._step()
    await settle()
    assert client.streamed == [call.engine_request] and (req.engine_generated, req.engine_prompt_tokens) == (7, 40)
    reqs, fut = client.calls[0]
    fut.set_result([EngineResult("abcd", "length", 40, 10)])
    done = await call.future
    assert (done.result.text, done.result.completion_tokens) == ("abcd", 10)


async def test_the_kv_plans_budget_and_shared_prompt_are_published_at_each_snapshot():
    """``binbatch_kv_plan_budget_tokens``: -1 until the engine's cache is known, then
    the budget; ``binbatch_kv_plan_shared_prompt_tokens``: what the plan holds once
    for the prompts vLLM's prefix cache shares, out of that budget."""
    clock = ManualClock()
    binner = FixedBinner(())
    former = BatchFormer(binner, clock, target_size=4, max_wait=0.0, max_queue=100)
    plan = KvPlan()
    core = Core(HintPredictor(), binner, former, BatchSizer(mode="static", static_size=4), kv_plan=plan)
    d = Dispatcher(core, StreamingClient(), clock, SidecarMetrics(), mode="continuous")
    reg = d.metrics.registry
    d.on_snapshot(EngineSnapshot(fresh=False))
    assert reg.get_sample_value("binbatch_kv_plan_budget_tokens") == -1
    plan.block = 32
    plan.observe_usage(1152, [(864, 800)] * 4)  # four sequences of an 800-token prompt, 768 of it shared
    d.on_snapshot(EngineSnapshot(kv_capacity_tokens=4096, kv_block_tokens=32, fresh=True))
    assert reg.get_sample_value("binbatch_kv_plan_shared_prompt_tokens") == 768
    assert reg.get_sample_value("binbatch_kv_plan_budget_tokens") == 4096 - 768


async def test_the_kv_plan_asks_for_an_early_scrape_while_it_holds_requests_it_may_learn_to_fit():
    """While the plan has no estimate of the prompt blocks vLLM's prefix cache shares
    and holds requests back, the first chunk that makes two in flight past their
    prefill asks the metrics feed for a scrape now (``Scheduler.usage_wanted``);
    once it has one, no more."""
    clock = ManualClock()
    binner = FixedBinner(())
    former = BatchFormer(binner, clock, target_size=8, max_wait=0.0, max_queue=100)
    plan = KvPlan(capacity=25.0, block=0)  # two 10-token answers fit, a third waits
    core = Core(HintPredictor(), binner, former, BatchSizer(mode="static", static_size=8), kv_plan=plan)
    d = Dispatcher(core, StreamingClient(), clock, SidecarMetrics(), mode="continuous")
    asked: list[int] = []
    d.scrape_soon = lambda: asked.append(sum(r.engine_generated is not None for r, _ in d._calls.items()))
    for i in range(3):
        submit(d, i, max_tokens=10)
    d._step()
    await settle()
    assert d.inflight_requests == 2 and d.pending_requests() == 1
    assert asked == [2]  # at the second one's first chunk, not the first's, and not at later chunks
    assert d.scheduler.usage_wanted()
    plan.observe_usage(20.0, [(10.0, 5.0)] * 2)  # the engine showed what they share (here nothing)
    assert not d.scheduler.usage_wanted()


async def test_a_unary_call_streams_only_while_the_kv_plan_wants_its_progress():
    clock = ManualClock()
    binner = FixedBinner(())
    former = BatchFormer(binner, clock, target_size=8, max_wait=0.0, max_queue=100)
    plan = KvPlan(capacity=1000.0, block=0)
    core = Core(HintPredictor(), binner, former, BatchSizer(mode="static", static_size=8), kv_plan=plan)
    client = StreamingClient()
    d = Dispatcher(core, client, clock, SidecarMetrics(), mode="continuous")
    plan.prompts_seen = PROGRESS_LEARN - 1  # still learning the engine's prompt count: it streams
    learning, _ = submit(d, 1, max_tokens=10)
    d._step()
    await settle()
    assert learning.progress_read and len(client.streamed) == 1
    plan.prompts_seen = PROGRESS_LEARN  # learned; 10 + 10 tokens in flight of a 1,000 budget: a whole answer
    quiet, _ = submit(d, 2, max_tokens=10)
    d._step()
    await settle()
    assert not quiet.progress_read and len(client.streamed) == 1 and len(client.calls) == 2
    # one that could take the in-flight to over half the budget streams, and so do those after it
    for i, tokens in ((3, 600), (4, 10)):
        loud, _ = submit(d, i, max_tokens=tokens)
        d._step()
        await settle()
        assert loud.progress_read
    assert len(client.streamed) == 3 and len(client.calls) == 4


async def test_without_the_kv_plan_a_unary_continuous_call_is_one_whole_answer():
    d, client, _ = make(mode="continuous", static=4, max_wait=0.0)
    d.client = StreamingClient()
    _, call = submit(d, 1)
    d._step()
    await settle()
    assert d.client.streamed == [] and len(d.client.calls) == 1
