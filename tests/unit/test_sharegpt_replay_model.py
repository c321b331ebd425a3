"""The ShareGPT replay in the engine model (issue 24): the bench's sidecar for it
(``sg-*``: ShortestFirst at the engine's pace, the KV plan) against direct at 0.95
of direct's capacity, with no hint -- a calibrated stand-in for a learned predictor
that ranks the answers at Kendall tau ~0.45 -- and with the true length as the
hint (the oracle).  The engine is the bench's ShareGPT engine (e2e.SHAREGPT_KV:
6 ms + 0.2 ms a sequence + 0.08 ms a prefilled token, 240 x 16 KV tokens),
answers streamed; the engine counts a prompt as the embedded engine does (a token a
word), the sidecar as its front end does (bytes / 4, ``estimate_prompt_tokens``), scaled
by what the engine reported for the prompts it answered, as live."""

from __future__ import annotations

from statistics import mean

import pytest
from scipy.stats import kendalltau

from binbatch_sidecar.bench import sharegpt, workloads
from binbatch_sidecar.bench.e2e import SHAREGPT_KV, E2EConfig, sidecar_overrides
from binbatch_sidecar.config import parse_config
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.predictor import OnlinePredictor
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.core.scheduler import Scheduler
from binbatch_sidecar.engine.model_file import save_model
from binbatch_sidecar.engine.training_records import train
from binbatch_sidecar.server.assembly import build_core
from binbatch_sidecar.server.front import estimate_prompt_tokens
from binbatch_sidecar.sim.engine_model import ContinuousEngine
from binbatch_sidecar.sim.simulator import NoisyLengthPredictor, SimResult, drive, engine_snapshot, run_direct

SEEDS = (1, 2, 3)
REPLAYED = 400
RHO = 0.76  # the stand-in's correlation in log length: Kendall tau ~0.45


def _engine() -> ContinuousEngine:
    e = SHAREGPT_KV
    return ContinuousEngine(a=e.step_a, c=e.step_c, kv_tokens=(e.num_gpu_blocks - 1) * e.block_size,
                            prefill_per_token=e.prefill_per_token, streams=True,
                            count_prompt=lambda r: len(r.prompt_text.split()))  # fmt: skip


class _Replay:
    def __init__(self, seed: int, rate: float | None, hint: bool, count: int = REPLAYED) -> None:
        self.bench = workloads.sharegpt_replay(count, rate=rate, seed=seed)
        self.hint = hint

    def requests(self):
        for i, b in enumerate(self.bench):
            n = float(b.output_tokens)
            yield Request(id=str(i), arrival=b.arrival_s, prompt_tokens=estimate_prompt_tokens(b.prompt),
                          max_tokens=b.max_tokens, actual_tokens=n, hint_tokens=n if self.hint else None,
                          prompt_text=b.prompt)  # fmt: skip


def _capacity(seed: int) -> float:
    """Direct's saturated rate in the model: three times the replay, all at once."""
    res = run_direct(_Replay(seed, None, False, 3 * REPLAYED), _engine())
    return res.completed / res.makespan


def _sidecar(replay: _Replay, predictor=None, warm_start: str = "") -> SimResult:
    """The bench's ShareGPT sidecar: the oracle's config with ``predictor`` put in, or with
    ``warm_start`` the judged one's (``Learned`` from that model file)."""
    _, doc = sidecar_overrides(E2EConfig(), warm_start)["sg-learned" if warm_start else "sg-hint"]
    clock = ManualClock()
    core = build_core(parse_config(doc), clock)
    if predictor is not None:
        core.predictor = predictor
    eng = _engine()
    return drive(Scheduler(core, clock, mode="continuous"), eng, replay.requests(), clock, full_latency_only=False,
                 snapshot=lambda: engine_snapshot(eng), scrape_interval=0.2)  # fmt: skip


def _ratios(res: SimResult, direct: SimResult) -> dict[str, float]:
    return {"mean": res.mean_latency / direct.mean_latency,
            "p99": res.latency_quantile(0.99) / direct.latency_quantile(0.99),
            "throughput": res.throughput / direct.throughput, "preemptions": res.preemptions / direct.preemptions}  # fmt: skip


@pytest.fixture(scope="module")
def directs() -> dict[int, tuple[float, SimResult]]:
    """Per seed, the offered rate (0.95 of direct's capacity) and direct's run at it:
    the simulations are deterministic, so every test compares against the same run."""
    out = {}
    for seed in SEEDS:
        rate = 0.95 * _capacity(seed)
        direct = run_direct(_Replay(seed, rate, False), _engine())
        assert direct.completed == REPLAYED and direct.preemptions > 0
        out[seed] = (rate, direct)
    return out


@pytest.fixture(scope="module")
def runs(directs) -> dict[str, list[dict[str, float]]]:
    train = [min(t.output_tokens, workloads.SHAREGPT_MAX_TOKENS) for t in sharegpt.split("train")]
    out: dict[str, list[dict[str, float]]] = {"learned": [], "oracle": []}
    for seed, (rate, direct) in directs.items():
        out["learned"].append(_ratios(_sidecar(_Replay(seed, rate, False), NoisyLengthPredictor(train, RHO, seed)), direct))
        out["oracle"].append(_ratios(_sidecar(_Replay(seed, rate, True)), direct))
    return out


@pytest.fixture(scope="module")
def learned_runs(tmp_path_factory, directs) -> list[dict[str, float]]:
    """The judged row's sidecar with the real ``Learned`` model, fitted on the training
    split as ``binbatch predictor train`` fits it (about 20 s)."""
    path = str(tmp_path_factory.mktemp("model") / "model.npz")
    save_model(path, train(sharegpt.records("train")))
    out = []
    for seed, (rate, direct) in directs.items():
        out.append(_ratios(_sidecar(_Replay(seed, rate, False), warm_start=path), direct))
    return out


def test_the_judged_sidecar_with_the_real_learned_model_wins_on_the_mean_within_the_tail_target(learned_runs):
    """Seeds 1-3, ranked by KV footprint (the bench's config): mean E2E 0.881x direct's,
    p99 1.077x, throughput 1.004x, preemptions 0.156x; ranked by output tokens alone,
    0.966x / 0.989x / 0.996x / 0.150x (fifth session)."""
    learned = {k: mean(r[k] for r in learned_runs) for k in learned_runs[0]}
    assert learned["mean"] <= 0.93 and learned["p99"] <= 1.25
    assert learned["throughput"] >= 0.97 and learned["preemptions"] <= 0.2


def test_the_stand_in_ranks_the_answers_as_a_learned_model_is_expected_to():
    train = [min(t.output_tokens, workloads.SHAREGPT_MAX_TOKENS) for t in sharegpt.split("train")]
    predictor = NoisyLengthPredictor(train, RHO, seed=1)
    reqs = list(_Replay(1, None, False).requests())
    tau = kendalltau([predictor.predict(r) for r in reqs], [r.actual_tokens for r in reqs]).statistic
    assert 0.4 <= tau <= 0.5


def test_without_a_hint_the_sidecar_keeps_direct_throughput_with_a_fifth_of_its_preemptions_and_a_bounded_tail(runs):
    """Seeds 1-3, ranked by KV footprint: throughput 0.986x direct's, preemptions
    0.08x, mean E2E 0.91x, p99 1.31x (by output tokens alone: 0.97x mean, p99 1.17x).
    The real model's p99 is 1.08x (above); this stand-in's errors, log-normal and
    blind to the prompt, cost more of the tail, and this bound is on what such a
    ranker may cost, not the issue's 1.25x.  Aged
    at a fixed 20 tokens a second instead of the engine's pace, the answers
    predicted long waited behind every shorter arrival: p99 1.77x (mean 0.94x)."""
    learned = {k: mean(r[k] for r in runs["learned"]) for k in runs["learned"][0]}
    assert learned["throughput"] >= 0.97
    assert learned["preemptions"] <= 0.2
    assert learned["p99"] <= 1.4


def test_with_the_true_length_the_sidecar_is_faster_on_the_mean_and_no_slower_at_p99(runs):
    """Seeds 1-3, ranked by KV footprint: mean E2E 0.78x direct's, p99 1.09x, 0.013x
    the preemptions (by output tokens alone 0.82x, 1.07x; aged at a fixed 20 tokens
    a second, before the prompt was counted as the sidecar counts it: 0.78x, 1.11x).
    What is left comes from the plan's estimates (prompts, unary calls' progress); while the
    engine queue's cap also held admission after each preemption it was 0.008x
    (mean 0.79x, p99 1.10x): the plan alone bounds the cache now (admission.engine_cap)."""
    oracle = {k: mean(r[k] for r in runs["oracle"]) for k in runs["oracle"][0]}
    assert oracle["mean"] <= 0.9 and oracle["p99"] <= 1.25 and oracle["preemptions"] <= 0.02


def test_the_online_predictor_plans_by_the_spread_it_has_seen_not_by_a_mean_taken_as_exact(directs):
    """Seeds 1-3 with today's Online (no hint, prompt-length buckets that rank almost
    nothing), ranked by KV footprint: mean E2E 0.95x direct's, p99 1.07x, throughput
    1.01x, preemptions 0.18x (by output tokens alone: 1.00x, 0.91x, 1.00x, 0.19x).
    A bucket's mean planned as an exact length gave 1.61x, 1.22x, 0.97x: its start
    planned every answer at max_tokens and an answer past the mean as nearly done."""
    ratios = []
    for seed, (rate, direct) in directs.items():
        ratios.append(_ratios(_sidecar(_Replay(seed, rate, False), OnlinePredictor()), direct))
    online = {k: mean(r[k] for r in ratios) for k in ratios[0]}
    assert online["mean"] <= 1.1 and online["p99"] <= 1.1
    assert online["throughput"] >= 0.98 and online["preemptions"] <= 0.3
