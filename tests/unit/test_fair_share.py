"""Per-tenant weighted fair share (core/fair_share.py): of admission and of the queue."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from binbatch_sidecar.core import fair_share
from binbatch_sidecar.core.admission import AdmissionOrder, AdmissionQueue, Backlog
from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.fair_share import FairAdmissionQueue, TenantPolicy, queue_share
from binbatch_sidecar.core.former import BatchFormer
from binbatch_sidecar.core.kv_plan import KvPlan
from binbatch_sidecar.core.predictor import HintPredictor
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.core.scheduler import Core, Outcome, Rejected, Scheduler
from binbatch_sidecar.core.sizer import BatchSizer

SHORTEST = AdmissionOrder("shortest_first", aging=None, max_wait=30.0)


def r(i: int, tenant: str = "", tokens: float = 10.0, arrival: float = 0.0, **kw) -> Request:
    return Request(id=str(i), arrival=arrival, max_tokens=int(tokens), predicted_tokens=tokens, tenant=tenant, **kw)


def drain(q: FairAdmissionQueue, n: int, now: float = 0.0) -> list[Request]:
    out = []
    for _ in range(n):
        head = q.pop(now)
        assert head is not None
        out.append(head[1])
    return out


@pytest.mark.parametrize(("weights", "share"), [({"a": 1, "b": 1}, 0.5), ({"a": 1, "b": 3}, 0.25)])
def test_admission_counts_follow_the_weights_while_both_wait(weights, share):
    q: FairAdmissionQueue[None] = FairAdmissionQueue(SHORTEST, weights.__getitem__)
    for i in range(400):
        q.push(None, r(i, "a"))
        q.push(None, r(1000 + i, "b"))
    for n in (8, 40, 200):
        got = drain(q, n)
        a = sum(x.tenant == "a" for x in got)
        assert abs(a - n * share) <= 1, (n, a)  # within one request of the weighted share, at every horizon


def test_the_share_is_of_predicted_tokens_not_of_requests():
    q: FairAdmissionQueue[None] = FairAdmissionQueue(SHORTEST)
    for i in range(100):
        q.push(None, r(i, "long", tokens=100.0))
        q.push(None, r(1000 + i, "short", tokens=10.0))
    got = drain(q, 44)
    assert sum(x.tenant == "long" for x in got) == 4  # 4 x 100 tokens beside 40 x 10


def test_a_tenant_under_its_share_goes_next_past_a_flood():
    q: FairAdmissionQueue[None] = FairAdmissionQueue(SHORTEST)
    for i in range(50):
        q.push(None, r(i, "flood", tokens=5.0))  # shorter: ShortestFirst alone would send them all first
    drain(q, 10)
    q.push(None, r(999, "steady", tokens=50.0))
    assert q.pop(0.0)[1].id == "999"


def test_a_new_tenant_banks_no_credit():
    q: FairAdmissionQueue[None] = FairAdmissionQueue(SHORTEST)
    for i in range(100):
        q.push(None, r(i, "a"))
    drain(q, 60)  # b, new, gets no credit for the time before it came
    for i in range(40):
        q.push(None, r(1000 + i, "b"))
    got = drain(q, 20)
    assert 9 <= sum(x.tenant == "b" for x in got) <= 11


def test_a_returning_tenant_keeps_at_most_a_burst_of_the_share_it_left_unused():
    q: FairAdmissionQueue[None] = FairAdmissionQueue(SHORTEST)
    q.push(None, r(0, "b"))
    drain(q, 1)  # b is known now
    for i in range(200):
        q.push(None, r(1 + i, "a"))
    drain(q, 100)  # b idle meanwhile: it left 50 requests of its share unused
    for i in range(100):
        q.push(None, r(1000 + i, "b"))
    got = drain(q, fair_share.BURST_REQUESTS + 20)
    assert [x.tenant for x in got[: fair_share.BURST_REQUESTS]] == ["b"] * fair_share.BURST_REQUESTS
    assert 9 <= sum(x.tenant == "b" for x in got[fair_share.BURST_REQUESTS:]) <= 11  # then the shares again


def test_within_a_tenant_the_queue_order_holds():
    q: FairAdmissionQueue[None] = FairAdmissionQueue(SHORTEST)
    for i, tokens in enumerate((30, 10, 20)):
        q.push(None, r(i, "a", tokens=tokens))
        q.push(None, r(10 + i, "b", tokens=tokens))
    got = drain(q, 6)
    assert [x.id for x in got if x.tenant == "a"] == ["1", "2", "0"]
    assert [x.id for x in got if x.tenant == "b"] == ["11", "12", "10"]


def test_a_reload_weight_applies_at_the_next_admission():
    weights = {"a": 1, "b": 1}
    q: FairAdmissionQueue[None] = FairAdmissionQueue(SHORTEST, lambda t: weights[t])
    for i in range(200):
        q.push(None, r(i, "a"))
        q.push(None, r(1000 + i, "b"))
    drain(q, 20)
    weights["a"] = 4
    got = drain(q, 100)
    assert 78 <= sum(x.tenant == "a" for x in got) <= 82


def test_expiry_and_deadlines_span_every_tenant():
    q: FairAdmissionQueue[None] = FairAdmissionQueue(SHORTEST)
    q.push(None, r(0, "a", deadline=5.0))
    q.push(None, r(1, "b", deadline=3.0))
    q.push(None, r(2, "b"))
    assert q.next_deadline() == 3.0
    assert [x.id for _, x in q.pop_expired(4.0)] == ["1"]
    assert q.next_deadline() == 5.0 and len(q) == 2
    assert [x.id for _, x in q.pop_expired(5.0)] == ["0"]
    assert q.next_deadline() is None and len(q) == 1 and [x.id for _, x in q] == ["2"]


def test_tenant_state_is_bounded_and_nothing_pushed_is_lost(monkeypatch):
    monkeypatch.setattr(fair_share, "MAX_TENANTS", 8)
    q: FairAdmissionQueue[None] = FairAdmissionQueue(SHORTEST)
    for i in range(6):  # these come and go: forgotten when the bound is reached
        q.push(None, r(i, f"idle{i}"))
    drain(q, 6)
    for i in range(20):  # all waiting at once: past the bound they share the overflow queue
        q.push(None, r(100 + i, f"t{i}"))
    assert q.tenants() <= 9 and len(q) == 20
    assert sorted(int(x.id) for x in drain(q, 20)) == list(range(100, 120))
    assert q.pop(0.0) is None


def _same(order: AdmissionOrder, ops, tenant: str, tpot: int | None) -> None:
    """Replay ``ops`` on a lone AdmissionQueue and on a FairAdmissionQueue whose every request is ``tenant``
    (the engine's TPOT told first, if ``tpot``: before the tenant's queue exists)."""
    plain: AdmissionQueue[int] = AdmissionQueue(order)
    fair: FairAdmissionQueue[int] = FairAdmissionQueue(order, lambda t: 3)
    if tpot is not None:
        plain.set_tpot(tpot / 1000)
        fair.set_tpot(tpot / 1000)
    now, n = 0.0, 0
    for op, value, tokens, prio, prompt in ops:
        now += value / 10
        if op == "push":
            for q in (plain, fair):
                q.push(n, Request(id=str(n), arrival=now, prompt_tokens=prompt, predicted_tokens=float(tokens),
                                  priority=prio, tenant=tenant, deadline=now + 5.0 if prio == 1 else None,
                                  send_by=now + 1.0 if prio == -1 else None))  # fmt: skip
            n += 1
        elif op == "tpot":
            plain.set_tpot(tokens / 1000)
            fair.set_tpot(tokens / 1000)
        elif op == "expire":
            assert [i for i, _ in plain.pop_expired(now)] == [i for i, _ in fair.pop_expired(now)]
            assert plain.next_deadline() == fair.next_deadline()
        else:
            backlog = Backlog(float(tokens), float(tokens) * 20, 4, 2000.0) if op == "drain" else None
            assert plain.arrivals_stopped(now) == fair.arrivals_stopped(now) or not plain
            a, b = plain.pop(now, backlog), fair.pop(now, backlog)
            assert (a and a[0]) == (b and b[0])
        assert len(plain) == len(fair)


OPS = st.lists(
    st.tuples(st.sampled_from(["push", "push", "push", "pop", "pop", "tpot", "expire", "drain"]),
              st.integers(0, 20), st.integers(1, 500), st.integers(-1, 1), st.integers(1, 400)),  # fmt: skip
    max_size=80,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, tenant=st.sampled_from(["", "acme"]), tpot=st.none() | st.integers(1, 500),
       order=st.sampled_from([SHORTEST, AdmissionOrder("fifo"), AdmissionOrder("shortest_first", aging=20.0, max_wait=3.0),
                              AdmissionOrder("shortest_first", aging=None, max_wait=30.0, by_footprint=True)]))  # fmt: skip
@example(ops=[("push", 0, 100, 0, 10), ("push", 10, 10, 0, 10), ("pop", 0, 1, 0, 1)], tenant="acme", order=SHORTEST,
         tpot=1)  # a tenant's queue made after the engine's TPOT was measured ages at its pace
def test_a_single_tenant_is_ordered_exactly_as_today(ops, tenant, order, tpot):
    _same(order, ops, tenant, tpot)


def test_queue_share_is_the_weighted_share_floored():
    assert queue_share(1, 2, 10) == 0.5
    assert queue_share(1, 100, 10) == 0.1  # the floor
    assert queue_share(3, 3, 10) == 1.0  # alone: all of it


# -- the per-tenant bound of the queue, in the scheduler ------------------------------------------


def scheduler(mode: str = "continuous", max_queued: int = 10, floor: int = 10, weights=None, size: int = 1,
              kv_plan: KvPlan | None = None) -> tuple[Scheduler, ManualClock]:  # fmt: skip
    clock = ManualClock()
    binner = FixedBinner(())
    former = BatchFormer(binner, clock, target_size=size, max_wait=0.0, max_queue=1000)
    sizer = BatchSizer(mode="static", static_size=size, max_size=256)
    core = Core(HintPredictor(), binner, former, sizer, max_queued_requests=max_queued, max_queued_bytes=10_000,
                tenants=TenantPolicy(weights or {}, 1, floor), kv_plan=kv_plan)  # fmt: skip
    return Scheduler(core, clock, mode=mode, max_inflight_batches=1), clock


def sreq(i: int, clock: ManualClock, tenant: str, body: int = 10) -> Request:
    return Request(id=str(i), arrival=clock.now(), max_tokens=8, hint_tokens=8, tenant=tenant, body_bytes=body)


@pytest.mark.parametrize("mode", ["continuous", "gang"])
def test_a_flood_is_refused_past_its_share_and_the_steady_tenant_is_not(mode):
    s, clock = scheduler(mode, max_queued=10)
    s.submit(sreq(0, clock, "steady"))
    s.step(clock.now())  # the steady one is in the engine: its tenant is active
    for i in range(5):  # weights 1:1 -> the flood may hold 5 of the 10
        s.submit(sreq(1 + i, clock, "flood"))
    s.step(clock.now())
    with pytest.raises(Rejected) as refused:
        s.submit(sreq(9, clock, "flood"))
    assert refused.value.kind == "resource_exhausted"
    assert "tenant 'flood'" in refused.value.message and "share is 50%" in refused.value.message
    assert "5 of batch.maxQueuedRequests (10)" in refused.value.message
    for i in range(4):
        s.submit(sreq(20 + i, clock, "steady"))  # under its share: accepted
    assert s.queued_by_tenant() == {"steady": 4, "flood": 5}


def test_a_lone_tenant_may_use_the_whole_queue_and_the_global_bound_counts_pending():
    s, clock = scheduler(max_queued=10)
    for i in range(11):  # one goes in, ten wait
        s.submit(sreq(i, clock, "flood"))
        s.step(clock.now())  # taken out of the bins: still queued
    assert s.core.former.queued() == 0 and s.backlog() == 10
    with pytest.raises(Rejected, match=r"batch.maxQueuedRequests \(10\) reached"):
        s.submit(sreq(10, clock, "flood"))


def test_the_byte_share_bounds_a_tenant_too():
    s, clock = scheduler(max_queued=100)
    s.submit(sreq(0, clock, "a"))  # active (in flight after the step)
    s.step(clock.now())
    s.submit(sreq(1, clock, "b", body=4000))
    with pytest.raises(Rejected, match=r"holds 4000 bytes .* 5000 of batch.maxQueuedBytes \(10000\)"):
        s.submit(sreq(2, clock, "b", body=1001))


def test_weights_and_the_floor_set_the_share_and_idle_tenants_are_forgotten():
    s, clock = scheduler(max_queued=100, floor=30, weights={"big": 9})
    first = sreq(0, clock, "big")
    s.submit(first)
    d = s.step(clock.now()).dispatches[0]
    for i in range(30):  # weight 1 of 10: 10% -> the floor, 30 of 100
        s.submit(sreq(1 + i, clock, "small"))
    with pytest.raises(Rejected, match="share is 30%"):
        s.submit(sreq(99, clock, "small"))
    s.complete(first, Outcome(completion_tokens=8.0), clock.now())
    s.release(d.slot, clock.now())
    assert "big" not in s.queued_by_tenant()  # nothing open: forgotten, and "small" is alone now
    s.submit(sreq(100, clock, "small"))


def test_the_scheduler_admits_a_steady_tenant_past_a_flood_in_continuous_mode():
    s, clock = scheduler(max_queued=100)
    flood = [sreq(i, clock, "flood") for i in range(6)]
    for x in flood:
        s.submit(x)
    first = s.step(clock.now()).dispatches  # one place in the engine (size 1)
    assert [d.requests[0].id for d in first] == ["0"]
    steady = sreq(99, clock, "steady")
    s.submit(steady)
    s.complete(flood[0], Outcome(completion_tokens=8.0), clock.now())
    s.release(first[0].slot, clock.now())
    assert [d.requests[0].id for d in s.step(clock.now()).dispatches] == ["99"]


def _admitted(s: Scheduler, clock: ManualClock) -> list[str]:
    return [d.requests[0].id for d in s.step(clock.now()).dispatches]


@pytest.mark.parametrize("by", ["count", "kv"])
def test_while_another_tenant_is_open_a_tenant_holds_at_most_its_share_of_the_engine(by):
    """The engine holds 4 (its batch size, or its KV cache: 4 answers of 8 tokens).  Beside a steady
    tenant a flood (weights 1:1) gets at most 2 of them, so the steady tenant's next arrivals go in at
    once instead of waiting for running answers to end; alone (or under one tenant name) it takes all 4."""

    def make() -> tuple[Scheduler, ManualClock]:
        if by == "count":
            return scheduler(max_queued=100, size=4)
        return scheduler(max_queued=100, size=64, kv_plan=KvPlan(capacity=32.0, block=0))

    s, clock = make()
    s.submit(sreq(0, clock, "steady"))
    assert _admitted(s, clock) == ["0"]
    for i in range(10):
        s.submit(sreq(1 + i, clock, "flood"))
    assert _admitted(s, clock) == ["1", "2"]  # its share: half the engine
    s.submit(sreq(99, clock, "steady"))
    assert _admitted(s, clock) == ["99"]  # at once, into the half kept
    assert _admitted(s, clock) == []  # full

    s, clock = make()  # the same requests under one tenant name: one tenant may take the whole engine
    for i in range(11):
        s.submit(sreq(i, clock, "flood"))
    assert _admitted(s, clock) == ["0", "1", "2", "3"]
    s.submit(sreq(99, clock, "flood"))
    assert _admitted(s, clock) == []  # it waits for an answer to end


def test_a_tenant_at_its_share_does_not_hold_back_another_tenants_request():
    """The steady tenant's head is next by the tags, but it holds its share of the engine already (1 of
    4 at weight 1 against the flood's 3): the flood's requests go in past it, up to the flood's share."""
    s, clock = scheduler(max_queued=100, size=4, weights={"flood": 3})
    s.submit(sreq(0, clock, "steady"))
    assert _admitted(s, clock) == ["0"]
    for i in range(1, 6):
        s.submit(sreq(i, clock, "flood"))
    s.submit(sreq(9, clock, "steady"))
    skipped = []
    peek = s._pending.peek
    s._pending.peek = lambda now, backlog=None, skip=None: (skipped.append(skip), peek(now, backlog, skip))[1]
    assert _admitted(s, clock) == ["1", "2", "3"]  # the engine is full: 1 + 3
    assert "steady" in skipped  # its head came first and was passed over
    assert s.queued_by_tenant() == {"steady": 1, "flood": 2}
