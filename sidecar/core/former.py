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
* with ``partial_waits_for_server`` (gang mode: a batch holds a server until its
  longest request ends) a bin that is due by max_wait or send-by is NOT cut while
  every server is busy: it stays in its bin, still filling, and is cut only when
  ``take(idle=True)`` says a server is free.  Cutting it at its due time instead
  queued a near-empty batch behind busy servers, holding one of them for its
  longest request when it finally went (batches of ~1.1 requests in simulation).
  At a free server (the seed: "first completed batch, first served"; a partial
  one only when none is completed): a send-by bin first, then full batches, then
  the longest bin past max_wait, topped up from the bins below it;
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
from .tpot_gate import TpotGate


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

    def top_priority(self) -> int:
        rank = self.by_rank
        while rank and not rank[0][3].live:
            heapq.heappop(rank)
        return rank[0][3].req.priority if rank else 0

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
        gate: TpotGate | None = None,
        partial_waits_for_server: bool = False,
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
        self.gate = gate  # holds tight-TPOT requests in the service queue (take)
        self._held_until: float | None = None  # earliest send_by among requests the gate held
        self._draining = False
        self._lazy = partial_waits_for_server
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

    def set_partial_waits_for_server(self, on: bool) -> None:
        """Gang mode: cut due partial batches only when a server is free (module doc)."""
        self._lazy = on

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
            if self._entries.get(e.req) is e:  # not a stale entry of a request queued again since
                del self._entries[e.req]
                e.leave_bin(self._bins)
                result.expired.append(e.req)
        self._sync_bins()
        if self._lazy:  # due bins are cut by take(idle=True), when a server is free
            return result
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

    def next_wake(self, releases: bool = True) -> float | None:
        """The earliest clock time at which ``poll()`` or ``take(idle=True)`` has work:
        a deadline, a send-by or a max_wait.  ``releases`` False: only deadlines (every
        server is busy, so a due bin waits for a server's release, not for a time)."""
        times = []
        while self._deadlines and self._deadlines[0][2].req not in self._entries:
            heapq.heappop(self._deadlines)
        if self._deadlines:
            times.append(self._deadlines[0][0])
        if not releases:
            return min(times) if times else None
        while self._send_by and not self._send_by[0][2].live:
            heapq.heappop(self._send_by)
        if self._send_by:
            times.append(self._send_by[0][0])
        if self._max_wait is not None:
            for b in self._bins:
                oldest = b.oldest_arrival() if b.count else None
                if oldest is not None:
                    times.append(oldest + self._max_wait)
        if self._held_until is not None:
            times.append(self._held_until)
        return min(times) if times else None

    # -- output ----------------------------------------------------------------------

    def take(self, idle: bool = False) -> Batch | None:
        """The next batch to dispatch, or None.

        Formed batches come in service-queue order.  With ``partial_waits_for_server``
        and ``idle`` (a server is free): a bin holding a request whose send-by time
        came goes first (its TTFT SLO says go); then completed (full) batches; then,
        with no completed batch waiting (or a lower priority one), the longest bin
        whose oldest request waited max_wait, filled up from the bins below it.  If
        there are none and ``idle``, the dispatch policy may release a partial batch
        from the bin with the most waiting.
        """
        due = self._due_bin() if idle and self._lazy else None
        if due is not None and due[3] == "slo":
            return self._take_due(due)
        batch = self._take_admitted(stop_key=None if due is None else -due[2])
        if batch is not None:
            return batch
        if due is not None:
            return self._take_due(due)
        if idle and self._policy is not None:
            i = max(range(self.k), key=lambda j: self._bins[j].count)
            n = min(self._policy.decide(self._bins[i].count), self._sizes[i])
            if n > 0:
                self._form(i, n, "policy")
                return self.take()
        return None

    def _take_admitted(self, stop_key: int | None = None) -> Batch | None:
        """The first formed batch in service order, without the requests the TPOT
        gate holds (they stay in the service queue as a batch of their own); none
        ranked after ``stop_key`` (a due bin of higher priority goes first)."""
        now = self._clock.now()
        held: list[tuple[int, int, Batch]] = []
        self._held_until = None
        out = None
        while self._service and out is None:
            if stop_key is not None and self._service[0][0] > stop_key:
                break
            item = heapq.heappop(self._service)
            batch = item[2]
            batch.requests = [r for r in batch.requests if r in self._entries]
            go, wait = batch.requests, []
            if self.gate is not None and not self._draining:
                go = [r for r in batch.requests if self.gate.admits(r.tpot_slo, now, r.send_by)]
                wait = [r for r in batch.requests if r not in go]
            if wait:
                held.append((item[0], item[1], Batch(batch.bin, wait, batch.reason, batch.formed_at)))
                sends = [r.send_by for r in wait if r.send_by is not None]
                if sends:
                    self._held_until = min(sends + ([self._held_until] if self._held_until is not None else []))
            if go:
                for r in go:
                    del self._entries[r]
                batch.requests = go
                out = batch
        for item in held:
            heapq.heappush(self._service, item)
        return out

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
        """Move everything still queued into batches (shutdown, end of a simulation);
        the TPOT gate holds nothing from now on."""
        self._draining = True
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
        """Batches waiting for a server: formed ones and, with
        ``partial_waits_for_server``, bins already due."""
        if not self._lazy:
            return len(self._service)
        now = self._clock.now()
        due = 0
        if self._max_wait is not None:
            due = sum(1 for t in self.oldest_arrivals() if t is not None and t + self._max_wait <= now)
        if not due and self._send_by and any(t <= now and e.live for t, _, e in self._send_by):
            due = 1
        return len(self._service) + due

    def queued_predictions(self) -> list[list[float]]:
        """Predicted lengths of the requests in each bin (for adaptive binners)."""
        return [
            [e.req.predicted_tokens for *_, e in b.by_rank if e.live]  # type: ignore[misc]
            for b in self._bins
        ]

    # -- internals -------------------------------------------------------------------

    def _due_bin(self) -> tuple[float, int, int, str] | None:
        """The partial bin to cut at a free server, as (due time, bin, priority,
        reason), or None.

        A bin holding a request whose send-by time came is due first ("slo", the
        earliest send-by).  Else a bin is due when its oldest request waited
        max_wait ("timeout"): the highest priority first, and of those the longest
        bin (its batch takes the shorter bins' requests along, ``_top_up``).
        """
        self._sync_bins()
        now = self._clock.now()
        while self._send_by and not self._send_by[0][2].live:
            heapq.heappop(self._send_by)
        if self._send_by and self._send_by[0][0] <= now:
            t, _, e = self._send_by[0]
            return (t, e.req.bin, self._bins[e.req.bin].top_priority(), "slo")  # type: ignore[arg-type,index]
        if self._max_wait is None:
            return None
        best: tuple[float, int, int, str] | None = None
        for i, b in enumerate(self._bins):
            oldest = b.oldest_arrival() if b.count else None
            if oldest is None or oldest + self._max_wait > now:
                continue
            cand = (oldest + self._max_wait, i, b.top_priority(), "timeout")
            if best is None or cand[2] >= best[2]:  # bins ascend: a later one is longer
                best = cand
        return best

    def _form_full(self, i: int) -> None:
        while self._bins[i].count >= self._sizes[i]:
            self._form(i, self._sizes[i], "full")

    def _form(self, i: int, n: int, reason: str) -> None:
        batch = self._cut(i, n, reason)
        if batch is not None:
            heapq.heappush(self._service, (-batch.priority, next(self._seq), batch))

    def _take_due(self, due: tuple[float, int, int, str]) -> Batch | None:
        batch = self._cut(due[1], self._sizes[due[1]], due[3])
        if batch is None:
            return None
        self._top_up(batch, self._sizes[due[1]])
        for r in batch.requests:
            del self._entries[r]
        return batch

    def _top_up(self, batch: Batch, size: int) -> None:
        """Fill a partial batch's free places from the bins below its own, nearest first.

        A batch holds its server until its longest request ends; requests of a lower
        bin are predicted shorter, so they ride along at (almost) no cost to the
        batch's service time instead of needing a batch, and a server, of their own.
        """
        for j in range(batch.bin - 1, -1, -1):
            room = size - len(batch.requests)
            if room <= 0:
                return
            for e in self._bins[j].pop(room):
                e.live = False
                batch.requests.append(e.req)

    def _cut(self, i: int, n: int, reason: str) -> Batch | None:
        """Up to ``n`` requests out of bin ``i`` as a batch (still held in ``_entries``)."""
        entries = self._bins[i].pop(n)
        if not entries:
            return None
        for e in entries:
            e.live = False  # out of the bin; still held in _entries until taken
        return Batch(i, [e.req for e in entries], reason, self._clock.now())

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
