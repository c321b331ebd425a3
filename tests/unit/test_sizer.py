"""The batch sizer: Eq. 12 (b_mem), Algorithm 2 (b_sla), and the per-bin BatchSizer
(memory-sla-dynamic-batching.md; DESIGN §2, §3.2-3.3)."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from scipy.stats import norm

from binbatch_sidecar.core.sizer import (
    REASONS,
    BatchSizer,
    EngineSnapshot,
    LengthStats,
    SlaSizer,
    b_mem,
    combine,
)

FRESH = EngineSnapshot(kv_capacity_tokens=100_000, fresh=True)
STALE = EngineSnapshot(kv_capacity_tokens=100_000, fresh=False)


def fits(b: int, eta: float, mu: float, sigma: float, eps_m: float) -> bool:
    """The constraint Eq. 12 solves: b·μ + θ·σ·√b ≤ η (Eq. 8-11, CLT)."""
    theta = float(norm.ppf(1 - eps_m))
    return b * mu + theta * sigma * math.sqrt(b) <= eta


# -- b_mem (Eq. 12) --------------------------------------------------------------------


def test_b_mem_matches_eq12_worked_by_hand_at_eps_5_percent():
    # θ = Φ⁻¹(0.95) = 1.6449; σθ = 50·1.6449 = 82.24; (σθ)² = 6763.9; 4μη = 4·100·10000 = 4e6
    # √(4 006 763.9) = 2001.69; (2001.69 − 82.24) / 200 = 9.5972; 9.5972² = 92.11 → 92
    # check: 92·100 + 82.24·√92 = 9200 + 788.8 = 9988.8 ≤ 10000 < 9300 + 82.24·√93 = 10093
    assert b_mem(eta=10_000, mu=100, sigma=50, eps_m=0.05) == 92


def test_b_mem_matches_eq12_worked_by_hand_at_eps_1_percent():
    # θ = Φ⁻¹(0.99) = 2.3263; σθ = 400·2.3263 = 930.54; (σθ)² = 865 903; 4μη = 4e8
    # √(400 865 903) = 20021.64; (20021.64 − 930.54) / 2000 = 9.5455; 9.5455² = 91.12 → 91
    assert b_mem(eta=100_000, mu=1000, sigma=400, eps_m=0.01) == 91


def test_b_mem_without_variance_is_capacity_over_mean_length():
    # σ = 0: b = (√(4μη) / 2μ)² = η/μ = 1000/30 = 33.3 → 33, whatever ε_M
    assert b_mem(1000, 30, 0, 0.01) == 33
    assert b_mem(1000, 30, 0, 0.4) == 33


def test_b_mem_at_even_odds_ignores_variance():
    # ε_M = 0.5: θ = Φ⁻¹(0.5) = 0, so b = η/μ = 262144/512 = 512 exactly (σ does not matter)
    assert b_mem(262_144, 512, 300, 0.5) == 512


def test_b_mem_exact_quotient_is_not_lost_to_rounding():
    # η/μ = 100 exactly; a floor of 99.99999999 would give 99
    assert b_mem(1000, 10, 0, 0.2) == 100


def test_b_mem_never_goes_below_the_running_requests():
    # η/μ = 1000/100 = 10
    assert b_mem(1000, 100, 0, 0.01, running=5) == 10
    assert b_mem(1000, 100, 0, 0.01, running=25) == 25


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("eta", dict(eta=0)),
        ("eta", dict(eta=float("inf"))),
        ("mu", dict(mu=0)),
        ("mu", dict(mu=-1)),
        ("sigma", dict(sigma=-0.1)),
        ("eps_m", dict(eps_m=0)),
        ("eps_m", dict(eps_m=1)),
        ("running", dict(running=-1)),
    ],
)
def test_b_mem_rejects_bad_arguments_naming_them(field, kwargs):
    args = dict(eta=1000.0, mu=10.0, sigma=1.0, eps_m=0.01) | kwargs
    with pytest.raises(ValueError, match=f"^{field} must be"):
        b_mem(**args)


etas = st.floats(1e3, 1e7)
mus = st.floats(1.0, 4096.0)
sigmas = st.floats(0.0, 4096.0)
epss = st.floats(1e-4, 0.5)


@given(etas, mus, sigmas, epss)
def test_b_mem_is_the_largest_size_meeting_the_overflow_bound(eta, mu, sigma, eps):
    b = b_mem(eta, mu, sigma, eps)
    # (a hair of slack either way: a size exactly on the bound may round to either side)
    assert b == 0 or fits(b, eta * (1 + 1e-9), mu, sigma, eps)
    assert not fits(b + 1, eta * (1 - 1e-9), mu, sigma, eps)


@given(etas, st.floats(1.0, 2.0), mus, sigmas, epss)
def test_b_mem_grows_with_capacity(eta, factor, mu, sigma, eps):
    assert b_mem(eta * factor, mu, sigma, eps) >= b_mem(eta, mu, sigma, eps)


@given(etas, mus, sigmas, st.floats(0.0, 1000.0), epss)
def test_b_mem_shrinks_with_length_spread(eta, mu, sigma, extra, eps):
    assert b_mem(eta, mu, sigma + extra, eps) <= b_mem(eta, mu, sigma, eps)


@given(etas, mus, sigmas, epss, st.floats(0.01, 1.0))
def test_b_mem_shrinks_with_a_smaller_overflow_probability(eta, mu, sigma, eps, factor):
    assert b_mem(eta, mu, sigma, eps * factor) <= b_mem(eta, mu, sigma, eps)


@given(etas, mus, st.floats(1.0, 2.0), sigmas, epss)
def test_b_mem_shrinks_with_longer_requests(eta, mu, factor, sigma, eps):
    assert b_mem(eta, mu * factor, sigma, eps) <= b_mem(eta, mu, sigma, eps)


# -- LengthStats -----------------------------------------------------------------------


def test_length_stats_is_empty_before_the_first_sample():
    stats = LengthStats()
    assert (stats.count, stats.mu, stats.sigma) == (0, None, None)


def test_length_stats_first_samples_give_exact_mean_and_variance():
    stats = LengthStats(half_life=256)
    for prompt, output in [(10, 100), (20, 300), (30, 200)]:
        stats.observe(prompt, output)
    # E[l_in] = 20, Var(l_in) = (100 + 0 + 100)/3; E[l_out] = 200, Var(l_out) = (1e4 + 1e4 + 0)/3
    # μ = 220, σ = √(20200/3) = 82.057
    assert stats.count == 3
    assert stats.mu == pytest.approx(220)
    assert stats.sigma == pytest.approx(math.sqrt(20_200 / 3))


def test_length_stats_follow_a_change_in_lengths():
    stats = LengthStats(half_life=10)
    for _ in range(200):
        stats.observe(0, 100)
    for _ in range(200):
        stats.observe(0, 500)
    # 200 samples = 20 half-lives: the old level keeps weight 2^-20
    assert stats.count == 400
    assert stats.mu == pytest.approx(500, abs=0.01)
    assert stats.sigma == pytest.approx(0, abs=1.0)


@pytest.mark.parametrize("field, args", [("prompt_tokens", (-1, 5)), ("output_tokens", (5, float("nan")))])
def test_length_stats_rejects_bad_lengths_naming_them(field, args):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        LengthStats().observe(*args)


def test_length_stats_rejects_a_bad_half_life():
    with pytest.raises(ValueError, match="^half_life must be"):
        LengthStats(half_life=0)


# -- SlaSizer (Algorithm 2) ------------------------------------------------------------


def test_sla_sizer_first_steps_follow_algorithm_2_by_hand():
    s = SlaSizer(0.030, b_min=1, b_max=512, alpha=4, delta=2, initial=32)
    # fast (20 ms < 30 − 1.5 ms) at b̄ = 32: low = min(32, 512 − 4) = 32, high = min(512 + 2, 512)
    # → b = ⌊(32 + 512)/2⌋ = 272
    assert s.update(0.020) == 272
    # slow (40 ms) at b̄ = 272: high = max(272, 32 + 4) = 272, low = max(32 − 2, 1) = 30
    # → b = ⌊(30 + 272)/2⌋ = 151
    assert s.update(0.040) == 151
    assert (s.low, s.high) == (30, 272)
    # within tolerance at b̄ = 151: window 151 ± ⌊4/2⌋ → b = ⌊(149 + 153)/2⌋ = 151
    assert s.update(0.0301) == 151
    assert (s.low, s.high) == (149, 153)


@given(
    a=st.floats(0.001, 0.02),
    c=st.floats(1e-5, 1e-3),
    b_star=st.floats(2.0, 500.0),
    initial=st.integers(1, 512),
)
def test_sla_sizer_converges_to_a_size_whose_tpot_meets_the_target(a, c, b_star, initial):
    d_sla = a + c * b_star  # TPOT(b) = a + c·b meets the target exactly at b*
    s = SlaSizer(d_sla, b_min=1, b_max=512, initial=initial)
    assume(s.eps_d / c >= 2)  # the tolerance band holds a few integer sizes
    tpot = lambda b: a + c * b  # noqa: E731
    for _ in range(30):
        s.update(tpot(s.b))
    for _ in range(10):  # ... and stays there
        assert abs(tpot(s.b) - d_sla) <= s.eps_d + 1e-12  # on the band's edge, up to rounding
        s.update(tpot(s.b))


def test_sla_sizer_converges_near_the_linear_models_solution():
    # TPOT(b) = 10 ms + 0.2 ms·b, target 30 ms → b* = 100; ε_D = 1.5 ms ↔ ±7.5 in b
    s = SlaSizer(0.030, b_min=1, b_max=512, initial=32)
    for _ in range(30):
        s.update(0.010 + 0.0002 * s.b)
    assert 93 <= s.b <= 107


@given(st.lists(st.floats(0.001, 0.1), max_size=20), st.floats(0.0316, 1.0))
def test_sla_sizer_shrinks_whenever_tpot_is_above_target(history, slow):
    s = SlaSizer(0.030, b_min=1, b_max=512, initial=64)  # ε_D = 1.5 ms
    for tpot in history:
        s.update(tpot)
    before = s.b
    after = s.update(slow)
    assert after < before or after == 1 or s.infeasible  # or the SLO is given up (the tests below)


@given(st.lists(st.floats(0.001, 0.1), max_size=20), st.floats(0.0, 0.0284))
def test_sla_sizer_never_shrinks_when_tpot_is_below_target(history, fast):
    s = SlaSizer(0.030, b_min=1, b_max=512, initial=64)
    for tpot in history:
        s.update(tpot)
    before = s.b
    assert s.update(fast) >= before


@given(st.lists(st.one_of(st.none(), st.floats(0.001, 0.1)), max_size=20))
def test_sla_sizer_holds_without_fresh_tpot(history):
    s = SlaSizer(0.030, b_min=1, b_max=512, initial=64)
    for tpot in history:
        s.update(tpot)
    state = (s.b, s.low, s.high)
    assert s.update(None) == state[0]
    assert (s.b, s.low, s.high) == state


@given(st.lists(st.tuples(st.one_of(st.none(), st.floats(0.0, 0.1)), st.one_of(st.none(), st.floats(0, 600)))))
def test_sla_sizer_keeps_its_size_inside_its_search_window(steps):
    s = SlaSizer(0.030, b_min=2, b_max=512, initial=64)
    for tpot, observed in steps:
        s.update(tpot, observed)
        assert 2 <= s.low <= s.b <= s.high <= 512


def test_sla_sizer_gives_up_an_slo_the_engine_misses_at_the_smallest_size():
    """A real vLLM CPU server takes ~32 ms a token at any batch size, the SLO is 20 ms:
    the search walks down to b_min, and three slow scrapes there give the SLO up."""
    s = SlaSizer(0.020, b_min=1, b_max=64, initial=32)
    sizes = [s.update(0.032) for _ in range(40)]
    first_min = sizes.index(1)
    # three scrapes measured at b_min (the third returns the lifted bound)
    assert sizes[first_min : first_min + 4] == [1, 1, 1, 64]
    assert s.infeasible and s.b == 64 and s.tpot_at_min == pytest.approx(0.032)
    assert sizes[-1] == 64 and s.update(0.040) == 64  # still beyond it: no more shrinking


def test_sla_sizer_searches_again_once_the_engine_meets_the_slo():
    s = SlaSizer(0.020, b_min=1, b_max=64, initial=1)
    for _ in range(3):
        s.update(0.032)
    assert s.infeasible
    s.update(0.015)  # e.g. a lighter model or a freed GPU: within reach again
    assert not s.infeasible
    for _ in range(60):
        s.update(0.010 + 0.0002 * s.b)  # TPOT(b) meets 20 ms up to b = 50
    assert not s.infeasible and 45 <= s.b <= 55  # TPOT within 20 ± 1 ms


def test_one_slow_scrape_at_the_smallest_size_does_not_give_the_slo_up():
    s = SlaSizer(0.020, b_min=1, b_max=64, initial=1)
    for tpot in (0.032, 0.032, 0.019, 0.032, 0.032, 0.019):  # never three slow in a row
        s.update(tpot, observed_batch=1)
    assert not s.infeasible


def test_a_slow_engine_running_more_than_the_smallest_size_is_not_proof_of_infeasibility():
    s = SlaSizer(0.020, b_min=1, b_max=64, initial=1)
    for _ in range(5):
        s.update(0.032, observed_batch=8)  # 8 of ours decoded: a smaller batch may still meet it
    assert not s.infeasible


def test_after_an_slo_is_given_up_stale_metrics_hold_the_size_instead_of_halving_it():
    sizer = BatchSizer(mode="sla", d_sla=0.020, static_size=4, max_size=64, kv_plan=True)
    slow = EngineSnapshot(kv_capacity_tokens=100_000, tpot_seconds=0.032, fresh=True)
    for _ in range(10):
        sizer.update(slow, k=1)
    assert sizer.sla is not None and sizer.sla.infeasible and sizer.sizes == [64]
    stale = sizer.update(EngineSnapshot(fresh=False), k=1)
    assert (stale.reason, stale.sizes) == ("stale-last-good", [64])


def test_the_sizer_reports_an_slo_given_up_with_the_tpot_it_saw():
    sizer = BatchSizer(mode="sla", d_sla=0.020, static_size=4, max_size=64, kv_plan=True)
    slow = EngineSnapshot(kv_capacity_tokens=100_000, tpot_seconds=0.032, fresh=True)
    decisions = [sizer.update(slow, k=1) for _ in range(10)]
    assert decisions[0].reason == "sla" and decisions[-1].reason == "sla-infeasible"
    assert decisions[-1].sizes == [64]
    assert "lifted: at 1 running the engine took 32.0 ms a token" in decisions[-1].detail


def test_sla_sizer_uses_the_observed_batch_when_given():
    s = SlaSizer(0.030, b_min=1, b_max=512, initial=200)
    # slow while only 40 ran: high = max(40, 1 + 4) = 40, low = max(1 − 2, 1) = 1 → b = 20
    assert s.update(0.050, observed_batch=40) == 20


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("d_sla", dict(d_sla=0)),
        ("b_min", dict(b_min=0)),
        ("b_max", dict(b_min=8, b_max=4)),
        ("eps_d", dict(eps_d=-1)),
        ("alpha", dict(alpha=0)),
        ("delta", dict(delta=-1)),
        ("initial", dict(initial=1000)),
    ],
)
def test_sla_sizer_rejects_bad_parameters_naming_them(field, kwargs):
    args = dict(d_sla=0.03) | kwargs
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SlaSizer(**args)


def test_sla_sizer_rejects_a_nan_tpot():
    with pytest.raises(ValueError, match="^tpot must be"):
        SlaSizer(0.03).update(float("nan"))


# -- combine ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mem, sla, expected",
    [
        (100, 50, 50),
        (40, 50, 40),
        (None, 50, 50),
        (100, None, 100),
        (None, None, 256),  # no bound: the policy's max_size
        (1000, None, 256),
        (0, 50, 1),
    ],
)
def test_combine_takes_the_smaller_bound_within_limits(mem, sla, expected):
    assert combine(mem, sla, min_size=1, max_size=256) == expected


def test_combine_rejects_inverted_limits():
    with pytest.raises(ValueError, match="^max_size must be"):
        combine(10, 10, min_size=8, max_size=4)


# -- BatchSizer ------------------------------------------------------------------------


def two_bin_sizer(**kw) -> BatchSizer:
    """Bin 0: prompt 100 + output 50 tokens; bin 1: prompt 100 + output 950 (40 each)."""
    sizer = BatchSizer(**({"mode": "memory", "static_size": 32, "max_size": 1024} | kw))
    for _ in range(40):
        sizer.observe(0, 100, 50)
        sizer.observe(1, 100, 950)
    return sizer


def test_short_output_bins_batch_wider():
    decision = two_bin_sizer().update(FRESH, k=3)
    # bin 0: μ = 150, σ = 0 → 100000/150 = 666.7 → 666
    # bin 1: μ = 1050, σ = 0 → 100000/1050 = 95.2 → 95
    # bin 2 (no samples) uses all 80: μ = 600, σ = 450 (outputs 50 | 950), θ = 2.3263 (ε_M = 1%)
    #   σθ = 1046.9; √(1046.9² + 4·600·1e5) = √241 096 000 = 15527.3
    #   ((15527.3 − 1046.9) / 1200)² = 12.067² = 145.6 → 145
    assert decision.sizes == [666, 95, 145]
    assert decision.b_mem == [666, 95, 145]
    assert decision.reason == "memory"


def test_size_is_clamped_to_max_size():
    assert two_bin_sizer(max_size=256).update(FRESH, k=2).sizes == [256, 95]


def test_running_requests_are_the_floor_of_the_memory_size():
    snap = EngineSnapshot(kv_capacity_tokens=100_000, running=120, fresh=True)
    assert two_bin_sizer().update(snap, k=2).sizes == [666, 120]


def test_kv_reserve_shrinks_the_capacity_used():
    # η·(1 − 0.1) = 90000: 90000/150 = 600, 90000/1050 = 85.7 → 85
    assert two_bin_sizer(kv_reserve_ratio=0.1).update(FRESH, k=2).sizes == [600, 85]


def test_sizer_uses_the_static_size_while_warming_up():
    sizer = BatchSizer(mode="memory", static_size=32, min_samples=32)
    for _ in range(31):
        sizer.observe(0, 10, 10)
    decision = sizer.update(FRESH, k=2)
    assert (decision.sizes, decision.reason, decision.b_mem) == ([32, 32], "warming-up", [None, None])


def test_bin_with_few_samples_borrows_the_overall_statistics():
    sizer = BatchSizer(mode="memory", static_size=32, max_size=4096, min_samples=32)
    for _ in range(40):
        sizer.observe(0, 0, 100)
    for _ in range(5):
        sizer.observe(1, 0, 2000)
    # bin 1 has 5 < 32 samples: overall μ = (40·100 + 5·2000)/45 = 311.1, σ = 597.3
    overall = sizer.overall
    expected = b_mem(100_000, overall.mu, overall.sigma, 0.01)
    assert sizer.update(FRESH, k=2).sizes[1] == expected


def test_missing_kv_capacity_falls_back_to_the_static_size():
    decision = two_bin_sizer().update(EngineSnapshot(fresh=True), k=2)
    assert (decision.sizes, decision.reason) == ([32, 32], "no-kv-capacity")


def test_static_mode_ignores_metrics():
    sizer = two_bin_sizer(mode="static", static_size=48)
    for snap in (FRESH, STALE, None, EngineSnapshot(kv_capacity_tokens=10, kv_usage_ratio=1.0, fresh=True)):
        decision = sizer.update(snap, k=3)
        assert (decision.sizes, decision.reason) == ([48, 48, 48], "static")


def test_stale_metrics_hold_the_last_good_sizes_instead_of_shrinking():
    """Stale metrics used to halve every bin toward min_size each update (1 in
    ~7 s): a 3x throughput loss while the engine was healthy."""
    sizer = two_bin_sizer(min_size=4)
    assert sizer.update(FRESH, k=2).sizes == [666, 95]
    for _ in range(20):
        decision = sizer.update(STALE, k=2)
        assert (decision.sizes, decision.reason) == ([666, 95], "stale-last-good")
    assert "last good sizes [666, 95]" in decision.detail


def test_stale_metrics_before_any_fresh_scrape_use_the_static_size():
    sizer = two_bin_sizer(static_size=48)
    for _ in range(5):
        decision = sizer.update(STALE, k=2)
        assert (decision.sizes, decision.reason) == ([48, 48], "stale-static")


@pytest.mark.parametrize(
    ("last_fresh", "sign"),
    [
        (EngineSnapshot(kv_capacity_tokens=100_000, kv_usage_ratio=0.97, fresh=True), "KV usage 0.97"),
        (EngineSnapshot(kv_capacity_tokens=100_000, preemptions_delta=3, fresh=True), "3 preemptions"),
        (EngineSnapshot(kv_capacity_tokens=100_000, tpot_seconds=0.5, fresh=True), "TPOT 500.0 ms"),
    ],
)
def test_stale_metrics_shrink_once_when_the_last_fresh_scrape_showed_pressure(last_fresh, sign):
    sizer = two_bin_sizer(min_size=4, mode="combined", d_sla=0.05, static_size=64)
    sizer.update(FRESH, k=2)
    good = sizer.update(last_fresh, k=2).sizes
    for _ in range(10):
        decision = sizer.update(STALE, k=2)
        # half the last good size, once: 4 + (g - 4) // 2, not all the way to min_size
        assert decision.sizes == [4 + (g - 4) // 2 for g in good]
        assert decision.reason == "stale-pressure" and sign in decision.detail


def test_broken_metrics_endpoint_keeps_the_batch_size_on_a_fake_clock():
    """The feed and the sizer together: a scrape failing for 10 s of (manual) time
    after a healthy one leaves B_t where it was, and says so."""
    from binbatch_sidecar.core.clock import ManualClock
    from binbatch_sidecar.engine.metrics_feed import MetricsFeed, MetricsUnavailable
    from binbatch_sidecar.engine.vllm_metrics import EngineMetrics

    class Source:
        kind, url = "scrape", "http://engine/metrics"
        healthy = True

        async def fetch(self) -> EngineMetrics:
            if not self.healthy:
                raise MetricsUnavailable("GET http://engine/metrics: ConnectionRefusedError")
            return EngineMetrics(kv_usage=0.3, running=10, num_gpu_blocks=6250, block_size=16,
                                 names_seen=frozenset({"vllm:x"}))  # fmt: skip

    clock = ManualClock()
    sizer = two_bin_sizer(min_size=1)
    decisions = []
    source = Source()
    feed = MetricsFeed(source, interval=0.5, stale_after=3.0, clock=clock,
                       on_snapshot=lambda snap: decisions.append(sizer.update(snap, k=2)))  # fmt: skip

    async def run() -> None:
        await feed.poll_once()
        source.healthy = False
        for _ in range(20):  # 10 s of failed scrapes
            clock.advance(0.5)
            await feed.poll_once()

    import asyncio

    asyncio.run(run())
    assert decisions[0].sizes == [666, 95] and decisions[0].reason == "memory"
    assert feed.state == "stale"
    assert [d.sizes for d in decisions] == [[666, 95]] * 21
    assert decisions[-1].reason == "stale-last-good"


def test_no_metrics_falls_back_to_static_size_without_growing():
    sizer = two_bin_sizer(static_size=128)
    assert sizer.update(FRESH, k=2).sizes == [666, 95]
    decision = sizer.update(None, k=2)
    assert (decision.sizes, decision.reason) == ([128, 95], "no-metrics")


snapshots = st.one_of(
    st.none(),
    st.builds(
        EngineSnapshot,
        kv_capacity_tokens=st.one_of(st.none(), st.floats(1e3, 1e7)),
        kv_usage_ratio=st.one_of(st.none(), st.floats(0, 1)),
        running=st.one_of(st.none(), st.integers(0, 2000)),
        tpot_seconds=st.one_of(st.none(), st.floats(0.001, 0.2)),
        fresh=st.booleans(),
    ),
)


@given(st.lists(snapshots, min_size=1, max_size=12), st.sampled_from(["memory", "sla", "combined"]))
def test_stale_or_missing_metrics_never_grow_any_bin(snaps, mode):
    sizer = two_bin_sizer(mode=mode, d_sla=0.03, static_size=32, max_size=1024)
    before = sizer.update(FRESH, k=3).sizes
    for snap in snaps:
        decision = sizer.update(snap, k=3)
        assert len(decision.sizes) == 3
        assert all(1 <= s <= 1024 for s in decision.sizes)
        assert all(r in REASONS for r in decision.reason.split("+"))
        if snap is None or not snap.fresh:
            assert all(new <= old for new, old in zip(decision.sizes, before))
        before = decision.sizes


def test_full_kv_cache_stops_every_bin_from_growing():
    sizer = two_bin_sizer()
    small = EngineSnapshot(kv_capacity_tokens=50_000, fresh=True)
    assert sizer.update(small, k=2).sizes == [333, 47]  # 50000/150, 50000/1050
    full = EngineSnapshot(kv_capacity_tokens=100_000, kv_usage_ratio=0.97, fresh=True)
    decision = sizer.update(full, k=2)
    assert (decision.sizes, decision.reason) == ([333, 47], "kv-saturated")


def test_sla_bound_wins_when_latency_is_the_tighter_limit():
    sizer = two_bin_sizer(mode="combined", d_sla=0.030, static_size=64)
    # TPOT 50 ms at b̄ = 64 is slow: high = max(64, 1 + 4) = 64, low = 1 → b_sla = ⌊65/2⌋ = 32
    decision = sizer.update(EngineSnapshot(kv_capacity_tokens=100_000, tpot_seconds=0.050, fresh=True), k=2)
    assert decision.b_sla == 32
    assert decision.sizes == [32, 32]
    assert decision.reason == "sla"


def test_reason_names_both_bounds_when_bins_differ():
    sizer = two_bin_sizer(mode="combined", d_sla=0.030, static_size=200)
    # b_sla holds its initial 200 without TPOT; bin 0 (666) is bound by it, bin 1 (95) by memory
    decision = sizer.update(FRESH, k=2)
    assert decision.sizes == [200, 95]
    assert decision.reason == "memory+sla"


def test_sizes_follow_a_change_in_the_number_of_bins():
    sizer = two_bin_sizer()
    sizer.update(FRESH, k=2)
    assert len(sizer.update(STALE, k=4).sizes) == 4
    assert sizer.sizes == [95] * 4  # the smallest old size (95) held, stale metrics being no pressure


def test_reset_bins_forgets_per_bin_statistics():
    sizer = two_bin_sizer()
    sizer.reset_bins()
    assert sizer.bin_stats(0) is None
    assert sizer.update(FRESH, k=2).sizes == [145, 145]  # the overall statistics for both


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("mode", dict(mode="dynamic")),
        ("min_size", dict(min_size=0)),
        ("max_size", dict(min_size=8, max_size=4, static_size=8)),
        ("static_size", dict(static_size=1000, max_size=256)),
        ("eps_m", dict(eps_m=1.5)),
        ("kv_reserve_ratio", dict(kv_reserve_ratio=1.0)),
        ("kv_saturation", dict(kv_saturation=0)),
        ("min_samples", dict(min_samples=0)),
        ("d_sla", dict(mode="sla")),
    ],
)
def test_batch_sizer_rejects_bad_settings_naming_them(field, kwargs):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        BatchSizer(**kwargs)


def test_batch_sizer_rejects_a_bad_bin_count():
    with pytest.raises(ValueError, match="^k must be"):
        BatchSizer().update(FRESH, k=0)


# -- the engine has room: a static guess is not the cap (issue 11 item 4) ---------------

ROOM = EngineSnapshot(kv_capacity_tokens=131072, kv_usage_ratio=0.02, running=0, waiting=0, fresh=True)


def test_warming_up_admits_up_to_the_max_size_while_the_engine_has_room():
    # A short burst of 64 on an engine with ample KV: the static 32 halved its throughput.
    sizer = BatchSizer(mode="combined", static_size=32, max_size=256, min_samples=32)
    decision = sizer.update(ROOM, k=4)
    assert (decision.sizes, decision.reason) == ([256] * 4, "warming-up")
    assert "has room" in decision.detail


def test_unknown_kv_capacity_admits_up_to_the_max_size_while_the_engine_has_room():
    sizer = BatchSizer(mode="memory", static_size=32, max_size=256)
    snap = EngineSnapshot(kv_usage_ratio=0.1, running=3, waiting=0, fresh=True)
    assert sizer.update(snap, k=2).sizes == [256, 256]


@pytest.mark.parametrize(
    "why",
    [
        {"kv_usage_ratio": 0.95},  # at saturation
        {"kv_usage_ratio": None},
        {"preemptions_delta": 2.0},
    ],
)
def test_warming_up_keeps_the_static_size_when_the_engine_shows_no_room(why):
    sizer = BatchSizer(mode="combined", static_size=32, max_size=256, min_samples=32)
    fields = {"kv_capacity_tokens": 131072, "kv_usage_ratio": 0.02, "running": 0, "waiting": 0} | why
    decision = sizer.update(EngineSnapshot(**fields, fresh=True), k=2)
    assert decision.sizes == [32, 32] and decision.reason in ("warming-up", "kv-saturated")


def test_room_lost_in_warm_up_stops_growth_at_once():
    sizer = BatchSizer(mode="memory", static_size=32, max_size=256, min_samples=32)
    assert sizer.update(ROOM, k=1).sizes == [256]
    busy = EngineSnapshot(kv_capacity_tokens=131072, kv_usage_ratio=0.5, running=200, preemptions_delta=3.0,
                          fresh=True)  # fmt: skip
    assert sizer.update(busy, k=1).sizes == [32]


def test_requests_queued_for_the_engines_next_step_are_not_a_lack_of_room():
    # In a burst the engine lists the requests that arrived since its last step as
    # waiting; the static size came back mid-burst and admitted it in two waves.
    sizer = BatchSizer(mode="combined", static_size=32, max_size=256, min_samples=32)
    mid_burst = EngineSnapshot(kv_capacity_tokens=131072, kv_usage_ratio=0.01, running=26, waiting=38, fresh=True)
    assert sizer.update(mid_burst, k=4).sizes == [256] * 4
