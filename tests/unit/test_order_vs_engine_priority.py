"""What ordering can win at 95% of saturation on a KV-limited engine, and whether the
sidecar's order wins it (issue 11, win 1).

The yardstick is the best an engine could do by itself: vLLM's own priority
scheduling (``--scheduling-policy priority``) told every request's true output
length, so shortest-first inside the engine with perfect knowledge, no lag, and
vLLM's own overcommit of the KV cache.  The sidecar, in front of a first-come
first-served engine, has to match it on the mean without its long tail.
"""

from __future__ import annotations

from statistics import mean

from binbatch_sidecar.bench import workloads
from binbatch_sidecar.bench.e2e import E2EConfig, sidecar_overrides
from binbatch_sidecar.config import parse_config
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.core.scheduler import Scheduler
from binbatch_sidecar.core.sizer import EngineSnapshot
from binbatch_sidecar.server.assembly import build_core
from binbatch_sidecar.sim.engine_model import ContinuousEngine
from binbatch_sidecar.sim.simulator import SimResult, drive, engine_snapshot, run_direct

RATE = 18.2  # 0.95 of direct's saturated throughput in this model (19.1-19.3 requests/s under overload)


class _Chat:
    def __init__(self, seed: int) -> None:
        self.bench = workloads.build("chat", 256, rate=RATE, seed=seed)

    def requests(self):
        for i, b in enumerate(self.bench):
            tokens = float(b.output_tokens)
            yield Request(id=str(i), arrival=b.arrival_s, prompt_tokens=3 + len(b.prompt.split()),
                          max_tokens=b.output_tokens, hint_tokens=tokens, actual_tokens=tokens)  # fmt: skip


def _engine(**kw) -> ContinuousEngine:
    """The bench's embedded KV-limited engine (e2e.KV_LIMITED), answers streamed."""
    return ContinuousEngine(a=0.006, c=0.0002, kv_tokens=752, prefill_per_token=0.00008, streams=True, **kw)


def _sidecar(workload: _Chat) -> SimResult:
    """The bench's hinted sidecar (``kv-hint``), one that has served before."""
    _, doc = sidecar_overrides(E2EConfig())["kv-hint"]
    clock = ManualClock()
    s = Scheduler(build_core(parse_config(doc), clock), clock, mode="continuous")
    s.on_snapshot(EngineSnapshot(kv_capacity_tokens=752, kv_block_tokens=1, tpot_seconds=0.0075, fresh=True), 0.0)
    s.core.kv_plan.observe_prompt(1.0, 1.0)
    eng = _engine()
    return drive(s, eng, workload.requests(), clock, full_latency_only=False,
                 snapshot=lambda: engine_snapshot(eng), scrape_interval=0.2)  # fmt: skip


def test_at_95pct_load_the_sidecars_order_matches_vllms_priority_scheduling_told_the_true_lengths():
    """Seeds 1-5 (the bench's chat load at 0.95), mean E2E against direct's:

    ====  =========================  ==================  =======  ===============
    seed  direct waits (of its E2E)  priority, true len  sidecar  p99: prio, ours
    ====  =========================  ==================  =======  ===============
    1     30%                        0.742               0.822    1.67, 1.01
    2     12%                        0.997               0.967    1.87, 1.02
    3     17%                        0.939               0.898    2.03, 0.99
    4     44%                        0.640               0.752    2.36, 1.17
    5     13%                        0.969               0.946    1.50, 1.00
    ====  =========================  ==================  =======  ===============

    So the sidecar's mean is within 2.5% of the engine's own oracle shortest-first
    (0.877 against 0.857) and its p99 is 1.04x direct's where the oracle's is
    1.89x: vLLM's priority policy preempts the longest running request, again and
    again.  The sidecar ages its queue at the engine's pace (admission.py): with a
    fixed 20 tokens a second instead, its mean was 0.861 and its p99 1.13x (seed 4:
    0.676 and 1.36x).  Neither reaches the issue's 0.7 on the mean: direct waits
    only 12-44% of its E2E at this load, so even an order that removed all waiting
    would reach 0.77 -- the engine's concurrency is set by its KV cache, which fits
    more short answers when they come, so its queue stays shallow.  A FIFO sidecar
    (the order off) is 1.06x direct."""
    ours, oracle, bounds, ours_p99, oracle_p99 = [], [], [], [], []
    for seed in (1, 2, 3, 4, 5):
        direct_engine = _engine()
        direct = run_direct(_Chat(seed), direct_engine)
        first = direct_engine.stats.first_token
        waited = mean(first[r] - r.arrival for r in first)
        prio = run_direct(_Chat(seed), _engine(priority=lambda r: r.actual_tokens))
        side = _sidecar(_Chat(seed))
        assert direct.completed == prio.completed == side.completed == 256
        ours.append(side.mean_latency / direct.mean_latency)
        oracle.append(prio.mean_latency / direct.mean_latency)
        bounds.append(1 - waited / direct.mean_latency)
        ours_p99.append(side.latency_quantile(0.99) / direct.latency_quantile(0.99))
        oracle_p99.append(prio.latency_quantile(0.99) / direct.latency_quantile(0.99))
    assert mean(oracle) < 0.95  # ordering pays at this load
    assert mean(ours) <= 1.03 * mean(oracle)
    assert mean(ours_p99) <= 1.1 < 1.5 <= mean(oracle_p99)
    assert mean(bounds) > 0.7  # the target is below what removing all waiting reaches
    assert all(o >= b for o, b in zip(ours, bounds))
