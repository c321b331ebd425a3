"""The batch former: bins, full/timeout/policy batches, priorities, deadlines, cancels."""

from __future__ import annotations

import itertools

import pytest

from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.former import BatchFormer, QueueFull
from binbatch_sidecar.core.request import Request

_ids = itertools.count()


def req(clock: ManualClock, length: float, **kw) -> Request:
    r = Request(id=f"r{next(_ids)}", arrival=clock.now(), **kw)
    r.predicted_tokens = length
    return r


class Always:
    """A dispatch policy that serves ``n`` whenever at least ``limit`` wait."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def decide(self, waiting: int) -> int:
        return waiting if waiting >= self.limit else 0


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def former(clock: ManualClock, **kw) -> BatchFormer:
    kw.setdefault("target_size", 3)
    return BatchFormer(FixedBinner([10.0, 100.0]), clock, **kw)


def test_requests_go_to_the_bin_of_their_predicted_length(clock):
    f = former(clock)
    assert [f.submit(req(clock, x)) for x in (1, 9.9, 10, 99, 100, 5000)] == [0, 0, 1, 1, 2, 2]
    assert f.bin_depths() == [2, 2, 2]


def test_full_bin_dispatches_before_timeout(clock):
    f = former(clock, max_wait=5.0)
    rs = [req(clock, 50) for _ in range(3)]
    for r in rs:
        f.submit(r)
    batch = f.take()
    assert batch is not None and batch.reason == "full" and batch.requests == rs
    assert f.queued() == 0


def test_partial_bin_waits_until_max_wait_then_leaves_as_timeout(clock):
    f = former(clock, max_wait=5.0)
    a = req(clock, 1)
    f.submit(a)
    assert f.next_wake() == 5.0
    clock.advance_to(4.99)
    f.poll()
    assert f.take() is None
    clock.advance_to(5.0)
    f.poll()
    batch = f.take()
    assert batch is not None and batch.reason == "timeout" and batch.requests == [a]
    assert f.next_wake() is None


def test_send_by_releases_a_partial_bin_before_max_wait(clock):
    """A TTFT SLO leaves a request less time to wait than the bin's max_wait."""
    f = former(clock, max_wait=5.0)
    relaxed, urgent = req(clock, 1), req(clock, 2, send_by=0.2)
    f.submit(relaxed)
    f.submit(urgent)
    assert f.next_wake() == 0.2
    clock.advance_to(0.19)
    f.poll()
    assert f.take() is None
    clock.advance_to(0.2)
    assert f.poll().formed == 1
    batch = f.take()
    assert batch is not None and batch.reason == "slo" and batch.requests == [relaxed, urgent]
    assert f.next_wake() is None


def test_send_by_of_a_cancelled_request_wakes_nobody(clock):
    f = former(clock, max_wait=None)
    r = req(clock, 1, send_by=1.0)
    f.submit(r)
    f.cancel(r)
    assert f.next_wake() is None


def test_without_max_wait_a_partial_bin_never_times_out(clock):
    f = former(clock, max_wait=None)
    f.submit(req(clock, 1))
    clock.advance(1e9)
    f.poll()
    assert f.take() is None and f.next_wake() is None


def test_first_completed_batch_is_served_first_across_bins(clock):
    f = former(clock, target_size=2)
    late_bin = [req(clock, 500), req(clock, 1)]  # one each in bins 2 and 0
    f.submit(late_bin[0])
    f.submit(late_bin[1])
    f.submit(req(clock, 50))
    f.submit(req(clock, 60))  # bin 1 completes first
    f.submit(req(clock, 2))  # then bin 0
    order = [f.take().bin, f.take().bin]
    assert order == [1, 0]


def test_higher_priority_goes_first_within_a_bin(clock):
    f = former(clock, target_size=2, max_wait=1.0)
    low1, low2, high = req(clock, 5), req(clock, 5, priority=0), req(clock, 5, priority=9)
    for r in (low1, low2):
        f.submit(r)
    first = f.take()
    assert first.requests == [low1, low2]
    f.submit(req(clock, 5))
    f.submit(high)
    assert f.take().requests[0] is high


def test_batch_holding_higher_priority_is_served_first(clock):
    f = former(clock, target_size=2)
    for _ in range(2):
        f.submit(req(clock, 5))
    f.submit(req(clock, 50))
    f.submit(req(clock, 50, priority=3))
    assert f.take().bin == 1
    assert f.take().bin == 0


def test_expired_request_leaves_before_dispatch(clock):
    f = former(clock, max_wait=10.0)
    doomed = req(clock, 5, deadline=2.0)
    keep = req(clock, 5)
    f.submit(doomed)
    f.submit(keep)
    assert f.next_wake() == 2.0
    clock.advance_to(2.0)
    assert f.poll().expired == [doomed]
    assert f.bin_depths()[0] == 1
    clock.advance_to(10.0)
    f.poll()
    assert f.take().requests == [keep]


def test_request_expiring_inside_a_formed_batch_is_not_dispatched(clock):
    f = former(clock, target_size=2)
    doomed, keep = req(clock, 5, deadline=1.0), req(clock, 5)
    f.submit(doomed)
    f.submit(keep)
    assert f.ready_batches() == 1
    clock.advance_to(1.0)
    assert f.poll().expired == [doomed]
    assert f.take().requests == [keep]


def test_cancelled_request_is_never_dispatched_and_frees_its_place(clock):
    f = former(clock, target_size=2, max_wait=1.0)
    gone, a = req(clock, 5), req(clock, 5)
    f.submit(gone)
    assert f.cancel(gone) is True and gone.cancelled
    assert f.bin_depths()[0] == 0 and f.queued() == 0
    f.submit(a)
    assert f.take() is None  # one live request: not a full batch
    f.submit(req(clock, 5))
    assert gone not in f.take().requests
    assert f.cancel(gone) is False  # already gone: nothing to withdraw


def test_cancel_after_take_reports_not_held(clock):
    f = former(clock, target_size=1)
    r = req(clock, 5)
    f.submit(r)
    assert f.take().requests == [r]
    assert f.cancel(r) is False


def test_full_queue_refuses_at_once(clock):
    f = former(clock, max_queue=2, target_size=10)
    f.submit(req(clock, 1))
    f.submit(req(clock, 1))
    with pytest.raises(QueueFull):
        f.submit(req(clock, 1))


def test_policy_releases_a_partial_batch_only_when_a_server_is_idle(clock):
    f = former(clock, target_size=10, policy=Always(limit=2))
    f.submit(req(clock, 5))
    assert f.take(idle=True) is None  # below the control limit
    f.submit(req(clock, 6))
    assert f.take(idle=False) is None  # busy servers: keep filling
    batch = f.take(idle=True)
    assert batch.reason == "policy" and batch.size == 2


def test_policy_serves_the_bin_with_most_waiting(clock):
    f = former(clock, target_size=10, policy=Always(limit=1))
    f.submit(req(clock, 5))
    for _ in range(3):
        f.submit(req(clock, 50))
    assert f.take(idle=True).bin == 1


def test_smaller_target_size_forms_batches_from_what_is_queued(clock):
    f = former(clock, target_size=8)
    for _ in range(5):
        f.submit(req(clock, 5))
    assert f.take() is None
    f.set_target_sizes([2, 8, 8])
    sizes = [f.take().size, f.take().size]
    assert sizes == [2, 2] and f.bin_depths()[0] == 1


def test_target_sizes_are_validated_by_name(clock):
    f = former(clock)
    with pytest.raises(ValueError, match="target_size"):
        f.set_target_sizes([1, 2])
    with pytest.raises(ValueError, match="target_size"):
        f.set_target_sizes(0)


def test_drain_forms_batches_of_everything_left(clock):
    f = former(clock, target_size=4)
    for x in (1, 2, 50, 500, 600):
        f.submit(req(clock, x))
    f.drain()
    got = []
    while (b := f.take()) is not None:
        got.append((b.bin, b.size, b.reason))
    assert sorted(got) == [(0, 2, "drain"), (1, 1, "drain"), (2, 2, "drain")]


class MovingBinner:
    """A binner whose boundary moves when told, as an auto binner's does."""

    def __init__(self) -> None:
        self.boundaries = (10.0,)
        self.version = 0

    @property
    def k(self) -> int:
        return len(self.boundaries) + 1

    def assign(self, predicted: float) -> int:
        return int(predicted >= self.boundaries[0])

    def observe(self, actual: float) -> None:
        pass

    def rebalance(self, queued) -> bool:
        return False


def test_queued_requests_are_rebinned_when_boundaries_move(clock):
    b = MovingBinner()
    f = BatchFormer(b, clock, target_size=3)
    for x in (5, 6, 20):
        f.submit(req(clock, x))
    assert f.bin_depths() == [2, 1]
    b.boundaries, b.version = (30.0,), 1
    f.poll()
    batch = f.take()  # all three now share bin 0 and make a full batch
    assert batch is not None and batch.size == 3 and batch.bin == 0


def test_every_request_leaves_exactly_once(clock):
    """Whatever mix of full, timeout, expiry and cancel: each request ends once."""
    f = former(clock, target_size=3, max_wait=2.0)
    seen: list[str] = []
    submitted = []
    for i in range(60):
        r = req(clock, [1, 50, 500][i % 3], deadline=clock.now() + (1.5 if i % 7 == 0 else 100))
        f.submit(r)
        submitted.append(r)
        if i % 11 == 0 and f.cancel(r):
            seen.append(r.id)
        clock.advance(0.3)
        seen.extend(x.id for x in f.poll().expired)
        while (b := f.take()) is not None:
            seen.extend(x.id for x in b.requests)
    clock.advance(10)
    seen.extend(x.id for x in f.poll().expired)
    f.drain()
    while (b := f.take()) is not None:
        seen.extend(x.id for x in b.requests)
    assert sorted(seen) == sorted(r.id for r in submitted)
    assert f.queued() == 0


def test_a_request_queued_again_expires_once_and_leaves_its_bin():
    """Found by the scheduler's property test: a request sent, queued again (the engine
    never received it) and then expired left its first deadline entry in the heap; that
    stale entry removed the new one from the held set but not from its bin, so the
    bin's depth stayed one above what the former held."""
    clock = ManualClock()
    f = BatchFormer(FixedBinner([10]), clock, target_size=1)
    r = Request("r", arrival=0.0, deadline=0.5, predicted_tokens=5)
    f.submit(r)
    assert f.take().requests == [r]  # sent
    f.set_target_sizes([2, 2])  # so that it waits in its bin this time
    f.submit(r)  # queued again
    assert f.bin_depths() == [1, 0]
    clock.advance(0.5)
    assert f.poll().expired == [r]
    assert f.queued() == 0 and f.bin_depths() == [0, 0]
