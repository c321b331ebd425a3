"""Binners: fixed, auto (Lemma 4.1 equal mass; Eq. 2 least batch time) and adaptive (BucketServe Algorithm 1)."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from binbatch_sidecar.core.binner import (
    AdaptiveBinner,
    AutoBinner,
    Binner,
    FixedBinner,
    bin_index,
    equal_mass_boundaries,
    min_service_boundaries,
    n_max_from_memory,
)
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.former import BatchFormer
from binbatch_sidecar.core.request import Request


def uniform_lengths(n: int, lo: float = 1.0, hi: float = 20.0, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [rng.uniform(lo, hi) for _ in range(n)]


def lemma_4_1(k: int, lo: float = 1.0, hi: float = 20.0) -> list[float]:
    return [lo + i * (hi - lo) / k for i in range(1, k)]  # Eq. 3


def test_all_binners_satisfy_the_protocol():
    binners: list[Binner] = [FixedBinner([10.0]), AutoBinner(2, [10.0]), AdaptiveBinner(0, 100, 5)]
    assert [b.k for b in binners] == [2, 2, 1]


# -- bin_index and FixedBinner ---------------------------------------------------------


def test_a_value_on_a_boundary_goes_to_the_bin_above():
    assert [bin_index((10.0, 20.0), x) for x in (9.99, 10.0, 19.99, 20.0, 1e9)] == [0, 1, 1, 2, 2]


def test_fixed_binner_assigns_by_its_boundaries_and_never_changes():
    b = FixedBinner([10.0, 100.0])
    assert (b.k, b.boundaries, b.version) == (3, (10.0, 100.0), 0)
    assert [b.assign(x) for x in (1, 10, 99, 100)] == [0, 1, 1, 2]
    b.observe(5000.0)
    assert b.rebalance([[1.0] * 100, [], []]) is False
    assert (b.boundaries, b.version) == ((10.0, 100.0), 0)


@pytest.mark.parametrize(
    "bad", [[10.0, 10.0], [20.0, 10.0], [0.0, 10.0], [-1.0], [float("nan")], [float("inf")]]
)
def test_fixed_binner_rejects_bad_boundaries_naming_them(bad):
    with pytest.raises(ValueError, match="boundaries"):
        FixedBinner(bad)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_uniform_boundaries_are_lemma_4_1s_equal_width_ones(k):
    assert FixedBinner.uniform(k, 1.0, 20.0).boundaries == pytest.approx(lemma_4_1(k))


def test_uniform_rejects_bad_arguments_naming_them():
    with pytest.raises(ValueError, match="k must"):
        FixedBinner.uniform(0, 1.0, 20.0)
    with pytest.raises(ValueError, match="lo < hi"):
        FixedBinner.uniform(2, 20.0, 1.0)


# -- equal_mass_boundaries -------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 4, 8])
def test_equal_mass_boundaries_of_uniform_samples_approach_lemma_4_1(k):
    got = equal_mass_boundaries(uniform_lengths(20_000), k)
    assert got == pytest.approx(lemma_4_1(k), abs=0.2)


def test_equal_mass_boundaries_accept_unsorted_samples():
    assert equal_mass_boundaries([4, 1, 3, 2], 4) == (2.0, 3.0, 4.0)


def test_equal_mass_boundaries_drop_tied_quantiles():
    # 60% of answers hit the same cap: the 2/4 and 3/4 quantiles are both 256.
    samples = [1, 2, 3, 4] + [256] * 6
    assert equal_mass_boundaries(samples, 4) == (4.0, 256.0)  # s[ceil(i·10/4)], i = 1, 2


def test_equal_mass_boundaries_of_a_constant_stream_are_one_bin():
    assert equal_mass_boundaries([7.0] * 100, 8) == ()


def test_equal_mass_boundaries_reject_bad_arguments_naming_them():
    with pytest.raises(ValueError, match="k must"):
        equal_mass_boundaries([1.0], 0)
    with pytest.raises(ValueError, match="samples"):
        equal_mass_boundaries([], 2)


@given(samples=st.lists(st.integers(0, 20), min_size=1, max_size=200), k=st.integers(1, 16))
def test_equal_mass_boundaries_are_increasing_and_leave_no_bin_empty(samples, k):
    b = equal_mass_boundaries(samples, k)
    assert len(b) <= k - 1
    assert all(x < y for x, y in zip(b, b[1:]))
    occupied = {bin_index(b, x) for x in samples}
    assert occupied == set(range(len(b) + 1))


@given(samples=st.sets(st.floats(0, 1e6), min_size=1, max_size=300), k=st.integers(1, 16))
def test_equal_mass_boundaries_of_distinct_samples_give_each_bin_n_over_k(samples, k):
    b = equal_mass_boundaries(samples, k)
    n = len(samples)
    counts = [0] * (len(b) + 1)
    for x in samples:
        counts[bin_index(b, x)] += 1
    if n >= k:
        assert len(b) == k - 1
        assert all(n // k <= c <= -(-n // k) for c in counts)  # floor(n/k)..ceil(n/k)


# -- AutoBinner ------------------------------------------------------------------------


def test_auto_binner_converges_from_bad_initial_boundaries_to_equal_mass():
    b = AutoBinner(4, [1000.0, 2000.0, 3000.0], window=4096, min_samples=512, refresh_every=256)
    assert b.assign(15.0) == 0  # everything in one bin at first
    for x in uniform_lengths(10_000, seed=3):
        b.observe(x)
    assert b.k == 4
    assert b.boundaries == pytest.approx(lemma_4_1(4), abs=0.6)
    assert [b.assign(x) for x in (3.0, 8.0, 13.0, 18.0)] == [0, 1, 2, 3]


def test_auto_binner_follows_a_shift_in_the_length_distribution():
    b = AutoBinner(2, [10.0], window=1000, min_samples=500, refresh_every=100)
    for x in uniform_lengths(3000, 1, 20, seed=1):
        b.observe(x)
    assert b.boundaries[0] == pytest.approx(10.5, abs=1.0)
    for x in uniform_lengths(3000, 100, 200, seed=2):
        b.observe(x)
    assert b.boundaries[0] == pytest.approx(150, abs=5)


def test_auto_binner_waits_for_min_samples_before_moving():
    b = AutoBinner(2, [10.0], window=100, min_samples=50, refresh_every=10)
    for x in range(49):
        b.observe(500.0 + x)
    assert (b.boundaries, b.version) == ((10.0,), 0)
    b.observe(600.0)
    assert b.version == 1 and b.boundaries[0] > 500


def test_auto_binner_memory_is_bounded_by_its_window():
    b = AutoBinner(4, (), window=256, min_samples=64, refresh_every=64)
    for x in uniform_lengths(100_000, seed=4):
        b.observe(x)
    assert b.samples_held == 256


def test_auto_binner_bumps_version_only_when_boundaries_change():
    b = AutoBinner(4, [5.0], window=64, min_samples=64, refresh_every=8, min_shift=0.0)
    seen = []
    for _ in range(1000):
        for x in range(1, 9):  # the window always holds 8 copies of 1..8 at a refresh
            b.observe(float(x))
        seen.append((b.version, b.boundaries))
    assert b.version == 1
    assert b.boundaries == (3.0, 5.0, 7.0)
    assert set(seen[8:]) == {(1, (3.0, 5.0, 7.0))}


def test_auto_binner_ignores_shifts_smaller_than_min_shift():
    b = AutoBinner(2, [100.0], window=10, min_samples=10, refresh_every=10, min_shift=0.05)
    for x in [90.0] * 5 + [101.0] * 5:  # median moves 100 -> 101: 1%
        b.observe(x)
    assert (b.boundaries, b.version) == ((100.0,), 0)
    for x in [90.0] * 5 + [120.0] * 5:  # 20%
        b.observe(x)
    assert (b.boundaries, b.version) == ((120.0,), 1)


def test_auto_binner_with_a_constant_length_reports_a_single_bin():
    b = AutoBinner(8, [10.0, 20.0], window=100, min_samples=100, refresh_every=100)
    for _ in range(100):
        b.observe(256.0)
    assert (b.k, b.target_k, b.boundaries) == (1, 8, ())


@given(
    lengths=st.lists(
        st.sampled_from([1, 2, 2, 3, 64, 256, 256, 256, 256]), min_size=1, max_size=400
    ),
    k=st.integers(1, 12),
)
def test_auto_binner_keeps_boundaries_strictly_increasing_with_tied_lengths(lengths, k):
    b = AutoBinner(k, (), window=128, min_samples=16, refresh_every=8)
    versions = [b.version]
    for x in lengths:
        b.observe(float(x))
        bd = b.boundaries
        assert all(x < y for x, y in zip(bd, bd[1:]))
        assert b.k == len(bd) + 1 <= k
        versions.append(b.version)
    assert all(v2 - v1 in (0, 1) for v1, v2 in zip(versions, versions[1:]))


def test_auto_binner_rebalance_is_a_no_op():
    b = AutoBinner(2, [10.0])
    assert b.rebalance([[1.0] * 1000, []]) is False
    assert b.version == 0


@pytest.mark.parametrize(
    ("args", "kw", "field"),
    [
        ((0,), {}, "k must"),
        ((2, [5.0, 6.0]), {}, "boundaries"),
        ((3, [6.0, 5.0]), {}, "boundaries"),
        ((2,), {"window": 0}, "window"),
        ((2,), {"window": 10, "min_samples": 11}, "min_samples"),
        ((2,), {"refresh_every": 0}, "refresh_every"),
        ((2,), {"min_shift": 1.0}, "min_shift"),
    ],
)
def test_auto_binner_rejects_bad_settings_naming_the_field(args, kw, field):
    with pytest.raises(ValueError, match=field):
        AutoBinner(*args, **kw)


def test_auto_binner_rejects_a_bad_observation_naming_it():
    with pytest.raises(ValueError, match="predicted"):
        AutoBinner(2).observe(float("nan"))


def test_auto_binner_estimates_at_min_samples_then_at_each_doubling_then_every_refresh_every():
    b = AutoBinner(2, (), window=1000, min_samples=4, refresh_every=16, min_shift=0.0)
    moved_at, version = [], b.version
    for n in range(1, 81):
        b.observe(float(n))  # a rising stream: every refresh moves the median
        if b.version != version:
            moved_at.append(n)
            version = b.version
    assert moved_at == [4, 8, 16, 32, 48, 64, 80]


def test_auto_binner_for_gang_batches_cuts_between_the_peaks_where_equal_mass_cuts_the_short_peak():
    lengths = two_peaks(400, seed=5)
    gang, shares = AutoBinner(2, (), min_samples=16, batch=8), AutoBinner(2, (), min_samples=16)
    for x in lengths:
        gang.observe(x)
        shares.observe(x)
    assert 12 < gang.boundaries[0] < 60  # short answers in one bin, long ones in the other
    assert shares.boundaries[0] <= 12  # the median lies inside the short peak


def test_auto_binner_rejects_a_batch_size_below_one():
    with pytest.raises(ValueError, match="batch"):
        AutoBinner(2, batch=0)


# -- min_service_boundaries (Eq. 2 on an empirical distribution) -----------------------


def two_peaks(n: int, seed: int = 0) -> list[float]:
    """75% short answers in 4..12 tokens, 25% long ones in 60..100 (bench e2e's mixed shape)."""
    rng = random.Random(seed)
    return [float(rng.randint(4, 12) if rng.random() < 0.75 else rng.randint(60, 100)) for _ in range(n)]


def batch_time(samples: list[float], cuts: tuple[float, ...], batch: int) -> Fraction:
    """Eq. 2 by brute force: sum over bins of Pr(bin)·E[max of ``batch`` draws from the bin]."""
    total = Fraction(0)
    for i in range(len(cuts) + 1):
        members = sorted(x for x in samples if bin_index(cuts, x) == i)
        m = len(members)
        e_max = sum(Fraction(x) * (Fraction(j + 1, m) ** batch - Fraction(j, m) ** batch) for j, x in enumerate(members))
        total += Fraction(m, len(samples)) * e_max
    return total


@pytest.mark.parametrize("k", [2, 4, 8])
def test_min_service_boundaries_for_evenly_spread_lengths_are_lemma_4_1_equal_mass(k):
    samples = [1 + 19 * i / 4095 for i in range(4096)]  # lengths spread evenly over [1, 20]
    assert min_service_boundaries(samples, k, 8) == pytest.approx(lemma_4_1(k), abs=0.1)


def test_min_service_boundaries_cut_a_two_peaked_distribution_between_the_peaks():
    lengths = two_peaks(64, seed=1)
    cuts = min_service_boundaries(lengths, 4, 8)
    shares = equal_mass_boundaries(lengths, 4)
    assert len(cuts) == 3 and sum(12 < c < 60 for c in cuts) == 1  # exactly one cut in the gap
    assert any(c <= 12 for c in cuts)  # and the short peak, most of the requests, split too
    assert not any(12 < c < 60 for c in shares)  # equal shares put no cut in the gap
    assert batch_time(lengths, cuts, 8) < batch_time(lengths, shares, 8)


@given(
    samples=st.lists(st.integers(1, 12), min_size=1, max_size=9),
    k=st.integers(1, 3),
    batch=st.integers(1, 4),
)
def test_min_service_boundaries_are_the_best_cuts_between_distinct_samples(samples, k, batch):
    lengths = [float(x) for x in samples]
    cuts = min_service_boundaries(lengths, k, batch)
    assert len(cuts) <= k - 1
    assert all(x < y for x, y in zip(cuts, cuts[1:])) and all(c > min(lengths) for c in cuts)
    assert all(any(bin_index(cuts, x) == i for x in lengths) for i in range(len(cuts) + 1))  # no empty bin
    values = sorted(set(lengths))
    gaps = [(a + b) / 2 for a, b in zip(values, values[1:])]
    best = min(batch_time(lengths, c, batch) for r in range(k) for c in itertools.combinations(gaps, r))
    assert batch_time(lengths, cuts, batch) <= best * (1 + Fraction(1, 10**9))  # best up to float rounding


def test_min_service_boundaries_of_one_length_is_one_bin():
    assert min_service_boundaries([256.0] * 50, 8, 16) == ()


@pytest.mark.parametrize(("args", "field"), [(([], 2, 8), "samples"), (([1.0], 0, 8), "k"), (([1.0], 2, 0), "batch")])
def test_min_service_boundaries_rejects_bad_arguments_naming_them(args, field):
    with pytest.raises(ValueError, match=field):
        min_service_boundaries(*args)


# -- n_max_from_memory (BucketServe Eq. 5-6) -------------------------------------------


def test_n_max_is_the_requests_that_fit_in_90_percent_of_kv_memory():
    assert n_max_from_memory(10_000, 100) == 90  # ⌊0.9·10000 / 100⌋
    assert n_max_from_memory(10_000, 100, reserve=0.0) == 100
    assert n_max_from_memory(10_000, 101) == 89  # 89·101 = 8989 ≤ 9000 < 90·101


def test_n_max_is_at_least_one_even_when_a_request_overflows_memory():
    assert n_max_from_memory(100, 1000) == 1


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((0, 100), "kv_capacity_tokens"),
        ((1000, 0), "mean_tokens_per_request"),
        ((1000, 100, 1.0), "reserve"),
        ((1000, 100, -0.1), "reserve"),
    ],
)
def test_n_max_rejects_bad_arguments_naming_them(args, field):
    with pytest.raises(ValueError, match=field):
        n_max_from_memory(*args)


# -- AdaptiveBinner (BucketServe Algorithm 1) ------------------------------------------


def test_adaptive_binner_starts_with_one_bucket():
    b = AdaptiveBinner(0, 1000, n_max=10)
    assert (b.k, b.boundaries, b.version) == (1, (), 0)


def test_adaptive_binner_splits_a_bucket_skewed_short_under_load():
    b = AdaptiveBinner(0, 1000, n_max=10)
    queued = [[10.0] * 30 + [900.0] * 5]  # 30/35 below the midpoint 500, 35 > n_max
    assert b.rebalance(queued) is True
    assert (b.boundaries, b.version) == ((500.0,), 1)
    # One split per call; the short bucket keeps splitting while it stays skewed.
    assert b.rebalance([[10.0] * 30, [900.0] * 5]) is True
    assert b.boundaries == (250.0, 500.0)


def test_adaptive_binner_splits_repeatedly_until_the_short_requests_stop_being_skewed():
    b = AdaptiveBinner(0, 1000, n_max=10, max_buckets=32)
    queued = [[10.0] * 30 + [900.0] * 5]
    while b.rebalance(queued):
        pass
    # Bucket [0, 15.625) holds the 10s, but they are above its midpoint: no more splits.
    assert b.boundaries == (15.625, 31.25, 62.5, 125.0, 250.0, 500.0)
    assert b.assign(10.0) == 0 and b.assign(900.0) == 6


def test_adaptive_binner_does_not_split_a_balanced_bucket():
    b = AdaptiveBinner(0, 1000, n_max=10)
    queued = [[100.0] * 20 + [900.0] * 20]  # exactly half below: not more than θ = 0.5
    assert b.rebalance(queued) is False
    assert b.version == 0


def test_adaptive_binner_does_not_split_a_bucket_of_at_most_n_max():
    b = AdaptiveBinner(0, 1000, n_max=10, max_buckets=8)
    b.rebalance([[10.0] * 30])
    b.rebalance([[10.0] * 30, []])
    assert b.k == 3
    # Total is still >= n_max, but no bucket holds more than n_max: nothing changes.
    assert b.rebalance([[10.0] * 10, [300.0] * 5, [900.0] * 5]) is False
    assert b.k == 3


def test_adaptive_binner_merges_back_to_one_bucket_at_low_load():
    b = AdaptiveBinner(0, 1000, n_max=10)
    b.rebalance([[10.0] * 30])
    assert b.k == 2
    assert b.rebalance([[10.0] * 5, [900.0] * 4]) is True  # 9 < n_max
    assert (b.k, b.boundaries, b.version) == (1, (), 2)
    assert b.rebalance([[10.0] * 5]) is False  # already one bucket: no version bump
    assert b.version == 2


def test_adaptive_binner_never_exceeds_max_buckets():
    b = AdaptiveBinner(0, 1024, n_max=2, max_buckets=3)
    queued = [[1.0] * 50 + [300.0] * 20 + [700.0] * 10]
    for _ in range(10):
        b.rebalance(queued)
    assert b.k == 3


def test_adaptive_binner_n_max_follows_memory():
    b = AdaptiveBinner(0, 1000, n_max=n_max_from_memory(10_000, 100))
    assert b.n_max == 90
    b.n_max = n_max_from_memory(1_000, 100)
    assert b.n_max == 9
    with pytest.raises(ValueError, match="n_max"):
        b.n_max = 0


@given(
    loads=st.lists(st.lists(st.floats(0, 2000), max_size=60), min_size=1, max_size=12),
    n_max=st.integers(1, 20),
    max_buckets=st.integers(1, 10),
    theta=st.floats(0, 0.9),
)
def test_adaptive_binner_invariants_hold_under_any_load(loads, n_max, max_buckets, theta):
    b = AdaptiveBinner(0, 1000, n_max=n_max, theta=theta, max_buckets=max_buckets)
    for values in loads:
        before = (b.version, b.boundaries)
        changed = b.rebalance([values])
        assert changed == (b.boundaries != before[1])
        assert b.version == before[0] + changed
        assert b.k == len(b.boundaries) + 1 <= max_buckets
        assert all(0 < x < y < 1000 for x, y in zip(b.boundaries, b.boundaries[1:]))
        if len(values) < n_max:
            assert b.k == 1


@pytest.mark.parametrize(
    ("args", "kw", "field"),
    [
        ((10, 5, 10), {}, "lo < hi"),
        ((-1, 5, 10), {}, "lo < hi"),
        ((0, 1000, 0), {}, "n_max"),
        ((0, 1000, 10), {"theta": 1.0}, "theta"),
        ((0, 1000, 10), {"max_buckets": 0}, "max_buckets"),
    ],
)
def test_adaptive_binner_rejects_bad_settings_naming_the_field(args, kw, field):
    with pytest.raises(ValueError, match=field):
        AdaptiveBinner(*args, **kw)


def test_adaptive_binner_drives_the_batch_formers_rebinning():
    clock = ManualClock()
    b = AdaptiveBinner(0, 1000, n_max=10)
    f = BatchFormer(b, clock, target_size=1000)
    for i, x in enumerate([10.0] * 30 + [900.0] * 5):
        r = Request(id=str(i), arrival=0.0)
        r.predicted_tokens = x
        f.submit(r)
    assert b.rebalance(f.queued_predictions()) is True
    f.poll()  # the former sees the new version and re-bins what it holds
    assert f.bin_depths() == [30, 5]


def test_auto_bins_use_the_batch_time_rule_in_gang_mode_and_equal_shares_in_continuous_mode():
    from binbatch_sidecar.config import parse_config
    from binbatch_sidecar.server.assembly import build_binner

    def built(mode: str) -> AutoBinner:
        cfg = parse_config({"bins": {"mode": "Auto", "count": 4}, "batch": {"mode": mode, "staticSize": 8}})
        b = build_binner(cfg)
        assert isinstance(b, AutoBinner)
        return b

    assert (built("Gang").batch, built("Continuous").batch) == (8, None)
