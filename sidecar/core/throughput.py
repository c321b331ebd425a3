"""Recent throughput: completed requests and output tokens per second over a window.

``Stats.throughput`` and the operator's ``status.throughputRequestsPerSecond``
read it.  Fed once per completed request with the clock's time; pure (no I/O, no
timers): old completions are dropped when the window is read or fed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

DEFAULT_WINDOW_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Rates:
    window_seconds: float  # the span the rates are averaged over (shorter than the window right after start)
    requests_per_second: float
    output_tokens_per_second: float


class ThroughputWindow:
    """Completions of the last ``window`` seconds.

    The rate divides by the window, or by the time since ``start`` while the
    sidecar is younger than the window: ten requests in the first two seconds
    are 5 requests/s, not 10/60.
    """

    def __init__(self, start: float, window: float = DEFAULT_WINDOW_SECONDS) -> None:
        if not window > 0:
            raise ValueError(f"window must be > 0 seconds, got {window}")
        self.window = window
        self._start = start
        self._events: deque[tuple[float, int]] = deque()  # (time, output tokens)
        self._tokens = 0

    def completed(self, now: float, output_tokens: int) -> None:
        """One request completed at ``now`` with ``output_tokens`` generated."""
        if output_tokens < 0:
            raise ValueError(f"output_tokens must be >= 0, got {output_tokens}")
        self._events.append((now, output_tokens))
        self._tokens += output_tokens
        self._expire(now)

    def rates(self, now: float) -> Rates:
        self._expire(now)
        span = min(self.window, now - self._start)
        if span <= 0:
            return Rates(0.0, 0.0, 0.0)
        return Rates(span, len(self._events) / span, self._tokens / span)

    def _expire(self, now: float) -> None:
        cutoff = now - self.window
        while self._events and self._events[0][0] <= cutoff:
            self._tokens -= self._events.popleft()[1]
