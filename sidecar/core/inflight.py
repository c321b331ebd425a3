"""In-flight accounting: which requests and batches hold engine capacity, per bin.

A ``Slot`` is what one engine call holds: a gang batch (one batch slot and its
requests) or, in continuous mode, one request.  The driver acquires a slot when it
sends the call and releases it exactly once when the call has ended, whether the
call ran, failed, or was cancelled before it ever started; ``release`` of a slot
already released does nothing, so the driver can release from the one place that
always runs (an asyncio task's done-callback) without counting twice.  Before this
ledger, release sat in the task's ``finally``, which never runs for a task
cancelled before its first step, and every such cancellation leaked a slot.

Pure by design (no asyncio, time passed in), so the scheduler of the core can own
it.  It also integrates requests in flight over time, the sizer's observed batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from .request import Request


@dataclass(eq=False, slots=True)
class Slot:
    """Engine capacity held by one call: ``requests`` of bin ``bin``; ``batch``: it
    also holds one of the gang mode's batch slots."""

    bin: int
    requests: tuple[Request, ...]
    batch: bool
    acquired_at: float
    held: bool = field(default=True)


class InflightLedger:
    """Counts of what is in the engine, overall and per bin, and ∫ requests dt."""

    def __init__(self, now: float) -> None:
        self._slots: set[Slot] = set()
        self._requests: Counter[int] = Counter()
        self._batches: Counter[int] = Counter()
        self.requests = 0
        self.batches = 0
        self._area = 0.0
        self._area_mark = now
        self._area_since = now

    # -- counts -------------------------------------------------------------------------

    def requests_in(self, bin_: int) -> int:
        return self._requests[bin_]

    def batches_in(self, bin_: int) -> int:
        return self._batches[bin_]

    def held(self) -> list[Slot]:
        """Slots not yet released (drain ends what they hold)."""
        return list(self._slots)

    # -- acquire / release ---------------------------------------------------------------

    def acquire(self, bin_: int, requests: Iterable[Request], *, batch: bool, now: float) -> Slot:
        slot = Slot(bin_, tuple(requests), batch, now)
        self._integrate(now)
        self._slots.add(slot)
        self._requests[bin_] += len(slot.requests)
        self.requests += len(slot.requests)
        if batch:
            self._batches[bin_] += 1
            self.batches += 1
        return slot

    def release(self, slot: Slot, now: float) -> bool:
        """Give ``slot`` back; False (and nothing changes) if it was released already."""
        if not slot.held:
            return False
        slot.held = False
        self._integrate(now)
        self._slots.discard(slot)
        self._requests[slot.bin] -= len(slot.requests)
        self.requests -= len(slot.requests)
        if not self._requests[slot.bin]:
            del self._requests[slot.bin]
        if slot.batch:
            self._batches[slot.bin] -= 1
            self.batches -= 1
            if not self._batches[slot.bin]:
                del self._batches[slot.bin]
        return True

    # -- the sizer's observed batch ---------------------------------------------------------

    def mean_requests(self, now: float) -> float | None:
        """Mean requests in flight since the last call (None: none were), and restart."""
        self._integrate(now)
        span = now - self._area_since
        mean = self._area / span if span > 0 and self._area > 0 else None
        self._area, self._area_since = 0.0, now
        return mean

    def _integrate(self, now: float) -> None:
        self._area += self.requests * (now - self._area_mark)
        self._area_mark = now
