"""Choosing the number of bins from load (ours; in no seed).

More bins raise saturated throughput (Theorem 4.2) but each bin fills more slowly,
so the wait to complete a batch grows as (B-1)·k/(2λ) (Lemma 5.1).  Given the
measured arrival rate and a latency target, pick the k that serves the load and
meets the target with the most throughput headroom.  Lengths are taken as uniform
over [lmin, lmax] as in the theory; callers pass observed low/high quantiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .theory import latency_lower_bound, throughput


@dataclass(frozen=True, slots=True)
class KChoice:
    k: int
    reason: str  # "meets-target" | "overloaded" | "target-unreachable"
    throughput: float  # Theorem 4.2 at the chosen k
    latency_bound: float  # Lemma 5.1 at the chosen k


def choose_k(
    lam: float, latency_target: float, batch: int, lmin: float, lmax: float, k_max: int = 32
) -> KChoice:
    """The largest k in [1, k_max] whose capacity exceeds lam and whose Lemma 5.1
    latency bound meets the target.  If no k meets the target, the stable k with the
    lowest bound ("target-unreachable"); if no k is stable, k_max ("overloaded":
    throughput is all that can be helped)."""
    if lam <= 0:
        raise ValueError(f"arrival rate lam must be > 0, got {lam}")
    if latency_target <= 0:
        raise ValueError(f"latency_target must be > 0, got {latency_target}")
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    rows = [
        (k, throughput(k, batch, lmin, lmax), latency_lower_bound(k, batch, lmin, lmax, lam))
        for k in range(1, k_max + 1)
    ]
    stable = [r for r in rows if r[1] > lam]
    if not stable:
        return KChoice(k_max, "overloaded", rows[-1][1], rows[-1][2])
    meeting = [r for r in stable if r[2] <= latency_target]
    if meeting:
        return KChoice(meeting[-1][0], "meets-target", meeting[-1][1], meeting[-1][2])
    best = min(stable, key=lambda r: r[2])
    return KChoice(best[0], "target-unreachable", best[1], best[2])


class ArrivalRate:
    """Arrival rate from an exponentially weighted mean of inter-arrival gaps."""

    def __init__(self, half_life: int = 200) -> None:
        if half_life < 1:
            raise ValueError(f"half_life must be >= 1, got {half_life}")
        self._alpha = 1 - 0.5 ** (1 / half_life)
        self._last: float | None = None
        self._gap: float | None = None

    def observe(self, t: float) -> None:
        if self._last is not None:
            gap = max(t - self._last, 0.0)
            self._gap = gap if self._gap is None else self._gap + self._alpha * (gap - self._gap)
        self._last = t

    @property
    def rate(self) -> float | None:
        if self._gap is None:
            return None
        return math.inf if self._gap == 0 else 1 / self._gap
