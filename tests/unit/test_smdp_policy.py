"""batch.dispatch Smdp: the batch-time fit, the bucketed cache of control limits,
and the former's dispatch policy built on them."""

from __future__ import annotations

import pytest

from binbatch_sidecar.core import smdp
from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.former import BatchFormer
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.core.smdp_policy import (
    ServiceTimeFit,
    SmdpCache,
    SmdpDispatch,
    SmdpParams,
    model_for,
    solve_bucket,
)

ALPHA, BETA = 0.002, 0.05  # 2 ms per request, 50 ms per dispatch


def fitted() -> ServiceTimeFit:
    fit = ServiceTimeFit()
    for b in (1, 2, 4, 8, 16, 3, 5, 7, 12, 16):
        for _ in range(b):  # every request of the batch reports it
            fit.observe(b, ALPHA * b + BETA)
    return fit


def test_fit_recovers_the_intercept_and_slope():
    alpha, beta = fitted().fit()  # type: ignore[misc]
    assert alpha == pytest.approx(ALPHA) and beta == pytest.approx(BETA)


def test_one_slow_batch_moves_neither_the_slope_nor_the_cost_of_a_dispatch():
    fit = fitted()
    for _ in range(16):  # a full batch held up by a pause half a second long
        fit.observe(16, ALPHA * 16 + BETA + 0.5)
    alpha, beta = fit.fit()  # type: ignore[misc]
    # A least-squares line through the batches tilts to alpha 0.013, beta 0.002.
    assert alpha == pytest.approx(ALPHA) and beta == pytest.approx(BETA)


def test_a_fit_that_sees_no_cost_per_request_charges_each_dispatch_the_typical_batch():
    fit = ServiceTimeFit()
    for b, t in ((1, 0.06), (2, 0.05), (4, 0.05), (8, 0.04)) * 3:
        for _ in range(b):
            fit.observe(b, t)
    assert fit.fit() == (0.0, 0.05)


def test_fit_needs_batches_of_more_than_one_size():
    fit = ServiceTimeFit()
    for _ in range(40):
        fit.observe(4, 0.1)
    assert fit.fit() is None
    assert ServiceTimeFit().fit() is None


def solved(rate: float, w2: float, batch: int = 16) -> SmdpDispatch:
    policy = SmdpDispatch(SmdpCache(SmdpParams(w2=w2)))
    policy.update(rate, 1, (ALPHA, BETA), batch)
    assert policy.decide(5) == 0  # nothing solved yet: wait (maxWait decides)
    for key in policy.cache.wanted():
        policy.cache.put(key, solve_bucket(key, policy.cache.params))
    assert policy.cache.wanted() == []
    return policy


def test_engine_time_cost_makes_the_policy_wait_for_fuller_batches():
    latency_only = solved(rate=40.0, w2=1e-6)
    weighed = solved(rate=40.0, w2=64.0)
    # Latency alone sends at once or nearly; charging engine time (β per
    # dispatch) waits for near-full batches of 16.
    assert latency_only.threshold is not None and latency_only.threshold <= 2
    assert weighed.threshold is not None and weighed.threshold >= 4 * latency_only.threshold
    t = weighed.threshold
    assert weighed.decide(t - 1) == 0 and weighed.decide(t) >= 1


def test_nearby_rates_share_a_bucket_and_its_solution():
    policy = solved(rate=40.0, w2=64.0)
    key = policy.key
    policy.update(41.0, 1, (ALPHA, BETA), 16)
    assert policy.key == key and policy.cache.wanted() == []


def test_overload_has_no_model_and_leaves_maxwait_in_charge():
    policy = SmdpDispatch(SmdpCache(SmdpParams(w2=64.0)))
    policy.update(10_000.0, 1, (ALPHA, BETA), 16)  # beyond 16 / (16α + β) ≈ 195/s
    assert policy.key is not None and model_for(policy.key, policy.cache.params) is None
    (key,) = policy.cache.wanted()
    policy.cache.put(key, solve_bucket(key, policy.cache.params))
    assert policy.threshold is None and policy.decide(100) == 0


def test_without_a_fit_or_a_rate_there_is_no_bucket():
    policy = SmdpDispatch(SmdpCache(SmdpParams(w2=64.0)))
    policy.update(None, 1, (ALPHA, BETA), 16)
    assert policy.key is None and policy.decide(10) == 0
    policy.update(40.0, 1, None, 16)
    assert policy.key is None


def test_former_sends_a_partial_batch_at_the_control_limit():
    clock = ManualClock()
    policy = solved(rate=40.0, w2=64.0)
    t = policy.threshold
    assert t is not None
    former = BatchFormer(FixedBinner([]), clock, target_size=16, max_wait=10.0, policy=policy)
    for i in range(t - 1):
        r = Request(id=str(i), arrival=0.0)
        r.predicted_tokens = 5.0
        former.submit(r)
    assert former.take(idle=True) is None
    r = Request(id="last", arrival=0.0)
    r.predicted_tokens = 5.0
    former.submit(r)
    batch = former.take(idle=True)
    assert batch is not None and batch.reason == "policy" and batch.size == policy.decide(t)
    assert isinstance(policy.cache.get(policy.key), smdp.ControlLimit)  # type: ignore[arg-type]
