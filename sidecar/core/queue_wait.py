"""How long a new request would wait in the queue, from the measured service rate.

The count bound alone (``maxQueuedRequests``, 10,000 by default) let ~40 s of
backlog build up, so under overload requests waited out their whole deadline and
were often cancelled after being sent (wasted engine work).  With a time bound a
request whose predicted wait exceeds its deadline is refused at once
(RESOURCE_EXHAUSTED) instead.

The rate is completions per second measured only over intervals in which the
engine was saturated (requests waited for a free slot, not just for their bin to
fill), so it is the engine's capacity, not the arrival rate of a quiet period:
``ServiceRate.completed(now, saturated)`` at each completion.  No I/O; time
comes from the caller.  Both windows keep their sums as samples come and go
(``_Window``): the rate and the mean service time are read on every submit with
a deadline, and a pass over 512 samples there cost more than the rest of the
sidecar's Python per request.
"""

from __future__ import annotations

import math
from collections import deque

WINDOW = 512  # completions kept
MAX_AGE_SECONDS = 30.0  # older completions do not describe the engine now
MIN_SAMPLES = 32  # fewer: no estimate, nothing is refused


class _Window:
    """The last ``size`` (time, seconds) samples and their sum, kept in integer
    nanoseconds as samples enter and leave: exact (no float drift over millions
    of requests) and O(1) to read."""

    __slots__ = ("_items", "_size", "_sum_ns")

    def __init__(self, size: int) -> None:
        self._items: deque[tuple[float, int]] = deque()
        self._size = size
        self._sum_ns = 0

    def __len__(self) -> int:
        return len(self._items)

    def append(self, t: float, seconds: float) -> None:
        ns = round(seconds * 1e9)
        if len(self._items) == self._size:
            self._sum_ns -= self._items.popleft()[1]
        self._items.append((t, ns))
        self._sum_ns += ns

    def drop_older_than(self, cutoff_age: float, now: float) -> None:
        items = self._items
        while items and now - items[0][0] > cutoff_age:
            self._sum_ns -= items.popleft()[1]

    def total(self) -> float:
        """The samples' sum in seconds."""
        return self._sum_ns / 1e9


class ServiceRate:
    """Completions per second while the engine was saturated (module docstring)."""

    def __init__(
        self, *, window: int = WINDOW, max_age: float = MAX_AGE_SECONDS, min_samples: int = MIN_SAMPLES
    ) -> None:
        if window < 1 or min_samples < 1 or min_samples > window:
            raise ValueError(f"need 1 <= min_samples <= window, got min_samples={min_samples}, window={window}")
        if not (math.isfinite(max_age) and max_age > 0):
            raise ValueError(f"max_age must be finite and > 0, got {max_age}")
        self.max_age = max_age
        self.min_samples = min_samples
        self._samples = _Window(window)  # (time, busy seconds it closes)
        self._services = _Window(window)  # (time, seconds in the engine)
        self._last: float | None = None
        self._busy = False  # was the engine saturated at the last completion?

    def completed(self, now: float, saturated: bool, service_seconds: float | None = None) -> None:
        """One completion at ``now``; ``saturated``: requests are waiting for a slot;
        ``service_seconds``: how long the request was in the engine."""
        if service_seconds is not None and math.isfinite(service_seconds) and service_seconds >= 0:
            self._services.append(now, service_seconds)
        if self._last is not None and self._busy:
            self._samples.append(now, max(0.0, now - self._last))
        self._last = now
        self._busy = saturated

    def rate(self, now: float) -> float | None:
        """Completions per second, or None without enough recent samples."""
        if not self._recent(self._samples, now):
            return None
        busy = self._samples.total()
        return len(self._samples) / busy if busy > 0 else None

    def service_seconds(self, now: float) -> float:
        """Mean seconds a request spends in the engine, over the recent window (0: unknown).

        A request admitted after its predicted queue wait still needs this long to
        finish: under load (many requests in the engine at once) it is seconds, so a
        bound on the queue wait alone admits requests that then time out in the engine.
        """
        if not self._recent(self._services, now):
            return 0.0
        return self._services.total() / len(self._services)

    def _recent(self, samples: _Window, now: float) -> bool:
        """Drop ``samples`` older than ``max_age``; True if enough are left to judge by."""
        samples.drop_older_than(self.max_age, now)
        return len(samples) >= self.min_samples


def predicted_wait(ahead: int, rate: float) -> float:
    """Seconds until ``ahead`` requests have been served at ``rate`` per second."""
    return ahead / rate


def refusal(ahead: int, rate: float | None, remaining: float | None, service: float = 0.0) -> str | None:
    """Why a request with ``remaining`` seconds to its deadline should be refused
    (None: accept): its predicted queue wait plus the mean ``service`` time in the
    engine exceeds the deadline.  No deadline, no backlog or no rate estimate: accept."""
    if remaining is None or rate is None or ahead <= 0:
        return None
    wait = predicted_wait(ahead, rate)
    if wait + service <= remaining:
        return None
    return (f"predicted queue wait {wait:.2f} s ({ahead} requests ahead, served at {rate:.1f}/s) "
            f"plus {service:.2f} s in the engine exceeds the request's deadline of {max(0.0, remaining):.2f} s")  # fmt: skip
