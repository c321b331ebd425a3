"""Binners: which bin a predicted output length goes to.

Bin i holds [b_{i-1}, b_i) of predicted length, where ``boundaries`` are the k-1
strictly increasing interior cut points (``bisect_right``).  Three binners:

* ``FixedBinner``: boundaries from the policy (or Lemma 4.1's equal-width ones
  for a uniform distribution, multi-bin-batching-v1.md Eq. 3).
* ``AutoBinner``: boundaries learned from the predicted lengths of arriving
  requests: equal-probability ones (Lemma 4.1), or, for gang batches, those with
  the least expected batch service time (Eq. 2 on the observed distribution).
* ``AdaptiveBinner``: BucketServe's Algorithm 1 - split a bucket at its midpoint
  under skewed load, merge back to one bucket at low load.

A binner's ``version`` changes whenever its boundaries do, so the batch former
knows to re-bin the requests it holds.  Its ``k`` is always
``len(boundaries) + 1``; the former compares it with its own bin count.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from typing import Iterable, Sequence

import numpy as np

from .stages import Binner  # noqa: F401 - the contract, declared with the other stages


def bin_index(boundaries: Sequence[float], value: float) -> int:
    """The bin of ``value``: bin i holds [b_{i-1}, b_i)."""
    return bisect.bisect_right(boundaries, value)


def _validated(boundaries: Iterable[float]) -> tuple[float, ...]:
    b = tuple(float(x) for x in boundaries)
    if any(not math.isfinite(x) or x <= 0 for x in b):
        raise ValueError(f"boundaries must be finite and > 0, got {list(b)}")
    if any(y <= x for x, y in zip(b, b[1:])):
        raise ValueError(f"boundaries must be strictly increasing, got {list(b)}")
    return b


def equal_mass_boundaries(samples: Iterable[float], k: int) -> tuple[float, ...]:
    """Lemma 4.1 on an empirical distribution: the i/k quantiles, i = 1..k-1.

    b_i is the sorted sample at index ceil(i·n/k), so exactly that many samples fall
    below it and, with distinct samples, each bin [b_{i-1}, b_i) holds n/k ± 1 of
    them (and the cut suits ``bisect_right``: a tied value goes to the bin above).
    Ties can make quantiles coincide: duplicates are dropped, and so are cuts at or
    below the smallest sample (their first bin would be empty).  The result is
    strictly increasing and may hold fewer than k-1 points; every bin it defines
    holds at least one sample.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    s = sorted(float(x) for x in samples)
    if not s:
        raise ValueError("samples must not be empty")
    n = len(s)
    out: list[float] = []
    for i in range(1, k):
        q = s[min(n - 1, math.ceil(i * n / k))]  # Lemma 4.1 (Eq. 3): the i/k quantile
        if q > s[0] and (not out or q > out[-1]):
            out.append(q)
    return tuple(out)


SKETCH = 256  # the window's order statistics min_service_boundaries works on
MAX_DRAWS = 64  # the max of more draws than this is the bin's top all the same


def min_service_boundaries(samples: Iterable[float], k: int, batch: int) -> tuple[float, ...]:
    """Eq. 2 minimised on an empirical distribution: the at most k-1 cut points with
    the least expected batch service time sum_i Pr(bin = i)·E[max of B lengths | bin i].

    A gang batch holds the engine until its longest member ends, so these are the
    throughput-optimal bins: the objective Lemma 4.1 solves for uniform lengths,
    where the answer is its equal-mass cuts.  For a skewed or bimodal distribution
    the answer differs: a cut goes in the gap between the modes, not inside the
    long mode, and the other cuts go where most requests are.

    Exact on the samples (``SKETCH`` evenly spaced order statistics of them when
    there are more): the i-th smallest of a bin's m samples is the max of B draws
    with probability (i/m)^B - ((i-1)/m)^B, B = min(``batch``, ``MAX_DRAWS``); every
    gap between two distinct samples is a candidate cut, and a dynamic programme
    picks the best.  A cut sits mid-gap: the same split of the samples, with the
    widest margin for lengths not seen yet (a long request a little shorter than
    the longs seen so far stays out of the short bin).  Strictly increasing, above
    the smallest sample, every bin holding a sample.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    s = np.sort(np.fromiter(samples, dtype=float))
    n = len(s)
    if not n:
        raise ValueError("samples must not be empty")
    if n > SKETCH:
        s = s[((np.arange(SKETCH) + 0.5) * n / SKETCH).astype(int)]
    values, counts = np.unique(s, return_counts=True)
    d = len(values)
    below = np.concatenate(([0], np.cumsum(counts)))  # below[j]: samples under values[j]
    # held[a, j]: samples in [values[a], values[j]); a bin [values[a], values[b]) holds held[a, b]
    held = np.clip(below[None, :] - below[:-1, None], 0, None).astype(float)
    power = held ** min(batch, MAX_DRAWS)
    # sum over the bin's values of value·Pr(it is the max), before dividing by held^B
    top = np.concatenate((np.zeros((d, 1)), np.cumsum(values[None, :] * np.diff(power, axis=1), axis=1)), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        cost = np.where(held > 0, held / len(s) * top / power, np.inf)  # Eq. 2: Pr(bin)·E[max | bin]
    # least[a]: least cost of the samples from values[a] up in at most r bins (least[d] = 0: none left)
    least = np.append(np.full(d, np.inf), 0.0)
    ends: list[np.ndarray] = []
    for _ in range(k):
        total = cost + least[None, :]
        end = np.argmin(total, axis=1)  # where the bin starting at values[a] ends
        least = np.append(total[np.arange(d), end], 0.0)
        ends.append(end)
    out: list[float] = []
    a = 0
    for end in reversed(ends):  # the first bin uses the k-bin choice, the next k-1, ...
        b = int(end[a])
        if b == d:
            break
        out.append(float(values[b - 1] + values[b]) / 2)  # mid-gap: the same split, the widest margin
        a = b
    return tuple(out)


class FixedBinner:
    """Boundaries fixed at construction; ``observe`` and ``rebalance`` do nothing."""

    def __init__(self, boundaries: Sequence[float]) -> None:
        self._boundaries = _validated(boundaries)

    @classmethod
    def uniform(cls, k: int, lo: float, hi: float) -> FixedBinner:
        """Lemma 4.1 (Eq. 3) for lengths ~ U[lo, hi]: k equal-width, equal-mass bins."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not lo < hi:
            raise ValueError(f"need lo < hi, got lo={lo}, hi={hi}")
        return cls([lo + i * (hi - lo) / k for i in range(1, k)])  # l_i = lmin + i/k·(lmax-lmin)

    @property
    def k(self) -> int:
        return len(self._boundaries) + 1

    @property
    def boundaries(self) -> tuple[float, ...]:
        return self._boundaries

    @property
    def version(self) -> int:
        return 0

    def assign(self, predicted: float) -> int:
        return bin_index(self._boundaries, predicted)

    def observe(self, predicted: float) -> None:
        pass

    def rebalance(self, queued: Sequence[Sequence[float]]) -> bool:
        return False


class AutoBinner:
    """Boundaries learned from the predicted output lengths of arriving requests.

    It learns from the lengths requests are binned by, the predictions, as each
    request arrives: the bins then hold the shares they were cut for even when the
    predictor is biased or shrinks towards the mean, and a burst is binned by its
    own lengths before any of it has completed.

    Two rules (``batch``): None, equal-probability cuts (``equal_mass_boundaries``,
    Lemma 4.1); an int B, the cuts with the least expected service time of a batch
    of B that holds the engine until its longest member ends
    (``min_service_boundaries``, Eq. 2: gang mode), which are the equal-mass cuts
    for uniform lengths and cut between the modes of a bimodal distribution.

    Memory: a sliding window of the last ``window`` observations (a deque), so the
    estimate is bounded whatever the stream length and follows drift in the
    workload.  The first estimate comes once ``min_samples`` are seen, the next
    ones each time the count seen doubles, then every ``refresh_every``: fast at
    start, when the initial boundaries are a guess, and amortised after.

    Ties (discrete lengths, a common ``max_tokens`` cap) can merge cuts; they are
    deduplicated rather than nudged apart, so ``k`` (= ``len(boundaries) + 1``, the
    bins that actually exist) may be below ``target_k`` until the distribution
    spreads out again.  To avoid re-binning the former's queue for noise, a refresh
    whose boundaries each moved by at most ``min_shift`` (relative) keeps the old
    ones.  ``version`` increments only when the boundaries actually change.

    ``initial_boundaries`` serve until the first refresh; they may hold fewer than
    ``target_k - 1`` points (``()`` starts with one bin).
    """

    def __init__(
        self,
        k: int,
        initial_boundaries: Sequence[float] = (),
        *,
        window: int = 2048,
        min_samples: int = 256,
        refresh_every: int = 128,
        min_shift: float = 0.02,
        batch: int | None = None,
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 1 <= min_samples <= window:
            raise ValueError(f"min_samples must be in [1, window={window}], got {min_samples}")
        if refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {refresh_every}")
        if not 0 <= min_shift < 1:
            raise ValueError(f"min_shift must be in [0, 1), got {min_shift}")
        if batch is not None and batch < 1:
            raise ValueError(f"batch must be >= 1 or None, got {batch}")
        b = _validated(initial_boundaries)
        if len(b) > k - 1:
            raise ValueError(f"boundaries: at most k-1={k - 1} interior cut points, got {len(b)}")
        self.target_k = k
        self.batch = batch
        self._boundaries = b
        self._version = 0
        self._window: deque[float] = deque(maxlen=window)
        self._refresh_every = refresh_every
        self._min_shift = min_shift
        self._seen = 0
        self._next_refresh = min_samples

    @property
    def k(self) -> int:
        return len(self._boundaries) + 1

    @property
    def boundaries(self) -> tuple[float, ...]:
        return self._boundaries

    @property
    def version(self) -> int:
        return self._version

    @property
    def samples_held(self) -> int:
        """Observations in the window (at most ``window``)."""
        return len(self._window)

    def assign(self, predicted: float) -> int:
        return bin_index(self._boundaries, predicted)

    def observe(self, predicted: float) -> None:
        """Add an arriving request's predicted length; refresh the boundaries when one is due."""
        if not math.isfinite(predicted) or predicted < 0:
            raise ValueError(f"predicted length must be finite and >= 0, got {predicted}")
        self._window.append(float(predicted))
        self._seen += 1
        if self._seen >= self._next_refresh:
            self._next_refresh = self._seen + min(self._seen, self._refresh_every)  # doubling, then every N
            self._refresh()

    def rebalance(self, queued: Sequence[Sequence[float]]) -> bool:
        """Boundaries follow the lengths observed (``observe``), not the queue."""
        return False

    def _refresh(self) -> None:
        if self.batch is None:
            new = equal_mass_boundaries(self._window, self.target_k)
        else:
            new = min_service_boundaries(self._window, self.target_k, self.batch)
        if new == self._boundaries or self._close(new):
            return
        self._boundaries = new
        self._version += 1

    def _close(self, new: tuple[float, ...]) -> bool:
        old = self._boundaries
        return len(new) == len(old) and all(
            abs(a - b) <= self._min_shift * b for a, b in zip(new, old)
        )


def n_max_from_memory(
    kv_capacity_tokens: float, mean_tokens_per_request: float, reserve: float = 0.10
) -> int:
    """BucketServe Eq. 5-6: the most requests whose KV cache fits in safe memory.

    Eq. 6 is N_max = max{N : Σ_{i≤N} S_i ≤ M_safe / (2·L·H·D·B)}, with
    M_safe = (1 - reserve)·M_remain (Eq. 5, 10% reserved).  M_remain / (2·L·H·D·B)
    is the KV capacity in tokens (vLLM: num_gpu_blocks × block_size), and we take
    S_i, the tokens of the requests still to come, at their observed mean, so
    N_max = ⌊(1 - reserve)·η / S̄⌋.  Never below 1: a bucket must admit a request.
    """
    if not kv_capacity_tokens > 0:
        raise ValueError(f"kv_capacity_tokens must be > 0, got {kv_capacity_tokens}")
    if not mean_tokens_per_request > 0:
        raise ValueError(f"mean_tokens_per_request must be > 0, got {mean_tokens_per_request}")
    if not 0 <= reserve < 1:
        raise ValueError(f"reserve must be in [0, 1), got {reserve}")
    safe = (1 - reserve) * kv_capacity_tokens  # Eq. 5: M_safe = 0.9 × M_remain
    return max(1, math.floor(safe / mean_tokens_per_request))  # Eq. 6 with S_i = S̄


class AdaptiveBinner:
    """BucketServe's Algorithm 1 (adaptive bucketing), over predicted output length.

    Starts with one bucket over [lo, hi].  On ``rebalance(queued)`` (AdjustBuckets):

    * total queued < n_max: merge everything back into one bucket (lines 11-13);
    * else each bucket holding more than n_max requests, more than ``theta`` of them
      below its midpoint, splits there (lines 14-29), at most ``max_buckets`` in all
      (the fullest buckets split first when not all may).

    Readings of the paper: one AdjustBuckets pass per call, so a bucket splits at
    most once per ``rebalance`` ("this process continues" over later calls, after
    the former has re-binned).  Requests are counted by their predicted lengths
    against this binner's own boundaries, so ``queued`` may be grouped any way
    (the former's bins, or one flat list).  Values outside [lo, hi] count in the
    edge buckets, where ``assign`` puts them.  ``n_max`` is settable, as KV memory
    (``n_max_from_memory``) changes.
    """

    def __init__(
        self, lo: float, hi: float, n_max: int, *, theta: float = 0.5, max_buckets: int = 8
    ) -> None:
        if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo < hi):
            raise ValueError(f"need 0 <= lo < hi, got lo={lo}, hi={hi}")
        if not 0 <= theta < 1:
            raise ValueError(f"theta must be in [0, 1), got {theta}")
        if max_buckets < 1:
            raise ValueError(f"max_buckets must be >= 1, got {max_buckets}")
        self.lo, self.hi = float(lo), float(hi)
        self.theta = theta
        self.max_buckets = max_buckets
        self.n_max = n_max
        self._boundaries: tuple[float, ...] = ()
        self._version = 0

    @property
    def n_max(self) -> int:
        return self._n_max

    @n_max.setter
    def n_max(self, value: int) -> None:
        if value < 1:
            raise ValueError(f"n_max must be >= 1, got {value}")
        self._n_max = int(value)

    @property
    def k(self) -> int:
        return len(self._boundaries) + 1

    @property
    def boundaries(self) -> tuple[float, ...]:
        return self._boundaries

    @property
    def version(self) -> int:
        return self._version

    def assign(self, predicted: float) -> int:
        return bin_index(self._boundaries, predicted)

    def observe(self, predicted: float) -> None:
        pass

    def rebalance(self, queued: Sequence[Sequence[float]]) -> bool:
        """AdjustBuckets (Algorithm 1, lines 10-29); True if the buckets changed."""
        values = [x for group in queued for x in group]
        if len(values) < self._n_max:  # lines 12-13: low load, one bucket
            return self._set(())
        edges = (self.lo, *self._boundaries, self.hi)
        mids = [(a + b) / 2 for a, b in zip(edges, edges[1:])]  # line 17: m_b
        counts = [0] * self.k
        below = [0] * self.k
        for x in values:
            i = self.assign(x)
            counts[i] += 1
            below[i] += x < mids[i]  # line 18: C_s
        splits = [  # line 19: |C_s|/|b| > θ and |b| > m = N_max
            i
            for i in range(self.k)
            if counts[i] > self._n_max
            and below[i] > self.theta * counts[i]
            and edges[i] < mids[i] < edges[i + 1]  # a float interval can halve only so often
        ]
        splits.sort(key=lambda i: -counts[i])
        new = [mids[i] for i in splits[: self.max_buckets - self.k]]
        return self._set(tuple(sorted((*self._boundaries, *new))))  # lines 23-29: split at m_b

    def _set(self, boundaries: tuple[float, ...]) -> bool:
        if boundaries == self._boundaries:
            return False
        self._boundaries = boundaries
        self._version += 1
        return True
