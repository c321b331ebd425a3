"""Smdp dispatch against maxWait in the discrete-event simulator (issue 10 §2).

One bin, one gang slot, Poisson arrivals, batch time l(b) = αb + β (the fit the
sidecar makes of its gang batches).  Each policy runs the same workload through
the real ``BatchFormer`` (sim/simulator.py) and is scored on the cost the Smdp
policy minimises: w1·E[requests in system] + w2·(engine seconds per second),
with E[requests in system] = λ·mean latency (Little) and w1 = 1, w2 =
``batch.smdpEngineWeight``.  Smdp runs as the sidecar runs it: the control limit
from ``smdp_policy.solve_bucket`` with maxWait as the bound.

Run ``python -m binbatch_sidecar.bench.smdp_dispatch`` for the table.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TextIO

from ..core.binner import FixedBinner
from ..core.former import Batch
from ..core.smdp_policy import SmdpCache, SmdpDispatch, SmdpParams, solve_bucket
from ..sim.simulator import OraclePredictor, Simulation, Workload

ALPHA = 0.002  # s per request in a batch
BETA = 0.05  # s per dispatch (the τ(b) intercept)
BATCH = 16
W2 = 16.0  # batch.smdpEngineWeight's default
MAX_WAITS = (0.02, 0.1, 0.5)  # seconds
RHOS = (0.1, 0.3, 0.5, 0.7, 0.9)
N = 20_000


@dataclass(frozen=True)
class Row:
    rho: float
    policy: str
    mean_latency: float  # s
    engine_per_request: float  # engine s per request
    mean_batch: float
    cost: float  # w1·λ·latency + w2·busy fraction


def run(rate: float, max_wait: float, policy: SmdpDispatch | None, n: int = N, seed: int = 1) -> tuple[float, float, float, float]:
    """(mean latency, engine seconds per request, mean batch size, busy fraction)."""
    latencies: list[float] = []
    sim: Simulation

    def service(batch: Batch) -> float:
        dt = ALPHA * batch.size + BETA
        done = sim.clock.now() + dt
        latencies.extend(done - r.arrival for r in batch.requests)
        return dt

    sim = Simulation(
        Workload(n=n, rate=rate, seed=seed), OraclePredictor(), FixedBinner([]),
        batch_size=BATCH, max_wait=max_wait, policy=policy, service_time=service,
    )  # fmt: skip
    res = sim.run()
    mean_batch = sum(res.batch_sizes) / len(res.batch_sizes)
    return sum(latencies) / len(latencies), res.busy / res.completed, mean_batch, res.busy / res.makespan


def smdp_policy(rate: float, w2: float = W2) -> SmdpDispatch:
    """The sidecar's policy with its bucket solved, as the background task would."""
    policy = SmdpDispatch(SmdpCache(SmdpParams(w2=w2)))
    policy.update(rate, 1, (ALPHA, BETA), BATCH)
    for key in policy.cache.wanted():
        policy.cache.put(key, solve_bucket(key, policy.cache.params))
    return policy


def compare(rhos=RHOS, max_waits=MAX_WAITS, w2: float = W2, n: int = N) -> list[Row]:
    mu_max = BATCH / (ALPHA * BATCH + BETA)
    rows = []
    for rho in rhos:
        rate = rho * mu_max
        runs = [(f"maxWait {int(mw * 1000)} ms", mw, None) for mw in max_waits]
        policy = smdp_policy(rate, w2)
        runs.append((f"smdp (limit {policy.threshold}) + maxWait {int(max(max_waits) * 1000)} ms", max(max_waits), policy))
        for name, mw, pol in runs:
            lat, eng, b, busy = run(rate, mw, pol, n)
            rows.append(Row(rho, name, lat, eng, b, rate * lat + w2 * busy))
    return rows


def print_table(rows: list[Row], out: TextIO = sys.stdout) -> None:
    out.write(f"l(b) = {ALPHA:g}·b + {BETA:g} s, B = {BATCH}, w2 = {W2:g}, {N} requests per run\n")
    out.write(f"{'rho':>4}  {'policy':<34} {'latency s':>10} {'engine s/req':>12} {'batch':>6} {'cost':>8}\n")
    for r in rows:
        out.write(f"{r.rho:>4.1f}  {r.policy:<34} {r.mean_latency:>10.4f} {r.engine_per_request:>12.5f} "
                  f"{r.mean_batch:>6.2f} {r.cost:>8.3f}\n")  # fmt: skip


def main() -> None:
    print_table(compare())


if __name__ == "__main__":
    main()
