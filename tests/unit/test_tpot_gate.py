"""The TPOT gate: x-slo-tpot-ms holds a tight request until the engine meets it."""

from __future__ import annotations

import itertools

from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.former import BatchFormer
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.core.tpot_gate import TpotGate

_ids = itertools.count()


def req(clock: ManualClock, **kw) -> Request:
    r = Request(id=f"g{next(_ids)}", arrival=clock.now(), **kw)
    r.predicted_tokens = 5.0
    return r


def test_only_slos_tighter_than_the_policy_are_gated():
    gate = TpotGate(policy_tpot=0.050)
    gate.observe(0.080, fresh=True)
    assert gate.admits(None, now=0.0)  # no SLO
    assert gate.admits(0.060, now=0.0)  # looser than the policy's: the sizer already serves it
    assert not gate.admits(0.020, now=0.0)  # tighter, and the engine runs at 80 ms/token


def test_any_slo_is_gated_when_the_policy_has_none():
    gate = TpotGate(policy_tpot=None)
    gate.observe(0.080, fresh=True)
    assert not gate.admits(0.060, now=0.0)
    gate.observe(0.040, fresh=True)
    assert gate.admits(0.060, now=0.0)


def test_unknown_engine_tpot_admits():
    gate = TpotGate(policy_tpot=None)
    assert gate.admits(0.010, now=0.0)  # never observed
    gate.observe(0.080, fresh=False)
    assert gate.admits(0.010, now=0.0)  # stale metrics
    gate.observe(None, fresh=True)
    assert gate.admits(0.010, now=0.0)  # no token since the last scrape: the engine is idle
    gate.observe(None, fresh=True, running=0)
    assert gate.admits(0.010, now=0.0)  # idle, and says so


def test_an_unchanged_sample_with_requests_running_keeps_the_last_tpot():
    """A PromQL source answers the same Prometheus sample between scrapes (15-30 s):
    no new token is counted while requests run.  That is no news, not an idle engine,
    so the gate stays shut on the last observation instead of opening until the next scrape."""
    gate = TpotGate(policy_tpot=None)
    gate.observe(0.080, fresh=True, running=12)
    assert not gate.admits(0.010, now=0.0)
    gate.observe(None, fresh=True, running=12)
    assert not gate.admits(0.010, now=0.0)
    assert gate.admits(0.100, now=0.0)  # a looser SLO than what was observed still goes
    gate.observe(None, fresh=False, running=12)
    assert gate.admits(0.010, now=0.0)  # stale metrics: unknown, open


def test_spent_ttft_budget_admits_a_held_request():
    gate = TpotGate(policy_tpot=None)
    gate.observe(0.080, fresh=True)
    assert not gate.admits(0.010, now=1.0, send_by=2.0)
    assert gate.admits(0.010, now=2.0, send_by=2.0)


def test_former_holds_tight_requests_and_lets_the_rest_of_their_batch_go():
    clock = ManualClock()
    gate = TpotGate(policy_tpot=None)
    gate.observe(0.080, fresh=True)
    f = BatchFormer(FixedBinner([]), clock, target_size=3, gate=gate)
    tight, loose1, loose2 = req(clock, tpot_slo=0.020), req(clock), req(clock)
    for r in (tight, loose1, loose2):
        f.submit(r)
    batch = f.take()
    assert batch is not None and batch.requests == [loose1, loose2]
    assert f.take() is None and f.queued() == 1  # the tight one waits in the sidecar
    gate.observe(0.015, fresh=True)  # the engine got faster
    again = f.take()
    assert again is not None and again.requests == [tight]


def test_former_wakes_the_driver_when_a_held_requests_ttft_budget_ends():
    clock = ManualClock()
    gate = TpotGate(policy_tpot=None)
    gate.observe(0.080, fresh=True)
    f = BatchFormer(FixedBinner([]), clock, target_size=1, gate=gate)
    r = req(clock, tpot_slo=0.020, send_by=3.0)
    f.submit(r)
    assert f.take() is None
    assert f.next_wake() == 3.0
    clock.advance_to(3.0)
    f.poll()
    batch = f.take()
    assert batch is not None and batch.requests == [r]


def test_held_request_still_expires_at_its_deadline():
    clock = ManualClock()
    gate = TpotGate(policy_tpot=None)
    gate.observe(0.080, fresh=True)
    f = BatchFormer(FixedBinner([]), clock, target_size=1, gate=gate)
    r = req(clock, tpot_slo=0.020, deadline=1.0)
    f.submit(r)
    assert f.take() is None
    clock.advance_to(1.0)
    assert f.poll().expired == [r]
    assert f.take() is None and f.queued() == 0


def test_drain_ignores_the_gate():
    clock = ManualClock()
    gate = TpotGate(policy_tpot=None)
    gate.observe(0.080, fresh=True)
    f = BatchFormer(FixedBinner([]), clock, target_size=4, gate=gate)
    r = req(clock, tpot_slo=0.020)
    f.submit(r)
    f.drain()
    batch = f.take()
    assert batch is not None and batch.requests == [r]


def test_an_slo_the_engine_misses_even_alone_is_not_held():
    """Over an interval with one request of ours and one running at both scrapes the
    engine took 32 ms a token: a 20 ms SLO cannot be met by waiting, a 40 ms one can."""
    gate = TpotGate(policy_tpot=None)
    gate.observe(0.030, fresh=True, running=1)
    gate.observe(0.032, fresh=True, running=1)
    gate.observe_interval(0.032, ours=1.0)
    assert gate.alone == 0.032
    gate.observe(0.060, fresh=True, running=8)  # busy now
    gate.observe_interval(0.060, ours=6.5)
    assert gate.alone == 0.032 and gate.admits(0.020, now=0.0)  # beyond it even alone: sent at once
    assert not gate.admits(0.040, now=0.0)  # within reach alone: held while the engine runs at 60 ms


def test_an_interval_with_more_than_one_running_is_not_alone():
    gate = TpotGate(policy_tpot=None)
    gate.observe(None, fresh=True, running=0)
    gate.observe(0.050, fresh=True, running=0)
    gate.observe_interval(0.050, ours=4.0)  # four of ours ran between two idle scrapes
    assert gate.alone is None
    gate.observe(0.050, fresh=True, running=3)
    gate.observe_interval(0.050, ours=0.5)  # one of ours, but others ran too
    assert gate.alone is None
    gate.observe(0.050, fresh=True, running=1)
    gate.observe_interval(0.050, ours=None)  # none of ours: another client's TPOT
    gate.observe(0.050, fresh=False, running=1)
    gate.observe(0.050, fresh=True, running=1)
    gate.observe_interval(0.050, ours=1.0)  # the scrape before was stale: its count is unknown
    assert gate.alone is None and not gate.admits(0.020, now=0.0)
