"""``batch.dispatch: Smdp`` — the SMDP control limit as the gang former's dispatch rule.

With a latency-only cost the SMDP of smdp-dynamic-batching.txt (core/smdp.py) is
work-conserving: serve whatever waits.  In gang mode a partial batch costs engine
time that full batches would use: a batch of b takes l(b) = α·b + β seconds, and
the intercept β is paid per dispatch.  So the cost charges engine time, the seed's
energy term ζ(a) = γ·a + δ with γ = α and δ = β (engine seconds; in the cloud,
GPU time), weighted against waiting: average cost = w1·E[requests in system] +
w2·(engine seconds per second), w1 = 1 and w2 = ``batch.smdpEngineWeight`` (the
request-seconds of waiting one engine-second is worth).  The optimum is a
control limit: a free slot takes a partial batch once its bin holds that many.

Three pure parts, none on the request path's critical section:

* ``ServiceTimeFit`` fits l(b) = α·b + β from gang batches' (size, seconds);
* ``SmdpCache`` keys solved control limits by geometric buckets of (λ, α, β), so
  a slowly drifting rate reuses a solution and a solve runs only on a new bucket;
* ``SmdpDispatch`` is the former's ``DispatchPolicy``: it answers from the cache
  for the current bucket, and 0 (wait: maxWait still bounds it) until a solution
  for that bucket exists.  The sidecar solves the wanted buckets in a background
  thread (``solve_bucket``).

Approximations (stated, since the seed models one server and one queue): the
former asks for the bin with the most requests, and bins share arrivals, so λ per
bin is λ/k; the slots (``maxInflightBatches``) are each treated as the seed's
single server fed by that bin.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from . import smdp

BUCKET_RATIO = 1.1  # geometric bucket width of λ, α and β (10 %)
S_MAX_FLOOR = 200  # truncation of the state space (smdp-dynamic-batching §V-C)

Key = tuple[int, int, int, int]  # buckets of λ per bin, α, β; and B_max


def _bucket(x: float) -> int:
    return round(math.log(x) / math.log(BUCKET_RATIO))


def _value(i: int) -> float:
    return BUCKET_RATIO**i


def load_service_time_library() -> None:
    """Import what ``ServiceTimeFit.fit`` uses (scipy.stats, about a second), which it
    otherwise imports at its first run, on the event loop."""
    import scipy.stats  # noqa: F401


class ServiceTimeFit:
    """l(b) = α·b + β over the last ``window`` reports, robust to slow batches.

    Every request of a gang batch reports the batch's (size, seconds), so each
    report counts 1/size towards the batches seen.  The line is the
    Theil–Sen fit (SciPy) through each size's median time: one batch slowed by a
    pause (a preemption, a collection, a busy node) moves neither, where it would
    tilt a least-squares line and could swing β, the cost of a dispatch, to 0.
    """

    def __init__(self, window: int = 4096, min_batches: float = 8.0) -> None:
        if window < 2 or not 2 <= min_batches <= window:
            raise ValueError(f"need 2 <= min_batches <= window, got {min_batches}, {window}")
        self.min_batches = min_batches
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, batch_size: int, seconds: float) -> None:
        """One request of a batch of ``batch_size`` that took ``seconds`` in the engine."""
        if batch_size >= 1 and seconds > 0 and math.isfinite(seconds):
            self._samples.append((batch_size, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(α, β) in seconds, or None: too few batches, or all of one size."""
        if sum(1 / b for b, _ in self._samples) < self.min_batches:
            return None
        by_size: dict[int, list[float]] = {}
        for b, t in self._samples:
            by_size.setdefault(b, []).append(t)
        if len(by_size) < 2:
            return None
        from scipy.stats import theilslopes  # imported at start-up when Smdp is on (load_service_time_library)

        sizes = sorted(by_size)
        medians = [statistics.median(by_size[b]) for b in sizes]
        slope, intercept, _, _ = theilslopes(medians, sizes)
        if slope <= 0:  # no cost per request seen: a dispatch costs the typical batch's time
            return 0.0, statistics.median(medians)
        return float(slope), max(0.0, float(intercept))


@dataclass(frozen=True, slots=True)
class SmdpParams:
    """What every solution of a cache depends on besides its key."""

    w2: float


def model_for(key: Key, params: SmdpParams) -> smdp.SmdpModel | None:
    """The SMDP of a bucket (its representative values), or None when it is not
    solvable: λ at or beyond the full-batch capacity (then batches fill anyway)."""
    lam, alpha, beta = (_value(i) for i in key[:3])
    b_max = key[3]
    mu_max = b_max / (alpha * b_max + beta)
    if lam >= mu_max:
        return None
    return smdp.SmdpModel(
        lam=lam, alpha=alpha, beta=beta, gamma=alpha, delta=beta, b_max=b_max,
        w1=1.0, w2=params.w2, s_max=max(S_MAX_FLOOR, 2 * b_max),
    )  # fmt: skip


def solve_bucket(key: Key, params: SmdpParams) -> smdp.ControlLimit | None:
    """Solve one bucket (CPU-bound: run it off the event loop)."""
    model = model_for(key, params)
    return None if model is None else smdp.ControlLimit(smdp.solve(model))


class SmdpCache:
    """Solved control limits by bucket; ``wanted`` lists the buckets asked for and
    not solved yet (the background solver takes them)."""

    def __init__(self, params: SmdpParams, max_entries: int = 256) -> None:
        self.params = params
        self._solved: dict[Key, smdp.ControlLimit | None] = {}
        self._wanted: dict[Key, None] = {}  # ordered set
        self._max = max_entries

    def get(self, key: Key) -> smdp.ControlLimit | None:
        if key in self._solved:
            return self._solved[key]
        self._wanted[key] = None
        return None

    def wanted(self) -> list[Key]:
        return list(self._wanted)

    def put(self, key: Key, limit: smdp.ControlLimit | None) -> None:
        self._wanted.pop(key, None)
        if len(self._solved) >= self._max:
            self._solved.pop(next(iter(self._solved)))
        self._solved[key] = limit


class SmdpDispatch:
    """The former's ``DispatchPolicy`` for ``batch.dispatch: Smdp``.

    ``update`` (each metrics snapshot) sets the current bucket from the arrival
    rate, the bin count and the fitted l(b); ``decide`` answers from the cache.
    """

    def __init__(self, cache: SmdpCache) -> None:
        self.cache = cache
        self.key: Key | None = None

    def update(self, rate: float | None, bins: int, fit: tuple[float, float] | None, batch: int) -> None:
        """``rate``: arrivals/s; ``bins``: k; ``fit``: (α, β) seconds; ``batch``: the target size B."""
        if rate is None or rate <= 0 or fit is None or fit[1] <= 0 or fit[0] <= 0 or batch < 1:
            self.key = None
            return
        alpha, beta = fit
        self.key = (_bucket(rate / max(1, bins)), _bucket(alpha), _bucket(beta), batch)
        self.cache.get(self.key)  # asks for a solve if new

    @property
    def threshold(self) -> int | None:
        """The control limit in use (None: no solution yet, maxWait alone)."""
        limit = self.cache.get(self.key) if self.key is not None else None
        return None if limit is None else limit.threshold

    def decide(self, waiting: int) -> int:
        limit = self.cache.get(self.key) if self.key is not None else None
        if limit is None:
            return 0  # no solution for this load yet: maxWait decides
        return limit.decide(waiting)
