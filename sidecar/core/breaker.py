"""A circuit breaker in front of the engine: hold the queue while the engine is down.

Without it an engine outage flushed the whole queue into the dead engine, where
every request failed in half a second although most could have waited out a
restart.  The breaker decides only *whether to dispatch*; the scheduler keeps the
requests.  Pure: no I/O, time comes from the caller, and an engine call's outcome
arrives as the reason it was an outage (or None); ``engine/breaker.py`` says which
engine errors are outages.

States:

* ``closed`` -- the engine answers; dispatch freely.
* ``open`` -- the engine is down: a health probe failed, or a request could not
  reach it (connection refused or lost, 502/503/504).  Nothing is dispatched;
  queued requests wait in the bounded queue until the engine is back or their
  deadline passes.
* ``half_open`` -- a health probe succeeded after an outage: one request (one
  batch in gang mode) at a time goes to the engine until one gets an answer or a
  second probe succeeds (``closed``: a long generation as the trial must not
  throttle a healthy engine for its whole length), or a call fails for the engine
  being down again (``open``).

An answer the engine *gave* -- a result, a 400, a 500 for one request, a 429 --
is not an outage: the engine is alive.
"""

from __future__ import annotations

from typing import Literal

State = Literal["closed", "open", "half_open"]
STATES: tuple[State, ...] = ("closed", "open", "half_open")


class EngineBreaker:
    """The breaker's state machine (module docstring).  Every method that changes
    the state returns True, so the caller knows to wake its dispatch loop."""

    def __init__(self) -> None:
        self.state: State = "closed"
        self.reason = ""  # why it last opened
        self.opened_at: float | None = None  # when it last opened (caller's clock)
        self.opens = 0  # times it opened

    def allows_dispatch(self, inflight: int) -> bool:
        """May one more request (or batch) go to the engine with ``inflight`` there?"""
        if self.state == "closed":
            return True
        return self.state == "half_open" and inflight == 0

    def on_probe(self, ok: bool, now: float, reason: str = "health probe failed") -> bool:
        """A health probe's result."""
        if not ok:
            return self._open(now, reason)
        if self.state == "open":
            self.state = "half_open"
            return True
        if self.state == "half_open":
            self.state, self.reason = "closed", ""
            return True
        return False

    def on_result(self, outage: str | None, now: float) -> bool:
        """An engine call's outcome: ``outage`` is why it showed the engine down
        (None: the engine answered, whatever it said)."""
        if outage is not None:
            return self._open(now, outage)
        if self.state == "half_open":
            self.state, self.reason = "closed", ""
            return True
        return False

    def open_seconds(self, now: float) -> float:
        """How long it has been open or half-open (0 when closed)."""
        if self.state == "closed" or self.opened_at is None:
            return 0.0
        return max(0.0, now - self.opened_at)

    def describe(self, now: float) -> str:
        """A sentence for error messages and logs."""
        if self.state == "closed":
            return "the engine is available"
        state = self.state.replace("_", "-")
        return f"the engine is unavailable ({state} for {self.open_seconds(now):.1f} s: {self.reason})"

    def _open(self, now: float, reason: str) -> bool:
        self.reason = reason
        if self.state == "open":
            return False
        if self.state == "closed":
            self.opened_at = now
            self.opens += 1
        self.state = "open"
        return True
