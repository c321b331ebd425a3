"""The SMDP dispatch policy against work-conserving and static batching (Figure 5).

Every policy is scored with :func:`smdp.average_cost` on the same truncated model
(Eq. 14), so the numbers are exact long-run averages, not simulations, and the
ratios to the SMDP optimum are directly comparable.

Run ``python -m binbatch_sidecar.bench.smdp_bench`` for the table.
"""

from __future__ import annotations

import sys
from typing import Iterable, TextIO

import numpy as np

from ..core import smdp

# GoogLeNet inference on a Tesla P4 (smdp-dynamic-batching §V, Figure 5 setting).
# The seed text lost its formulas, so the exact fitted coefficients are not in it;
# these round values match its description of the profile (linear fits to NVIDIA's
# published GoogLeNet/P4 numbers): about 1.3 ms for one image, a peak of about
# 3 requests/ms at B_max = 32, and 35–55 W board power (ζ(b)/l(b), mJ/ms = W).
ALPHA_MS = 0.3  # l(b) = αb + β, ms per request in the batch
BETA_MS = 1.0  # ms per batch
GAMMA_MJ = 17.0  # ζ(b) = γb + δ, mJ per request in the batch
DELTA_MJ = 28.0  # mJ per batch
B_MAX = 32
# Objective (Eq. 3): w1·(mean number in system) + w2·(mean power in W). The paper
# sweeps w2 from 0 (latency only) upwards; equal weights put both terms in the same
# range here (tens of requests, ~50 W), where the policies differ the most.
W1 = 1.0
W2 = 1.0
S_MAX = 200  # §V-C: above ~200 the ordinary truncation is stable; the tail cost makes it safe
STATIC_SIZES = (8, 16, 32)  # §V-B: three static sizes, 32 being "maximum batching"
RHOS = (0.1, 0.3, 0.5, 0.7, 0.9)  # Figure 5's x-axis: λ normalised by μ_max


def default_model(lam: float, **overrides) -> smdp.SmdpModel:
    """The Figure 5 model at arrival rate ``lam`` (requests/ms); fields may be overridden."""
    fields = dict(
        lam=lam, alpha=ALPHA_MS, beta=BETA_MS, gamma=GAMMA_MJ, delta=DELTA_MJ,
        b_max=B_MAX, w1=W1, w2=W2, s_max=S_MAX,
    )  # fmt: skip
    fields.update(overrides)
    return smdp.SmdpModel(**fields)


MU_MAX = B_MAX / (ALPHA_MS * B_MAX + BETA_MS)  # requests/ms at full batches (§II)
DEFAULT_RATES = tuple(round(r * MU_MAX, 4) for r in RHOS)


def describe(model: smdp.SmdpModel) -> str:
    """One line naming the profile and weights (the arrival rate varies per row)."""
    return (
        f"l(b)={model.alpha:g}b+{model.beta:g} ms, ζ(b)={model.gamma:g}b+{model.delta:g} mJ, "
        f"B_max={model.b_max}, w1={model.w1:g}, w2={model.w2:g}, s_max={model.s_max}"
    )


def _row(model: smdp.SmdpModel, name: str, actions: tuple[int, ...], best: float) -> dict:
    pi = smdp.stationary_distribution(model, actions)
    acts = np.asarray(actions)
    serving = pi * (acts > 0)
    last = actions[-1]
    cost = smdp.average_cost(model, actions)
    return {
        "rate": model.lam,
        "rho": round(model.rho, 3),
        "policy": name,
        "control_limit": smdp.control_limit(actions),
        "mean_batch": round(float(serving @ acts / serving.sum()), 2) if serving.sum() > 0 else 0.0,
        # Extended beyond s_max with its last action, the policy keeps up iff a > λ l(a).
        "stable": last > model.lam * model.service_time(last),
        "avg_cost": cost,
        "ratio_to_smdp": round(cost / best, 4),
    }


def compare_policies(model: smdp.SmdpModel, static_sizes: Iterable[int] = STATIC_SIZES) -> list[dict]:
    """SMDP optimum, work-conserving and static policies on one model, as table rows."""
    best = smdp.solve(model)
    policies = [("smdp", best.actions), ("work-conserving", smdp.work_conserving_policy(model))]
    policies += [(f"static-{b}", smdp.static_policy(model, b)) for b in static_sizes]
    return [_row(model, name, actions, best.avg_cost) for name, actions in policies]


def sweep(
    lams: Iterable[float] = DEFAULT_RATES, static_sizes: Iterable[int] = STATIC_SIZES, **overrides
) -> list[dict]:
    """:func:`compare_policies` at each arrival rate: average cost vs λ (Figure 5)."""
    sizes = tuple(static_sizes)
    return [row for lam in lams for row in compare_policies(default_model(lam, **overrides), sizes)]


def print_table(rows: list[dict], out: TextIO = sys.stdout) -> None:
    cols = list(rows[0])
    text = [[f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    width = [max(len(c), *(len(t[i]) for t in text)) for i, c in enumerate(cols)]
    out.write("  ".join(c.rjust(w) for c, w in zip(cols, width)) + "\n")
    for t in text:
        out.write("  ".join(v.rjust(w) for v, w in zip(t, width)) + "\n")


def main() -> None:
    model = default_model(DEFAULT_RATES[0])
    print(f"SMDP dispatch vs other policies, average cost per ms ({describe(model)})")
    print_table(sweep())


if __name__ == "__main__":
    main()
