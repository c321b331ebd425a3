"""``binbatch bench sim``: sidecar configurations against direct-to-engine, in simulation.

Every row runs the same Poisson workload on the same KV-limited engine model
(``sim/engine_model.ContinuousEngine``: τ(b) = a + c·b per decode step, recompute
preemption when the running sequences outgrow the KV budget).  "direct" sends each
request straight into the engine's own FCFS queue; the other rows put the
sidecar's own ``Scheduler`` in front of it (the code that serves, not a copy):
continuous admission with the policy's static size, continuous admission sized by
the memory bound b_mem from the engine's metrics every scrape (FIFO, and
shortest-predicted-first over four bins), continuous admission capped only at the
engine's own queue (``followEngineQueue``, FIFO and shortest-first: the queue forms
in the sidecar, where it is ordered), and gang batching with one and four bins.  Ratios are to direct at the same load.  A minute of
simulated traffic takes well under a second per row.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import TextIO

from ..core.admission import AdmissionOrder, Order
from ..core.binner import FixedBinner
from ..core.clock import ManualClock
from ..core.former import BatchFormer
from ..core.predictor import HintPredictor
from ..core.scheduler import Core, Mode
from ..core.sizer import BatchSizer
from ..sim.engine_model import ContinuousEngine
from ..sim.simulator import SimResult, Workload, run_direct, run_sidecar


@dataclass(frozen=True)
class SimBenchConfig:
    rates: tuple[float, ...] = (1.0, 2.0, 3.0)  # requests per second
    requests: int = 1000
    prompt: tuple[int, int] = (32, 512)  # prompt tokens ~ U{lo..hi}
    output: tuple[float, float] = (16.0, 1024.0)  # output tokens ~ U[lo, hi]; the client hints the true length
    a: float = 0.010  # step time intercept, seconds
    c: float = 0.0005  # step time per running sequence, seconds
    kv_tokens: int = 16_384
    max_num_seqs: int = 256
    static_size: int = 32  # the policy defaults (config.py): staticSize, maxWait, maxInflightBatches
    max_wait: float = 0.05
    max_inflight_batches: int = 4
    max_size: int = 256
    aging: float = 20.0  # batch.agingTokensPerSecond, batch.maxQueueWaitMilliseconds (config.py defaults)
    max_queue_wait: float = 30.0
    scrape_interval: float = 0.5
    seed: int = 1


@dataclass(frozen=True)
class Setup:
    name: str
    mode: Mode
    sizing: str
    k: int
    order: Order = "fifo"
    follow_engine: bool = False
    size: int | None = None  # the static size, if not the policy's


SETUPS = (
    Setup("continuous static", "continuous", "static", 1),
    Setup("continuous memory", "continuous", "memory", 1),
    Setup("continuous memory sjf k=4", "continuous", "memory", 4, "shortest_first"),
    Setup("continuous engine-queue fifo", "continuous", "static", 1, "fifo", True, 256),
    Setup("continuous engine-queue sjf k=4", "continuous", "static", 4, "shortest_first", True, 256),
    Setup("gang k=1", "gang", "static", 1),
    Setup("gang k=4", "gang", "static", 4),
)


def _engine(cfg: SimBenchConfig) -> ContinuousEngine:
    return ContinuousEngine(a=cfg.a, c=cfg.c, kv_tokens=cfg.kv_tokens, max_num_seqs=cfg.max_num_seqs)


def _workload(cfg: SimBenchConfig, rate: float) -> Workload:
    lo, hi = cfg.output
    return Workload(n=cfg.requests, lmin=lo, lmax=hi, rate=rate, seed=cfg.seed, prompt=cfg.prompt, hint=True)


def _sidecar(cfg: SimBenchConfig, s: Setup, rate: float) -> SimResult:
    clock = ManualClock()
    lo, hi = cfg.output
    binner = FixedBinner.uniform(s.k, lo, hi) if s.k > 1 else FixedBinner(())
    size = s.size or cfg.static_size
    former = BatchFormer(binner, clock, target_size=size, max_wait=cfg.max_wait, max_queue=cfg.requests + 1)
    sizer = BatchSizer(mode=s.sizing, static_size=size, max_size=cfg.max_size)  # type: ignore[arg-type]
    admission = AdmissionOrder(s.order, aging=cfg.aging, max_wait=cfg.max_queue_wait, follow_engine=s.follow_engine)
    core = Core(HintPredictor(), binner, former, sizer, admission=admission)
    return run_sidecar(
        _workload(cfg, rate), core, clock, _engine(cfg), mode=s.mode,
        max_inflight_batches=cfg.max_inflight_batches, scrape_interval=cfg.scrape_interval,
    )  # fmt: skip


def _row(rate: float, name: str, res: SimResult, base: SimResult | None) -> dict:
    p99 = res.latency_quantile(0.99)
    row = {
        "rate": rate,
        "setup": name,
        "throughput_rps": round(res.throughput, 3),
        "mean_e2e_s": round(res.mean_latency, 2),
        "p99_e2e_s": round(p99, 2),
        "preemptions": res.preemptions,
        "completed": res.completed,
    }
    if base is not None:
        row["throughput_x"] = round(res.throughput / base.throughput, 3) if base.throughput else None
        row["mean_e2e_x"] = round(res.mean_latency / base.mean_latency, 3) if base.mean_latency else None
        row["p99_e2e_x"] = round(p99 / base.latency_quantile(0.99), 3)
    return row


def run(cfg: SimBenchConfig) -> dict:
    started = time.perf_counter()
    rows = []
    for rate in cfg.rates:
        base = run_direct(_workload(cfg, rate), _engine(cfg))
        rows.append(_row(rate, "direct", base, base))
        for s in SETUPS:
            rows.append(_row(rate, s.name, _sidecar(cfg, s, rate), base))
    return {"setting": asdict(cfg), "rows": rows, "seconds": round(time.perf_counter() - started, 2)}


def print_table(doc: dict, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    s = doc["setting"]
    out.write(
        f"simulated engine: step τ(b) = {s['a']:g} + {s['c']:g}·b s, KV {s['kv_tokens']} tokens, "
        f"max-num-seqs {s['max_num_seqs']}, recompute preemption\n"
        f"workload: {s['requests']} Poisson requests per load, prompt U{{{s['prompt'][0]}..{s['prompt'][1]}}}, "
        f"output U[{s['output'][0]:g}, {s['output'][1]:g}] tokens (hinted exactly)\n"
        f"sidecar: staticSize {s['static_size']}, maxWait {s['max_wait']:g} s, maxInflightBatches "
        f"{s['max_inflight_batches']}; ratios (x) are to direct at the same load\n"
    )
    cols = ["rate", "setup", "throughput_rps", "throughput_x", "mean_e2e_s", "mean_e2e_x", "p99_e2e_s", "p99_e2e_x",
            "preemptions"]  # fmt: skip
    rows = doc["rows"]
    width = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols}
    out.write("  ".join(c.rjust(width[c]) for c in cols) + "\n")
    for r in rows:
        out.write("  ".join(_fmt(r[c]).rjust(width[c]) for c in cols) + "\n")
    out.write(f"\n{doc['seconds']} s\n")


def _fmt(v: object) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def main(as_json: bool, out: TextIO | None = None, cfg: SimBenchConfig | None = None) -> int:
    out = out or sys.stdout
    doc = run(cfg or SimBenchConfig())
    if as_json:
        json.dump(doc, out, indent=2)
        out.write("\n")
    else:
        print_table(doc, out)
    return 0
