"""Continuous admission order: shortest predicted first, with aging and a hard max wait.

Driven through the Scheduler with a manual clock, one engine slot, so each
completion lets exactly one waiting request in and the order is visible.
"""

from __future__ import annotations

import math

import pytest

from binbatch_sidecar.core.admission import AdmissionOrder, AdmissionQueue, Backlog, engine_cap, kv_area
from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.former import BatchFormer
from binbatch_sidecar.core.predictor import HintPredictor
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.core.scheduler import Core, Outcome, Scheduler
from binbatch_sidecar.core.sizer import BatchSizer, EngineSnapshot

OK = Outcome(completion_tokens=5.0, prompt_tokens=3.0)


def make(order: AdmissionOrder, slots: int = 1, k: int = 4) -> tuple[Scheduler, ManualClock]:
    clock = ManualClock()
    binner = FixedBinner.uniform(k, 1, 1000) if k > 1 else FixedBinner(())
    former = BatchFormer(binner, clock, target_size=slots, max_wait=0.0, max_queue=1000)
    sizer = BatchSizer(mode="static", static_size=slots, max_size=256)
    core = Core(HintPredictor(), binner, former, sizer, admission=order)
    return Scheduler(core, clock, mode="continuous"), clock


def req(name: str, clock: ManualClock, tokens: float, **kw) -> Request:
    return Request(id=name, arrival=clock.now(), max_tokens=2000, hint_tokens=tokens, **kw)


def finish_one(s: Scheduler, clock: ManualClock, running: list) -> list[str]:
    """End the request in flight; return the ids admitted next."""
    d = running.pop()
    for r in d.requests:
        s.complete(r, OK, clock.now())
    s.release(d.slot, clock.now())
    step = s.step(clock.now())
    running.extend(step.dispatches)
    return [r.id for x in step.dispatches for r in x.requests]


def test_shortest_predicted_first_across_bins_when_the_engine_is_full():
    s, clock = make(AdmissionOrder("shortest_first"))
    s.submit(req("first", clock, 900))
    running = s.step(clock.now()).dispatches
    assert [r.id for d in running for r in d.requests] == ["first"]  # the engine was idle: it goes at once
    for name, tokens in [("long", 800), ("mid", 400), ("short", 20), ("tiny", 5)]:
        clock.advance(0.001)
        s.submit(req(name, clock, tokens))
        assert s.step(clock.now()).dispatches == []  # the engine is full: they queue here
    order = [finish_one(s, clock, running) for _ in range(4)]
    assert order == [["tiny"], ["short"], ["mid"], ["long"]]


def _engine_of_two_then(s: Scheduler, clock: ManualClock, waiting: list[tuple[str, float]]) -> list:
    """Two 10-token requests fill a two-slot engine; then ``waiting`` arrive at once."""
    for name in ("a", "b"):
        s.submit(req(name, clock, 10))
    running = s.step(clock.now()).dispatches
    assert len(running) == 2
    for name, tokens in waiting:
        s.submit(req(name, clock, tokens))
    assert s.step(clock.now()).dispatches == []
    return running


def test_once_arrivals_stop_the_longest_goes_first_if_the_rest_drains_before_it_could_end():
    """The rest (30 waiting + 10 in flight, 2 at a time) drains in 20 steps; the
    100-token request sent last would run 80 steps alone."""
    s, clock = make(AdmissionOrder("shortest_first"), slots=2)
    running = _engine_of_two_then(s, clock, [("s1", 10), ("long", 100), ("s2", 10), ("s3", 10)])
    clock.advance(0.5)  # no arrival since: the burst is over
    assert finish_one(s, clock, running) == ["long"]
    assert finish_one(s, clock, running) == ["s1"]  # then shortest first again


def test_while_requests_keep_arriving_the_longest_waits_its_turn():
    s, clock = make(AdmissionOrder("shortest_first"), slots=2)
    running = _engine_of_two_then(s, clock, [("s1", 10), ("long", 100), ("s2", 10), ("s3", 10)])
    assert finish_one(s, clock, running) == ["s1"]  # at the instant of the last arrival: more may come


def test_the_longest_waits_while_the_rest_takes_longer_than_it_does():
    """30 tokens against a rest of 10 x 10 waiting + 10 in flight, 2 at a time: 55 steps."""
    s, clock = make(AdmissionOrder("shortest_first"), slots=2)
    running = _engine_of_two_then(s, clock, [("long", 30)] + [(f"s{i}", 10) for i in range(10)])
    clock.advance(0.5)
    assert finish_one(s, clock, running) == ["s0"]


def test_the_critical_path_rule_keeps_priorities_and_leaves_fifo_alone():
    s, clock = make(AdmissionOrder("shortest_first"), slots=2)
    running = _engine_of_two_then(s, clock, [("long", 100)])
    s.submit(req("urgent", clock, 10, priority=1))
    clock.advance(0.5)
    assert finish_one(s, clock, running) == ["urgent"]
    s, clock = make(AdmissionOrder("fifo"), slots=2)
    running = _engine_of_two_then(s, clock, [("s1", 10), ("long", 100)])
    clock.advance(0.5)
    assert finish_one(s, clock, running) == ["s1"]


def test_the_drain_is_bounded_by_the_engines_concurrency_and_by_its_kv_cache():
    assert kv_area(20, 10) == 10 * (20 + 5)  # 10 steps holding 20, 21, ... 29 tokens
    assert Backlog(40.0, 0.0, 4, None).drain_steps(60.0, 0.0) == 25  # 100 tokens, 4 a step
    assert Backlog(40.0, 1000.0, 4, 100.0).drain_steps(60.0, 4000.0) == 50  # 5000 token-steps in 100 at once
    assert Backlog(40.0, 1000.0, None, None).drain_steps(60.0, 4000.0) is None  # nothing bounds it: no rule


def test_the_drain_counts_waiting_prompts_as_the_kv_plan_holds_them():
    """A waiting request's KV area is its prompt scaled to the engine's count, less
    the prefix the engine holds once for all (both the KV plan's), plus its answer."""
    backlog = Backlog(0.0, 0.0, None, 1000.0, prompt_scale=2.0, shared=100.0)
    assert backlog.waiting_area(10.0, 10.0 * 300, 10.0 * 10 / 2) == kv_area(2.0 * 300 - 100, 10)
    # a burst behind one system prompt: 64 answers of 50 tokens, 300-token prompts of which 256 are
    # shared, and one answer of 265: counted whole, the rest drains in 2.5x the longest answer's steps
    # and it would wait; counted as the engine holds them, it is on the critical path at once
    q: AdmissionQueue[int] = AdmissionQueue(AdmissionOrder("shortest_first"))
    for i in range(64):
        q.push(i, Request(id=f"s{i}", arrival=i * 1e-3, prompt_tokens=300, predicted_tokens=50.0))
    q.push(64, Request(id="long", arrival=0.064, prompt_tokens=300, predicted_tokens=265.0))
    whole = Backlog(0.0, 0.0, 64, 1280.0)
    shared = Backlog(0.0, 0.0, 64, 1280.0, prompt_scale=1.0, shared=256.0)
    assert whole.waiting_area(64 * 50, 64 * 50 * 300, 64 * 50 * 25) / 1280 > 2.5 * 265
    after = 1.0  # arrivals have stopped
    assert q.peek(after, whole)[1].id == "s0"
    assert q.peek(after, shared)[1].id == "long"


def test_fifo_keeps_the_formers_order():
    s, clock = make(AdmissionOrder("fifo"), k=1)
    s.submit(req("a", clock, 900))
    running = s.step(clock.now()).dispatches
    for name, tokens in [("b", 800), ("c", 5)]:
        clock.advance(0.001)
        s.submit(req(name, clock, tokens))
        s.step(clock.now())
    assert [finish_one(s, clock, running) for _ in range(2)] == [["b"], ["c"]]


def test_a_long_request_under_a_stream_of_short_ones_is_admitted_by_its_max_wait():
    max_wait = 2.0
    s, clock = make(AdmissionOrder("shortest_first", aging=0.0, max_wait=max_wait))
    s.submit(req("s0", clock, 5))
    running = s.step(clock.now()).dispatches
    long = req("long", clock, 900)
    s.submit(long)
    admitted_at = None
    for i in range(1, 200):  # every 0.1 s a short one arrives and one finishes: the long one is never shortest
        clock.advance(0.1)
        s.submit(req(f"s{i}", clock, 5))
        if "long" in finish_one(s, clock, running):
            admitted_at = clock.now()
            break
    assert admitted_at is not None, "the long request was starved"
    assert max_wait <= admitted_at - long.arrival < max_wait + 0.1 + 1e-9


def test_aging_lets_a_long_request_pass_shorter_newcomers_before_the_max_wait():
    # rank = predicted − aging × waited: after 1 s a 900-token request ranks as 900 − 1000 < 5
    s, clock = make(AdmissionOrder("shortest_first", aging=1000.0, max_wait=math.inf))
    s.submit(req("s0", clock, 5))
    running = s.step(clock.now()).dispatches
    long = req("long", clock, 900)
    s.submit(long)
    admitted = []
    for i in range(1, 40):
        clock.advance(0.1)
        s.submit(req(f"s{i}", clock, 5))
        admitted += finish_one(s, clock, running)
        if "long" in admitted:
            break
    assert "long" in admitted and clock.now() - long.arrival <= 1.0 + 1e-9
    assert admitted.index("long") >= 5  # before aging caught up, the short ones went first


def test_at_the_engines_pace_a_long_request_passes_newcomers_once_it_would_end_first():
    """Aging None: a waiting request gains 1/TPOT tokens of rank a second, so it
    goes first once it would end before a newcomer sent now.  A 900-token request
    on an engine at 10 ms a token would end 9 s after it arrives; a 5-token one
    arriving t seconds later, at t + 0.05 s -- it overtakes them after ~8.95 s.
    At 5 ms a token the same happens after half that time: the queue re-keys when
    the measured TPOT moves."""
    for tpot, passes_after in ((0.010, 8.95), (0.005, 4.475)):
        s, clock = make(AdmissionOrder("shortest_first", aging=None, max_wait=math.inf))
        s.submit(req("s0", clock, 5))
        running = s.step(clock.now()).dispatches
        clock.advance(0.01)
        s.on_snapshot(EngineSnapshot(tpot_seconds=tpot, fresh=True), clock.now())  # s0 ran since: its engine's TPOT
        long = req("long", clock, 900)
        s.submit(long)
        for i in range(1, 200):
            clock.advance(0.05)
            s.submit(req(f"s{i}", clock, 5))
            if "long" in finish_one(s, clock, running):
                break
        assert clock.now() - long.arrival == pytest.approx(passes_after, abs=0.051)


def test_a_request_past_its_send_by_goes_after_those_that_can_still_meet_their_ttft():
    s, clock = make(AdmissionOrder("shortest_first"))
    s.submit(req("busy", clock, 900))
    running = s.step(clock.now()).dispatches
    s.submit(req("late", clock, 5, send_by=clock.now() + 0.5))
    s.submit(req("fresh", clock, 300, send_by=clock.now() + 5.0))
    clock.advance(1.0)  # "late" has spent its queue share: it would miss its TTFT anyway
    assert finish_one(s, clock, running) == ["fresh"]
    assert finish_one(s, clock, running) == ["late"]  # sent, not shed


def test_a_queued_request_whose_deadline_passes_ends_at_its_deadline_not_when_it_reaches_the_head():
    s, clock = make(AdmissionOrder("shortest_first"))
    s.submit(req("busy", clock, 5))
    s.step(clock.now())
    doomed = req("doomed", clock, 900, deadline=clock.now() + 1.0)
    s.submit(doomed)
    s.step(clock.now())
    assert s.next_wake() == pytest.approx(1.0)  # the driver arms a timer for it
    clock.advance(1.0)
    step = s.step(clock.now())
    assert [r.id for r in step.expired] == ["doomed"] and not s.is_open(doomed)


def test_a_higher_priority_request_goes_first_whatever_its_length():
    s, clock = make(AdmissionOrder("shortest_first"))
    s.submit(req("busy", clock, 5))
    running = s.step(clock.now()).dispatches
    s.submit(req("short", clock, 5))
    s.submit(req("urgent", clock, 900, priority=1))
    assert finish_one(s, clock, running) == ["urgent"]


def test_a_reload_reorders_the_requests_already_taken():
    s, clock = make(AdmissionOrder("fifo"), k=1)
    s.submit(req("busy", clock, 5))
    running = s.step(clock.now()).dispatches
    for name, tokens in [("long", 900), ("short", 5)]:
        clock.advance(0.001)
        s.submit(req(name, clock, tokens))
        s.step(clock.now())  # taken from the former into the admission queue
    core = s.core
    s.replace_core(Core(core.predictor, core.binner, core.former, core.sizer, admission=AdmissionOrder("shortest_first")),
                   mode="continuous", max_inflight_batches=4)  # fmt: skip
    assert finish_one(s, clock, running) == ["short"]


@pytest.mark.parametrize(
    "kwargs, field",
    [({"order": "sjf"}, "order"), ({"aging": -1.0}, "aging"), ({"max_wait": 0.0}, "max_wait")],
)
def test_a_bad_policy_names_its_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AdmissionOrder(**kwargs)


def test_the_queue_counts_and_iterates_only_live_entries():
    clock = ManualClock()
    q: AdmissionQueue[str] = AdmissionQueue(AdmissionOrder("shortest_first"))
    a, b = req("a", clock, 10, predicted_tokens=10.0), req("b", clock, 5, predicted_tokens=5.0)
    q.push("A", a)
    q.push("B", b)
    assert len(q) == 2 and q.pop(0.0) == ("B", b)
    assert len(q) == 1 and list(q) == [("A", a)] and q.pop(0.0) == ("A", a) and not q and q.pop(0.0) is None


def test_the_policy_keys_reach_the_scheduling_core():
    from binbatch_sidecar.config import parse_config
    from binbatch_sidecar.server.assembly import build_core

    cfg = parse_config({"batch": {"order": "ShortestFirst", "aging": "Fixed", "agingTokensPerSecond": 40,
                                  "maxQueueWaitMilliseconds": 2500}})  # fmt: skip
    assert build_core(cfg, ManualClock()).admission == AdmissionOrder("shortest_first", 40.0, 2.5, follow_engine=True,
                                                                      by_footprint=True)  # shortestBy Auto
    fifo = parse_config({"batch": {"order": "Fifo", "followEngineQueue": False}})
    assert build_core(fifo, ManualClock()).admission == AdmissionOrder("fifo", None, 30.0, follow_engine=False)


def test_engine_cap_holds_at_what_the_engine_runs_while_it_queues_and_grows_while_it_has_room():
    assert engine_cap(None, 0, 5, None) is None and engine_cap(4, None, 5, None) is None  # no counts: no cap
    assert engine_cap(running=6, waiting=3, inflight=9, previous=20) == 6  # its own queue: hold at what it runs
    assert engine_cap(running=0, waiting=2, inflight=2, previous=None) == 1
    assert engine_cap(running=6, waiting=3, inflight=9, previous=None, kv_usage=0.9) == 6  # full KV: it holds all it can
    # a burst queued since the engine's last step, KV mostly free: not a sign it is full
    assert engine_cap(running=6, waiting=30, inflight=36, previous=None, kv_usage=0.1) is None
    assert engine_cap(running=8, waiting=0, inflight=8, previous=None) is None  # room and no cap yet: none
    assert engine_cap(running=8, waiting=0, inflight=8, previous=8) == 10  # room: a quarter above, at least 2
    assert engine_cap(running=0, waiting=0, inflight=0, previous=8) is None  # both idle: the cap is dropped
    cap: int | None = 1
    for _ in range(10):  # the engine keeps up: the cap grows geometrically, never the bottleneck
        cap = engine_cap(running=cap or 0, waiting=0, inflight=cap or 0, previous=cap)
    assert cap is not None and cap > 20


def test_follow_engine_keeps_the_queue_here_while_the_engine_queues():
    s, clock = make(AdmissionOrder("shortest_first", follow_engine=True), slots=100, k=1)
    s.on_snapshot(EngineSnapshot(kv_capacity_tokens=None, running=2, waiting=1, fresh=True), clock.now())
    assert s.engine_cap == 2
    for i in range(5):
        s.submit(req(f"r{i}", clock, 10))
    assert len(s.step(clock.now()).dispatches) == 2  # the engine holds 2: the other 3 wait here, in order
    s.on_snapshot(EngineSnapshot(kv_capacity_tokens=None, running=2, waiting=0, fresh=True), clock.now())
    assert len(s.step(clock.now()).dispatches) == 2  # room again: the cap grows to 4
    s.on_snapshot(None, clock.now())  # no metrics: no engine cap, only B_t
    assert s.engine_cap is None and len(s.step(clock.now()).dispatches) == 1


def test_without_follow_engine_the_engine_counts_do_not_cap_admission():
    s, clock = make(AdmissionOrder("shortest_first"), slots=100, k=1)
    s.on_snapshot(EngineSnapshot(kv_capacity_tokens=None, running=2, waiting=1, fresh=True), clock.now())
    for i in range(5):
        s.submit(req(f"r{i}", clock, 10))
    assert s.engine_cap is None and len(s.step(clock.now()).dispatches) == 5


def test_an_engine_held_by_its_sequence_limit_with_kv_to_spare_is_capped_at_what_it_runs():
    """vLLM's --max-num-seqs, not the KV cache, holds it: it queues at two scrapes in
    a row, runs no more, KV mostly free.  Requests sent on would wait in its FCFS
    queue, so the cap holds them here, where shortest-first orders them."""
    s, clock = make(AdmissionOrder("shortest_first", follow_engine=True), slots=100, k=1)
    s.on_snapshot(EngineSnapshot(kv_capacity_tokens=None, kv_usage_ratio=0.1, running=8, waiting=0, fresh=True), 0.0)
    s.on_snapshot(EngineSnapshot(kv_capacity_tokens=None, kv_usage_ratio=0.1, running=8, waiting=4, fresh=True), 0.2)
    assert s.engine_cap is None  # one scrape with a queue and free KV: maybe a burst since its last step
    s.on_snapshot(EngineSnapshot(kv_capacity_tokens=None, kv_usage_ratio=0.1, running=8, waiting=4, fresh=True), 0.4)
    assert s.engine_cap == 8  # still queued, no more running: it is full
    # a burst the engine is taking in: it runs more than at the scrape before, so it is not full
    assert engine_cap(running=20, waiting=5, inflight=25, previous=None, kv_usage=0.2, before=(8, 12)) is None


def test_with_the_kv_plan_a_full_cache_queue_is_the_plans_and_only_a_sequence_limit_caps():
    """The KV plan bounds admission by the cache: a queue in a full cache is a
    preemption, which the plan answers; capping at what the engine then ran kept a
    few requests in a KV-limited engine while the cap grew back a scrape at a time."""
    full = {"kv_usage": 0.95, "kv_planned": True}
    assert engine_cap(running=6, waiting=3, inflight=9, previous=None, **full) is None
    assert engine_cap(running=6, waiting=3, inflight=9, previous=6, **full) == 11  # grows as with room: 9 + 2
    # a preemption: it queues again and runs fewer than at the scrape before: not a limit either
    assert engine_cap(running=4, waiting=2, inflight=6, previous=None, kv_usage=0.6, before=(6, 1),
                      kv_planned=True) is None  # fmt: skip
    # a sequence limit: queued at two scrapes, running exactly as many, the cache not full
    assert engine_cap(running=8, waiting=4, inflight=12, previous=None, kv_usage=0.1, before=(8, 4),
                      kv_planned=True) == 8  # fmt: skip
    assert engine_cap(running=8, waiting=4, inflight=12, previous=None, kv_usage=0.1, kv_planned=True) is None


def test_first_fit_decreasing_finds_the_longest_that_fits_by_bisection():
    """``packed`` against a scan of every waiting request, longest first, for
    tests that are monotone in the length (as the KV plan's is)."""
    import random

    rng = random.Random(7)
    for trial in range(200):
        q: AdmissionQueue[int] = AdmissionQueue(AdmissionOrder("shortest_first"))
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 30))]
        for i, n in enumerate(lengths):
            q.push(i, Request(id=str(i), arrival=0.0, predicted_tokens=float(n)))
        room = rng.randint(0, 55)
        got = q.packed(1.0, lambda r: (r.predicted_tokens or 0) <= room)
        fitting = [n for n in lengths if n <= room]
        if not fitting:
            assert got is None
        else:
            assert got is not None and got[1].predicted_tokens == max(fitting)
            q.remove(got[1])
            assert len(q) == len(lengths) - 1


def test_first_fit_decreasing_keeps_priorities_and_the_max_wait_bound():
    q: AdmissionQueue[str] = AdmissionQueue(AdmissionOrder("shortest_first", max_wait=5.0))
    q.push("old", Request(id="old", arrival=0.0, predicted_tokens=90.0))
    q.push("low", Request(id="low", arrival=4.0, predicted_tokens=20.0))
    q.push("urgent", Request(id="urgent", arrival=4.0, predicted_tokens=40.0, priority=1))
    q.push("urgent-short", Request(id="urgent-short", arrival=4.0, predicted_tokens=10.0, priority=1))

    def under(n: float):
        return lambda r: (r.predicted_tokens or 0) <= n

    assert q.packed(4.5, under(100))[0] == "urgent"  # the longest of the highest priority
    assert q.packed(4.5, under(30))[0] == "urgent-short"
    assert q.packed(4.5, under(5)) is None  # the urgent ones wait: no lower priority goes past them
    assert q.packed(5.0, under(100))[0] == "old"  # waited max_wait: it goes first, when it fits
    assert q.packed(5.0, under(50)) is None


def test_an_idle_hour_does_not_hide_the_end_of_the_next_burst():
    """Arrivals stop after QUIET_GAPS mean gaps without one.  A gap that long means
    arrivals had stopped, so it counts at that bound: an hour's idle gap folded in
    whole made the next 64-request burst's mean gap 0.2 s, and its end was seen
    only 2 s after its last arrival; now within QUIET_GAPS of its own gaps."""
    q: AdmissionQueue[int] = AdmissionQueue(AdmissionOrder("shortest_first"))
    t = 0.0
    for i in range(20):  # a stream, one a second
        q.push(i, Request(id=str(i), arrival=t, predicted_tokens=10.0))
        t += 1.0
    t += 3600.0  # an idle hour
    for i in range(64):  # then a burst, a millisecond apart
        q.push(i, Request(id=f"b{i}", arrival=t, predicted_tokens=10.0))
        t += 0.001
    last = t - 0.001
    assert q.arrivals_stopped(last + 0.5)  # half a second after the burst: over
    assert not q.arrivals_stopped(last + 0.00001)


# -- batch.order EnginePriority: the key the engine (vLLM --scheduling-policy priority) orders by


def _req(name: str, arrival: float, predicted: float, priority: int = 0, max_tokens: int = 1000) -> Request:
    r = Request(id=name, arrival=arrival, prompt_tokens=10, max_tokens=max_tokens, priority=priority)
    r.predicted_tokens = predicted
    return r


def test_engine_priority_is_the_ideal_end_in_ms_so_the_shorter_goes_first_unless_the_longer_waited_longer():
    from binbatch_sidecar.core.admission import engine_priority

    tpot = 0.01  # 100 tokens a second
    assert engine_priority(_req("a", 10.0, 50), tpot, epoch=10.0) == 500
    short_late, long_early = _req("s", 10.2, 10), _req("l", 10.0, 50)
    # the long one would end at 0.5 s, the short at 0.3 s: shortest first
    assert engine_priority(short_late, tpot, 10.0) < engine_priority(long_early, tpot, 10.0)
    # a long one that arrived more than its extra decode time (0.4 s) earlier goes first: it aged
    assert engine_priority(_req("l", 9.5, 50), tpot, 10.0) < engine_priority(short_late, tpot, 10.0)
    # a more urgent request class goes before any ideal end
    assert engine_priority(_req("vip", 1e6, 300, priority=1), tpot, 0.0) < engine_priority(_req("x", 0.0, 1), tpot, 0.0)
    # never past max_tokens; the default time per token until one is measured
    assert engine_priority(_req("m", 0.0, 500, max_tokens=20), tpot, 0.0) == 200
    assert engine_priority(_req("d", 0.0, 10), None, 0.0) == 200


def test_engine_priority_order_needs_continuous_mode_no_engine_queue_cap_and_no_projected_plan():
    from binbatch_sidecar.config import parse_config
    from binbatch_sidecar.server.assembly import build_admission

    ok = {"batch": {"order": "EnginePriority", "followEngineQueue": False}}
    order = build_admission(parse_config(ok))
    assert order.engine_priority and order.order == "shortest_first" and not order.follow_engine
    for doc, field in [({"batch": {"order": "EnginePriority"}}, "batch.followEngineQueue"),
                       ({"batch": {**ok["batch"], "mode": "Gang"}}, "batch.order"),
                       ({**ok, "memory": {"admission": "Projected"}}, "memory.admission")]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            parse_config(doc)
    assert not build_admission(parse_config({})).engine_priority


def test_by_kv_footprint_a_short_answer_to_a_long_prompt_waits_behind_a_longer_answer_to_a_short_one():
    """OutputTokens ranks 100 tokens after a 3000-token prompt before 300 tokens after
    a 20-token one; KvFootprint weighs each token by the KV its request holds per step,
    its prompt plus half the mean answer (about 50): 100 x 3050 against 300 x 70."""
    for by_footprint, first in ((False, "long-prompt"), (True, "short-prompt")):
        q: AdmissionQueue[str] = AdmissionQueue(AdmissionOrder("shortest_first", aging=0.0, by_footprint=by_footprint))
        for name, prompt, tokens in (("long-prompt", 3000, 100.0), ("short-prompt", 20, 300.0)):
            r = Request(id=name, arrival=0.0, prompt_tokens=prompt, max_tokens=1000)
            r.predicted_tokens = tokens
            q.push(name, r)
        assert q.pop(0.0)[0] == first


def test_by_kv_footprint_a_request_of_the_usual_prompt_ranks_at_its_tokens_so_aging_keeps_its_pace():
    """Every request with a 50-token prompt: each ranks at its own tokens, however
    long, so a 900-token answer aged at 100 tokens a second passes 100-token
    newcomers after 8 s either way (ranked by the whole KV area, L (p + L/2), in
    steps of the mean footprint, it waited 39.8 s)."""
    waits = []
    for by_footprint in (False, True):
        q: AdmissionQueue[str] = AdmissionQueue(AdmissionOrder("shortest_first", aging=100.0, by_footprint=by_footprint))
        first = Request(id="long", arrival=0.0, prompt_tokens=50, max_tokens=1000)
        first.predicted_tokens = 900.0
        q.push("long", first)
        for i in range(1000):
            t = i * 0.01
            r = Request(id=str(i), arrival=t, prompt_tokens=50, max_tokens=1000)
            r.predicted_tokens = 100.0
            q.push(str(i), r)
            if q.pop(t)[0] == "long":
                waits.append(t)
                break
    assert waits == [pytest.approx(8.0), pytest.approx(8.0)]  # a tie at 8 s: the one that came first


def test_kv_footprint_ranking_reaches_the_core_and_needs_the_projected_plan():
    from binbatch_sidecar.config import ConfigError, parse_config
    from binbatch_sidecar.server.assembly import build_core

    cfg = parse_config({"batch": {"shortestBy": "KvFootprint"}, "memory": {"admission": "Projected"}})
    assert build_core(cfg, ManualClock()).admission.by_footprint
    # the default (Auto) ranks by footprint where the plan applies, by output tokens where it does not
    assert build_core(parse_config({}), ManualClock()).admission.by_footprint
    for without_plan in ({"memory": {"admission": "BatchSize"}}, {"batch": {"sizing": "Static"}},
                         {"batch": {"order": "EnginePriority", "followEngineQueue": False}}):
        assert not build_core(parse_config(without_plan), ManualClock()).admission.by_footprint, without_plan
    with pytest.raises(ConfigError, match=r"batch\.shortestBy.*memory\.admission Projected \(is BatchSize\)"):
        parse_config({"batch": {"shortestBy": "KvFootprint"}, "memory": {"admission": "BatchSize"}})
    with pytest.raises(ConfigError, match=r"batch\.shortestBy.*\(is Auto, resolving to BatchSize\)"):
        parse_config({"batch": {"shortestBy": "KvFootprint", "mode": "Gang"}})
