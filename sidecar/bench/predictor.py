"""``binbatch bench predictor``: how well each length predictor knows an answer's length.

On the ShareGPT workload (``sharegpt.py``: first turns, fixed disjoint splits),
every predictor learns from the training records only (``sharegpt.records("train")``:
the training split's first turns and the later turns of its conversations, what
``binbatch predictor records`` writes) and is judged on the evaluation split's
first turns, through the same ``predict`` the sidecar calls (features included),
with no ``max_tokens`` cap so the model itself is measured:

* ``online``: ``Online``, the spread of each prompt-length bucket's last answers (the prompt's
  tokens estimated as the front door does, from its bytes);
* ``learned``: ``Learned`` (``core/length_model.py``), fitted on the training split;
* ``learned_file``: that same model written by ``save_model`` (what ``binbatch predictor
  train`` writes: sparse float16, deflated) and read back, as a pod reads it from a
  ConfigMap; ``file_bytes`` its file's size, ``legacy_file_bytes`` the older dense
  float32 file's (``learned`` scores exactly what that older file held);
* ``oracle``: the true length, the yardstick.

Measures (the seed's Table 1 and more):

* bin accuracy at k = 2, 4, 8: bins are equal-mass quantiles of the TRAINING
  split's true lengths (k - 1 cut points); a prediction's bin is the bin of its
  median, the true bin the bin of the true length; accuracy is the share of
  evaluation turns whose two bins are equal, and "within one" the share within
  one bin (the seed's "1 bin accuracy");
* Kendall's tau-b of the medians against the true lengths (how well the order
  matches: what shortest-first needs);
* mean absolute error of the median, in tokens;
* the KV plan's coverage: the share of evaluation turns whose true length is at
  most the predicted ``PLAN_LEVEL`` quantile (calibrated if it is near that level);
* predict latency p50/p99 per request, wall clock and this thread's CPU time
  (the wall clock counts the time other processes on this machine's cores take);
* the model's memory;
* a learning curve: tau and 4-bin accuracy after the first 250 / 1,000 / 4,000
  training records (in a fixed shuffled order), and after the training split's
  first turns alone.
"""

from __future__ import annotations

import io
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from scipy.stats import kendalltau

from ..core import length_model
from ..core.length_dist import PLAN_LEVEL, LengthDist
from ..core.predictor import LearnedPredictor, LengthPredictor, OnlinePredictor
from ..core.request import Request
from ..engine.model_file import load_model, save_model
from ..engine.training_records import Record
from ..engine.training_records import train as train_model
from ..server.front import estimate_prompt_tokens
from . import sharegpt

KS = (2, 4, 8)
CURVE = (250, 1000, 4000)
TARGETS = {"kendall_tau": 0.45, "bin_accuracy_k4": 0.47, "predict_p99_ms": 1.0, "model_mib": 100.0}  # issue 24
SEED = 1


@dataclass(frozen=True)
class PredictorBenchConfig:
    curve: Sequence[int] = CURVE
    seed: int = SEED
    eval_limit: int | None = None  # the first N evaluation turns (tests); None: all


def boundaries(lengths: Sequence[float], k: int) -> list[float]:
    """k equal-mass bins: the k - 1 interior quantiles of ``lengths``."""
    return [float(q) for q in np.quantile(np.asarray(lengths, float), [i / k for i in range(1, k)])]


def _bins(values: np.ndarray, cuts: Sequence[float]) -> np.ndarray:
    return np.searchsorted(np.asarray(cuts), values, side="right")  # bisect_right, as AccuracyTracker does


def _request(turn: sharegpt.Turn | Record, i: int) -> Request:
    return Request(id=f"t{i}", arrival=0.0, prompt_tokens=estimate_prompt_tokens(turn.prompt), prompt_text=turn.prompt)


class _Oracle:
    """The true length (the yardstick): the bench reads it from the turn."""

    name = "oracle"

    def __init__(self, truth: dict[str, float]) -> None:
        self.truth = truth

    def predict(self, req: Request) -> float:
        req.length, req.prediction_source = LengthDist.exact(self.truth[req.id]), "oracle"
        return req.length.median

    def observe(self, req: Request, actual_tokens: float) -> None:
        pass


def _online(train: Sequence[Record]) -> OnlinePredictor:
    p = OnlinePredictor()
    for i, t in enumerate(train):
        p.observe(_request(t, i), t.output_tokens)
    return p


def _learned(train: Sequence[Record]) -> LearnedPredictor:
    return LearnedPredictor(model=train_model(train))


def _through_file(model: length_model.LengthModel) -> tuple[LearnedPredictor, int, int]:
    """``model`` written to a model file and read back; the file's bytes, and the older dense layout's."""
    with tempfile.TemporaryDirectory(prefix="binbatch-bench-") as tmp:
        path = os.path.join(tmp, "model.npz")
        save_model(path, model)
        size, back = os.path.getsize(path), load_model(path)
    arrays = {k: v for k, v in model.to_arrays().items() if k != "slots"}
    arrays.update(format=np.array(length_model.LEGACY_FORMAT), weights=model.weights)
    legacy = io.BytesIO()  # what binbatch-length-model/3 wrote: every weight, float32, uncompressed
    np.savez(legacy, **arrays)
    return LearnedPredictor(model=back), size, len(legacy.getvalue())


def score(predictor: LengthPredictor, turns: Sequence[sharegpt.Turn], cuts: dict[int, list[float]],
          timed: bool = True) -> dict[str, Any]:  # fmt: skip
    """Every measure of ``predictor`` on ``turns``, bins cut at ``cuts[k]``."""
    medians, plans, wall, cpu = [], [], [], []
    for i, t in enumerate(turns):
        req = _request(t, i)
        w0, c0 = time.perf_counter(), time.thread_time()
        medians.append(predictor.predict(req))
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - w0)
        assert req.length is not None
        plans.append(req.length.plan)
    pred, true = np.array(medians), np.array([float(t.output_tokens) for t in turns])
    out: dict[str, Any] = {"kendall_tau": float(kendalltau(pred, true).statistic) if np.ptp(pred) > 0 else 0.0}
    for k in KS:
        off = np.abs(_bins(pred, cuts[k]) - _bins(true, cuts[k]))
        out[f"bin_accuracy_k{k}"] = float(np.mean(off == 0))
        if k > 2:
            out[f"within_one_k{k}"] = float(np.mean(off <= 1))
    out["mae_tokens"] = float(np.mean(np.abs(pred - true)))
    out["plan_coverage"] = float(np.mean(true <= np.array(plans)))
    if timed:
        out["predict_p50_ms"], out["predict_p99_ms"] = (float(x) * 1e3 for x in np.percentile(wall, [50, 99]))
        out["predict_cpu_p99_ms"] = float(np.percentile(cpu, 99)) * 1e3
    return out


def _memory(predictor: LengthPredictor) -> int:
    if isinstance(predictor, LearnedPredictor) and predictor.model is not None:
        return predictor.model.nbytes
    if isinstance(predictor, OnlinePredictor):
        return 64 * (len(predictor) + 1)  # two numbers and a key per bucket, roughly
    return 0


def run(cfg: PredictorBenchConfig = PredictorBenchConfig(),
        say: Callable[[str], None] = lambda m: None) -> dict[str, Any]:  # fmt: skip
    first, evaluation = sharegpt.split("train"), sharegpt.split("eval")
    train = sharegpt.records("train")
    if cfg.eval_limit is not None:
        evaluation = evaluation[: cfg.eval_limit]
    cuts = {k: boundaries([t.output_tokens for t in first], k) for k in KS}
    truth = {f"t{i}": float(t.output_tokens) for i, t in enumerate(evaluation)}
    shuffled = list(train)
    random.Random(cfg.seed).shuffle(shuffled)
    predictors: dict[str, LengthPredictor] = {}
    say(f"fitting on {len(train)} training records")
    t0 = time.perf_counter()
    predictors["online"] = _online(train)
    predictors["learned"] = _learned(train)
    fit_seconds = time.perf_counter() - t0
    model = predictors["learned"].model  # type: ignore[attr-defined]
    predictors["learned_file"], file_bytes, legacy_bytes = _through_file(model)
    predictors["oracle"] = _Oracle(truth)
    doc: dict[str, Any] = {"predictors": {}}
    for name, p in predictors.items():
        say(f"scoring {name} on {len(evaluation)} evaluation turns")
        row = score(p, evaluation, cuts)
        row["model_bytes"] = _memory(p)
        doc["predictors"][name] = row
    doc["predictors"]["learned"]["file_bytes"] = legacy_bytes
    doc["predictors"]["learned_file"]["file_bytes"] = file_bytes
    for name, make in (("online", _online), ("learned", _learned)):
        curve = {}
        for n in cfg.curve:
            say(f"learning curve: {name} after {n} records")
            row = score(make(shuffled[:n]), evaluation, cuts, timed=False)
            curve[str(n)] = {"kendall_tau": row["kendall_tau"], "bin_accuracy_k4": row["bin_accuracy_k4"]}
        say(f"learning curve: {name} on the {len(first)} first turns alone")
        row = score(make(sharegpt.records_of(first)), evaluation, cuts, timed=False)
        curve["first_turns"] = {"kendall_tau": row["kendall_tau"], "bin_accuracy_k4": row["bin_accuracy_k4"]}
        doc["predictors"][name]["learning_curve"] = curve
    learned = doc["predictors"]["learned"]
    doc["targets"] = {
        key: {"target": target, "measured": learned[key] if key != "model_mib" else learned["model_bytes"] / 2**20,
              "met": (learned[key] <= target if key == "predict_p99_ms" else learned[key] >= target)
              if key != "model_mib" else learned["model_bytes"] / 2**20 <= target}
        for key, target in TARGETS.items()
    }  # fmt: skip
    doc["setup"] = {
        "train_records": len(train), "train_first_turns": len(first), "eval_turns": len(evaluation),
        "plan_level": PLAN_LEVEL,
        "boundaries": {str(k): cuts[k] for k in KS}, "fit_seconds": fit_seconds,
        "bins": "equal-mass quantiles of the training split's true lengths; a prediction's bin is its median's",
    }  # fmt: skip
    return doc


def print_tables(doc: dict[str, Any]) -> None:
    s = doc["setup"]
    print(f"binbatch bench predictor: ShareGPT, trained on {s['train_records']} records ({s['train_first_turns']} "
          f"first turns and the later turns of their conversations), judged on {s['eval_turns']} held-out first turns "
          f"(bins: equal-mass quantiles of the training first turns' lengths, 4 bins cut at "
          f"{', '.join(f'{b:.0f}' for b in s['boundaries']['4'])})")  # fmt: skip
    cols = [("tau", "kendall_tau", "{:.3f}"), ("k=2", "bin_accuracy_k2", "{:.3f}"), ("k=4", "bin_accuracy_k4", "{:.3f}"),
            ("k=8", "bin_accuracy_k8", "{:.3f}"), ("±1 k4", "within_one_k4", "{:.3f}"),
            ("±1 k8", "within_one_k8", "{:.3f}"), ("MAE", "mae_tokens", "{:.0f}"),
            (f"q{s['plan_level']:.2f} cov", "plan_coverage", "{:.3f}"), ("p50 ms", "predict_p50_ms", "{:.3f}"),
            ("p99 ms", "predict_p99_ms", "{:.3f}"), ("cpu p99", "predict_cpu_p99_ms", "{:.3f}"),
            ("MiB", "model_bytes", "{:.2f}")]  # fmt: skip
    print(f"{'predictor':12}" + "".join(f"{c[0]:>10}" for c in cols))
    for name, row in doc["predictors"].items():
        cells = [c[2].format(row[c[1]] / 2**20 if c[1] == "model_bytes" else row[c[1]]) for c in cols]
        print(f"{name:12}" + "".join(f"{x:>10}" for x in cells))
    files = doc["predictors"].get("learned", {}), doc["predictors"].get("learned_file", {})
    if all("file_bytes" in row for row in files):
        print(f"model file: {files[1]['file_bytes'] / 1024:.0f} KiB as binbatch predictor train writes it (learned_file: "
              f"sparse float16), {files[0]['file_bytes'] / 1024:.0f} KiB in the older dense float32 layout (learned)")
    print("learning curve (tau / 4-bin accuracy after N training records; first_turns: the first turns alone):")
    for name, row in doc["predictors"].items():
        if "learning_curve" in row:
            curve = row["learning_curve"].items()
            pts = "  ".join(f"{n}: {v['kendall_tau']:.3f} / {v['bin_accuracy_k4']:.3f}" for n, v in curve)
            print(f"  {name:8} {pts}")
    for key, t in doc["targets"].items():
        verdict = "met" if t["met"] else "MISSED"
        print(f"target {key}: {t['measured']:.3f} against {t['target']} -> {verdict}")
    sys.stdout.flush()
