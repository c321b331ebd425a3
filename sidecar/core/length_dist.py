"""A predicted output length as a distribution, not one number (issue 24).

Each consumer reads the part it needs:

* ordering (shortest first): the median -- a monotone function of the model's
  score, so the order is the model's rank;
* the bin: the median;
* the KV plan: an upper quantile (``PLAN_LEVEL``), so a request is planned at a
  length it stays under with that probability;
* a running request: its quantiles given the tokens it has already produced
  (``quantile(p, produced=g)``: the p-quantile of L given L > g), so the plan
  releases what a long prediction held as soon as the answer shows it is short,
  and re-plans a request that outruns its prediction before it forces a
  preemption.

The distribution is held as its quantiles at fixed ``LEVELS`` (a piecewise-linear
quantile function), which any source can fill: a point mass for a client's hint,
empirical quantiles for a learned bucket, a model's point estimate times its
residual quantiles, an external service's quantiles at levels of its choosing.  ``max_tokens`` caps it: the engine stops there.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Iterable, Sequence

import numpy as np

LEVELS: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)
PLAN_LEVEL = 0.9  # the KV plan's quantile: an answer stays within it 9 times in 10 (if calibrated)
TAIL = 1.5  # with no cap, the length at level 1 is the 0.98-quantile times this
OUTRUN = 0.25  # an answer past every quantile is planned to run this share of its length again


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Output tokens as quantiles at ``LEVELS``; ``cap`` is the most the engine will generate."""

    points: tuple[float, ...]
    cap: float = math.inf

    def __post_init__(self) -> None:
        if len(self.points) != len(LEVELS):
            raise ValueError(f"points: {len(LEVELS)} quantiles expected (one per LEVELS), got {len(self.points)}")
        if any(not (math.isfinite(x) and x >= 1) for x in self.points):
            raise ValueError(f"points: quantiles must be finite and >= 1, got {self.points}")
        if any(b < a for a, b in zip(self.points, self.points[1:])):
            raise ValueError(f"points: quantiles must not decrease, got {self.points}")
        if not self.cap >= self.points[-1]:
            raise ValueError(f"cap: {self.cap} is below the highest quantile {self.points[-1]}")

    # -- construction -------------------------------------------------------------

    @classmethod
    def exact(cls, tokens: float, cap: float = math.inf) -> LengthDist:
        """A length said to be known (a client's hint): every quantile is ``tokens``
        (within the cap); an answer that runs past it is planned on by the tail."""
        n = min(cap, max(1.0, float(tokens)))
        return cls((n,) * len(LEVELS), cap)

    @classmethod
    def scaled(cls, center: float, ratios: Sequence[float], cap: float = math.inf) -> LengthDist:
        """``center`` times each of the residual ratios' quantiles at ``LEVELS``, within [1, cap].

        A model of log length with residuals r has quantiles exp(prediction + q_r):
        ``ratios`` are exp(q_r), measured on held-out records."""
        if len(ratios) != len(LEVELS):
            raise ValueError(f"ratios: {len(LEVELS)} expected, got {len(ratios)}")
        top = cap if math.isfinite(cap) else math.inf
        pts = tuple(min(top, max(1.0, center * r)) for r in ratios)
        return cls(_monotone(pts), cap)

    @classmethod
    def from_samples(cls, samples: Iterable[float], cap: float = math.inf) -> LengthDist:
        """Empirical quantiles of observed lengths (at least one sample), within [1, cap]."""
        xs = sorted(min(cap, max(1.0, float(x))) for x in samples)
        if not xs:
            raise ValueError("samples: at least one is needed")
        return cls(tuple(_empirical(xs, p) for p in LEVELS), cap)

    @classmethod
    def from_quantiles(cls, given: Sequence[tuple[float, float]], cap: float = math.inf) -> LengthDist:
        """Quantiles ``(level, tokens)`` at any levels (an external predictor's) mapped onto ``LEVELS``.

        Log tokens are interpolated linearly in the normal score of the level and
        extended past the outermost levels with the slope of the nearest pair, so two
        quantiles give a log-normal and one a point mass; each within [1, cap]."""
        if not given:
            raise ValueError("quantiles: at least one is needed")
        levels = [p for p, _ in given]
        if any(not 0 < p < 1 for p in levels) or any(b <= a for a, b in zip(levels, levels[1:])):
            raise ValueError(f"quantiles: levels must rise strictly within (0, 1), got {levels}")
        tokens = [t for _, t in given]
        if any(not (math.isfinite(t) and t >= 0) for t in tokens) or any(b < a for a, b in zip(tokens, tokens[1:])):
            raise ValueError(f"quantiles: tokens must be finite, >= 0 and not fall as the level rises, got {tokens}")
        named = {p: min(cap, max(1.0, t)) for p, t in given}
        z = [_NORMAL.inv_cdf(p) for p in levels]
        y = [math.log(named[p]) for p in levels]

        def at(level: float) -> float:
            if level in named:
                return named[level]
            if len(z) == 1:
                return named[levels[0]]
            zl = _NORMAL.inv_cdf(level)
            i = min(max(bisect.bisect_right(z, zl), 1), len(z) - 1)  # the pair around zl, else the nearest
            log_tokens = y[i - 1] + (y[i] - y[i - 1]) * (zl - z[i - 1]) / (z[i] - z[i - 1])
            return min(cap, max(1.0, math.exp(min(log_tokens, 700.0))))  # exp stays finite

        return cls(_monotone([at(p) for p in LEVELS]), cap)

    # -- reading ------------------------------------------------------------------

    @property
    def known(self) -> bool:
        """Every quantile is one length (a client's hint): the KV plan takes it as certain."""
        return self.points[0] == self.points[-1]

    @property
    def median(self) -> float:
        return self.quantile(0.5)

    @property
    def plan(self) -> float:
        """The KV plan's length: the ``PLAN_LEVEL`` quantile."""
        return self.quantile(PLAN_LEVEL)

    def _top(self) -> float:
        return self.cap if math.isfinite(self.cap) else self.points[-1] * TAIL

    def _q(self, p: float) -> float:
        """The unconditional quantile function, piecewise linear through (0, q_0.02), LEVELS, (1, top)."""
        if p <= LEVELS[0]:
            return self.points[0]
        if p >= LEVELS[-1]:
            return self.points[-1] + (self._top() - self.points[-1]) * (p - LEVELS[-1]) / (1 - LEVELS[-1])
        i = bisect.bisect_right(LEVELS, p)
        lo, hi = LEVELS[i - 1], LEVELS[i]
        return self.points[i - 1] + (self.points[i] - self.points[i - 1]) * (p - lo) / (hi - lo)

    def cdf(self, x: float) -> float:
        """P(L <= x), the inverse of the quantile function (the smallest level reaching x)."""
        if x < self.points[0]:
            return 0.0
        top = self._top()
        if x >= top:
            return 1.0
        knots = (*self.points, top)
        levels = (*LEVELS, 1.0)
        i = bisect.bisect_right(knots, x)
        if i >= len(knots):
            return 1.0
        a, b = knots[i - 1], knots[i]
        return levels[i - 1] + (levels[i] - levels[i - 1]) * ((x - a) / (b - a) if b > a else 1.0)

    def still_running(self, steps: np.ndarray, produced: float) -> np.ndarray:
        """P(L > produced + s | L > produced) for each s of ``steps``: the chance an
        answer ``produced`` tokens long is still running s tokens later (``produced``
        below the top, where the answer may still end)."""
        knots = np.array((*self.points, self._top()))
        levels = np.array((*LEVELS, 1.0))
        gone = float(np.interp(produced, knots, levels, left=0.0, right=1.0)) if produced > 0 else 0.0
        return (1.0 - np.interp(produced + steps, knots, levels, left=0.0, right=1.0)) / (1.0 - gone)

    def quantile(self, p: float, produced: float = 0.0) -> float:
        """The p-quantile of the total length, given that ``produced`` tokens are out and
        the answer has not ended: Q(F(g) + p (1 - F(g))), at least g + 1 and at most the cap.

        An answer past every quantile is planned at (1 + OUTRUN) g (it outran its
        prediction: re-plan it rather than hold it at a length it has passed)."""
        if not 0 <= p <= 1:
            raise ValueError(f"p must be in [0, 1], got {p}")
        g = max(0.0, float(produced))
        if g <= 0:
            return self._q(p)
        floor = min(self.cap, g + 1)
        f = self.cdf(g)
        if f >= 1.0:
            return min(self.cap, max(floor, g * (1 + OUTRUN)))
        return min(self.cap, max(floor, self._q(f + p * (1 - f))))

    def remaining(self, p: float, produced: float) -> float:
        """Tokens still to come at the p-quantile, given ``produced`` are out."""
        return max(0.0, self.quantile(p, produced) - max(0.0, produced))


_NORMAL = NormalDist()


def _monotone(points: Sequence[float]) -> tuple[float, ...]:
    out, top = [], -math.inf
    for x in points:
        top = max(top, x)
        out.append(top)
    return tuple(out)


def _empirical(sorted_xs: Sequence[float], p: float) -> float:
    """Linear interpolation between order statistics (numpy's default, method 'linear')."""
    pos = p * (len(sorted_xs) - 1)
    i = int(pos)
    if i + 1 >= len(sorted_xs):
        return sorted_xs[-1]
    return sorted_xs[i] + (sorted_xs[i + 1] - sorted_xs[i]) * (pos - i)
