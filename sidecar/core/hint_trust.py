"""Length hints are earned: a request class whose hints keep running short loses them.

A hint places its request as a known length: ShortestFirst admits a short hint first,
and the KV plan counts on it.  A hint that runs long therefore jumps the queue and,
when the answer outruns it, takes the KV headroom everyone else was planned with.
Trust is kept per request class ("" for requests naming none) and, with caller
authentication on (``auth.callerTokensDir``), per caller within it: a caller whose hints
run long loses them without taking an honest caller's of the same class away.  Callers
are those of the config's token directory, so the keys stay bounded.

Per class, the ratio of actual output tokens to hinted tokens (the hint as used:
capped at ``max_tokens``) of the latest ``window`` hinted completions is kept, each
for ``horizon`` seconds.  Once at least ``min_samples`` are held and their median is
above ``lose_ratio``, the class's hints are ignored and the predictor places its
requests; they come back when the median falls to ``regain_ratio`` or below (hints
are still recorded while ignored, so honest completions restore them) or when the
evidence ages out below ``min_samples``.  The gap between the two ratios keeps a
class near the line from flipping on every completion.

No I/O: time comes from the injected clock, and every flip is queued as a
``TrustChange`` the driver takes (``take_changes``) to log and count.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from .clock import Clock

WINDOW = 32  # hinted completions per class the median is taken over
LOSE_RATIO = 2.0  # median actual/hinted above this: the class's hints are ignored
REGAIN_RATIO = 1.5  # ... until the median is back at or below this
# No verdict on fewer hinted completions.  Each lie believed before the verdict jumps the queue and
# overruns the KV plan, and at 0.9 load the backlog that leaves drains at a tenth of capacity: with
# eight (the first value) a class hinting an eighth of its answers cost the honest callers 1.50x their
# p99 E2E (bench liar, four repeats; one at 2.1x), with four 0.87x and 1.03x (two runs; the same noise
# either way).  A median of four above 2x is still no honest class's.
MIN_SAMPLES = 4
HORIZON_SECONDS = 600.0  # a completion counts this long


@dataclass(frozen=True, slots=True)
class TrustChange:
    """A class (of one caller, with caller authentication on) lost (``trusted`` False) or regained its hints."""

    request_class: str
    trusted: bool
    median_ratio: float | None  # None: the evidence aged out
    samples: int
    at: float
    caller: str = ""


@dataclass(slots=True)
class _ClassRecord:
    samples: deque[tuple[float, float]]  # (clock time, actual / hinted)
    trusted: bool = True
    # the samples' median, kept until they change: every hinted request asks (trusted, then record)
    median: float | None = None
    changed: bool = True

    def median_ratio(self) -> float | None:
        if self.changed:
            self.median = statistics.median(r for _, r in self.samples) if self.samples else None
            self.changed = False
        return self.median


class HintTrust:
    """Per request class: are its hints still believed?"""

    def __init__(
        self, clock: Clock, *, window: int = WINDOW, lose_ratio: float = LOSE_RATIO,
        regain_ratio: float = REGAIN_RATIO, min_samples: int = MIN_SAMPLES, horizon: float = HORIZON_SECONDS,
    ) -> None:  # fmt: skip
        if not 1 <= min_samples <= window:
            raise ValueError(f"min_samples must be in [1, window={window}], got {min_samples}")
        if not 0 < regain_ratio <= lose_ratio:
            raise ValueError(f"regain_ratio must be in (0, lose_ratio={lose_ratio}], got {regain_ratio}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.clock = clock
        self.window, self.lose_ratio, self.regain_ratio = window, lose_ratio, regain_ratio
        self.min_samples, self.horizon = min_samples, horizon
        self._classes: dict[tuple[str, str], _ClassRecord] = {}  # by (caller, request class)
        self._changes: list[TrustChange] = []

    def trusted(self, request_class: str, caller: str = "") -> bool:
        """Whether ``request_class``'s hints (sent by ``caller``) place its requests now."""
        key = (caller, request_class)
        rec = self._classes.get(key)
        if rec is None:
            return True
        self._judge(key, rec)  # evidence may have aged out
        return rec.trusted

    def record(self, request_class: str, hinted: float, actual: float, caller: str = "") -> None:
        """A completion of ``request_class`` (sent by ``caller``) that carried a hint (``hinted`` >= 1
        tokens, as used) produced ``actual`` output tokens."""
        if not hinted >= 1:
            raise ValueError(f"hinted must be >= 1 tokens, got {hinted}")
        key = (caller, request_class)
        rec = self._classes.get(key)
        if rec is None:
            rec = self._classes[key] = _ClassRecord(deque(maxlen=self.window))
        rec.samples.append((self.clock.now(), max(0.0, float(actual)) / float(hinted)))
        rec.changed = True
        self._judge(key, rec)

    def median_ratio(self, request_class: str, caller: str = "") -> float | None:
        """The median actual/hinted of the class's recent hinted completions (None: none held)."""
        rec = self._classes.get((caller, request_class))
        if rec is None:
            return None
        self._expire(rec)
        return rec.median_ratio()

    def distrusted(self, caller: str = "") -> list[str]:
        """The classes whose hints (sent by ``caller``) are ignored now."""
        return [name for who, name in list(self._classes) if who == caller and not self.trusted(name, who)]

    def take_changes(self) -> list[TrustChange]:
        """The flips since the last call, oldest first (the driver logs and counts them)."""
        out, self._changes = self._changes, []
        return out

    def _expire(self, rec: _ClassRecord) -> None:
        cutoff = self.clock.now() - self.horizon
        while rec.samples and rec.samples[0][0] <= cutoff:
            rec.samples.popleft()
            rec.changed = True

    def _judge(self, key: tuple[str, str], rec: _ClassRecord) -> None:
        self._expire(rec)
        n = len(rec.samples)
        median = rec.median_ratio()
        if rec.trusted:
            flip = n >= self.min_samples and median is not None and median > self.lose_ratio
        else:
            flip = n < self.min_samples or (median is not None and median <= self.regain_ratio)
        if flip:
            rec.trusted = not rec.trusted
            shown = median if n >= self.min_samples else None
            self._changes.append(TrustChange(key[1], rec.trusted, shown, n, self.clock.now(), caller=key[0]))
