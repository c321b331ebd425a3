"""Length predictors: the output length of a request, before it runs.

* ``HintPredictor``: the client's ``expected_output_tokens`` hint, else ``max_tokens``.
* ``OnlinePredictor``: learns from the completions the sidecar sees, per
  (request class, prompt-length bucket), with coarser fallbacks.
* ``LearnedPredictor``: a model that reads the prompt (``length_model``), warm-started
  from a file and refitted off the request path on the completions it sees; the
  online predictor answers until it has a model.
* ``ExternalFirst``: an external predictor service's answer (``req.external_length``,
  asked by the server before the request is queued) for requests without a hint,
  else the predictor it wraps.

Each sets ``req.length``, the predicted length as a distribution (``LengthDist``:
its median orders and bins, its upper quantile plans the KV cache), and returns
the median.  The client's hint wins (the API promises it, for the hints the server
lets through: server/front.py): every predictor
returns the hint, capped at ``max_tokens``, as an exact length whenever one is
given; the others only predict requests without a hint.

A predictor reads the prompt's text, its class, its token estimate and
``max_tokens``, never what could force a length (``min_tokens``, stop strings,
``ignore_eos``): the core ``Request`` does not carry them.

``predict`` records where its answer came from in ``req.prediction_source``
(``SOURCES``), so accuracy is reported per source: a good hint and a poor learned
estimate must not average into one number.

* ``AccuracyTracker``: how often the prediction lands in the right bin - the
  analogue of multi-bin-batching-v2 Table 1 (bin classification accuracy) and its
  "1 bin accuracy" (predicted bin within one of the actual bin, Appendix C.1) -
  and how well predictions rank the answers (Kendall's tau).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, replace
from typing import Sequence

from .length_dist import LengthDist
from .length_model import Features, LengthModel, featurize
from .request import Request
from .stages import LengthPredictor  # noqa: F401 - the contract, declared with the other stages

_Key = tuple[str] | tuple[str, int]  # (request_class,) or (request_class, prompt bucket)

# Where a prediction came from: the client's hint, an external predictor service, the
# learned model, the online estimate, the request's max_tokens, or predictor.defaultOutputTokens.
SOURCES = ("hint", "external", "learned", "online", "max_tokens", "default")
TAU_MIN_PAIRS = 8  # AccuracyTracker.kendall_tau: fewer pairs rank nothing


def _cap(req: Request) -> float:
    return float(req.max_tokens) if req.max_tokens > 0 else math.inf


def _set(req: Request, dist: LengthDist, source: str) -> float:
    """Record ``dist`` as ``req``'s predicted length and where it came from; its median."""
    req.length, req.prediction_source = dist, source
    return dist.median


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
            return _set(req, LengthDist.exact(hint, _cap(req)), "hint")
        if req.max_tokens > 0:
            return _set(req, LengthDist.exact(req.max_tokens, _cap(req)), "max_tokens")
        return _set(req, LengthDist.exact(self.default_tokens), "default")

    def observe(self, req: Request, actual_tokens: float) -> None:
        pass


def prompt_bucket(prompt_tokens: int) -> int:
    """Powers of two: 0 -> 0, 1 -> 1, 2-3 -> 2, 4-7 -> 3, ... (``int.bit_length``)."""
    return max(0, int(prompt_tokens)).bit_length()


class OnlinePredictor:
    """Learns output lengths from observed completions.

    A request with a hint gets the hint (capped at ``max_tokens``): the client knows
    its request better than an average of others.  Otherwise, keys, finest first:
    (request_class, prompt_bucket), (request_class,), global.  ``predict`` gives the
    empirical distribution of the last ``window`` lengths of the finest key with at
    least ``min_samples`` of them (the global one from ``GLOBAL_MIN_SAMPLES``: a
    spread learned from two answers plans the KV cache better than ``max_tokens``
    taken as exact), else the ``HintPredictor`` rule; within [``min_tokens``,
    ``max_tokens``] (when that is > 0).

    A distribution, not a mean taken as exact: the KV plan holds an uncertain total
    at its upper quantile, where a bucket's mean planned every answer as known (on
    the ShareGPT replay in the engine model, seeds 1-3: mean E2E 1.61x -> 1.03x
    direct's, throughput 0.97x -> 1.00x).  The window follows drift: only the last
    ``window`` answers count.

    Memory is bounded: at most ``window`` numbers per key and ``max_keys`` keys (fine
    and class keys together, least recently used evicted; both ``predict`` and
    ``observe`` count as use).  Class names come from clients, so without the bound a
    stream of distinct classes would grow without limit.
    """

    name = "online"
    GLOBAL_MIN_SAMPLES = 2

    def __init__(
        self,
        *,
        min_samples: int = 8,
        window: int = 64,
        max_keys: int = 4096,
        min_tokens: float = 1.0,
        fallback: HintPredictor | None = None,
    ) -> None:
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        if window < max(min_samples, self.GLOBAL_MIN_SAMPLES):
            raise ValueError(f"window must be >= min_samples ({min_samples}) and >= {self.GLOBAL_MIN_SAMPLES}, got {window}")  # fmt: skip
        if max_keys < 2:
            raise ValueError(f"max_keys must be >= 2, got {max_keys}")
        if not (math.isfinite(min_tokens) and min_tokens > 0):
            raise ValueError(f"min_tokens must be finite and > 0, got {min_tokens}")
        self.min_samples = min_samples
        self.window = window
        self.max_keys = max_keys
        self.min_tokens = float(min_tokens)
        self.fallback = fallback or HintPredictor()
        self._keys: OrderedDict[_Key, deque[float]] = OrderedDict()
        self._global: deque[float] = deque(maxlen=window)

    def __len__(self) -> int:
        """Keys held (at most ``max_keys``; the global window is not counted)."""
        return len(self._keys)

    @staticmethod
    def _key_chain(req: Request) -> tuple[tuple[str, int], tuple[str]]:
        return (req.request_class, prompt_bucket(req.prompt_tokens)), (req.request_class,)

    def predict(self, req: Request) -> float:
        hint = _hinted(req)
        if hint is not None:
            return _set(req, LengthDist.exact(max(hint, self.min_tokens), _cap(req)), "hint")
        lengths = self._learned(req)
        if lengths is None:
            estimate = max(min(self.fallback.predict(req), _cap(req)), self.min_tokens)
            return _set(req, LengthDist.exact(estimate, max(_cap(req), estimate)), req.prediction_source)
        floor = self.min_tokens
        return _set(req, LengthDist.from_samples((max(x, floor) for x in lengths), max(_cap(req), floor)), "online")

    def _learned(self, req: Request) -> deque[float] | None:
        for key in self._key_chain(req):
            lengths = self._keys.get(key)
            if lengths is not None:
                self._keys.move_to_end(key)
                if len(lengths) >= self.min_samples:
                    return lengths
        return self._global if len(self._global) >= min(self.min_samples, self.GLOBAL_MIN_SAMPLES) else None

    def observe(self, req: Request, actual_tokens: float) -> None:
        if not (math.isfinite(actual_tokens) and actual_tokens >= 0):
            raise ValueError(f"actual_tokens must be finite and >= 0, got {actual_tokens}")
        x = float(actual_tokens)
        for key in self._key_chain(req):
            lengths = self._keys.get(key)
            if lengths is None:
                lengths = self._keys[key] = deque(maxlen=self.window)
            self._keys.move_to_end(key)
            lengths.append(x)
        self._global.append(x)
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
        return _set(req, req.external_length, "external")

    def observe(self, req: Request, actual_tokens: float) -> None:
        self.inner.observe(req, actual_tokens)


def _features(req: Request) -> Features:
    """What the learned model reads of a request: its prompt's text, its class, its cap
    (computed once per request: an unhinted one is featurized to predict, then kept to learn from)."""
    f = req.features
    if f is None:
        f = req.features = featurize(req.prompt_text, req.request_class, req.max_tokens)
    return f


@dataclass(frozen=True, slots=True)
class TrainingRecord:
    """One completion kept to learn from: the prompt's hashed features, never its text;
    ``sequence`` numbers the predictor's completions from 1 (what an export's cursor counts)."""

    sequence: int
    features: Features
    output_tokens: float


class LearnedPredictor:
    """Reads the prompt: a ``LengthModel``'s distribution for requests without a hint.

    Until it has a model (no warm start and too few completions yet) the online
    predictor answers (``fallback``, which it keeps feeding).  Every completion's
    hashed features and length go into a bounded buffer (the last ``buffer``
    records); ``refit_due`` says when enough new ones came (after ``first_fit``
    records, then each time as many as the last fit had, up to ``refit_every``;
    with a warm start, every ``refit_every``),
    ``training_set`` hands a copy to whoever fits off the request path
    (``length_model.fit``, given ``prior``: the warm start), and ``install`` swaps
    the new model in whole.  Pure: the engine layer runs the fit in a thread.

    The records are numbered (``TrainingRecord.sequence``) within an ``epoch``
    (a name the caller gives, new per process), so ``export`` hands out only the
    ones after a cursor: the operator gathers a fleet's records that way.
    ``carry_records`` keeps them (and the numbering) across a model swap.
    """

    name = "learned"

    def __init__(
        self,
        *,
        model: LengthModel | None = None,
        fallback: OnlinePredictor | None = None,
        buffer: int = 4096,
        refit_every: int = 1024,
        first_fit: int = 64,
        warm_start: str = "",
        epoch: str = "",
    ) -> None:
        if not 16 <= first_fit <= buffer:
            raise ValueError(f"first_fit must be in [16, buffer={buffer}], got {first_fit}")
        if refit_every < 1:
            raise ValueError(f"refit_every must be >= 1, got {refit_every}")
        self.prior = model  # the warm start: every refit is centred on it
        self.warm_start = warm_start  # where the prior came from ("" none)
        self.warm_start_stamp: tuple[int, int, int] | None = None  # that file as last read (the engine layer's)
        self.model = model
        self.fallback = fallback or OnlinePredictor()
        self.first_fit, self.refit_every = first_fit, refit_every
        self._records: deque[TrainingRecord] = deque(maxlen=buffer)
        self._sequence = 0  # the last record's number
        self.epoch = epoch  # what the numbering is valid in (a new process starts again at 1)
        self._new = 0  # records since the last training_set
        self._last_fit = 0  # records the last training_set held
        self.installed_at: float | None = None  # clock time of the last install (the engine layer's clock)
        self.fitting = False  # a training set is out and not yet installed or dropped

    @property
    def buffered(self) -> int:
        return len(self._records)

    def resize(self, buffer: int) -> None:
        """Keep the last ``buffer`` records from now on (a reload may change it)."""
        if buffer != self._records.maxlen:
            self._records = deque(self._records, maxlen=buffer)
            self.first_fit = min(self.first_fit, buffer)

    def predict(self, req: Request) -> float:
        hint = _hinted(req)
        if hint is not None:
            return _set(req, LengthDist.exact(hint, _cap(req)), "hint")
        model = self.model
        if model is None:
            return self.fallback.predict(req)
        return _set(req, model.dist(_features(req), _cap(req)), "learned")

    def observe(self, req: Request, actual_tokens: float) -> None:
        self.fallback.observe(req, actual_tokens)  # validates actual_tokens
        self._sequence += 1
        self._records.append(TrainingRecord(self._sequence, _features(req), float(actual_tokens)))
        self._new += 1

    def export(self, since: int, limit: int) -> tuple[list[TrainingRecord], int]:
        """The records numbered above ``since``, oldest first, at most ``limit``; and how many newer ones are
        left."""
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        held = len(self._records)
        first = self._sequence - held + 1  # the oldest record's number
        start = min(held, max(0, since - first + 1))
        out = list(itertools.islice(self._records, start, start + limit))
        return out, held - start - len(out)

    @property
    def oldest_sequence(self) -> int:
        """The oldest record's number (0: none held)."""
        return self._sequence - len(self._records) + 1 if self._records else 0

    def carry_records(self, previous: LearnedPredictor) -> None:
        """Take over ``previous``'s records and numbering (its model file was swapped for a new one):
        what was learned from stays exportable, and the refit counts only the records that come next."""
        self._records = deque(previous._records, maxlen=self._records.maxlen)
        self._sequence, self.epoch = previous._sequence, previous.epoch
        self._last_fit = len(self._records)

    def refit_due(self) -> bool:
        # with a warm start, a fit on a few records would replace the prior's residual
        # quantiles (its KV plan's coverage) with noisy ones: wait for refit_every
        first = self.first_fit
        if self.prior is not None:
            first = max(first, min(self.refit_every, self._records.maxlen or first))
        if self.fitting or len(self._records) < first:
            return False
        return self._new >= min(self.refit_every, max(first, self._last_fit))

    def training_set(self) -> tuple[list[Features], list[float]]:
        """The buffered records to fit on (a copy: observing goes on meanwhile); marks a fit as running."""
        self.fitting, self._new, self._last_fit = True, 0, len(self._records)
        records = list(self._records)
        return [r.features for r in records], [r.output_tokens for r in records]

    def install(self, model: LengthModel | None, now: float) -> None:
        """Swap in a fitted model (None: the fit failed; keep the old one)."""
        self.fitting = False
        if model is not None:
            version = (self.model.version if self.model is not None else 0) + 1  # models this predictor has run
            self.model, self.installed_at = replace(model, version=version), now


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
        self._added = 0  # pairs recorded so far: the window's version, for the cached tau
        self._tau: dict[tuple[int, str | None], float | None] = {}

    def __len__(self) -> int:
        return len(self._pairs)

    def record(self, predicted: float, actual: float, source: str = "") -> None:
        if len(self._pairs) == self.window:
            self._count(self._pairs.popleft(), -1)
        pair = (float(predicted), float(actual), source)
        self._pairs.append(pair)
        self._added += 1
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

    def kendall_tau(self, source: str | None = None) -> float | None:
        """Kendall's tau-b of predicted against actual lengths in the window (of one
        ``source``, or all), None below ``TAU_MIN_PAIRS`` pairs or when either side is
        constant.  Recomputed only after the window changed."""
        key = (self._added, source)
        if key not in self._tau:
            pairs = [(p, a) for p, a, s in self._pairs if source is None or s == source]
            tau = None
            if len(pairs) >= TAU_MIN_PAIRS:
                from scipy.stats import kendalltau

                value = float(kendalltau(*zip(*pairs)).statistic)
                tau = value if math.isfinite(value) else None
            self._tau = {k: v for k, v in self._tau.items() if k[0] == self._added}
            self._tau[key] = tau
        return self._tau[key]

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
