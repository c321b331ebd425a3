"""Closed forms of multi-bin batching and the auto-k choice built on them."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from binbatch_sidecar.core import theory
from binbatch_sidecar.core.autok import ArrivalRate, choose_k

# The seed's reference values (B=128, lengths ~ U[1, 20]).
SEED_TABLE = {1: 6.447, 2: 8.434, 4: 9.970, 8: 10.969, 16: 11.548, 32: 11.860}


@pytest.mark.parametrize("k,expected", sorted(SEED_TABLE.items()))
def test_theorem_4_2_matches_the_seed_table(k, expected):
    assert theory.throughput(k, 128, 1, 20) == pytest.approx(expected, abs=5e-4)


def test_capacity_is_batch_over_mean_length():
    assert theory.capacity(128, 1, 20) == pytest.approx(12.190, abs=5e-4)


def test_k1_service_time_is_expected_max_of_b_uniforms():
    # E[max of B iid U[a,b]] = a + (b-a)·B/(B+1): 1 + 19·128/129
    assert theory.expected_service_time(1, 128, 1, 20) == pytest.approx(1 + 19 * 128 / 129)


@given(st.integers(1, 512), st.integers(1, 63))
def test_throughput_grows_with_k_and_stays_below_capacity(batch, k):
    t1, t2 = theory.throughput(k, batch, 1, 20), theory.throughput(k + 1, batch, 1, 20)
    assert t1 <= t2 < theory.capacity(batch, 1, 20) + 1e-9


def test_lemma_5_1_adds_the_wait_to_fill_a_batch():
    # k=2, λ=4: E[t_2] + 127·2/8
    expected = theory.expected_service_time(2, 128, 1, 20) + 127 * 2 / 8
    assert theory.latency_lower_bound(2, 128, 1, 20, 4.0) == pytest.approx(expected)


def test_theorem_4_3_smallest_k_reaches_the_target():
    eps = 0.5
    k = theory.bins_for_throughput(eps, 128, 1, 20)
    cmax = theory.capacity(128, 1, 20)
    assert theory.throughput(k, 128, 1, 20) >= cmax - eps - 1e-9
    assert theory.throughput(k - 1, 128, 1, 20) < cmax - eps


@pytest.mark.parametrize(
    "call,field",
    [
        (lambda: theory.throughput(0, 128, 1, 20), "k"),
        (lambda: theory.throughput(1, 0, 1, 20), "batch"),
        (lambda: theory.throughput(1, 8, 20, 1), "lmin"),
        (lambda: theory.latency_lower_bound(1, 8, 1, 20, 0), "lam"),
        (lambda: theory.bins_for_throughput(100, 128, 1, 20), "eps"),
    ],
)
def test_bad_arguments_are_refused_by_name(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_auto_k_takes_more_bins_when_latency_allows():
    tight = choose_k(lam=5.0, latency_target=40, batch=128, lmin=1, lmax=20)
    loose = choose_k(lam=5.0, latency_target=400, batch=128, lmin=1, lmax=20)
    assert tight.reason == loose.reason == "meets-target"
    assert tight.k < loose.k
    assert tight.latency_bound <= 40 and loose.latency_bound <= 400


def test_auto_k_picks_the_largest_k_meeting_the_target():
    c = choose_k(lam=5.0, latency_target=100, batch=128, lmin=1, lmax=20)
    assert theory.latency_lower_bound(c.k, 128, 1, 20, 5.0) <= 100
    assert theory.latency_lower_bound(c.k + 1, 128, 1, 20, 5.0) > 100


def test_auto_k_needs_enough_bins_to_carry_the_load():
    # λ=10 exceeds what k=1..3 can serve (6.4, 8.4, 9.4): only k>=4 is stable.
    c = choose_k(lam=10.0, latency_target=1e6, batch=128, lmin=1, lmax=20)
    assert theory.throughput(c.k, 128, 1, 20) > 10.0
    unreachable = choose_k(lam=10.0, latency_target=1.0, batch=128, lmin=1, lmax=20)
    assert unreachable.reason == "target-unreachable" and unreachable.throughput > 10.0


def test_auto_k_overloaded_goes_to_the_most_bins():
    c = choose_k(lam=50.0, latency_target=100, batch=128, lmin=1, lmax=20, k_max=16)
    assert (c.k, c.reason) == (16, "overloaded")


def test_arrival_rate_estimate_tracks_a_steady_stream():
    est = ArrivalRate(half_life=10)
    assert est.rate is None
    for i in range(200):
        est.observe(i * 0.25)
    assert est.rate == pytest.approx(4.0)
    est.observe(49.75)  # a burst: two arrivals at one instant
    assert est.rate > 4.0 and math.isfinite(est.rate)
