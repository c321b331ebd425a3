"""The batch former: per-bin queues that turn requests into batches.

Algorithm 1 of multi-bin-batching-v1.md, plus what a server needs around it:

* a request goes to the bin of its predicted length (the binner decides);
* a bin emits a batch when it holds its target size B ("full"), when its oldest
  request has waited ``max_wait`` ("timeout"), when a request's ``send_by`` time
  comes (its TTFT SLO leaves no more time to wait: "slo"), or, when a server is
  idle, when the dispatch policy says a partial batch should go now ("policy", the
  SMDP control limit of DESIGN §3.4), or when a continuous engine has room
  (``take_partial``, "room": maxWait gathers a gang batch, and an engine that
  batches by itself gains nothing from a request held back);
* emitted batches wait in one service queue: first completed batch, first served,
  a batch holding a higher priority first;
* within a bin, higher priority first, then earliest arrival;
* a request whose deadline passes, or that is cancelled, leaves before dispatch.

No I/O and no timers of its own: ``next_wake()`` tells the driver (the asyncio
server or the simulator) when to call ``poll()`` next, so deadlines are armed
timers in the driver rather than a polling loop.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Protocol, Sequence

from .binner import Binner
from .clock import Clock
from .request import Request
from .stages import Batch, PollResult


class QueueFull(Exception):
    """The former holds ``max_queue`` requests already; the caller should refuse."""


class DispatchPolicy(Protocol):
    """When a server is idle: how many of ``waiting`` requests to serve now (0 = wait)."""

    def decide(self, waiting: int) -> int: ...


class _Entry:
    """A held request.  ``live``: still in its bin's heaps (False once it is in a
    formed batch, cancelled or expired; the heaps drop dead entries lazily)."""

    __slots__ = ("req", "seq", "live")

    def __init__(self, req: Request, seq: int) -> None:
        self.req = req
        self.seq = seq
        self.live = True

    def leave_bin(self, bins: list[_Bin]) -> None:
        if self.live:
            self.live = False
            bins[self.req.bin].count -= 1  # type: ignore[index]


class _Bin:
    """One bin's queue: a heap by (priority, arrival) and, for max_wait, by arrival."""

    __slots__ = ("by_rank", "by_age", "count")

    def __init__(self) -> None:
        self.by_rank: list[tuple[int, float, int, _Entry]] = []
        self.by_age: list[tuple[float, int, _Entry]] = []
        self.count = 0

    def push(self, e: _Entry, track_age: bool) -> None:
        heapq.heappush(self.by_rank, (-e.req.priority, e.req.arrival, e.seq, e))
        if track_age:
            heapq.heappush(self.by_age, (e.req.arrival, e.seq, e))
        self.count += 1

    def pop(self, n: int) -> list[_Entry]:
        out: list[_Entry] = []
        while len(out) < n and self.by_rank:
            e = heapq.heappop(self.by_rank)[3]
            if e.live:
                out.append(e)
        self.count -= len(out)
        return out

    def oldest_arrival(self) -> float | None:
        age = self.by_age
        while age and not age[0][2].live:
            heapq.heappop(age)
        return age[0][0] if age else None


class BatchFormer:
    """Per-bin queues, batch formation and the service queue.

    ``target_size`` is B, one int for all bins or one per bin (the sizer changes it
    with ``set_target_sizes``).  ``max_wait`` is in clock units (None = wait for a
    full batch).  ``max_queue`` bounds the requests held (queued, not yet taken).
    """

    def __init__(
        self,
        binner: Binner,
        clock: Clock,
        *,
        target_size: int | Sequence[int] = 32,
        max_wait: float | None = None,
        max_queue: int = 10_000,
        policy: DispatchPolicy | None = None,
    ) -> None:
        if max_wait is not None and max_wait < 0:
            raise ValueError(f"max_wait must be >= 0 or None, got {max_wait}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self._binner = binner
        self._clock = clock
        self._max_wait = max_wait
        self._max_queue = max_queue
        self._policy = policy
        self._seq = itertools.count()
        self._bins: list[_Bin] = [_Bin() for _ in range(binner.k)]
        self._version = binner.version
        self._entries: dict[Request, _Entry] = {}  # queued or in the service queue
        self._deadlines: list[tuple[float, int, _Entry]] = []
        self._send_by: list[tuple[float, int, _Entry]] = []
        self._service: list[tuple[int, int, Batch]] = []  # (-priority, seq, batch)
        self._sizes: list[int] = []
        self.set_target_sizes(target_size)

    # -- configuration -------------------------------------------------------------

    @property
    def k(self) -> int:
        return len(self._bins)

    @property
    def target_sizes(self) -> tuple[int, ...]:
        return tuple(self._sizes)

    def set_target_sizes(self, size: int | Sequence[int]) -> None:
        sizes = [size] * self.k if isinstance(size, int) else list(size)
        if len(sizes) != self.k:
            raise ValueError(f"target_size needs {self.k} values (one per bin), got {len(sizes)}")
        if any(s < 1 for s in sizes):
            raise ValueError(f"target_size values must be >= 1, got {sizes}")
        self._sizes = sizes
        for i in range(self.k):
            self._form_full(i)

    def set_policy(self, policy: DispatchPolicy | None) -> None:
        self._policy = policy

    # -- intake --------------------------------------------------------------------

    def submit(self, req: Request) -> int:
        """Queue ``req`` (its ``predicted_tokens`` already set) and return its bin.

        Raises QueueFull when ``max_queue`` requests are held already.
        """
        if req.predicted_tokens is None:
            raise ValueError(f"request {req.id}: predicted_tokens must be set before submit")
        if self.queued() >= self._max_queue:
            raise QueueFull(f"{self._max_queue} requests queued")
        self._sync_bins()
        e = _Entry(req, next(self._seq))
        self._entries[req] = e
        if req.deadline is not None:
            heapq.heappush(self._deadlines, (req.deadline, e.seq, e))
        if req.send_by is not None:
            heapq.heappush(self._send_by, (req.send_by, e.seq, e))
        i = self._binner.assign(req.predicted_tokens)
        req.bin = i
        self._bins[i].push(e, self._max_wait is not None)
        self._form_full(i)
        return i

    def cancel(self, req: Request) -> bool:
        """Withdraw ``req``; True if it was still held (it will never be dispatched)."""
        e = self._entries.pop(req, None)
        req.cancelled = True
        if e is None:
            return False
        e.leave_bin(self._bins)
        return True

    # -- time ------------------------------------------------------------------------

    def poll(self) -> PollResult:
        """Drop expired requests and form timed-out batches, as of the clock's now."""
        now = self._clock.now()
        result = PollResult()
        while self._deadlines and self._deadlines[0][0] <= now:
            e = heapq.heappop(self._deadlines)[2]
            if self._entries.pop(e.req, None) is not None:
                e.leave_bin(self._bins)
                result.expired.append(e.req)
        self._sync_bins()
        while self._send_by and self._send_by[0][0] <= now:
            e = self._send_by[0][2]
            if not e.live:  # already in a batch, cancelled or expired
                heapq.heappop(self._send_by)
                continue
            # The bin holds fewer than B (full bins form at once), so this batch takes
            # all of it, ``e`` included; the loop re-checks rather than assume so.
            self._form(e.req.bin, self._sizes[e.req.bin], "slo")  # type: ignore[index]
            result.formed += 1
        if self._max_wait is not None:
            for i, b in enumerate(self._bins):
                while b.count:
                    oldest = b.oldest_arrival()
                    if oldest is None or oldest + self._max_wait > now:
                        break
                    self._form(i, self._sizes[i], "timeout")
                    result.formed += 1
        return result

    def next_wake(self) -> float | None:
        """The earliest clock time at which ``poll()`` has work: a deadline, a send-by or a max_wait."""
        times = []
        while self._deadlines and self._deadlines[0][2].req not in self._entries:
            heapq.heappop(self._deadlines)
        if self._deadlines:
            times.append(self._deadlines[0][0])
        while self._send_by and not self._send_by[0][2].live:
            heapq.heappop(self._send_by)
        if self._send_by:
            times.append(self._send_by[0][0])
        if self._max_wait is not None:
            for b in self._bins:
                oldest = b.oldest_arrival() if b.count else None
                if oldest is not None:
                    times.append(oldest + self._max_wait)
        return min(times) if times else None

    # -- output ----------------------------------------------------------------------

    def take(self, idle: bool = False) -> Batch | None:
        """The next batch to dispatch, or None.

        Full and timed-out batches come first, in service-queue order.  If there are
        none and ``idle`` (a server is free), the dispatch policy may release a
        partial batch from the bin with the most waiting.
        """
        while self._service:
            batch = heapq.heappop(self._service)[2]
            batch.requests = [r for r in batch.requests if self._entries.pop(r, None) is not None]
            if batch.requests:
                return batch
        if idle and self._policy is not None:
            i = max(range(self.k), key=lambda j: self._bins[j].count)
            n = min(self._policy.decide(self._bins[i].count), self._sizes[i])
            if n > 0:
                self._form(i, n, "policy")
                return self.take()
        return None

    def take_partial(self) -> Batch | None:
        """A partial batch now ("room") from the bin whose oldest request arrived
        first, or None with every bin empty.  The continuous scheduler asks while
        the engine has room under its B_t: there maxWait only adds latency."""
        self._sync_bins()
        waiting = [(b.oldest_arrival(), i) for i, b in enumerate(self._bins) if b.count]
        if not waiting:
            return None
        i = min(waiting)[1]
        self._form(i, self._sizes[i], "room")
        return self.take()

    def drain(self) -> None:
        """Move everything still queued into batches (shutdown, end of a simulation)."""
        self._sync_bins()
        for i, b in enumerate(self._bins):
            while b.count:
                self._form(i, self._sizes[i], "drain")

    def queued(self) -> int:
        """Requests held: in bins or in formed batches not yet taken."""
        return len(self._entries)

    def bin_depths(self) -> list[int]:
        return [b.count for b in self._bins]

    def oldest_arrivals(self) -> list[float | None]:
        """Arrival time of the oldest request in each bin (None: empty bin)."""
        return [b.oldest_arrival() if b.count else None for b in self._bins]

    def ready_batches(self) -> int:
        return len(self._service)

    def queued_predictions(self) -> list[list[float]]:
        """Predicted lengths of the requests in each bin (for adaptive binners)."""
        return [
            [e.req.predicted_tokens for *_, e in b.by_rank if e.live]  # type: ignore[misc]
            for b in self._bins
        ]

    # -- internals -------------------------------------------------------------------

    def _form_full(self, i: int) -> None:
        while self._bins[i].count >= self._sizes[i]:
            self._form(i, self._sizes[i], "full")

    def _form(self, i: int, n: int, reason: str) -> None:
        entries = self._bins[i].pop(n)
        if not entries:
            return
        for e in entries:
            e.live = False  # out of the bin; still held in _entries until taken
        batch = Batch(i, [e.req for e in entries], reason, self._clock.now())
        heapq.heappush(self._service, (-batch.priority, next(self._seq), batch))

    def _sync_bins(self) -> None:
        """Re-bin queued requests if the binner's boundaries changed."""
        if self._binner.version == self._version and self._binner.k == len(self._bins):
            return
        self._version = self._binner.version
        live = [e for b in self._bins for *_, e in b.by_rank if e.live]
        self._bins = [_Bin() for _ in range(self._binner.k)]
        if len(self._sizes) != self._binner.k:
            base = max(self._sizes) if self._sizes else 1
            self._sizes = [base] * self._binner.k
        for e in sorted(live, key=lambda e: e.seq):
            i = self._binner.assign(e.req.predicted_tokens)  # type: ignore[arg-type]
            e.req.bin = i
            self._bins[i].push(e, self._max_wait is not None)
        for i in range(self.k):
            self._form_full(i)
