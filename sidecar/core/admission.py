"""Continuous admission order: which waiting request enters the engine next.

The engine (vLLM) serves its own queue first come, first served.  In continuous
mode the scheduler admits one request at a time while the engine holds fewer than
B_t, so when the engine is full a queue forms here, in front of it, and its order
is ours to choose (issue 11, win 1):

* ``Fifo`` -- the order the former released them (its batches, each in bin order);
* ``ShortestFirst`` -- the smallest predicted output first (shortest-job-first cuts
  mean latency most when a queue forms; the bins are its classes), with aging so a
  long request is never starved:

  - rank = predicted_tokens − aging × waited.  Since waited = now − arrival, the
    order by rank is the order by predicted_tokens + aging × arrival, which does
    not change with time, so one heap keeps it.  By default the aging is the
    engine's own pace, 1/TPOT tokens a second (``set_tpot``): the rank is then,
    in the engine's time, when the request would end if sent now, so a waiting
    request moves up by one token of its own for each token the engine decodes
    meanwhile, whatever the engine -- the key ``engine_priority`` hands vLLM.  A
    fixed 20 tokens a second let the long answers of the ShareGPT replay wait
    behind every shorter arrival (engine model, a predictor of Kendall tau 0.45:
    p99 E2E 1.66x direct's; at the engine's pace 1.24x);
  - with ``by_footprint`` (``batch.shortestBy: KvFootprint``, for a queue that
    waits on the KV plan) each predicted token is weighted by the KV cache the
    request holds while it runs, its prompt p plus the arrivals' mean answer's
    half, against the arrivals' usual footprint (their mean prompt plus that
    half; ``FOOTPRINT_EWMA``): rank L (p + L̄/2) / (p̄ + L̄/2).  When the cache
    limits the engine's batch, it is what every waiting request waits for, and
    a short answer to a long prompt holds as much of it as a longer answer to a
    short one (shortest-first by the resource, Smith's rule).  A request of the
    usual prompt ranks at its tokens, and the rank stays linear in them, so the
    aging keeps its pace for every length.  The ShareGPT replay in the engine
    model (seeds 1-3, the real ``Learned`` model, no hint; the sidecar counting a
    prompt by its estimate, bytes / 4 scaled by what the engine reported, the
    engine by words): mean E2E 0.966x -> 0.881x direct's, p99 0.989x -> 1.077x;
    the oracle 0.819x -> 0.786x (p99 1.07x -> 1.10x); in ``bench e2e``, side by
    side in two runs, 1.005x -> 0.925x and 0.989x -> 0.902x, p99 1.0x -> 1.1x.
    The bench's ShareGPT sidecars rank so.  Ranked by the whole KV area
    instead, L (p + L/2) (each answer's own growth, not the mean's), the mean was
    the same (0.881x) but the L^2 put the answers predicted long behind every
    shorter arrival: p99 1.03x, and with the noisier stand-in predictor of
    test_sharegpt_replay_model 1.32x (1.17x by footprint).  Where prompts vary
    little beside the answers it buys nothing: the bench's chat load at 0.95 with
    hints (test_order_vs_engine_priority, five seeds) 0.877x -> 0.888x, one seed
    of five 0.75x -> 0.81x, p99 1.04x -> 1.03x.  The prompt is the sidecar's raw
    estimate (bytes / 4), not scaled to the engine's count as the KV plan scales
    it.  Scaled (there the engine counts 0.6-0.7 of the estimate), the same
    seeds ranked no better: mean 0.882x, p99 1.098x (sixth session), so the
    rank keeps the raw estimate;
  - a request that waited ``max_wait`` goes before every other, the oldest first:
    the hard bound on how long any request waits here while the engine admits;
  - a higher priority (request class) still goes first;
  - critical path first, once arrivals have stopped (no arrival for
    ``QUIET_GAPS`` mean gaps between arrivals: the end of a burst, of a batch
    job): what is left is then a batch whose makespan is what counts, and the
    longest request goes before the shortest when its predicted length, in
    steps, is at least what the rest takes to drain (``Backlog``).  Sent last,
    it would run alone after the rest, lengthening the makespan one for one, and
    the long requests left to the end pack the KV cache badly (they all grow
    at once).  Sent at its latest start it overlaps the short ones.  While
    arrivals go on, a queue does not drain, so the order stays shortest first
    (this rule triggering there cost a third more mean latency at load 0.95
    in simulation).  The KV-pressure burst of the bench (64 chat requests): 612
    -> 498 engine steps with exact lengths, mean latency +17%.  Beside this
    order, while the KV plan admits, the scheduler sends the longest requests the
    cache holds to their end (``packed`` below) as long as those so sent hold
    under half of the plan's budget at their planned ends (and under half of the
    engine's own sequence limit where that holds its queue: ``engine_cap``;
    ``scheduler.PACKED_SHARE``): long answers overlap the short ones from the
    start and the short ones keep the other half;
  - or, with ``drain`` "longest_fit_first" (``batch.drainOrder: LongestFitFirst``)
    and the KV plan (kv_plan.py) admitting, first fit decreasing once arrivals
    have stopped: the longest waiting request the cache holds to its end goes
    next (``packed``), so no request that does not fit yet holds the queue.  The
    long answers start while the cache is nearly empty and grow while short ones
    come and go around them; the critical-path rule starts them at the latest
    start its drain bound (perfect packing) allows, too late, and they end up
    running together, packing the cache badly.  The bench's KV-pressure burst in
    the engine model, eight seeds: 0.94x -> 1.01x direct's throughput on the mean,
    and on the bad seeds most (0.85 -> 0.98x).  It costs the burst's short answers:
    mean latency about 1.1x direct's where the critical-path rule has 0.7x.  So it
    is the user's choice: a batch job's makespan, or a spike's latency;
  - a request whose ``send_by`` has passed (it spent its TTFT SLO's queue share
    already and will likely miss its TTFT) goes after every request that can still
    meet its own: sending it first would turn one miss into two.  It is sent, not
    shed (nothing accepted is lost), and ``max_wait`` still bounds its wait.

Pure: no I/O, time is passed in.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Iterator, Literal, TypeVar, get_args

from .request import Request, expected_tokens

Order = Literal["fifo", "shortest_first"]
ORDERS: tuple[Order, ...] = get_args(Order)
Drain = Literal["shortest_first", "longest_fit_first"]
DRAINS: tuple[Drain, ...] = get_args(Drain)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AdmissionOrder:
    """The policy: ``order``, ``aging`` (tokens of rank a second of waiting is
    worth; None: the engine's own pace, 1/TPOT, see ``AdmissionQueue.set_tpot``)
    and ``max_wait`` (seconds; inf: no hard bound)."""

    order: Order = "fifo"
    aging: float | None = 0.0
    max_wait: float = math.inf
    follow_engine: bool = False  # also cap admission at the engine's own concurrency (``engine_cap``)
    drain: Drain = "shortest_first"  # once arrivals stop: the critical-path rule, or first fit decreasing
    engine_priority: bool = False  # the engine orders its queue by ``engine_priority`` (vLLM priority scheduling)
    by_footprint: bool = False  # shortest_first weighs a request's tokens by its KV footprint (module docstring)

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.drain not in DRAINS:
            raise ValueError(f"drain must be one of {DRAINS}, got {self.drain!r}")
        if self.aging is not None and not (math.isfinite(self.aging) and self.aging >= 0):
            raise ValueError(f"aging must be finite and >= 0 (or None: the engine's pace), got {self.aging!r}")
        if not self.max_wait > 0:
            raise ValueError(f"max_wait must be > 0, got {self.max_wait!r}")


# ``engine_priority``: a request-class priority step outweighs this many ms of ideal end
# time (~31.7 years), so a more urgent class always goes first; the time per token
# assumed until the engine's is measured (a GPU's order of magnitude).
CLASS_STRIDE_MS = 10**12
DEFAULT_TPOT_S = 0.02


def engine_priority(req: Request, tpot: float | None, epoch: float) -> int:
    """vLLM's ``priority`` for ``req`` (lower goes first) when the engine orders
    the queue (``batch.order: EnginePriority``, vLLM's ``--scheduling-policy
    priority``): when it would end if served at once -- its arrival plus its
    predicted tokens times the engine's time per token ``tpot``, in ms since
    ``epoch`` -- less ``CLASS_STRIDE_MS`` per step of request priority.

    That is shortest-first with aging of 1/tpot tokens a second: between two
    waiting requests the shorter goes first unless the longer arrived earlier by
    more than the difference of their decode times, so a long request moves up
    as it waits, at the pace the engine decodes, whatever the engine (no aging
    to tune; linear aging at a fixed 20 tokens/s starves the long answers in
    vLLM's queue, since its priority policy also preempts the largest key).  In
    the engine model at load 0.95 (chat, seeds 1-5) it gives mean E2E 0.85x and
    p99 1.17x direct's; without the aging (priority = length) p99 is 1.9x.
    The key never changes once sent: vLLM compares it as it was."""
    step = tpot if tpot and tpot > 0 else DEFAULT_TPOT_S
    end_ms = (req.arrival - epoch + expected_tokens(req) * step) * 1000.0
    return round(end_ms) - req.priority * CLASS_STRIDE_MS


# KV usage at or above which a queue in the engine means "it holds all it can"; below
# it, waiting requests are a burst that arrived since the engine's last step.
FULL_KV_USAGE = 0.8


def engine_cap(
    running: int | None,
    waiting: int | None,
    inflight: int,
    previous: int | None,
    kv_usage: float | None = None,
    before: tuple[int, int] | None = None,
    kv_planned: bool = False,
) -> int | None:
    """How many requests to keep in the engine so its own (FCFS) queue stays empty
    and the queue forms here, where it is ordered (issue 11, win 1's condition).

    From one metrics scrape: while the engine queues requests (``waiting`` > 0)
    with its KV cache full (``kv_usage`` ≥ ``FULL_KV_USAGE``, or not reported) it
    runs all it can hold, so the cap is what it runs (never below 1).  So it is
    too when it queued at the scrape before (``before``: its (running, waiting)
    then) and runs no more now: a sequence limit (vLLM's ``--max-num-seqs``), not
    the KV cache, holds it, and a queue there would be served FCFS.  While it
    queues none it has room: with no cap yet there is none (an idle engine says
    nothing about what it can hold, and a burst must not wait for the cap to grow);
    with a cap, it grows above what the engine runs, what we have in flight and
    itself by a quarter (at least 2), so it reaches the engine's real (KV-limited)
    concurrency within a few scrapes and is never the bottleneck; once the engine
    and the sidecar hold nothing, the cap is dropped.  None: no cap (also when the
    engine reports neither count).

    ``kv_planned``: the KV plan bounds admission by the engine's cache already, so a
    queue with the cache full is a preemption the plan answers, not a limit: the cap
    then holds only at a sequence limit (queued at two scrapes, running exactly as many
    again, the cache not full).  Capping at what a KV-limited engine ran after a
    preemption held the queue here at a few requests while the cap grew back a scrape
    at a time: the bench's chat load at 0.8 of capacity, no hint, mean E2E 1.13x direct's
    with the cap, 0.98x without, with the same preemptions (8-10 of direct's 96).
    """
    if running is None or waiting is None:
        return None
    queued_before = before is not None and before[1] > 0
    if kv_planned:  # a sequence limit only: the same count running, the cache not full
        held = queued_before and running == before[0] and not (kv_usage is not None and kv_usage >= FULL_KV_USAGE)
    else:  # a full cache (or one not reported), or no more running than when it queued before
        held = kv_usage is None or kv_usage >= FULL_KV_USAGE or (queued_before and running <= before[0])
    if waiting > 0 and held:
        return max(1, running)
    if previous is None or running + inflight == 0:
        return None
    base = max(running, inflight, previous)
    return base + max(2, base // 4)


# The aging at the engine's pace is re-keyed when the measured time per token moved by
# more than this share (a rebuild of the heap; TPOT moves a few percent with the batch).
REKEY_SHARE = 0.1

# Arrivals have stopped after this many mean gaps between them with none (a
# Poisson stream has such a gap with probability e^-10 per arrival).
QUIET_GAPS = 10.0
GAP_EWMA = 0.1  # weight of the newest gap in the mean gap
# ``by_footprint``: weight of each arriving request in the mean prompt and answer the footprint is measured against
FOOTPRINT_EWMA = 0.05


def kv_area(held: float, left: float) -> float:
    """Token-steps of KV a sequence holding ``held`` tokens occupies over its
    ``left`` remaining steps (it gains one per step)."""
    return left * (held + left / 2)


@dataclass(frozen=True, slots=True)
class Backlog:
    """What is in the engine, for the critical-path rule: the predicted tokens its
    requests have left and their KV area (``kv_area``), how many it runs at once
    and its KV capacity in tokens (None: unknown).  ``prompt_scale`` and
    ``shared``: how the KV plan counts a prompt (the engine's tokens per
    estimated one; the prefix the engine holds once for all, out of
    ``kv_tokens`` already), so a waiting request's area is counted as the plan
    will hold it (``waiting_area``)."""

    tokens_left: float
    area_left: float
    concurrency: int | None
    kv_tokens: float | None
    prompt_scale: float = 1.0
    shared: float = 0.0

    def waiting_area(self, tokens: float, prompt_area: float, own_area: float) -> float:
        """The KV area of waiting requests with ``tokens`` predicted tokens in all,
        ``prompt_area`` the sum of each one's tokens times its estimated prompt and
        ``own_area`` the sum of each one's tokens squared, halved: each prompt
        scaled and less the shared prefix, as the plan holds it.  Counted raw, a
        256-word system prompt before every question of a burst counted the
        burst's drain at 4x its length, and its longest answers started together
        at the end, 1.6 s into a 3.5 s burst, where vLLM alone had started them
        at once."""
        return max(self.prompt_scale * prompt_area - self.shared * tokens, 0.0) + own_area

    def drain_steps(self, waiting_tokens: float, waiting_area: float) -> float | None:
        """Steps the engine takes for these and ``waiting_*`` (None: no bound known):
        at most ``concurrency`` tokens a step, at most ``kv_tokens`` of KV at once."""
        bounds = []
        if self.concurrency:
            bounds.append((waiting_tokens + self.tokens_left) / self.concurrency)
        if self.kv_tokens:
            bounds.append((waiting_area + self.area_left) / self.kv_tokens)
        return max(bounds) if bounds else None


class _Entry(Generic[T]):
    __slots__ = ("item", "req", "seq", "live", "key")

    def __init__(self, item: T, req: Request, seq: int) -> None:
        self.item = item
        self.req = req
        self.seq = seq
        self.live = True
        self.key: tuple[float, float, int] | None = None  # its place in ``_by_length`` (shortest_first)


class AdmissionQueue(Generic[T]):
    """Requests taken from the former and not yet admitted, each with the driver's
    ``item``; ``peek(now)`` / ``pop(now)`` give the next one by the order above.
    Heaps drop removed entries lazily."""

    def __init__(self, order: AdmissionOrder | None = None) -> None:
        self.order = order or AdmissionOrder()
        self._seq = itertools.count()
        self._len = 0
        self._ranked: list[tuple[float, float, int, _Entry[T]]] = []  # (-priority, rank key, seq)
        self._late: list[tuple[int, float, int, _Entry[T]]] = []  # past send_by: (-priority, arrival, seq)
        self._oldest: list[tuple[float, int, _Entry[T]]] = []  # (arrival, seq): the max-wait bound
        self._deadlines: list[tuple[float, int, _Entry[T]]] = []
        # shortest_first: the live entries by (-priority, -predicted, seq), the longest of the highest
        # priority first (the critical-path rule and ``packed``), kept sorted; ``remove`` finds a request's
        self._by_length: list[tuple[float, float, int, _Entry[T]]] = []
        self._entry_of: dict[Request, _Entry[T]] = {}
        self._tokens = 0.0  # predicted tokens of the live entries
        self._prompt_area = 0.0  # and their KV area (``kv_area``), in two parts: each one's tokens x its prompt,
        self._own_area = 0.0  # and each one's tokens squared, halved (``Backlog.waiting_area`` scales the first)
        self._last_arrival: float | None = None
        self._gap = 0.0  # mean gap between arrivals (EWMA)
        self._aging = self.order.aging if self.order.aging is not None else 1.0 / DEFAULT_TPOT_S
        # ``by_footprint``: the arrivals' mean prompt and predicted tokens (EWMA), and the half answer and
        # usual footprint the heap is keyed by (None: not ranked by footprint)
        self._mean_prompt = self._mean_tokens = 0.0
        self._half: float | None = None
        self._footprint = 1.0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[tuple[T, Request]]:
        """The live entries, in no particular order."""
        return ((e.item, e.req) for *_, e in self._oldest if e.live)

    def push(self, item: T, req: Request) -> None:
        seq = next(self._seq)
        e = _Entry(item, req, seq)
        self._len += 1
        if self.order.order == "fifo":
            rank = float(seq)
            prio = 0.0
        else:
            if self.order.by_footprint:
                self._observe_footprint(req)
            rank = self._rank(req)
            prio = -float(req.priority)
        heapq.heappush(self._ranked, (prio, rank, seq, e))
        if self.order.order != "fifo":
            tokens = req.predicted_tokens or 0.0
            e.key = (prio, -tokens, seq)
            bisect.insort(self._by_length, (*e.key, e))
            self._entry_of[req] = e
            self._tokens += tokens
            self._prompt_area += tokens * req.prompt_tokens
            self._own_area += tokens * tokens / 2
            if self._last_arrival is not None:
                gap = max(0.0, req.arrival - self._last_arrival)
                # a gap past QUIET_GAPS means arrivals had stopped: it counts at that bound, so an idle
                # night does not make the next burst look like a slow stream for its first hundred arrivals
                self._gap += GAP_EWMA * ((gap if self._gap == 0.0 else min(gap, QUIET_GAPS * self._gap)) - self._gap)
            self._last_arrival = req.arrival if self._last_arrival is None else max(self._last_arrival, req.arrival)
        heapq.heappush(self._oldest, (req.arrival, seq, e))
        if req.deadline is not None:
            heapq.heappush(self._deadlines, (req.deadline, seq, e))

    def _rank(self, req: Request) -> float:
        tokens = req.predicted_tokens or 0.0
        if self._half is not None:  # by_footprint: weighted by the KV it holds per step against the usual
            tokens *= (req.prompt_tokens + self._half) / self._footprint
        return tokens + self._aging * req.arrival

    def _observe_footprint(self, req: Request) -> None:
        """``by_footprint``: ``req`` joins the arrivals' mean prompt and predicted
        tokens; the heap is re-keyed when the half answer or the usual footprint
        moved by more than ``REKEY_SHARE``."""
        w = FOOTPRINT_EWMA if self._half is not None else 1.0
        self._mean_prompt += w * (req.prompt_tokens - self._mean_prompt)
        self._mean_tokens += w * (max(req.predicted_tokens or 0.0, 1.0) - self._mean_tokens)
        half = self._mean_tokens / 2
        footprint = self._mean_prompt + half
        if self._half is None or max(abs(half / self._half - 1.0), abs(footprint / self._footprint - 1.0)) > REKEY_SHARE:
            self._half, self._footprint = half, footprint
            self._rekey()

    def _rekey(self) -> None:
        self._ranked = [(prio, self._rank(e.req), seq, e) for prio, _, seq, e in self._ranked if e.live]
        heapq.heapify(self._ranked)

    def set_tpot(self, tpot: float | None) -> None:
        """The engine's measured time per output token: with ``aging`` None the
        queue ages at its pace, 1/tpot tokens a second.  The heap is re-keyed when
        the pace moved by more than ``REKEY_SHARE`` (O(n), rare)."""
        if self.order.aging is not None or self.order.order == "fifo" or not (tpot and tpot > 0):
            return
        if abs(self._aging * tpot - 1.0) <= REKEY_SHARE:
            return
        self._aging = 1.0 / tpot
        self._rekey()

    def adopt_aging(self, other: AdmissionQueue) -> None:
        """Age at ``other``'s pace (a tenant's queue made after the engine's TPOT was
        measured: fair_share.py); from then on each is told every ``set_tpot``."""
        if self.order.aging is None and self._aging != other._aging:
            self._aging = other._aging
            self._rekey()

    def peek(self, now: float, backlog: Backlog | None = None) -> tuple[T, Request] | None:
        e = self._next(now, backlog)
        return None if e is None else (e.item, e.req)

    def packed(self, now: float, fits: Callable[[Request], bool]) -> tuple[T, Request] | None:
        """The next entry by first fit decreasing (module docstring; shortest_first
        only): a request that waited ``max_wait`` if ``fits`` it, else the longest
        predicted of the highest priority waiting that ``fits``; None if none does.

        ``fits`` (the KV plan's test) is taken as monotone in the predicted length,
        true for every request shorter than one it is true for, so the longest that
        fits is found by bisection: log2(n) tests, not n."""
        _drop_dead(self._oldest)
        if not self._oldest:
            return None
        oldest = self._oldest[0][2]
        if now - oldest.req.arrival >= self.order.max_wait:
            return (oldest.item, oldest.req) if fits(oldest.req) else None
        top = self._by_length[0][0]
        lo, hi = 0, bisect.bisect_left(self._by_length, (top, math.inf))  # the highest priority's class
        if not fits(self._by_length[hi - 1][3].req):
            return None  # not even its shortest
        while lo < hi - 1:  # invariant: the entry at hi - 1 fits
            mid = (lo + hi - 1) // 2
            if fits(self._by_length[mid][3].req):
                hi = mid + 1
            else:
                lo = mid + 1
        e = self._by_length[hi - 1][3]
        return e.item, e.req

    def behind(self, head: Request, n: int) -> list[tuple[T, Request]]:
        """Up to ``n`` entries that come after ``head`` by rank, for backfilling
        (scheduler.py; shortest_first only, and not those already moved behind
        for a passed ``send_by``)."""
        live = (x for x in self._ranked if x[-1].live and x[-1].req is not head)
        return [(e.item, e.req) for *_, e in heapq.nsmallest(n, live)]

    def remove(self, req: Request) -> None:
        """Remove ``req``'s entry (as given by ``packed`` or ``behind``)."""
        self._remove(self._entry_of[req])

    def pop(self, now: float, backlog: Backlog | None = None) -> tuple[T, Request] | None:
        """The next entry, removed; the same ``now`` and ``backlog`` as the ``peek``
        before it give the same entry."""
        e = self._next(now, backlog)
        if e is None:
            return None
        self._remove(e)
        return e.item, e.req

    def pop_expired(self, now: float) -> list[tuple[T, Request]]:
        """Remove and return the entries whose deadline has come."""
        out = []
        while self._deadlines and (self._deadlines[0][0] <= now or not self._deadlines[0][2].live):
            e = heapq.heappop(self._deadlines)[2]
            if e.live:
                self._remove(e)
                out.append((e.item, e.req))
        return out

    def next_deadline(self) -> float | None:
        _drop_dead(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def _remove(self, e: _Entry[T]) -> None:
        e.live = False
        self._len -= 1
        if self.order.order != "fifo":
            tokens = e.req.predicted_tokens or 0.0
            del self._by_length[bisect.bisect_left(self._by_length, e.key)]  # the 3-tuple sorts before its entry's
            self._entry_of.pop(e.req, None)
            self._tokens = max(0.0, self._tokens - tokens) if self._len else 0.0
            self._prompt_area = max(0.0, self._prompt_area - tokens * e.req.prompt_tokens) if self._len else 0.0
            self._own_area = max(0.0, self._own_area - tokens * tokens / 2) if self._len else 0.0

    def arrivals_stopped(self, now: float) -> bool:
        """No request arrived for ``QUIET_GAPS`` mean gaps (and none just now)."""
        last = self._last_arrival
        return last is not None and now - last > QUIET_GAPS * self._gap and now > last

    def _critical(self, now: float, backlog: Backlog) -> _Entry[T] | None:
        """The longest waiting request if it is on the critical path (module docstring)."""
        if not self._by_length or not self.arrivals_stopped(now):
            return None
        longest = self._by_length[0][3]
        tokens = longest.req.predicted_tokens or 0.0
        rest = self._tokens - tokens
        area = backlog.waiting_area(rest, self._prompt_area - tokens * longest.req.prompt_tokens,
                                    self._own_area - tokens * tokens / 2)  # fmt: skip
        steps = backlog.drain_steps(rest, area)
        return longest if steps is not None and tokens >= steps else None

    def _next(self, now: float, backlog: Backlog | None = None) -> _Entry[T] | None:
        _drop_dead(self._oldest)
        if not self._oldest:
            return None
        oldest = self._oldest[0][2]
        if self.order.order == "fifo":
            _drop_dead(self._ranked)
            return self._ranked[0][3]
        if now - oldest.req.arrival >= self.order.max_wait:
            return oldest
        if backlog is not None and (critical := self._critical(now, backlog)) is not None:
            return critical  # the longest of the highest priority waiting
        ranked = self._ranked
        while True:
            _drop_dead(ranked)
            if not ranked:
                break
            e = ranked[0][3]
            if e.req.send_by is None or now <= e.req.send_by:
                return e
            heapq.heappop(ranked)  # late: it moves behind every request that can still meet its TTFT
            heapq.heappush(self._late, (-e.req.priority, e.req.arrival, e.seq, e))
        _drop_dead(self._late)
        return self._late[0][3] if self._late else None


def _drop_dead(heap: list) -> None:
    while heap and not heap[0][-1].live:
        heapq.heappop(heap)
