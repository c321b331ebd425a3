"""Closed forms of multi-bin batching (multi-bin-batching-v1.md, §4–5).

Service time of a batch is the longest request in it; lengths ~ U[lmin, lmax];
k bins of equal probability mass (Lemma 4.1); batch size B.
"""

from __future__ import annotations

import math


def _check(k: int, batch: int, lmin: float, lmax: float) -> None:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if not 0 <= lmin < lmax:
        raise ValueError(f"need 0 <= lmin < lmax, got lmin={lmin}, lmax={lmax}")


def expected_service_time(k: int, batch: int, lmin: float, lmax: float) -> float:
    """E[t_service,k], the denominator of Theorem 4.2 (Eq. 4)."""
    _check(k, batch, lmin, lmax)
    mean = (lmax + lmin) / 2
    top = batch / (batch + 1) * lmax + 1 / (batch + 1) * lmin  # E[max of B] in one bin
    return mean + (top - mean) / k


def throughput(k: int, batch: int, lmin: float, lmax: float) -> float:
    """Saturated throughput with k bins, Theorem 4.2 (Eq. 4): B / E[t_k]."""
    return batch / expected_service_time(k, batch, lmin, lmax)


def capacity(batch: int, lmin: float, lmax: float) -> float:
    """c_max, the limit of Theorem 4.2 as k grows (Eq. 5)."""
    _check(1, batch, lmin, lmax)
    return batch / ((lmax + lmin) / 2)


def latency_lower_bound(k: int, batch: int, lmin: float, lmax: float, lam: float) -> float:
    """Expected latency with infinitely many servers, Lemma 5.1 (Eq. 7)."""
    if lam <= 0:
        raise ValueError(f"arrival rate lam must be > 0, got {lam}")
    return expected_service_time(k, batch, lmin, lmax) + (batch - 1) * k / (2 * lam)


def bins_for_throughput(eps: float, batch: int, lmin: float, lmax: float) -> int:
    """Smallest k that reaches c_max - eps, Theorem 4.3 (Eq. 6)."""
    cmax = capacity(batch, lmin, lmax)
    if not 0 < eps < cmax:
        raise ValueError(f"eps must be in (0, c_max={cmax:.4g}), got {eps}")
    mean = (lmax + lmin) / 2
    top = batch / (batch + 1) * lmax + 1 / (batch + 1) * lmin
    return max(1, math.ceil((cmax - eps) * (top - mean) / (eps * mean)))
