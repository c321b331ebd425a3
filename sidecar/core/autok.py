"""Choosing the number of bins from load (ours; in no seed).

More bins raise saturated throughput (Theorem 4.2) but each bin fills more slowly,
so the wait to complete a batch grows as (B-1)·k/(2λ) (Lemma 5.1).  Given the
measured arrival rate and a latency target, pick the k that serves the load and
meets the target with the most throughput headroom.  Lengths are taken as uniform
over [lmin, lmax] as in the theory; callers pass observed low/high quantiles.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .theory import latency_lower_bound, throughput


K_REASONS = ("meets-target", "overloaded", "target-unreachable")  # KChoice.reason, Adjustment.reason of "binCount"


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


class ArrivalWindow:
    """Arrival rate λ over the last ``window`` seconds, from a cumulative count of
    accepted requests sampled at each metrics snapshot (no per-request hook)."""

    def __init__(self, window: float = 30.0) -> None:
        if not window > 0:
            raise ValueError(f"window must be > 0 seconds, got {window}")
        self.window = window
        self._samples: deque[tuple[float, int]] = deque()  # (time, accepted so far)

    def sample(self, now: float, accepted: int) -> float | None:
        """Record the count at ``now``; the rate over the window (None: one sample)."""
        self._samples.append((now, accepted))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window:
            self._samples.popleft()
        t0, n0 = self._samples[0]
        if now <= t0:
            return None
        return max(0, accepted - n0) / (now - t0)


@dataclass(frozen=True, slots=True)
class KDecision:
    """A new bin count and why: ``reason`` is a ``KChoice.reason``, ``detail`` a sentence."""

    old: int
    new: int
    reason: str
    detail: str


class BinCountController:
    """``bins.countMode: Auto``: re-choose k from the measured arrival rate.

    Time in ``choose_k`` is in token steps (the theory's service time is the
    longest length in a batch); the engine's seconds per output token converts λ
    and the target into those units.  Two guards keep k from flapping: a band
    (k stays while it lies between the choices at λ·(1−margin) and λ·(1+margin),
    since the choice grows with λ), and a candidate must win ``confirm``
    consecutive decisions, at least ``hold`` seconds after the last change.
    """

    def __init__(
        self, k: int, k_max: int, latency_target: float, *, window: float = 30.0,
        margin: float = 0.2, confirm: int = 3, hold: float = 10.0,
    ) -> None:  # fmt: skip
        if not 1 <= k <= k_max:
            raise ValueError(f"k must be in [1, k_max={k_max}], got {k}")
        if not latency_target > 0:
            raise ValueError(f"latency_target must be > 0 seconds, got {latency_target}")
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        if confirm < 1:
            raise ValueError(f"confirm must be >= 1, got {confirm}")
        self.k, self.k_max, self.latency_target = k, k_max, latency_target
        self.margin, self.confirm, self.hold = margin, confirm, hold
        self.arrivals = ArrivalWindow(window)
        self.rate: float | None = None
        self._candidate: int | None = None
        self._streak = 0
        self._changed_at: float | None = None

    def on_snapshot(
        self, now: float, accepted: int, seconds_per_token: float | None, batch: int, lmin: float, lmax: float
    ) -> KDecision | None:
        """Sample λ; return a decision when k should change now, else None."""
        lam = self.arrivals.sample(now, accepted)
        self.rate = lam
        if lam is None or lam <= 0 or not seconds_per_token or seconds_per_token <= 0:
            self._candidate, self._streak = None, 0  # idle, or no time scale: keep k
            return None
        lam_tok = lam * seconds_per_token  # arrivals per token step
        target_tok = self.latency_target / seconds_per_token

        def pick(rate: float) -> KChoice:
            return choose_k(rate, target_tok, batch, lmin, lmax, self.k_max)

        choice = pick(lam_tok)
        low, high = pick(lam_tok * (1 - self.margin)).k if self.margin else choice.k, pick(lam_tok * (1 + self.margin)).k
        if min(low, high) <= self.k <= max(low, high) or choice.k == self.k:
            self._candidate, self._streak = None, 0
            return None
        self._streak = self._streak + 1 if choice.k == self._candidate else 1
        self._candidate = choice.k
        if self._streak < self.confirm or (self._changed_at is not None and now - self._changed_at < self.hold):
            return None
        old, self.k = self.k, choice.k
        self._changed_at, self._candidate, self._streak = now, None, 0
        detail = (
            f"arrival rate {lam:.3g}/s, {seconds_per_token * 1000:.3g} ms/token, batch {batch}: k={choice.k} "
            f"bounds latency at {choice.latency_bound * seconds_per_token:.3g} s "
            f"(target {self.latency_target:.3g} s), throughput {choice.throughput / seconds_per_token:.3g}/s"
        )
        return KDecision(old, choice.k, choice.reason, detail)
