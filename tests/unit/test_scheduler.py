"""The core Scheduler on its own: no event loop, time passed in.

These are the decisions the dispatcher used to make inside asyncio; here they are
driven call by call, as the simulator drives them.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.former import BatchFormer
from binbatch_sidecar.core.predictor import HintPredictor
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.core.scheduler import Core, Outcome, Rejected, Scheduler
from binbatch_sidecar.core.sizer import BatchSizer, EngineSnapshot

OK = Outcome(completion_tokens=5.0, prompt_tokens=3.0)
REFUSED = Outcome(unavailable=True, sent=False, outage="connection refused")


def make(mode="gang", size=2, k=1, max_wait=1.0, inflight=1, max_queue=100, sizing="static"):
    clock = ManualClock()
    binner = FixedBinner.uniform(k, 1, 100) if k > 1 else FixedBinner(())
    former = BatchFormer(binner, clock, target_size=size, max_wait=max_wait, max_queue=max_queue)
    sizer = BatchSizer(mode=sizing, static_size=size, max_size=256, min_samples=4)
    return Scheduler(Core(HintPredictor(), binner, former, sizer), clock, mode=mode, max_inflight_batches=inflight), clock


def req(i: int, clock: ManualClock, tokens: int = 10, deadline: float | None = None) -> Request:
    return Request(id=str(i), arrival=clock.now(), max_tokens=tokens, hint_tokens=tokens, deadline=deadline)


def ids(step) -> list[list[str]]:
    return [[r.id for r in d.requests] for d in step.dispatches]


def test_gang_dispatches_full_batches_up_to_the_inflight_limit():
    s, clock = make(size=2, inflight=1)
    rs = [req(i, clock) for i in range(4)]
    for r in rs:
        s.submit(r)
    first = s.step(clock.now())
    assert ids(first) == [["0", "1"]] and s.inflight_batches == 1 and s.inflight_requests == 2
    assert ids(s.step(clock.now())) == []  # the one batch slot is held
    for r in rs[:2]:
        assert s.complete(r, OK, clock.now()) == "completed"
    assert s.release(first.dispatches[0].slot, clock.now()) == ([], True)
    assert ids(s.step(clock.now())) == [["2", "3"]]


def test_continuous_admits_one_request_per_call_up_to_the_bins_target():
    s, clock = make(mode="continuous", size=2, max_wait=0.0)
    rs = [req(i, clock) for i in range(3)]
    for r in rs:
        s.submit(r)
    step = s.step(clock.now())
    assert ids(step) == [["0"], ["1"]] and s.inflight_requests == 2 and s.pending_requests() == 1
    s.complete(rs[0], OK, clock.now())
    s.release(step.dispatches[0].slot, clock.now())
    assert ids(s.step(clock.now())) == [["2"]]


def test_refusals_draining_queue_full_breaker_open_and_predicted_wait():
    s, clock = make(max_queue=1)
    s.submit(req(0, clock))
    with pytest.raises(Rejected) as full:
        s.submit(req(1, clock))
    assert full.value.kind == "resource_exhausted" and s.totals["rejected"] == 1
    s.on_engine_health(False, clock.now())
    with pytest.raises(Rejected) as down:
        s.submit(req(2, clock))  # no deadline: not held for the engine's return
    assert down.value.kind == "unavailable"
    s.start_drain()
    with pytest.raises(Rejected, match="shutting down"):
        s.submit(req(3, clock, deadline=10.0))
    assert s.totals["rejected"] == 2  # draining refusals are not counted as rejected


def test_a_request_the_engine_never_received_is_queued_again_and_its_old_call_leaves_it():
    s, clock = make(mode="continuous", size=1, max_wait=0.0)
    r = req(0, clock, deadline=30.0)
    s.submit(r)
    first = s.step(clock.now()).dispatches[0]
    assert s.complete(r, REFUSED, clock.now()) == "requeued"
    assert s.breaker.state == "open" and s.is_open(r)
    assert s.release(first.slot, clock.now()) == ([], True)  # not an orphan of the old call
    assert s.step(clock.now()).dispatches == []  # held while the breaker is open
    s.on_engine_health(True, clock.now())
    again = s.step(clock.now()).dispatches
    assert [d.requests for d in again] == [(r,)]
    assert s.complete(r, OK, clock.now()) == "completed" and s.breaker.state == "closed"


def test_a_call_that_ends_without_answers_leaves_its_requests_to_the_driver_once():
    s, clock = make(size=2)
    rs = [req(i, clock) for i in range(2)]
    for r in rs:
        s.submit(r)
    d = s.step(clock.now()).dispatches[0]
    s.complete(rs[0], OK, clock.now())
    orphans, released = s.release(d.slot, clock.now())
    assert orphans == [rs[1]] and released
    assert s.release(d.slot, clock.now()) == ([], False)  # released once only
    assert s.end(rs[1], "failed") and not s.end(rs[1], "failed")
    assert s.totals["completed"] == 1 and s.totals["failed"] == 1 and s.idle()


def test_expired_and_cancelled_requests_end_once_and_are_never_dispatched():
    s, clock = make(size=5, max_wait=10.0)
    a, b = req(0, clock, deadline=1.0), req(1, clock)
    s.submit(a)
    s.submit(b)
    assert s.cancel(b, clock.now()) == "cancelled" and s.cancel(b, clock.now()) is None
    clock.advance(2.0)
    step = s.step(clock.now())
    assert step.expired == [a] and step.dispatches == []
    assert s.totals["expired"] == 1 and s.totals["cancelled"] == 1 and s.idle()


def test_a_snapshot_sets_sizes_and_reports_the_change():
    s, clock = make(mode="continuous", size=4, sizing="memory")
    for i in range(8):  # enough completions for the length statistics
        r = req(i, clock)
        s.submit(r)
    while s.pending_requests() or s.core.former.queued():
        for d in s.step(clock.now()).dispatches:
            for r in d.requests:
                s.complete(r, Outcome(completion_tokens=100.0, prompt_tokens=100.0), clock.now())
            s.release(d.slot, clock.now())
        clock.advance(1.0)
    decision, changes = s.on_snapshot(EngineSnapshot(kv_capacity_tokens=3000.0, running=0, fresh=True), clock.now())
    assert decision.reason == "memory" and decision.sizes == [3000 // 200]  # σ = 0: b_mem = η / μ
    assert [c.field for c in changes] == ["batchSize"] and changes[0].old == "[4]"
    assert s.core.former.target_sizes == tuple(decision.sizes)


OPS = st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 100), st.one_of(st.none(), st.floats(0.1, 3.0))),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("step")),
    st.tuples(st.just("advance"), st.floats(0.05, 2.0)),
    st.tuples(st.just("answer"), st.integers(0, 50), st.sampled_from(["ok", "error", "refused", "none"])),
    st.tuples(st.just("probe"), st.booleans()),
    st.tuples(st.just("resize"), st.integers(1, 3)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["gang", "continuous"]), k=st.integers(1, 3), size=st.integers(1, 3),
    inflight=st.integers(1, 3), program=st.lists(OPS, min_size=10, max_size=80),
)  # fmt: skip
def test_every_accepted_request_ends_exactly_once_and_the_ledger_returns_to_zero(mode, k, size, inflight, program):
    s, clock = make(mode=mode, size=size, k=k, inflight=inflight, max_queue=20)
    accepted: list[Request] = []
    calls: list = []  # dispatches not yet released
    ended: dict[Request, int] = {}

    def end(r: Request, outcome: str) -> None:
        if s.end(r, outcome):
            ended[r] = ended.get(r, 0) + 1

    def answer(i: int, how: str) -> None:
        d = calls.pop(i % len(calls))
        outcome = {"ok": OK, "error": Outcome(), "refused": REFUSED}.get(how)
        for r in d.requests:
            if outcome is not None:
                verdict = s.complete(r, outcome, clock.now())
                if verdict in ("completed", "failed"):
                    ended[r] = ended.get(r, 0) + 1
        orphans, released = s.release(d.slot, clock.now())
        assert released
        for r in orphans:
            end(r, "failed")

    def step() -> None:
        out = s.step(clock.now())
        for r in out.expired:
            ended[r] = ended.get(r, 0) + 1
        calls.extend(out.dispatches)

    for op in program:
        match op:
            case ("submit", tokens, deadline):
                r = req(len(accepted), clock, tokens, None if deadline is None else clock.now() + deadline)
                try:
                    s.submit(r)
                except Rejected:
                    continue
                accepted.append(r)
            case ("cancel", i) if accepted:
                r = accepted[i % len(accepted)]
                if s.cancel(r, clock.now()) is not None:
                    ended[r] = ended.get(r, 0) + 1
            case ("step",):
                step()
            case ("advance", dt):
                clock.advance(dt)
            case ("answer", i, how) if calls:
                answer(i, how)
            case ("probe", ok):
                s.on_engine_health(ok, clock.now())
            case ("resize", n):
                s.core.former.set_target_sizes(n)
    s.on_engine_health(True, clock.now())
    s.on_engine_health(True, clock.now())
    for _ in range(500):
        step()
        while calls:
            answer(0, "ok")
        clock.advance(1.0)
        if s.idle():
            break
    assert all(ended.get(r) == 1 for r in accepted), "each accepted request ends exactly once"
    assert sum(ended.values()) == len(accepted) == s.totals["accepted"]
    assert (s.inflight_requests, s.inflight_batches, s.held(), s.pending_requests()) == (0, 0, [], 0)


# -- gang mode: a partial batch waits for a free slot (issue 11 item 5) ----------------


def _finish(s: Scheduler, step, clock: ManualClock) -> None:
    for d in step.dispatches:
        for r in d.requests:
            s.complete(r, OK, clock.now())
        s.release(d.slot, clock.now())


def test_gang_partial_batch_is_not_cut_while_every_slot_is_busy_and_fills_meanwhile():
    """Cutting a due bin at its due time queued a batch of one behind the busy
    slot; it now stays in its bin, takes what arrives, and leaves when a slot frees."""
    s, clock = make(size=3, max_wait=1.0, inflight=1)
    for i in range(3):
        s.submit(req(i, clock))
    busy = s.step(clock.now())
    assert ids(busy) == [["0", "1", "2"]]
    s.submit(req(3, clock))
    clock.advance_to(1.5)  # request 3 waited past max_wait; the slot is still busy
    assert ids(s.step(clock.now())) == []
    assert s.next_wake() is None  # a slot's release wakes the driver, not a due time
    assert s.saturated()  # a due bin waits for engine capacity
    s.submit(req(4, clock))  # joins request 3 in its bin
    clock.advance_to(2.0)
    _finish(s, busy, clock)
    partial = s.step(clock.now())
    assert ids(partial) == [["3", "4"]] and partial.batches[0].reason == "timeout"


def test_gang_free_slot_cuts_a_due_partial_batch_at_its_due_time():
    s, clock = make(size=3, max_wait=1.0, inflight=1)
    s.submit(req(0, clock))
    assert ids(s.step(clock.now())) == []
    assert s.next_wake() == 1.0
    clock.advance_to(1.0)
    assert ids(s.step(clock.now())) == [["0"]]


def test_gang_full_batch_completed_first_goes_before_a_partial_due_later():
    s, clock = make(size=2, k=2, max_wait=1.0, inflight=1)
    short, long_ = 10, 90
    for i in range(2):
        s.submit(req(i, clock, short))
    busy = s.step(clock.now())
    s.submit(req(2, clock, long_))  # partial, due at 1.0
    clock.advance_to(0.5)
    for i in (3, 4):
        s.submit(req(i, clock, short))  # full at 0.5: completed before the partial is due
    clock.advance_to(2.0)
    _finish(s, busy, clock)
    first = s.step(clock.now())
    assert ids(first) == [["3", "4"]]
    _finish(s, first, clock)
    assert ids(s.step(clock.now())) == [["2"]]


def test_gang_completed_batch_goes_before_a_partial_due_earlier_and_the_partial_keeps_filling():
    """A burst still arriving (slower than max_wait on a busy machine): the long bin
    is due before the short bin's next batch completes; serving the partial long
    batch first would cost a third long batch once the rest of its bin arrives."""
    s, clock = make(size=2, k=2, max_wait=1.0, inflight=1)
    for i in range(2):
        s.submit(req(i, clock, 10))
    busy = s.step(clock.now())
    s.submit(req(2, clock, 90))  # due at 1.0
    clock.advance_to(1.5)
    for i in (3, 4):
        s.submit(req(i, clock, 10))  # full at 1.5
    clock.advance_to(2.0)
    _finish(s, busy, clock)
    first = s.step(clock.now())
    assert ids(first) == [["3", "4"]]
    s.submit(req(5, clock, 90))  # the long bin fills meanwhile
    _finish(s, first, clock)
    step = s.step(clock.now())
    assert ids(step) == [["2", "5"]] and step.batches[0].reason == "full"


def test_gang_higher_priority_partial_goes_before_a_full_batch():
    s, clock = make(size=2, k=2, max_wait=1.0, inflight=1)
    for i in range(2):
        s.submit(req(i, clock, 10))
    busy = s.step(clock.now())
    urgent = req(2, clock, 90)
    urgent.priority = 5
    s.submit(urgent)
    for i in (3, 4):
        s.submit(req(i, clock, 10))
    clock.advance_to(2.0)
    _finish(s, busy, clock)
    assert ids(s.step(clock.now())) == [["2"]]


def test_gang_request_whose_ttft_slo_says_go_leaves_when_a_slot_frees():
    s, clock = make(size=3, max_wait=None, inflight=1)
    for i in range(3):
        s.submit(req(i, clock))
    busy = s.step(clock.now())
    urgent = req(3, clock)
    urgent.send_by = 0.2
    s.submit(urgent)
    clock.advance_to(0.5)
    assert ids(s.step(clock.now())) == []  # no slot: it waits in its bin
    s.submit(req(4, clock))
    _finish(s, busy, clock)
    step = s.step(clock.now())
    assert ids(step) == [["3", "4"]] and step.batches[0].reason == "slo"


def test_continuous_mode_still_cuts_due_partial_batches_at_their_due_time():
    """The continuous path keeps its rule: a due bin is cut by poll into the service queue."""
    s, clock = make(mode="continuous", size=3, max_wait=1.0)
    s.submit(req(0, clock))
    clock.advance_to(1.0)
    s.core.former.poll()
    assert s.core.former.ready_batches() == 1 and s.core.former.bin_depths() == [0]


def test_gang_due_partial_batch_takes_shorter_bins_requests_along():
    """The tail of a burst: a long bin's partial batch and a short bin's each held
    the one slot for a batch; the long batch now carries the short requests (they
    end before its longest one), one slot-hold instead of two."""
    s, clock = make(size=4, k=4, max_wait=1.0, inflight=1)
    for i in range(4):
        s.submit(req(i, clock, 90))
    busy = s.step(clock.now())
    s.submit(req(4, clock, 10))  # bin 0
    s.submit(req(5, clock, 60))  # bin 2
    s.submit(req(6, clock, 95))  # bin 3, timed out last
    clock.advance_to(2.0)
    _finish(s, busy, clock)
    step = s.step(clock.now())
    assert ids(step) == [["6", "5", "4"]]
    assert step.batches[0].bin == 3 and s.core.former.queued() == 0


def test_gang_top_up_never_exceeds_the_batch_size_and_takes_the_nearest_bin_first():
    s, clock = make(size=2, k=4, max_wait=1.0, inflight=1)
    for i in range(2):
        s.submit(req(i, clock, 90))
    busy = s.step(clock.now())
    s.submit(req(2, clock, 10))  # bin 0
    s.submit(req(3, clock, 60))  # bin 2
    s.submit(req(4, clock, 95))  # bin 3
    clock.advance_to(2.0)
    _finish(s, busy, clock)
    first = s.step(clock.now())
    assert ids(first) == [["4", "3"]]
    _finish(s, first, clock)
    assert ids(s.step(clock.now())) == [["2"]]


# -- nothing to win: maxWait does not hold a continuous request while the engine has room (issue 11)


def test_continuous_sends_a_lone_request_at_once_while_the_engine_has_room():
    # maxWait gathers a gang batch; a continuous engine batches by itself, so a
    # request held 50 ms in a bin at light load was 50 ms of added latency.
    s, clock = make(mode="continuous", size=4, k=2, max_wait=0.05)
    s.submit(req(0, clock, tokens=10))
    step = s.step(clock.now())
    assert ids(step) == [["0"]] and [b.reason for b in step.batches] == ["room"]
    clock.advance(0.001)
    s.submit(req(1, clock, tokens=90))  # the other bin, one request in flight: still room
    assert ids(s.step(clock.now())) == [["1"]]


def test_continuous_holds_requests_when_the_engine_is_at_its_target():
    s, clock = make(mode="continuous", size=2, max_wait=0.05)
    for i in range(2):
        s.submit(req(i, clock))
    assert ids(s.step(clock.now())) == [["0"], ["1"]]
    s.submit(req(2, clock))
    assert ids(s.step(clock.now())) == [] and s.core.former.bin_depths() == [1]  # no room: it waits in its bin


def test_take_partial_serves_the_bin_whose_oldest_request_came_first():
    clock = ManualClock()
    former = BatchFormer(FixedBinner.uniform(2, 1, 100), clock, target_size=4, max_wait=1.0, max_queue=10)
    first = req(0, clock, tokens=90)  # the long bin
    first.predicted_tokens = 90.0
    former.submit(first)
    clock.advance(0.01)
    second = req(1, clock, tokens=10)  # the short bin, later
    second.predicted_tokens = 10.0
    former.submit(second)
    batch = former.take_partial()
    assert batch is not None and batch.requests == [first] and batch.reason == "room"
    assert former.take_partial().requests == [second]
    assert former.take_partial() is None


# -- bins.mode Auto in gang mode: a burst is binned by its own predicted lengths --------


def _gang_burst(bins_mode: str, seed: int) -> tuple[list[list[int]], tuple[float, ...]]:
    """A burst of 64 hinted requests (75% short, 25% long) through a gang sidecar's
    core built from its config, on the seed's one-server model; returns each
    dispatched batch's lengths and the boundaries the binner held when the last
    request arrived (before anything completed)."""
    import random

    from binbatch_sidecar.config import parse_config
    from binbatch_sidecar.server.assembly import build_core
    from binbatch_sidecar.sim.engine_model import BatchServers
    from binbatch_sidecar.sim.simulator import drive

    cfg = parse_config({
        "predictor": {"kind": "Hint"}, "bins": {"mode": bins_mode, "count": 4, "maxOutputTokens": 100},
        "batch": {"mode": "Gang", "sizing": "Static", "staticSize": 8, "maxWaitMilliseconds": 200, "maxInflightBatches": 1},
    })  # fmt: skip
    clock = ManualClock()
    core = build_core(cfg, clock)
    sched = Scheduler(core, clock, mode="gang", max_inflight_batches=1)
    rng = random.Random(seed)
    lengths = [rng.randint(4, 12) if rng.random() < 0.75 else rng.randint(60, 100) for _ in range(64)]
    burst = [Request(id=str(i), arrival=0.0, max_tokens=n, hint_tokens=n, actual_tokens=n) for i, n in enumerate(lengths)]
    at_arrival: list[tuple[float, ...]] = []
    submit = sched.submit

    def submit_and_look(r: Request) -> int:
        bin_ = submit(r)
        at_arrival.append(core.binner.boundaries)
        return bin_

    sched.submit = submit_and_look  # type: ignore[method-assign]
    sched.start_drain = lambda: None  # type: ignore[method-assign]  # a live sidecar cuts partial bins on maxWait
    res = drive(sched, BatchServers(), iter(burst), clock)
    by_id = dict(enumerate(lengths))
    return [[by_id[int(i)] for i in d[2]] for d in res.dispatches], at_arrival[-1]


def test_gang_auto_bins_learn_a_burst_from_its_predictions_and_keep_short_and_long_apart():
    steps = {"Auto": 0, "Fixed": 0}
    for seed in range(1, 9):
        batches, learned = _gang_burst("Auto", seed)
        assert sum(12 < c < 60 for c in learned) == 1  # a cut between the peaks before any request completed
        assert sum(len(b) for b in batches) == 64
        mixed = [b for b in batches if min(b) <= 12 and max(b) >= 60]
        assert len(mixed) <= 1  # at most the last partial long batch, topped up with short ones
        steps["Auto"] += sum(max(b) for b in batches)  # a batch holds the engine until its longest ends
        steps["Fixed"] += sum(max(b) for b in _gang_burst("Fixed", seed)[0])
    assert steps["Auto"] < 0.97 * steps["Fixed"]  # than equal-width bins over [1, 100]


def sized(i: int, clock: ManualClock, n: int, deadline: float | None = None) -> Request:
    r = req(i, clock, deadline=deadline)
    r.body_bytes = n
    return r


def bounded(max_bytes: int, **kw):
    s, clock = make(**kw)
    s.core.max_queued_bytes = max_bytes
    return s, clock


def test_queued_bytes_refuse_past_the_bound_naming_it_and_free_when_the_request_is_sent():
    s, clock = bounded(100, mode="gang", size=2, inflight=1)
    a, b = sized(0, clock, 60), sized(1, clock, 40)
    s.submit(a)
    s.submit(b)
    assert s.queued_bytes == 100
    with pytest.raises(Rejected, match=r"batch\.maxQueuedBytes \(100\)") as full:
        s.submit(sized(2, clock, 1))
    assert full.value.kind == "resource_exhausted" and s.totals["rejected"] == 1
    step = s.step(clock.now())  # the batch goes to the engine: its bytes leave the queue
    assert ids(step) == [["0", "1"]] and s.queued_bytes == 0
    s.submit(sized(3, clock, 100))  # room again, up to the bound exactly
    assert s.queued_bytes == 100
    for r in (a, b):  # answers release nothing more: released once, when sent
        s.complete(r, OK, clock.now())
    s.release(step.dispatches[0].slot, clock.now())
    assert s.queued_bytes == 100


def test_queued_bytes_are_released_once_when_cancelled_expired_or_cut_at_shutdown():
    s, clock = bounded(1000, mode="gang", size=8, inflight=1, max_wait=60.0)
    cancelled, expiring, cut = sized(0, clock, 10), sized(1, clock, 20, deadline=1.0), sized(2, clock, 30)
    for r in (cancelled, expiring, cut):
        s.submit(r)
    assert s.queued_bytes == 60
    assert s.cancel(cancelled, clock.now()) == "cancelled" and s.queued_bytes == 50
    assert s.cancel(cancelled, clock.now()) is None and s.queued_bytes == 50  # a second withdraw frees nothing
    clock.advance(2.0)
    assert [r.id for r in s.step(clock.now()).expired] == ["1"] and s.queued_bytes == 30
    s.start_drain()
    assert [r.id for r in s.cut_queued()] == ["2"] and s.queued_bytes == 0
    assert s.end(cut, "failed") is False and s.queued_bytes == 0


def test_continuous_pending_requests_hold_their_bytes_until_admitted_and_a_requeue_holds_them_again():
    s, clock = bounded(1000, mode="continuous", size=1, max_wait=0.0)
    first, second = sized(0, clock, 100), sized(1, clock, 200)
    s.submit(first)
    s.submit(second)
    step = s.step(clock.now())  # one goes in; the other is taken from its bin but waits for room: still queued
    assert ids(step) == [["0"]] and s.pending_requests() == 1 and s.queued_bytes == 200
    never_sent = Outcome(unavailable=True, sent=False)  # the engine never got it (and is not down): queued again
    assert s.complete(first, never_sent, clock.now()) == "requeued"
    assert s.queued_bytes == 300
    s.release(step.dispatches[0].slot, clock.now())
    assert s.end(first, "failed") and s.queued_bytes == 200  # ended while queued: released there, once
    assert ids(s.step(clock.now())) == [["1"]] and s.queued_bytes == 0


def test_without_a_byte_bound_nothing_is_refused_for_its_size():
    s, clock = make()
    s.submit(sized(0, clock, 10**12))
    assert s.queued_bytes == 10**12


def test_the_kv_plan_of_a_request_in_flight_is_kept_only_while_what_it_reads_is_unchanged():
    # every admission lists each request in flight: the memo must give plan.held's very answer, whatever changed
    from binbatch_sidecar.core.kv_plan import KvPlan
    from binbatch_sidecar.core.length_dist import LEVELS, LengthDist
    from binbatch_sidecar.core.request import predicted_length
    from binbatch_sidecar.core.scheduler import _held, _plan_context

    plan = KvPlan(capacity=10_000, step_seconds=0.02)
    r = Request("r", 0.0, prompt_tokens=40, max_tokens=500)
    r.length = LengthDist.scaled(100, [0.2 + 0.15 * i for i in range(len(LEVELS))], 500)

    def held(elapsed: float):
        return _held(plan, r, elapsed, _plan_context(plan))

    def fresh(elapsed: float):
        return plan.held(r.prompt_tokens, predicted_length(r), elapsed, generated=r.engine_generated,
                         engine_prompt=r.engine_prompt_tokens)  # fmt: skip

    seen = []
    for elapsed in (0.0, 0.1, 0.5):  # before its first chunk: the plan moves with the time
        seen.append(held(elapsed))
        assert seen[-1] == fresh(elapsed)
    assert seen[0] != seen[2]
    assert held(0.505) is seen[2]  # within one engine step of it: the same plan, not worked out again
    r.engine_generated = 30  # its stream said how far it is
    kept = held(0.6)
    assert kept == fresh(0.6) and held(5.0) is kept  # then the time alone changes nothing
    plan.observe_prompt(40, 120)  # the engine counts three times the estimated prompt tokens
    assert held(5.0) == fresh(5.0) != kept
    r.engine_prompt_tokens = 77
    assert held(5.0) == fresh(5.0)
    r.engine_generated = 120  # outran its median
    assert held(5.0) == fresh(5.0)
    r.length = LengthDist.exact(150, 500)  # predicted anew (a requeue)
    assert held(5.0) == fresh(5.0)
    r.length, r.predicted_tokens = None, 90.0  # a predictor that gives only a number
    assert held(5.0) == fresh(5.0)
    r.predicted_tokens = 200.0
    assert held(5.0) == fresh(5.0)
