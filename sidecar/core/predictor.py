"""Length predictors: the expected output tokens of a request, before it runs.

* ``HintPredictor``: the client's ``expected_output_tokens`` hint, else ``max_tokens``.
* ``OnlinePredictor``: learns from the completions the sidecar sees, per
  (request class, prompt-length bucket), with coarser fallbacks.

The client's hint always wins (the API promises it): both predictors return the
hint, capped at ``max_tokens``, whenever one is given; the online predictor only
predicts requests without a hint.  ``predict`` records where its answer came from
in ``req.prediction_source`` (``SOURCES``), so accuracy is reported per source: a
good hint and a poor learned estimate must not average into one number.
* ``ExternalFirst``: an external predictor service's answer (``req.external_length``,
  asked by the server before the request is queued) for requests without a hint,
  else the predictor it wraps.
* ``AccuracyTracker``: how often the prediction lands in the right bin - the
  analogue of multi-bin-batching-v2 Table 1 (bin classification accuracy) and its
  "1 bin accuracy" (predicted bin within one of the actual bin, Appendix C.1).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, OrderedDict, deque
from typing import Sequence

from .request import Request
from .stages import LengthPredictor  # noqa: F401 - the contract, declared with the other stages

_Key = tuple[str] | tuple[str, int]  # (request_class,) or (request_class, prompt bucket)

# Where a prediction came from: the client's hint, an external predictor service,
# the online estimate, the request's max_tokens, or predictor.defaultOutputTokens.
SOURCES = ("hint", "external", "online", "max_tokens", "default")


def _hinted(req: Request) -> float | None:
    """The client's hint capped at ``max_tokens`` (when > 0), or None without a hint."""
    if req.hint_tokens is None or not req.hint_tokens > 0:
        return None
    hint = float(req.hint_tokens)
    return min(hint, float(req.max_tokens)) if req.max_tokens > 0 else hint


class HintPredictor:
    """The client's hint if > 0 (capped at ``max_tokens``), else ``max_tokens`` if > 0,
    else ``default_tokens``."""

    name = "hint"

    def __init__(self, default_tokens: float = 256.0) -> None:
        if not (math.isfinite(default_tokens) and default_tokens > 0):
            raise ValueError(f"default_tokens must be finite and > 0, got {default_tokens}")
        self.default_tokens = float(default_tokens)

    def predict(self, req: Request) -> float:
        hint = _hinted(req)
        if hint is not None:
            req.prediction_source = "hint"
            return hint
        if req.max_tokens > 0:
            req.prediction_source = "max_tokens"
            return float(req.max_tokens)
        req.prediction_source = "default"
        return self.default_tokens

    def observe(self, req: Request, actual_tokens: float) -> None:
        pass


class _Estimate:
    """Running mean that turns into an EWMA: weight max(1/n, alpha) on each sample.

    The first 1/alpha samples are averaged exactly (no bias toward a start value);
    after that old samples fade with factor (1 - alpha).  Two numbers per key.
    """

    __slots__ = ("n", "mean")

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0

    def add(self, x: float, alpha: float) -> None:
        self.n += 1
        self.mean += max(1 / self.n, alpha) * (x - self.mean)


def prompt_bucket(prompt_tokens: int) -> int:
    """Powers of two: 0 -> 0, 1 -> 1, 2-3 -> 2, 4-7 -> 3, ... (``int.bit_length``)."""
    return max(0, int(prompt_tokens)).bit_length()


class OnlinePredictor:
    """Learns output lengths from observed completions.

    A request with a hint gets the hint (capped at ``max_tokens``): the client knows
    its request better than an average of others.  Otherwise, keys, finest first:
    (request_class, prompt_bucket), (request_class,), global.  ``predict`` uses the
    finest key with at least ``min_samples`` observations, else the ``HintPredictor``
    rule; the result is capped at ``max_tokens`` when that is > 0 and floored at
    ``min_tokens`` so it is always > 0.

    Memory is bounded: per key a two-number estimate (``_Estimate``: exact mean for
    the first 1/alpha samples, then EWMA, so it follows drift), and at most
    ``max_keys`` keys (fine and class keys together, least recently used evicted;
    both ``predict`` and ``observe`` count as use).  Class names come from clients,
    so without the bound a stream of distinct classes would grow without limit.
    """

    name = "online"

    def __init__(
        self,
        *,
        min_samples: int = 8,
        alpha: float = 0.05,
        max_keys: int = 4096,
        min_tokens: float = 1.0,
        fallback: HintPredictor | None = None,
    ) -> None:
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if max_keys < 2:
            raise ValueError(f"max_keys must be >= 2, got {max_keys}")
        if not (math.isfinite(min_tokens) and min_tokens > 0):
            raise ValueError(f"min_tokens must be finite and > 0, got {min_tokens}")
        self.min_samples = min_samples
        self.alpha = alpha
        self.max_keys = max_keys
        self.min_tokens = float(min_tokens)
        self.fallback = fallback or HintPredictor()
        self._keys: OrderedDict[_Key, _Estimate] = OrderedDict()
        self._global = _Estimate()

    def __len__(self) -> int:
        """Keys held (at most ``max_keys``; the global estimate is not counted)."""
        return len(self._keys)

    @staticmethod
    def _key_chain(req: Request) -> tuple[tuple[str, int], tuple[str]]:
        return (req.request_class, prompt_bucket(req.prompt_tokens)), (req.request_class,)

    def predict(self, req: Request) -> float:
        hint = _hinted(req)
        if hint is not None:
            req.prediction_source = "hint"
            return max(hint, self.min_tokens)
        estimate = self._learned(req)
        if estimate is None:
            estimate = self.fallback.predict(req)
        else:
            req.prediction_source = "online"
        if req.max_tokens > 0:
            estimate = min(estimate, float(req.max_tokens))
        return max(estimate, self.min_tokens)

    def _learned(self, req: Request) -> float | None:
        for key in self._key_chain(req):
            est = self._keys.get(key)
            if est is not None:
                self._keys.move_to_end(key)
                if est.n >= self.min_samples:
                    return est.mean
        return self._global.mean if self._global.n >= self.min_samples else None

    def observe(self, req: Request, actual_tokens: float) -> None:
        if not (math.isfinite(actual_tokens) and actual_tokens >= 0):
            raise ValueError(f"actual_tokens must be finite and >= 0, got {actual_tokens}")
        x = float(actual_tokens)
        for key in self._key_chain(req):
            est = self._keys.get(key)
            if est is None:
                est = self._keys[key] = _Estimate()
            self._keys.move_to_end(key)
            est.add(x, self.alpha)
        self._global.add(x, self.alpha)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)  # LRU eviction


class ExternalFirst:
    """The sources in order: the client's hint, then the external service's answer, then
    ``inner``.  ``inner`` keeps learning from every completion; its name is the one reported."""

    name: str

    def __init__(self, inner: LengthPredictor) -> None:
        self.inner = inner
        self.name = inner.name

    def predict(self, req: Request) -> float:
        if req.external_length is None or _hinted(req) is not None:
            return self.inner.predict(req)
        req.length = req.external_length
        req.prediction_source = "external"
        return req.length.median

    def observe(self, req: Request, actual_tokens: float) -> None:
        self.inner.observe(req, actual_tokens)


class AccuracyTracker:
    """Bin accuracy of the last ``window`` (predicted, actual) pairs, overall and
    per prediction source (``SOURCES``: hint vs online vs the fallbacks).

    A value's bin is ``bisect_right(boundaries, value)``.  ``bin_accuracy`` is
    Table 1's classification accuracy (predicted bin == actual bin);
    ``within_one_bin_accuracy`` is Appendix C.1's "1 bin accuracy"
    (|predicted bin - actual bin| <= 1).  Boundaries are passed at query time, so
    the same pairs can be scored against the binner's current boundaries.

    The dispatcher asks for every score on every metrics snapshot, so the scores
    are kept as running counts for the last boundaries asked about: a pair added
    or evicted updates them in O(log k); only new boundaries rescore the window
    (it cost ~3 ms per score per snapshot, recounting 1024 pairs every time).
    """

    def __init__(self, window: int = 1024) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._pairs: deque[tuple[float, float, str]] = deque()
        self._per_source: Counter[str] = Counter()
        self._scored_for: tuple[float, ...] | None = None  # the boundaries _hits counts against
        # source (None: all) -> [pairs within 0 bins, pairs within 1 bin]
        self._hits: dict[str | None, list[int]] = {}

    def __len__(self) -> int:
        return len(self._pairs)

    def record(self, predicted: float, actual: float, source: str = "") -> None:
        if len(self._pairs) == self.window:
            self._count(self._pairs.popleft(), -1)
        pair = (float(predicted), float(actual), source)
        self._pairs.append(pair)
        self._count(pair, +1)

    def _count(self, pair: tuple[float, float, str], sign: int) -> None:
        source = pair[2]
        self._per_source[source] += sign
        if self._per_source[source] == 0:
            del self._per_source[source]
        if self._scored_for is not None:
            self._count_hits(pair, sign)

    def samples(self, source: str | None = None) -> int:
        """Pairs held, of one ``source`` or (None) of all."""
        return len(self._pairs) if source is None else self._per_source.get(source, 0)

    def sources(self) -> list[str]:
        """The sources that have pairs in the window, in ``SOURCES`` order."""
        held = set(self._per_source)
        return [s for s in SOURCES if s in held] + sorted(held - set(SOURCES))

    def bin_accuracy(self, boundaries: Sequence[float], source: str | None = None) -> float | None:
        return self._share_within(boundaries, 0, source)

    def within_one_bin_accuracy(self, boundaries: Sequence[float], source: str | None = None) -> float | None:
        return self._share_within(boundaries, 1, source)

    def _share_within(self, boundaries: Sequence[float], tolerance: int, source: str | None) -> float | None:
        n = self.samples(source)
        if not n:
            return None
        key = tuple(boundaries)
        if key != self._scored_for:
            self._scored_for, self._hits = key, {}
            for pair in self._pairs:
                self._count_hits(pair)
        return self._hits.get(source, (0, 0))[tolerance] / n

    def _count_hits(self, pair: tuple[float, float, str], sign: int = 1) -> None:
        """Add (sign 1) or remove (-1) ``pair``'s hits against ``_scored_for``."""
        bounds = self._scored_for
        assert bounds is not None
        off = abs(bisect.bisect_right(bounds, pair[0]) - bisect.bisect_right(bounds, pair[1]))
        for key in (None, pair[2]):
            hits = self._hits.setdefault(key, [0, 0])
            hits[0] += sign * (off == 0)
            hits[1] += sign * (off <= 1)
