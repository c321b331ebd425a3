"""``binbatch bench theory``: the seeds' results reproduced on the real core.

Every number here comes from the discrete-event simulator driving the sidecar's
own predictor -> binner -> batch former, set beside the closed forms:

1. saturated throughput for k bins against Theorem 4.2 (multi-bin v1, Eq. 4);
2. mean latency against arrival rate beside Lemma 5.1's lower bound (Figure 4);
3. saturated throughput against the symmetric bin-error probability p (v2 Fig. 8);
4. the SMDP dispatch policy against static and work-conserving ones on average
   cost (smdp-dynamic-batching, Figure 5 setting).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, TextIO

from ..core import theory
from ..core.binner import FixedBinner
from ..sim.simulator import NoisyBinPredictor, OraclePredictor, Simulation, Workload
from . import smdp_bench

Progress = Callable[[str], None]


@dataclass(frozen=True)
class TheoryConfig:
    batch: int = 128
    lmin: float = 1.0
    lmax: float = 20.0
    ks: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    requests: int = 128_000
    latency_ks: tuple[int, ...] = (1, 2, 3)
    latency_rates: tuple[float, ...] = (0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    latency_requests: int = 20_000
    error_ks: tuple[int, ...] = (2, 4, 8)
    error_ps: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
    error_requests: int = 32_000
    smdp_rates: tuple[float, ...] = smdp_bench.DEFAULT_RATES
    seed: int = 1


def _sim(cfg: TheoryConfig, k: int, n: int, rate: float | None, p: float | None, seed: int):
    binner = FixedBinner.uniform(k, cfg.lmin, cfg.lmax)  # Lemma 4.1: equal mass for U[lmin, lmax]
    edges = [cfg.lmin, *binner.boundaries, cfg.lmax]
    predictor = OraclePredictor() if p is None else NoisyBinPredictor(edges, p, seed=seed + 7)
    workload = Workload(n=n, lmin=cfg.lmin, lmax=cfg.lmax, rate=rate, seed=seed)
    return Simulation(workload, predictor, binner, batch_size=cfg.batch).run()


def throughput_rows(cfg: TheoryConfig, progress: Progress) -> list[dict]:
    rows = []
    for k in cfg.ks:
        res = _sim(cfg, k, cfg.requests, None, None, cfg.seed + k)
        want = theory.throughput(k, cfg.batch, cfg.lmin, cfg.lmax)
        got = res.saturated_throughput
        rows.append(
            {
                "k": k,
                "measured": round(got, 4),
                "theory": round(want, 4),
                "error_pct": round(100 * (got - want) / want, 3),
                "full_batches": res.batches.get("full", 0),
            }
        )
        progress(f"throughput k={k:<2} measured {got:.3f}  theory {want:.3f}")
    return rows


def latency_rows(cfg: TheoryConfig, progress: Progress) -> list[dict]:
    rows = []
    for k in cfg.latency_ks:
        for lam in cfg.latency_rates:
            res = _sim(cfg, k, cfg.latency_requests, lam, None, cfg.seed + 100 * k)
            bound = theory.latency_lower_bound(k, cfg.batch, cfg.lmin, cfg.lmax, lam)
            rows.append(
                {
                    "k": k,
                    "rate": lam,
                    "measured": round(res.mean_latency, 3),
                    "lower_bound": round(bound, 3),
                    "ratio": round(res.mean_latency / bound, 4),
                }
            )
        progress(f"latency   k={k} over {len(cfg.latency_rates)} arrival rates")
    return rows


def error_rows(cfg: TheoryConfig, progress: Progress) -> list[dict]:
    rows = []
    for k in cfg.error_ks:
        for p in cfg.error_ps:
            res = _sim(cfg, k, cfg.error_requests, None, p, cfg.seed + 1000 * k)
            rows.append(
                {
                    "k": k,
                    "p": p,
                    "measured": round(res.saturated_throughput, 4),
                    "theory_oracle": round(theory.throughput(k, cfg.batch, cfg.lmin, cfg.lmax), 4),
                    "theory_k1": round(theory.throughput(1, cfg.batch, cfg.lmin, cfg.lmax), 4),
                }
            )
        progress(f"bin error k={k} over {len(cfg.error_ps)} error probabilities")
    return rows


def run(cfg: TheoryConfig, progress: Progress) -> dict:
    started = time.perf_counter()
    doc = {
        "setting": {
            "batch": cfg.batch,
            "lmin": cfg.lmin,
            "lmax": cfg.lmax,
            "requests": cfg.requests,
            "c_max": round(theory.capacity(cfg.batch, cfg.lmin, cfg.lmax), 4),
            "method": (
                "discrete-event simulation of the sidecar's batch former, one server, "
                "oracle lengths, Lemma 4.1 bins; saturated throughput = requests in full "
                "batches / server time spent on them"
            ),
        },
        "throughput": throughput_rows(cfg, progress),
        "latency": latency_rows(cfg, progress),
        "bin_error": error_rows(cfg, progress),
    }
    model = smdp_bench.default_model(cfg.smdp_rates[0])
    doc["smdp"] = {"model": smdp_bench.describe(model), "rows": smdp_bench.sweep(cfg.smdp_rates)}
    progress("smdp      policies compared on average cost")
    doc["seconds"] = round(time.perf_counter() - started, 2)
    return doc


def _table(out: TextIO, title: str, rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(rows[0])
    width = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols}
    out.write(f"\n{title}\n")
    out.write("  ".join(c.rjust(width[c]) for c in cols) + "\n")
    for r in rows:
        out.write("  ".join(_fmt(r[c]).rjust(width[c]) for c in cols) + "\n")


def _fmt(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def print_tables(doc: dict, out: TextIO = sys.stdout) -> None:
    s = doc["setting"]
    out.write(
        f"multi-bin batching, B={s['batch']}, lengths ~ U[{s['lmin']:g}, {s['lmax']:g}], "
        f"c_max={s['c_max']}\n"
    )
    _table(out, f"Saturated throughput vs k ({s['requests']} requests; Theorem 4.2)", doc["throughput"])
    _table(out, "Mean latency vs arrival rate (Lemma 5.1 lower bound; Figure 4)", doc["latency"])
    _table(out, "Saturated throughput vs bin-error probability p (v2 Figure 8)", doc["bin_error"])
    _table(out, f"SMDP dispatch vs other policies, average cost ({doc['smdp']['model']})", doc["smdp"]["rows"])
    out.write(f"\n{doc['seconds']} s\n")


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 9))
    t = doc["throughput"]
    a = ax[0][0]
    a.plot([r["k"] for r in t], [r["theory"] for r in t], "k--", label="Theorem 4.2")
    a.plot([r["k"] for r in t], [r["measured"] for r in t], "o", label="simulated core")
    a.axhline(doc["setting"]["c_max"], color="grey", lw=0.8, label="c_max")
    a.set(xscale="log", xlabel="bins k", ylabel="requests / unit time", title="Saturated throughput")
    a.legend()

    a = ax[0][1]
    for k in sorted({r["k"] for r in doc["latency"]}):
        rows = [r for r in doc["latency"] if r["k"] == k]
        (line,) = a.plot([r["rate"] for r in rows], [r["measured"] for r in rows], "o-", label=f"k={k}")
        a.plot([r["rate"] for r in rows], [r["lower_bound"] for r in rows], "--", color=line.get_color())
    a.set(xlabel="arrival rate λ", ylabel="mean latency", yscale="log", title="Latency (dashed: Lemma 5.1)")
    a.legend()

    a = ax[1][0]
    for k in sorted({r["k"] for r in doc["bin_error"]}):
        rows = [r for r in doc["bin_error"] if r["k"] == k]
        a.plot([r["p"] for r in rows], [r["measured"] for r in rows], "o-", label=f"k={k}")
    a.axhline(doc["throughput"][0]["theory"], color="grey", lw=0.8, label="k=1")
    a.set(xlabel="bin error probability p", ylabel="throughput", title="Throughput under prediction error")
    a.legend()

    a = ax[1][1]
    rows = doc["smdp"]["rows"]
    for name in dict.fromkeys(r["policy"] for r in rows):
        pts = [r for r in rows if r["policy"] == name]
        a.plot([r["rate"] for r in pts], [r["avg_cost"] for r in pts], "o-", label=name)
    a.set(xlabel="arrival rate λ", ylabel="average cost / unit time", title="SMDP vs static and greedy")
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
