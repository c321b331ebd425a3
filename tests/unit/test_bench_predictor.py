"""``binbatch bench predictor``: every predictor judged on the held-out split, the oracle the yardstick."""

from __future__ import annotations

import json

import numpy as np
import pytest

from binbatch_sidecar import cli
from binbatch_sidecar.bench import predictor as bench
from binbatch_sidecar.engine.model_file import MAX_FILE_BYTES


def test_equal_mass_boundaries_and_the_bin_of_a_boundary_value():
    cuts = bench.boundaries(list(range(1, 101)), 4)
    assert cuts == pytest.approx([25.75, 50.5, 75.25])
    assert bench._bins(np.array([1.0, 25.75, 100.0]), cuts).tolist() == [0, 1, 3]  # bisect_right, as AccuracyTracker


@pytest.fixture(scope="module")
def doc() -> dict:
    return bench.run(bench.PredictorBenchConfig(curve=(250,), eval_limit=400))


def test_every_predictor_reports_the_issue_keys(doc):
    assert list(doc["predictors"]) == ["online", "learned", "learned_file", "oracle"]
    for row in doc["predictors"].values():
        for key in ("kendall_tau", "bin_accuracy_k2", "bin_accuracy_k4", "bin_accuracy_k8", "within_one_k4",
                    "within_one_k8", "mae_tokens", "plan_coverage", "predict_p50_ms", "predict_p99_ms", "model_bytes"):
            assert key in row, key
    assert set(doc["predictors"]["learned"]["learning_curve"]) == {"250", "first_turns"}


def test_the_oracle_is_perfect_and_the_learned_model_ranks_better_than_prompt_length(doc):
    oracle, learned, online = (doc["predictors"][k] for k in ("oracle", "learned", "online"))
    assert oracle["kendall_tau"] == oracle["bin_accuracy_k8"] == oracle["plan_coverage"] == 1.0
    assert oracle["mae_tokens"] == 0
    assert learned["kendall_tau"] > online["kendall_tau"] + 0.2
    assert learned["bin_accuracy_k4"] > online["bin_accuracy_k4"]
    assert 0.8 <= learned["plan_coverage"] <= 0.97  # the 0.9 quantile, calibrated on held-out folds
    assert doc["targets"]["model_mib"]["met"]


def test_the_model_file_of_the_training_split_fits_a_configmap_and_ranks_as_the_model_does(doc):
    """What ``binbatch predictor train`` writes for the ShareGPT training split, read back."""
    learned, from_file = doc["predictors"]["learned"], doc["predictors"]["learned_file"]
    assert from_file["file_bytes"] <= MAX_FILE_BYTES < learned["file_bytes"]  # the older dense file did not fit
    assert abs(from_file["kendall_tau"] - learned["kendall_tau"]) <= 0.005
    assert abs(from_file["bin_accuracy_k4"] - learned["bin_accuracy_k4"]) <= 0.01


def test_json_output(monkeypatch, capsys, doc):
    monkeypatch.setattr(bench, "run", lambda cfg, say: doc)
    assert cli.main(["bench", "predictor", "--json", "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["predictors"]["learned"]["kendall_tau"] == doc["predictors"]["learned"]["kendall_tau"]
