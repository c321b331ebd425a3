"""Time for the scheduling core, injected so a simulation can drive the same code."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class MonotonicClock:
    """Wall time for the running sidecar (seconds, monotonic)."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told: the simulator's and the unit tests'."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"clock cannot go back: {t} < {self._now}")
        self._now = float(t)

    def advance(self, dt: float) -> None:
        self.advance_to(self._now + dt)
