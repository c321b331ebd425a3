"""A few requests taken in per turn of the event loop, so a burst reaches the engine as it is read.

asyncio runs what is ready in arrival order.  When a burst of requests reaches the
HTTP door at once, aiohttp starts a handler for each in the same turn, and every one
of them reads, parses, predicts and queues its request before anything else runs: the
dispatcher's pass that admits them, the engine calls it starts, and the task in which
aiohttp (on Python 3.11) writes each call's body all wait behind the whole burst.
Traced on the embedded engine, a 64-request burst reached the engine 30-40 ms after
its first request reached the sidecar, almost all of it at the end, where called
directly the engine starts on the first requests at once; its first steps then ran
nearly empty, and the burst's mean E2E through the door was 1.08-1.11x direct's.

``Turns`` lets ``PER_TURN`` handlers go on per turn and queues the rest in arrival
order, so requests are admitted, sent and written while the next are read.  A lone
request, or requests arriving in different turns, never wait.  One a turn paid a
dispatcher pass per request and took the door's most requests per second under 64
callers from about 800 to about 610; two a turn kept it and gained as much on the
bursts (``docs/results/2026-11-30-turns-http``).  The gRPC door needs none of this:
gRPC hands its calls to Python one at a time.
"""

from __future__ import annotations

import asyncio
from collections import deque

PER_TURN = 2


class Turns:
    """``await turns.take()`` returns in this caller's turn: at once while fewer than
    ``per_turn`` callers went on in this turn of the loop and none waits, else in a
    later turn, in arrival order."""

    def __init__(self, per_turn: int = PER_TURN) -> None:
        if per_turn < 1:
            raise ValueError(f"per_turn must be at least 1, not {per_turn}")
        self.per_turn = per_turn
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._went = 0  # callers that went on in this turn
        self._armed = False  # _next runs in the next turn

    async def take(self) -> None:
        if not self._waiting and self._went < self.per_turn:
            self._went += 1
            if not self._armed:
                self._armed = True
                asyncio.get_running_loop().call_soon(self._next)
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        await turn  # cancelled: _next skips it (a cancelled future is done)

    def _next(self) -> None:
        """A new turn: the longest waiting callers', up to ``per_turn``."""
        self._went = 0
        while self._waiting and self._went < self.per_turn:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                self._went += 1
        self._armed = self._went > 0
        if self._armed:  # the callers woken run in the next turn: count that turn as theirs
            asyncio.get_running_loop().call_soon(self._next)
