"""The SMDP dispatch policy (smdp-dynamic-batching.txt, DESIGN §3.4) and its bench."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from binbatch_sidecar.bench import smdp_bench
from binbatch_sidecar.core import smdp
from binbatch_sidecar.core.smdp import ControlLimit, SmdpModel

RHOS = (0.2, 0.5, 0.85)


def figure5(rho: float, **overrides) -> SmdpModel:
    return smdp_bench.default_model(rho * smdp_bench.MU_MAX, **overrides)


def serves_from_the_limit_on(actions: tuple[int, ...]) -> bool:
    limit = smdp.control_limit(actions)
    return limit is not None and all(a == 0 for a in actions[:limit]) and all(a > 0 for a in actions[limit:])


# --- optimality and structure -------------------------------------------------------


@pytest.mark.parametrize("w2", [0.0, 1.0, 10.0])
@pytest.mark.parametrize("rho", RHOS)
def test_optimal_policy_costs_no_more_than_static_or_work_conserving(rho, w2):
    model = figure5(rho, w2=w2)
    best = smdp.solve(model)
    others = [smdp.work_conserving_policy(model)] + [smdp.static_policy(model, b) for b in (1, 4, 8, 16, 32)]
    for actions in others:
        assert best.avg_cost <= smdp.average_cost(model, actions) + 1e-6


@given(
    rho=st.floats(0.05, 0.9),
    alpha=st.floats(0.0, 2.0),
    beta=st.floats(0.05, 5.0),
    gamma=st.floats(0.0, 20.0),
    delta=st.floats(0.0, 100.0),
    b_max=st.integers(1, 8),
    w2=st.floats(0.0, 5.0),
)
@settings(max_examples=25, deadline=None)
def test_no_reference_policy_beats_the_optimum_on_random_small_models(rho, alpha, beta, gamma, delta, b_max, w2):
    lam = rho * b_max / (alpha * b_max + beta)
    model = SmdpModel(lam, alpha, beta, gamma, delta, b_max=b_max, w1=1.0, w2=w2, s_max=6 * b_max + 30)
    best = smdp.solve(model)
    assert best.converged
    others = [smdp.work_conserving_policy(model)]
    others += [smdp.static_policy(model, b) for b in range(1, b_max + 1)]
    worst_tolerance = 1e-6 + 1e-9 * best.avg_cost
    assert all(best.avg_cost <= smdp.average_cost(model, a) + worst_tolerance for a in others)


@pytest.mark.parametrize("w2", [0.0, 1.0, 10.0])
@pytest.mark.parametrize("rho", RHOS)
def test_optimal_policy_waits_below_a_control_limit_and_serves_from_it_on(rho, w2):
    assert serves_from_the_limit_on(smdp.solve(figure5(rho, w2=w2)).actions)


def test_latency_only_objective_never_idles_while_requests_wait():
    # §V-A: with w2 = 0 the control limit is close to 1. With a small intercept β it is
    # exactly 1, as for work-conserving; the optimum may still split the queue into
    # smaller batches (those served leave sooner), so it is a little cheaper.
    for rho in RHOS:
        model = figure5(rho, w2=0.0, beta=0.05)
        best = smdp.solve(model)
        greedy = smdp.average_cost(model, smdp.work_conserving_policy(model))
        assert best.control_limit == 1
        assert best.avg_cost <= greedy < 1.1 * best.avg_cost


def test_latency_only_objective_on_the_p4_profile_has_a_control_limit_near_one():
    assert all(smdp.solve(figure5(rho, w2=0.0)).control_limit <= 2 for rho in RHOS)


@pytest.mark.parametrize("rho", RHOS)
def test_larger_fixed_energy_per_batch_raises_the_control_limit(rho):
    deltas = (0.0, 28.0, 100.0, 300.0, 1000.0)  # mJ per batch; the P4 profile has 28
    limits = [smdp.solve(figure5(rho, delta=delta)).control_limit for delta in deltas]
    assert limits == sorted(limits)
    assert limits[-1] > limits[0]


def test_heavier_energy_weight_raises_the_control_limit():
    limits = [smdp.solve(figure5(0.5, w2=w2)).control_limit for w2 in (0.0, 1.0, 10.0, 100.0)]
    assert limits == sorted(limits)
    assert limits[-1] > limits[0]


# --- relative value iteration ---------------------------------------------------------


@pytest.mark.parametrize("rho", RHOS)
def test_rvi_converges_and_its_bounds_bracket_the_optimal_cost(rho):
    best = smdp.solve(figure5(rho))
    lo, hi = best.bounds
    assert best.converged
    assert lo - 1e-9 <= best.avg_cost <= hi + 1e-9
    assert hi - lo < 1e-6


def test_plain_rvi_reaches_the_same_policy_as_the_accelerated_one():
    model = figure5(0.5, s_max=120)
    plain = smdp.solve(model, evaluate_every=None)
    assert plain.converged
    assert plain.actions == smdp.solve(model).actions
    assert plain.avg_cost == pytest.approx(smdp.solve(model).avg_cost, rel=1e-9)


def test_rvi_reports_not_converged_when_stopped_early():
    sol = smdp.solve(figure5(0.5), max_iter=3, evaluate_every=None)
    assert not sol.converged
    assert sol.iterations == 3


def test_a_larger_truncation_leaves_the_optimum_unchanged():
    small, large = smdp.solve(figure5(0.7, s_max=150)), smdp.solve(figure5(0.7, s_max=300))
    assert small.actions[:100] == large.actions[:100]
    assert small.avg_cost == pytest.approx(large.avg_cost, rel=1e-9)


# --- exact evaluation of any policy (Eq. 14) --------------------------------------------


def test_average_cost_matches_a_hand_computed_value_on_a_tiny_model():
    # λ = 0.5, l(a) = a + 1, ζ(a) = a + 2, B_max = s_max = 2, w1 = 1, w2 = 0.1, no tail excess.
    # Policy (0, 0, 2): wait at 0 and 1, serve 2 at 2. Serving takes l(2) = 3, so
    # n ~ Poisson(1.5): p0 = e^-1.5 = 0.223130, p1 = 1.5 e^-1.5 = 0.334695.
    # Chain 0 -> 1 -> 2, and 2 -> min(n, 2); balance gives π ∝ (p0, p0 + p1, 1).
    # Costs (Eq. 9): c(0) = 0, c(1) = 1/λ = 2, c(2) = 2·3 + λ·3²/2 + 0.1·ζ(2)
    #   = 8.65, plus the requests lost past s_max (Eq. 13): 0.1·(γ + δ/B_max)·E(n − 2)^+
    #   = 0.2·(1.5 − 2 + 2 p0 + p1) = 0.2·0.280956 = 0.056191  ->  c(2) = 8.706191.
    # Sojourns (Eq. 7): 1/λ = 2, 2, 3.
    # g = (0.557825·2 + 8.706191) / (0.223130·2 + 0.557825·2 + 3) = 9.821842 / 4.561911 = 2.153010
    model = SmdpModel(
        lam=0.5, alpha=1.0, beta=1.0, gamma=1.0, delta=2.0, b_max=2, w1=1.0, w2=0.1, s_max=2, tail_excess=0.0
    )
    assert smdp.average_cost(model, (0, 0, 2)) == pytest.approx(2.153010, abs=1e-6)


def test_average_cost_of_a_single_server_queue_is_the_mm1_like_closed_form():
    # B_max = 1, α = 0: an M/D/1 queue with service β; Pollaczek–Khinchine gives
    # L = ρ + ρ²/(2(1 − ρ)). Work-conserving with w2 = 0 costs exactly L when s_max is large.
    rho = 0.6
    model = SmdpModel(lam=rho, alpha=0.0, beta=1.0, gamma=0.0, delta=0.0, b_max=1, w1=1.0, w2=0.0, s_max=200)
    expected = rho + rho**2 / (2 * (1 - rho))
    assert smdp.average_cost(model, smdp.work_conserving_policy(model)) == pytest.approx(expected, rel=1e-9)


def test_transition_rows_are_probability_distributions():
    model = figure5(0.5)
    for actions in (smdp.work_conserving_policy(model), smdp.static_policy(model, 16)):
        p = smdp.transition_matrix(model, actions)
        assert np.all(p >= 0)
        assert np.allclose(p.sum(axis=1), 1.0)


def test_a_policy_that_cannot_keep_up_lives_in_the_overflow_state():
    model = figure5(0.9)  # static-8 serves at most 8 / l(8) < λ
    assert smdp.overflow_share(model, smdp.static_policy(model, 8)) > 0.5
    assert smdp.overflow_share(model, smdp.solve(model).actions) < 1e-6


@pytest.mark.parametrize(
    "actions, message",
    [
        ((0, 1), "actions"),  # wrong length
        ((0, 2, 0, 0), r"actions\[1\]"),  # more than waiting
        ((0, 1, 1, -1), r"actions\[3\]"),  # negative
        ((0.0, 1.0, 1.0, 1.0), "actions"),  # not integers
    ],
)
def test_average_cost_rejects_infeasible_actions(actions, message):
    model = SmdpModel(lam=0.1, alpha=1.0, beta=1.0, gamma=1.0, delta=1.0, b_max=1, s_max=3)
    with pytest.raises(ValueError, match=message):
        smdp.average_cost(model, actions)


# --- reference policies and the dispatch rule ---------------------------------------------


def test_static_policy_serves_exactly_b_once_b_wait():
    model = SmdpModel(lam=0.1, alpha=1.0, beta=1.0, gamma=1.0, delta=1.0, b_max=4, s_max=6)
    assert smdp.static_policy(model, 3) == (0, 0, 0, 3, 3, 3, 3)
    assert smdp.work_conserving_policy(model) == (0, 1, 2, 3, 4, 4, 4)
    with pytest.raises(ValueError, match="b must"):
        smdp.static_policy(model, 5)


def test_control_limit_waits_below_the_threshold_and_serves_from_it():
    sol = smdp.solve(figure5(0.5))
    policy = ControlLimit(sol)
    limit = sol.control_limit
    assert policy.threshold == limit > 1
    assert policy.decide(0) == 0
    assert policy.decide(limit - 1) == 0
    assert 0 < policy.decide(limit) <= limit
    assert all(policy.decide(w) <= min(w, 32) for w in range(0, 260))


def test_control_limit_serves_full_batches_beyond_the_truncation():
    sol = smdp.solve(figure5(0.5))
    policy = ControlLimit(sol)
    assert policy.decide(sol.model.s_max) == 32
    assert policy.decide(10 * sol.model.s_max) == 32


# --- validation ---------------------------------------------------------------------------


GOOD = dict(lam=1.0, alpha=0.3, beta=1.0, gamma=17.0, delta=28.0, b_max=32, w1=1.0, w2=1.0, s_max=200)


@pytest.mark.parametrize(
    "field, value",
    [
        ("lam", 0.0),
        ("lam", 5.0),  # above μ_max = 32 / 10.6
        ("lam", math.nan),
        ("alpha", -0.1),
        ("beta", math.inf),
        ("gamma", -1.0),
        ("delta", -1.0),
        ("b_max", 0),
        ("b_max", 2.5),
        ("w1", -1.0),
        ("w2", "1"),
        ("s_max", 16),  # below b_max
        ("s_max", True),
        ("tail_excess", -1.0),
    ],
)
def test_invalid_model_field_is_named_in_the_error(field, value):
    with pytest.raises(ValueError, match=field):
        SmdpModel(**{**GOOD, field: value})


def test_zero_service_time_and_zero_weights_are_rejected():
    with pytest.raises(ValueError, match="alpha and beta"):
        SmdpModel(**{**GOOD, "alpha": 0.0, "beta": 0.0})
    with pytest.raises(ValueError, match="w1 and w2"):
        SmdpModel(**{**GOOD, "w1": 0.0, "w2": 0.0})


@pytest.mark.parametrize("field, value", [("tol", 0.0), ("max_iter", 0), ("evaluate_every", 0)])
def test_invalid_solver_setting_is_named_in_the_error(field, value):
    with pytest.raises(ValueError, match=field):
        smdp.solve(figure5(0.5), **{field: value})


# --- the bench --------------------------------------------------------------------------------


def test_compare_policies_scores_everything_against_the_smdp_optimum():
    rows = smdp_bench.compare_policies(figure5(0.3))
    assert [r["policy"] for r in rows] == ["smdp", "work-conserving", "static-8", "static-16", "static-32"]
    assert rows[0]["ratio_to_smdp"] == 1.0
    assert all(r["ratio_to_smdp"] >= 1.0 for r in rows)
    assert len({tuple(r) for r in rows}) == 1  # same columns in every row


def test_sweep_gives_one_row_per_policy_and_rate_and_flags_unstable_static_batches():
    rows = smdp_bench.sweep(smdp_bench.DEFAULT_RATES[-1:], static_sizes=(8, 32))
    by_name = {r["policy"]: r for r in rows}
    assert set(by_name) == {"smdp", "work-conserving", "static-8", "static-32"}
    assert by_name["static-8"]["stable"] is False
    assert by_name["smdp"]["stable"] is True


def test_default_model_is_the_p4_profile_with_32_max_batch():
    model = smdp_bench.default_model(1.0)
    assert (model.alpha, model.beta, model.gamma, model.delta, model.b_max) == (0.3, 1.0, 17.0, 28.0, 32)
    assert smdp_bench.MU_MAX == pytest.approx(32 / 10.6)
    assert "B_max=32" in smdp_bench.describe(model)
