"""The simulator drives the real core and reproduces the theory (reduced sizes)."""

from __future__ import annotations

import pytest

from binbatch_sidecar.core import theory
from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.sim.simulator import (
    NoisyBinPredictor,
    OraclePredictor,
    Simulation,
    Workload,
)


def saturated(k: int, n: int, seed: int = 3, batch: int = 128):
    binner = FixedBinner.uniform(k, 1.0, 20.0)
    return Simulation(Workload(n=n, seed=seed), OraclePredictor(), binner, batch_size=batch).run()


@pytest.mark.parametrize("k", [1, 2, 4, 8, 16, 32])
def test_saturated_throughput_reproduces_theorem_4_2_within_3_percent(k):
    res = saturated(k, 20_000)
    assert res.saturated_throughput == pytest.approx(theory.throughput(k, 128, 1, 20), rel=0.03)


def test_every_request_is_served_once_including_the_drained_tail():
    res = saturated(8, 5_000)
    assert res.completed == 5_000
    assert sum(res.batch_sizes) == 5_000
    assert res.batches.get("drain", 0) >= 1  # partial bins at the end were flushed


def test_more_bins_serve_faster_in_the_same_run_settings():
    got = [saturated(k, 20_000).saturated_throughput for k in (1, 2, 4)]
    assert got[0] < got[1] < got[2]


def test_latency_at_low_load_is_at_least_lemma_5_1_and_close_to_it():
    lam = 1.0
    binner = FixedBinner.uniform(2, 1.0, 20.0)
    w = Workload(n=6_000, rate=lam, seed=5)
    res = Simulation(w, OraclePredictor(), binner, batch_size=32).run()
    bound = theory.latency_lower_bound(2, 32, 1, 20, lam)
    assert bound * 0.97 <= res.mean_latency <= bound * 1.15


def test_max_wait_bounds_the_time_to_form_a_batch():
    # At λ=0.5 a bin of 128 would take ~256 time units to fill; maxWait=10 cuts it.
    binner = FixedBinner.uniform(1, 1.0, 20.0)
    res = Simulation(
        Workload(n=500, rate=0.5, seed=2), OraclePredictor(), binner, batch_size=128, max_wait=10.0
    ).run()
    assert res.batches.get("timeout", 0) > 0 and res.batches.get("full", 0) == 0
    assert res.completed == 500


def test_bin_errors_lower_throughput_towards_one_bin():
    def run(p: float) -> float:
        binner = FixedBinner.uniform(4, 1.0, 20.0)
        edges = [1.0, *binner.boundaries, 20.0]
        pred = NoisyBinPredictor(edges, p, seed=9)
        return Simulation(Workload(n=20_000, seed=4), pred, binner, batch_size=128).run().saturated_throughput

    clean, noisy = run(0.0), run(0.5)
    assert noisy < clean * 0.97
    assert noisy > theory.throughput(1, 128, 1, 20)


def test_noisy_predictor_moves_a_fraction_p_to_neighbouring_bins():
    edges = [0.0, 1.0, 2.0, 3.0, 4.0]
    pred = NoisyBinPredictor(edges, 0.4, seed=1)
    n = 20_000
    inner = [pred.predict(Request(id="x", arrival=0, actual_tokens=1.25)) for _ in range(n)]
    edge = [pred.predict(Request(id="x", arrival=0, actual_tokens=0.25)) for _ in range(n)]
    below = sum(0 <= v < 1 for v in inner) / n
    above = sum(2 <= v < 3 for v in inner) / n
    assert below == pytest.approx(0.2, abs=0.02) and above == pytest.approx(0.2, abs=0.02)
    assert {round(v % 1, 6) for v in inner} == {0.25}  # relative place in the bin kept
    assert sum(1 <= v < 2 for v in edge) / n == pytest.approx(0.2, abs=0.02)


def test_workload_is_validated_by_name():
    with pytest.raises(ValueError, match="rate"):
        Workload(n=10, rate=0)
    with pytest.raises(ValueError, match="n must"):
        Workload(n=0)
