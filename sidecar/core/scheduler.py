"""The scheduler: every decision between accepting a request and ending it.

The sidecar's asyncio dispatcher (``engine/dispatcher.py``) and the discrete-event
simulator (``sim/simulator.py``) drive this same class, so what is simulated is
what serves.  It does no I/O and has no timers: time is passed in (``now``) or
read from the injected clock, and ``next_wake()`` tells the driver when to call
``step`` again.  A driver:

* ``submit(req)`` -- predict, bin, or refuse (``Rejected``): draining, queue full,
  engine breaker open for a request without a deadline, predicted queue wait over
  the request's deadline;
* ``step(now)`` -- what to send to the engine now (``Dispatch``: a gang batch
  while fewer than ``max_inflight_batches`` are in flight; in continuous mode one
  request at a time while the requests in flight are below its bin's B_t) and the
  requests that expired; each dispatch holds a ``Slot`` of the in-flight ledger;
* ``complete(req, outcome)`` -- an engine call's answer for one request: learn from
  it, feed the breaker and the service rate, queue it again if the engine never
  received it; ``release(slot)`` once the call has ended however it ended;
* ``cancel``, ``on_snapshot`` (sizer, binner rebalance, adaptive n_max),
  ``on_engine_health``, ``replace_core``, ``start_drain`` / ``cut_queued``.

Every accepted request ends exactly once: ``end(req, outcome)`` is True only the
first time (the driver resolves its caller then), and ``totals`` counts outcomes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from .admission import AdmissionOrder, Backlog, engine_cap, kv_area
from .fair_share import FairAdmissionQueue, TenantPolicy, queue_share
from .binner import AdaptiveBinner, Binner, n_max_from_memory
from .breaker import EngineBreaker
from .clock import Clock
from .former import Batch, BatchFormer, QueueFull
from .inflight import InflightLedger, Slot
from .kv_plan import SHARED_MIN_SEQS, InFlight, KvPlan, Seq, peak_tokens
from .predictor import AccuracyTracker, LengthPredictor
from .queue_wait import ServiceRate, refusal
from .request import Request, expected_tokens, predicted_length
from .sizer import BatchSizer, EngineSnapshot, SizeDecision

Mode = Literal["gang", "continuous"]
# Adjustment.field values (binbatch.proto lists them).  Adjustment.reason is
# "<reason>: <detail>": for a batch size the sizer's reason (sizer.REASONS), for
# bin boundaries REBALANCE_REASON.
AdjustmentField = Literal["batchSize", "binBoundaries", "binCount"]
ADJUSTMENT_FIELDS: tuple[AdjustmentField, ...] = get_args(AdjustmentField)
REBALANCE_REASON = "rebalance"
# Requests behind a head the KV cache does not hold yet that backfilling looks at (``_backfill``).
BACKFILL_LOOKAHEAD = 8
# A unary request's engine call streams for the KV plan while the plan has counted fewer prompts than
# this, or once what is in flight could fill this share of its budget (``Scheduler.reads_progress``).
PROGRESS_LEARN = 8
PROGRESS_LOAD = 0.25
# Once a burst's arrivals stop, the default drain order (shortest first) sends the longest requests the
# KV cache holds to their end while those it sent so hold less than this share of the plan's budget at
# their planned ends (``Request.packed_tokens``) -- and, where the engine's own sequence limit holds its
# queue (``engine_cap``), are fewer than this share of it; the rest goes shortest first (``_admit_continuous``).
PACKED_SHARE = 0.5
Verdict = Literal["completed", "failed", "requeued"]


class Rejected(Exception):
    """The sidecar ended a request itself.  ``kind``: resource_exhausted |
    unavailable | deadline | cancelled; the servicer maps it to a gRPC status."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass
class Core:
    """The scheduling core one config builds; swapped whole on a config reload."""

    predictor: LengthPredictor
    binner: Binner
    former: BatchFormer
    sizer: BatchSizer
    accuracy: AccuracyTracker = field(default_factory=AccuracyTracker)
    admission: AdmissionOrder = field(default_factory=AdmissionOrder)  # continuous mode: who goes in next
    kv_plan: KvPlan | None = None  # continuous mode: admit only what the KV cache holds to the end (kv_plan.py)
    max_queued_bytes: int | None = None  # batch.maxQueuedBytes: Request.body_bytes of every queued request; None: no bound
    # batch.maxQueuedRequests as the per-tenant share bounds it (fair_share.py); None: no per-tenant bound by count
    max_queued_requests: int | None = None
    tenants: TenantPolicy = field(default_factory=TenantPolicy)  # the tenants' weights (tenants config section)


class _TenantLoad:
    """A tenant's requests accepted and not ended (``open``: queued or in flight), those queued and their bytes."""

    __slots__ = ("open", "queued", "bytes", "weight")

    def __init__(self, weight: int) -> None:
        self.open = self.queued = self.bytes = 0
        self.weight = weight


@dataclass(frozen=True, slots=True)
class Dispatch:
    """One engine call to make now: ``requests`` holding ``slot``, out of ``batch``
    (in continuous mode one request of the batch, ``batch.size`` its batch's size)."""

    slot: Slot
    batch: Batch
    requests: tuple[Request, ...]


@dataclass(slots=True)
class StepResult:
    dispatches: list[Dispatch] = field(default_factory=list)
    expired: list[Request] = field(default_factory=list)  # ended by the scheduler ("expired")
    batches: list[Batch] = field(default_factory=list)  # batches taken from the former (for metrics)


@dataclass(frozen=True, slots=True)
class Outcome:
    """An engine call's answer for one request, in the scheduler's terms.

    ``completion_tokens`` None: it failed.  ``unavailable``: the engine could not
    serve it; ``sent`` False: the engine never received it (it may be queued
    again).  ``outage``: why the answer shows the engine down (None: alive)."""

    completion_tokens: float | None = None
    prompt_tokens: float = 0.0
    unavailable: bool = False
    sent: bool = True
    outage: str | None = None


@dataclass(frozen=True, slots=True)
class Change:
    """A size or boundary change ``on_snapshot`` made (the driver logs and records it)."""

    field: AdjustmentField
    old: str
    new: str
    reason: str  # "<kind>: <detail>"
    kind: str


class Scheduler:
    def __init__(self, core: Core, clock: Clock, *, mode: Mode = "continuous", max_inflight_batches: int = 4) -> None:
        if mode not in ("gang", "continuous"):
            raise ValueError(f"mode must be 'gang' or 'continuous', got {mode!r}")
        if max_inflight_batches < 1:
            raise ValueError(f"max_inflight_batches must be >= 1, got {max_inflight_batches}")
        self.core = core
        self.clock = clock
        self.mode: Mode = mode
        self.max_inflight_batches = max_inflight_batches
        self.accepting = True
        self.totals: Counter[str] = Counter()  # accepted, and each outcome
        self.ledger = InflightLedger(clock.now())  # what holds engine capacity, per bin
        self.breaker = EngineBreaker()
        self.service_rate = ServiceRate()
        self.last_decision: SizeDecision | None = None
        self._open: set[Request] = set()  # accepted and not yet ended
        self._held_bytes: dict[Request, int] = {}  # queued requests' body_bytes, released once (``_release_bytes``)
        self.queued_bytes = 0  # their sum: what batch.maxQueuedBytes bounds (binbatch_queued_bytes)
        self._slot_of: dict[Request, Slot] = {}  # the engine call holding each request now
        # continuous: taken from the former, not yet admitted, in the admission order
        self._pending: FairAdmissionQueue[Batch] = FairAdmissionQueue(core.admission, self._weight)
        # per tenant, while it has requests open (fair_share.py); the sum of their weights
        self._tenants: dict[str, _TenantLoad] = {}
        self._active_weight = 0
        self.engine_cap: int | None = None  # continuous, core.admission.follow_engine: see admission.engine_cap
        self._engine_counts: tuple[int, int] | None = None  # the engine's (running, waiting) at the last fresh scrape
        self._binner_version = core.binner.version
        core.former.set_partial_waits_for_server(mode == "gang")

    # -- counts --------------------------------------------------------------------

    @property
    def inflight_requests(self) -> int:
        return self.ledger.requests

    @property
    def inflight_batches(self) -> int:
        return self.ledger.batches

    def _weight(self, tenant: str) -> int:
        return self.core.tenants.weight(tenant)

    def queued_by_tenant(self) -> dict[str, int]:
        """Requests queued (not yet sent) per tenant with any open ("": the shared tenant)."""
        return {name: load.queued for name, load in self._tenants.items()}

    def is_open(self, req: Request) -> bool:
        """Accepted and not yet ended."""
        return req in self._open

    def pending_requests(self) -> int:
        """Requests out of their bins but not yet sent (see ``Dispatcher.pending_requests``)."""
        former = self.core.former
        formed = former.queued() - sum(former.bin_depths())
        return formed + sum(1 for _, r in self._pending if r in self._open)

    def backlog(self) -> int:
        """Requests accepted and not yet sent to the engine."""
        return self.core.former.queued() + len(self._pending)

    def saturated(self) -> bool:
        """Are requests waiting for engine capacity (not merely for their bin to fill)?"""
        return bool(self._pending) or self.core.former.ready_batches() > 0

    def idle(self) -> bool:
        """Nothing queued, pending or in flight (a drain may end)."""
        return self.core.former.queued() == 0 and not self._pending and self.inflight_requests == 0

    def next_wake(self) -> float | None:
        """When ``step`` next has work by the clock.  In gang mode a due partial
        batch waits for a free slot, so while none is free only deadlines count
        (a slot's release wakes the driver anyway); in continuous mode a request
        taken but not admitted wakes it at its deadline."""
        if self.mode == "gang":
            former_wake = self.core.former.next_wake(releases=self._slot_free())
        else:
            former_wake = self.core.former.next_wake()
        times = [t for t in (former_wake, self._pending.next_deadline()) if t is not None]
        return min(times, default=None)

    def _slot_free(self) -> bool:
        n = self.inflight_batches
        return n < self.max_inflight_batches and self.breaker.allows_dispatch(n)

    # -- intake and endings ----------------------------------------------------------

    def submit(self, req: Request) -> int:
        """Queue ``req``; returns its bin.  Raises ``Rejected`` when refused."""
        if not self.accepting:
            raise Rejected("unavailable", "the sidecar is shutting down and accepts no new requests")
        refused = self._refusal(req)
        if refused is not None:
            self.totals["rejected"] += 1
            raise refused
        refused = self._tenant_refusal(req)
        if refused is not None:
            self.totals["rejected"] += 1
            raise refused
        queued = len(self._held_bytes)  # in the bins and taken from them, not yet sent (the former counts only the bins)
        if (count := self.core.max_queued_requests) is not None and queued >= count:
            self.totals["rejected"] += 1
            full = f"queue full: batch.maxQueuedRequests ({count}) reached, {queued} requests queued"
            if self.breaker.state == "open":  # as the former's own bound: the engine's outage is the news
                raise Rejected("unavailable", f"{self.breaker.describe(self.clock.now())}; {full}")
            raise Rejected("resource_exhausted", f"{full}; retry later")
        limit = self.core.max_queued_bytes
        if limit is not None and self.queued_bytes + req.body_bytes > limit:
            self.totals["rejected"] += 1
            raise Rejected("resource_exhausted", f"queue full: batch.maxQueuedBytes ({limit}) reached, "
                                                 f"{self.queued_bytes} bytes of requests queued; retry later")  # fmt: skip
        req.predicted_tokens = self.core.predictor.predict(req)
        self.core.binner.observe(req.predicted_tokens)  # before it is binned: a burst is binned by its own lengths
        try:
            bin_ = self.core.former.submit(req)
        except QueueFull as exc:
            self.totals["rejected"] += 1
            if self.breaker.state == "open":
                raise Rejected("unavailable", f"{self.breaker.describe(self.clock.now())}; queue full: {exc}") from None
            raise Rejected("resource_exhausted", f"queue full: {exc}") from None
        self.totals["accepted"] += 1
        self._open.add(req)
        load = self._tenants.get(req.tenant)
        if load is None:
            load = self._tenants[req.tenant] = _TenantLoad(self._weight(req.tenant))
            self._active_weight += load.weight
        load.open += 1
        self._hold_bytes(req)
        return bin_

    def _tenant_refusal(self, req: Request) -> Rejected | None:
        """Refuse ``req`` if its tenant holds its share of the queue already: with other tenants'
        requests queued or in flight, a tenant of weight w may hold at most max(w / W,
        tenants.maxQueuedSharePercent) of batch.maxQueuedRequests and of batch.maxQueuedBytes, W the
        weights of every tenant with requests open, its own included (fair_share.py).  A lone tenant is
        not bounded here."""
        core = self.core
        load = self._tenants.get(req.tenant)
        weight = load.weight if load is not None else self._weight(req.tenant)
        active = self._active_weight + (0 if load is not None else weight)
        share = queue_share(weight, active, core.tenants.floor_percent)
        if active == weight or share >= 1.0:
            return None
        queued, held = (load.queued, load.bytes) if load is not None else (0, 0)
        others = len(self._tenants) - (load is not None)
        who = f"tenant {req.tenant!r}" if req.tenant else "the shared tenant (no x-llm-d-inference-fairness-id)"
        why = (f"its share is {share:.0%} (weight {weight} of {active} for the {others + 1} tenants with requests "
               f"queued or running, at least tenants.maxQueuedSharePercent {core.tenants.floor_percent}%)")  # fmt: skip
        limit = core.max_queued_requests
        if limit is not None and queued + 1 > (cap := max(1, int(limit * share))):
            return Rejected("resource_exhausted", f"queue full for {who}: it holds {queued} queued requests, "
                            f"{cap} of batch.maxQueuedRequests ({limit}); {why}; retry later")  # fmt: skip
        limit = core.max_queued_bytes
        if limit is not None and held + req.body_bytes > (cap := int(limit * share)):
            return Rejected("resource_exhausted", f"queue full for {who}: it holds {held} bytes of queued requests, "
                            f"{cap} of batch.maxQueuedBytes ({limit}); {why}; retry later")  # fmt: skip
        return None

    def _hold_bytes(self, req: Request) -> None:
        """``req`` is queued: its bytes count against batch.maxQueuedBytes (and it against its
        tenant's share) until it leaves."""
        if req not in self._held_bytes:
            self._held_bytes[req] = req.body_bytes
            self.queued_bytes += req.body_bytes
            load = self._tenants.get(req.tenant)
            if load is not None:
                load.queued += 1
                load.bytes += req.body_bytes

    def _release_bytes(self, req: Request) -> None:
        """``req`` left the queue (sent to the engine, or ended): its bytes, once."""
        if req in self._held_bytes:
            held = self._held_bytes.pop(req)
            self.queued_bytes -= held
            load = self._tenants.get(req.tenant)
            if load is not None:
                load.queued -= 1
                load.bytes -= held

    def end(self, req: Request, outcome: str) -> bool:
        """End ``req`` with ``outcome``; True only the first time (the caller answers it then)."""
        if req not in self._open:
            return False
        self._open.discard(req)
        self._release_bytes(req)
        load = self._tenants.get(req.tenant)
        if load is not None:
            load.open -= 1
            if load.open <= 0:  # idle: forgotten (the tenants kept are those with requests open)
                del self._tenants[req.tenant]
                self._active_weight -= load.weight
        self.totals[outcome] += 1
        return True

    def cancel(self, req: Request, now: float) -> str | None:
        """The caller went away: withdraw ``req``; the outcome it ended with
        ("expired" or "cancelled"), or None if it had ended already.  One taken but
        not admitted is skipped at admission; one in flight stays in its slot until
        its call ends (the driver aborts the call)."""
        self.core.former.cancel(req)  # marks req.cancelled; leaves the bin if still there
        outcome = "expired" if req.expired(now) else "cancelled"
        return outcome if self.end(req, outcome) else None

    # -- what to dispatch now ---------------------------------------------------------

    def step(self, now: float) -> StepResult:
        """Expire what is due and decide what goes to the engine now."""
        out = StepResult()
        former = self.core.former
        for req in former.poll().expired:
            if self.end(req, "expired"):
                out.expired.append(req)
        if self.mode == "gang":
            while self._slot_free():
                batch = former.take(idle=True)
                if batch is None:
                    break
                out.batches.append(batch)
                live = tuple(r for r in batch.requests if not r.cancelled)
                out.dispatches.append(Dispatch(self._enter(batch.bin, live, batch=True, now=now), batch, live))
        else:
            self._admit_continuous(now, out)
        return out

    def _admit_continuous(self, now: float, out: StepResult) -> None:
        """Admit one request at a time while the engine holds fewer than the next
        request's bin's B_t.  Every batch the former releases is taken first, so the
        admission order (``core.admission``: FIFO, or shortest predicted first with
        aging) chooses among all the requests waiting here."""
        former = self.core.former
        pending = self._pending
        for _, req in pending.pop_expired(now):
            if self.end(req, "expired"):
                out.expired.append(req)
        # what is in flight, listed once in this pass and kept as it admits (InFlight): a burst's
        # pass admits dozens, and listing it again for each made the pass quadratic
        listed: InFlight | None = None
        share: list[float] | None = None  # the requests in flight sent on the packed share: KV at their ends, count

        def inflight() -> InFlight:
            nonlocal listed
            if listed is None:
                listed = self._inflight_left(now)
            return listed

        def packed_room() -> bool:
            """Do the requests in flight sent on the packed share hold under ``PACKED_SHARE`` of the
            plan's budget, and of the engine's own sequence limit where it holds its queue (``engine_cap``)?"""
            nonlocal share
            if share is None:
                ends = [r.packed_tokens for slot in self.ledger.held() for r in slot.requests
                        if r in self._open and r.packed_tokens > 0]  # fmt: skip
                share = [sum(ends), len(ends)]
            budget = self.core.kv_plan.budget if self.core.kv_plan is not None else None
            cap = self.engine_cap
            return budget is not None and share[0] < PACKED_SHARE * budget and (cap is None or share[1] < PACKED_SHARE * cap)

        while self.breaker.allows_dispatch(self.inflight_requests):
            while (batch := self._take_continuous(pending)) is not None:
                out.batches.append(batch)
                for r in batch.requests:
                    pending.push(batch, r)
            sizes = former.target_sizes
            # what is in flight is listed only when read: once arrivals have stopped (the drain
            # order: the critical-path rule or first fit decreasing), and by the KV plan once the
            # engine has room (``_kv_fits``), at most once
            left = inflight() if pending.arrivals_stopped(now) else None
            # a batch is left: first fit decreasing (admission.py), for all of it or for its share
            packing = (left is not None and pending.order.order != "fifo" and self._kv_planned()
                       and (pending.order.drain == "longest_fit_first" or packed_room()))  # fmt: skip
            if packing:  # the longest request the KV cache holds goes next
                head = pending.packed(now, lambda r: self._kv_fits(r, now, left) and not self._over_share(r, now, sizes))
                packing = head is not None or pending.order.drain == "longest_fit_first"
            backlog = None if left is None or packing else self._backlog(left, max(sizes))
            skipped = False
            if not packing:
                head = pending.peek(now, backlog)
                if head is not None and head[1] in self._open and self._over_share(head[1], now, sizes):
                    # its tenant holds its share of the engine: the next tenant's head, if one waits and may
                    head = pending.peek(now, backlog, skip=head[1].tenant)
                    if head is None or (head[1] in self._open and self._over_share(head[1], now, sizes)):
                        return
                    skipped = True
            if head is None:
                return
            batch, req = head
            if req not in self._open:  # cancelled while waiting: ended already
                self._take(pending, req, packing or skipped, now, backlog)
                continue
            if self.inflight_requests >= self._bin_limit(batch.bin, sizes):
                return
            planned = self._kv_planned()
            if packing or self._kv_fits(req, now, inflight() if planned else None):
                self._take(pending, req, packing or skipped, now, backlog)
            elif not skipped and (behind := self._backfill(pending, req, now, inflight(), sizes)) is not None:
                batch, req = behind
                pending.remove(req)
            else:
                return
            if req.expired(now):
                if self.end(req, "expired"):
                    out.expired.append(req)
                continue
            req.kv_planned = planned
            listing = inflight() if self.core.kv_plan is not None else listed  # the plan reads it (reads_progress)
            out.dispatches.append(Dispatch(self._enter(batch.bin, (req,), batch=False, now=now, inflight=listing),
                                           batch, (req,)))  # fmt: skip
            req.packed_tokens = 0.0
            if packing and pending.order.drain == "shortest_first":  # sent on the packed share: it counts there
                seq = self._in_flight(req, 0.0)
                req.packed_tokens = seq.held + seq.left
                assert share is not None  # packed_room counted it
                share[0] += req.packed_tokens
                share[1] += 1

    @staticmethod
    def _take(pending: FairAdmissionQueue, req: Request, packed: bool, now: float, backlog: Backlog | None) -> None:
        """Remove ``req``, the head ``pending.packed`` or ``pending.peek`` gave, from the queue."""
        if packed:
            pending.remove(req)
        else:
            pending.pop(now, backlog)

    def _inflight_left(self, now: float, tenant: str | None = None) -> InFlight:
        """(tokens held, tokens left) of every open request in flight (of ``tenant``'s
        only, if given): the KV plan's count from what its engine stream said, or its
        estimate from the time since it went in; without a plan its whole predicted length."""
        plan = self.core.kv_plan
        if plan is None:
            return InFlight(self._in_flight(r, 0.0) for slot in self.ledger.held()
                            for r in slot.requests if r in self._open and (tenant is None or r.tenant == tenant))  # fmt: skip
        # a pass lists this for each burst's request it takes in (turns.py): the loop is kept lean
        listing, context, open_ = InFlight(block=plan.block), _plan_context(plan), self._open
        for slot in self.ledger.held():
            elapsed = now - slot.acquired_at
            for r in slot.requests:
                if r in open_ and (tenant is None or r.tenant == tenant):
                    listing.append(_held(plan, r, elapsed, context))
        return listing

    def _in_flight(self, r: Request, elapsed: float) -> Seq:
        """One request of ``_inflight_left``, in flight for ``elapsed`` seconds."""
        plan = self.core.kv_plan
        if plan is None:
            return Seq(float(r.prompt_tokens), expected_tokens(r))
        return _held(plan, r, elapsed, _plan_context(plan))

    def _backlog(self, left: list[Seq], size: int) -> Backlog:
        """The engine's remaining work (``left``: ``_inflight_left``), for the
        critical-path rule (admission.py): it runs at most ``size`` (capped by
        ``engine_cap``) at once, in the KV plan's budget."""
        plan = self.core.kv_plan
        concurrency = size if self.engine_cap is None else min(size, self.engine_cap)
        tokens, area = sum(s.left for s in left), sum(kv_area(s.held, s.left) for s in left)
        if plan is None:
            return Backlog(tokens, area, concurrency, None)
        return Backlog(tokens, area, concurrency, plan.budget, plan.prompt_scale, plan.shared_blocks)

    def _kv_planned(self) -> bool:
        """Is the KV plan on, with the engine's capacity known?"""
        plan = self.core.kv_plan
        return plan is not None and plan.budget is not None

    def _kv_fits(self, req: Request, now: float, left: list[Seq] | None = None) -> bool:
        """Does the engine's KV cache hold ``req`` and every request in flight
        (``left``, ``_inflight_left`` if listed already) until each finishes
        (``core.kv_plan``; no plan: yes)?  The head of the queue waits when it does
        not; a later one goes past it only if it ends before the head could start
        (``_backfill``; and see ``AdmissionQueue.packed``)."""
        plan = self.core.kv_plan
        if plan is None or not self._kv_planned():
            return True
        return plan.fits(self._inflight_left(now) if left is None else left, self._queued_seq(req))

    def _over_share(self, req: Request, now: float, sizes: tuple[int, ...]) -> bool:
        """Would admitting ``req`` take its tenant past its weighted share of the engine
        while another tenant has requests open?  The engine is the KV plan's budget
        (the tenant's requests in flight and ``req``, at their planned peak), else the
        batch size (its requests in flight).  A tenant holding nothing in flight may
        always send one.  Admission does not preempt: a tenant that took every place
        the engine freed made the others' requests wait for a running answer and run
        in a full engine's slower steps, however far below their share they were --
        on ``binbatch bench tenants`` a steady tenant's p50 and p99 E2E went to
        1.5-1.7x its run alone, with fair admission order alone.  The price: while
        another tenant has requests open but uses less than its share, the rest of
        the engine is not lent to the tenant over its share."""
        if len(self._tenants) < 2:
            return False
        load = self._tenants.get(req.tenant)
        mine = 0 if load is None else load.open - load.queued  # its requests in flight (accepted, not queued, not ended)
        if mine <= 0:
            return False
        share = load.weight / self._active_weight
        plan = self.core.kv_plan
        if plan is not None and self._kv_planned():
            held = self._inflight_left(now, req.tenant)
            return peak_tokens([*held, self._queued_seq(req)], plan.block) > share * plan.budget
        return mine + 1 > share * self._bin_limit(req.bin or 0, sizes)

    def _bin_limit(self, bin_: int, sizes: tuple[int, ...]) -> int:
        """The most requests the engine may hold when one of bin ``bin_`` goes in:
        its bin's B_t (``sizes``: the former's target sizes), capped by ``engine_cap``."""
        limit = sizes[bin_] if bin_ < len(sizes) else min(sizes)
        return limit if self.engine_cap is None else min(limit, self.engine_cap)

    def _queued_seq(self, req: Request) -> Seq:
        """``req``, still waiting here, as the KV plan would hold it once sent (needs a plan)."""
        return self.core.kv_plan.held(req.prompt_tokens, predicted_length(req), 0.0)

    def _backfill(
        self, pending: FairAdmissionQueue, head: Request, now: float, left: list[Seq] | None, sizes: tuple[int, ...]
    ) -> tuple[Batch, Request] | None:  # fmt: skip
        """A request to send past ``head``, which the KV cache does not hold yet:
        of the ``BACKFILL_LOOKAHEAD`` next by rank, the first the cache holds now
        (within its bin's B_t and the engine's cap) that is planned to end before ``head`` could start
        (``KvPlan.start_step``) -- EASY backfilling: it fills room that would stand
        empty and does not delay the head.  Without it one long prompt at the head
        held the queue while the engine ran a single sequence: on the real vLLM
        test server (ShareGPT x0.25, 4,128 KV tokens, a tenth of the prompts over
        1,000 tokens) the engine ran 1 request for seconds at a time, 21 waiting
        here.  None: no such request (or the order is FIFO, kept pure)."""
        plan = self.core.kv_plan
        if plan is None or pending.order.order == "fifo":
            return None
        left = self._inflight_left(now) if left is None else left
        start: float | None = None
        for batch, req in pending.behind(head, BACKFILL_LOOKAHEAD):
            seq = self._queued_seq(req)
            if req not in self._open or self.inflight_requests >= self._bin_limit(batch.bin, sizes) \
                    or not plan.fits(left, seq):  # fmt: skip
                continue
            if start is None:
                start = plan.start_step(left, self._queued_seq(head))
            if seq.left <= start:
                return batch, req
        return None

    def _take_continuous(self, pending: FairAdmissionQueue) -> Batch | None:
        """The next batch the former releases, or -- while the engine holds fewer than
        the largest target size and nothing waits here -- a partial one at once
        ("room"): a continuous engine batches by itself, so maxWait would only add
        latency."""
        former = self.core.former
        batch = former.take(idle=self.inflight_requests == 0 and not pending)
        if batch is None and not pending and self.inflight_requests < max(former.target_sizes):
            batch = former.take_partial()
        return batch

    def _enter(self, bin_: int, reqs: tuple[Request, ...], *, batch: bool, now: float,
               inflight: InFlight | None = None) -> Slot:  # fmt: skip
        """``inflight``: the pass's listing of what is in flight (``_inflight_left``), if made:
        ``reqs`` join it."""
        slot = self.ledger.acquire(bin_, reqs, batch=batch, now=now)
        for req in reqs:
            self._slot_of[req] = slot
            self._release_bytes(req)
            if inflight is not None:
                inflight.append(self._in_flight(req, 0.0))
        if not batch:
            reqs[0].progress_read = self.reads_progress(now, inflight)
        return slot

    def reads_progress(self, now: float, inflight: InFlight | None = None) -> bool:
        """Does the KV plan want the progress of the request sent now, from its engine
        stream's chunks (so a unary call streams, ``Dispatcher._run_single``)?  While it
        learns the engine's prompt count (its first ``PROGRESS_LEARN`` answers: a fresh
        sidecar's first burst), and, the engine's cache known, once what is in flight
        (each request at its planned end) could fill ``PROGRESS_LOAD`` of its budget.  Below that no
        admission can be refused until what is in flight grows fourfold, and a request
        sent without a stream is planned from the time it has run (``KvPlan.held``).  A
        streamed unary call costs the sidecar about half a millisecond of CPU and the
        engine as much again (chunks to write, parse and reassemble).  At half the
        budget, the engine model's ShareGPT replay told the true lengths saw 0.013x
        direct's preemptions instead of under 0.01x: progress told by the time drifts
        with the engine's step time."""
        plan = self.core.kv_plan
        if plan is None:
            return False
        if plan.prompts_seen < PROGRESS_LEARN:
            return True
        if plan.budget is None:  # the engine's cache is not known: the plan refuses nothing
            return False
        if inflight is None:
            inflight = self._inflight_left(now)
        return inflight.planned >= PROGRESS_LOAD * plan.budget

    # -- answers -----------------------------------------------------------------------

    def complete(self, req: Request, outcome: Outcome, now: float) -> Verdict | None:
        """An engine call answered for ``req``.  Returns what became of it, or None
        if it had ended already (cancelled while in flight)."""
        self.breaker.on_result(outcome.outage, now)  # a driver compares the breaker's state to see a change
        if not outcome.unavailable:
            slot = self._slot_of.get(req)
            self.service_rate.completed(now, self.saturated(), None if slot is None else now - slot.acquired_at)
        elif self._requeue(req, outcome, now):
            return "requeued"
        if outcome.completion_tokens is None:
            return "failed" if self.end(req, "failed") else None
        core = self.core
        actual = float(outcome.completion_tokens)
        req.actual_tokens = actual
        predicted = req.predicted_tokens if req.predicted_tokens is not None else actual
        core.predictor.observe(req, actual)
        if core.kv_plan is not None and not req.prompt_counted:
            core.kv_plan.observe_prompt(req.prompt_tokens, outcome.prompt_tokens)
        if req.bin is not None:
            core.sizer.observe(req.bin, outcome.prompt_tokens, actual)
        core.accuracy.record(predicted, actual, req.prediction_source)
        return "completed" if self.end(req, "completed") else None

    def prompt_counted(self, req: Request, counted: int) -> bool:
        """The engine's stream counted ``req``'s prompt at ``counted`` tokens, at its first chunk: the
        KV plan learns its prompt scale from it then, not at the end of the answer, so a fresh
        sidecar's plan stops counting the queue's prompts at the prior after one engine step, not one
        answer (a burst at a fresh sidecar was held to a fraction of the engine's concurrency until
        its first answer came back).  Returns whether the scale moved (the queue may now fit more)."""
        plan = self.core.kv_plan
        if plan is None or req.prompt_counted:
            return False
        req.prompt_counted = True
        before = plan.prompt_scale
        plan.observe_prompt(req.prompt_tokens, counted)
        return plan.prompt_scale != before

    def _requeue(self, req: Request, outcome: Outcome, now: float) -> bool:
        """Queue ``req`` again if the engine never received it and it may still wait."""
        if outcome.sent or req.cancelled or req not in self._open or req.expired(now) or not self.accepting:
            return False
        try:
            self.core.former.submit(req)
        except QueueFull:
            return False
        self._slot_of.pop(req, None)  # its old call's end must not answer it
        self._hold_bytes(req)  # queued again (accepted already: never refused for its bytes)
        return True

    def release(self, slot: Slot, now: float) -> tuple[list[Request], bool]:
        """An engine call ended, however it ended.  Returns the requests it leaves
        unanswered (still open and still held by this slot: the driver ends them)
        and whether the slot was held until now (False: released already)."""
        orphans = []
        for req in slot.requests:
            if self._slot_of.get(req) is slot:
                del self._slot_of[req]
                if req in self._open:
                    orphans.append(req)
        return orphans, self.ledger.release(slot, now)

    # -- engine health and queue time ------------------------------------------------

    def on_engine_health(self, ok: bool, now: float) -> bool:
        """A health probe's result; True if the breaker changed state."""
        return self.breaker.on_probe(ok, now)

    def _refusal(self, req: Request) -> Rejected | None:
        """Why ``req`` is refused before it is queued (None: accept it)."""
        now = self.clock.now()
        remaining = None if req.deadline is None else req.deadline - now
        if self.breaker.state == "open":
            if remaining is None:
                return Rejected("unavailable", f"{self.breaker.describe(now)}; a request without a deadline "
                                               "is not held for its return")  # fmt: skip
            return None  # held up to its deadline (bounded by the queue)
        if self.breaker.state == "half_open" or remaining is None:
            return None  # half-open: the measured rate describes the engine before the outage
        rate = self.service_rate
        why = refusal(self.backlog(), rate.rate(now), remaining, rate.service_seconds(now))
        return None if why is None else Rejected("resource_exhausted", why)

    # -- sizing ----------------------------------------------------------------------

    def on_snapshot(self, snapshot: EngineSnapshot | None, now: float) -> tuple[SizeDecision, list[Change]]:
        """Recompute B_t from a metrics snapshot (None: no metrics source); also
        the adaptive binner's n_max and rebalance.  Returns the decision and the
        changes it made."""
        core = self.core
        changes: list[Change] = []
        observed = self.ledger.mean_requests(now)
        if core.former.gate is not None and snapshot is not None:
            core.former.gate.observe_interval(snapshot.tpot_seconds, observed)
        if isinstance(core.binner, AdaptiveBinner) and snapshot is not None and snapshot.kv_capacity_tokens:
            mu = core.sizer.overall.mu
            if mu:
                core.binner.n_max = n_max_from_memory(snapshot.kv_capacity_tokens, mu)
        core.binner.rebalance(core.former.queued_predictions())
        if core.binner.version != self._binner_version:
            self._binner_version = core.binner.version
            core.sizer.reset_bins()
            why = f"{REBALANCE_REASON}: the binner moved its boundaries"
            changes.append(Change("binBoundaries", "", fmt(core.binner.boundaries), why, REBALANCE_REASON))
        core.former.poll()  # re-bins the queue if the binner moved, before sizes are set
        old = list(core.former.target_sizes)
        if observed is None and snapshot is not None and snapshot.tpot_seconds is not None:
            # none of ours was in the engine: its TPOT is another client's batch, no evidence for b_sla
            snapshot = replace(snapshot, tpot_seconds=None)
        decision = core.sizer.update(snapshot, core.binner.k, observed_batch=observed)
        core.former.set_target_sizes(decision.sizes)
        self.last_decision = decision
        if core.kv_plan is not None and snapshot is not None and snapshot.fresh:
            # preemptions while none of ours was in the engine are another client's: not the plan's to answer
            preempted = snapshot.preemptions_delta
            if preempted and observed is None:
                preempted = 0.0
            # the plan was wrong only if it counted every request in flight and was sure of each one's
            # length: one sent before the engine's cache was known (a fresh sidecar's first burst) was
            # never counted, and the preemptions it brings shrank the first burst's budget to 0.7 of the
            # cache (engine model, a burst at start, six seeds: 0.91x -> 0.96x direct's throughput)
            certain = all(predicted_length(r).known and r.kv_planned for slot in self.ledger.held() for r in slot.requests)
            core.kv_plan.on_snapshot(
                snapshot.kv_capacity_tokens, snapshot.kv_block_tokens, snapshot.tpot_seconds, preempted, certain
            )
            self._observe_usage(snapshot)
        if snapshot is not None and snapshot.fresh:
            self._pending.set_tpot(snapshot.tpot_seconds)  # aging at the engine's pace (admission.py)
        if core.admission.follow_engine and snapshot is not None and snapshot.fresh:
            self.engine_cap = engine_cap(
                snapshot.running, snapshot.waiting, self.inflight_requests, self.engine_cap, snapshot.kv_usage_ratio,
                self._engine_counts, self._kv_planned(),
            )  # fmt: skip
            counts = (snapshot.running, snapshot.waiting)
            self._engine_counts = None if counts[0] is None or counts[1] is None else (counts[0], counts[1])
        else:
            self.engine_cap = None
            self._engine_counts = None
        if decision.sizes != old:
            reason = f"{decision.reason}: {decision.detail}"
            changes.append(Change("batchSize", fmt(old), fmt(decision.sizes), reason, decision.reason))
        return decision, changes

    def usage_wanted(self) -> bool:
        """Would the engine's KV usage, read now, teach the KV plan what it does not
        know yet and is holding requests back for: how much of the prompts in flight
        vLLM's prefix cache holds once (``_observe_usage``)?  True while the plan has
        no estimate (a fresh sidecar; a preemption with every length known cleared
        it), requests wait here, and enough of those in flight have streamed past
        their prefill.  The dispatcher then asks the metrics feed for an early
        scrape: a burst behind one system prompt at a fresh sidecar ran 4 at a time
        until the next scrape (half a second at the default interval) where the
        engine alone ran 28."""
        plan = self.core.kv_plan
        if plan is None or plan.capacity is None or not plan.usage_live or plan.shared_seen or not self._pending:
            return False
        return sum(1 for _ in self._streamed()) >= SHARED_MIN_SEQS

    def _streamed(self) -> Iterator[Request]:
        """The open requests in flight whose stream said how many tokens the engine
        counted in their prompt and generated (at least one: past their prefill)."""
        return (r for slot in self.ledger.held() for r in slot.requests
                if r.engine_prompt_tokens is not None and r.engine_generated and r in self._open)  # fmt: skip

    def _observe_usage(self, snapshot: EngineSnapshot) -> None:
        """Show the KV plan what the engine's cache holds against what it counts of the
        requests in flight that streamed past their prefill (``KvPlan.observe_usage``:
        the prompt blocks vLLM's prefix cache shares), with how many wait in the
        engine: a sequence preempted there holds nothing it is counted for."""
        plan = self.core.kv_plan
        if plan is None or plan.capacity is None or snapshot.kv_usage_ratio is None or snapshot.waiting is None:
            return
        block = plan.block
        # the cache holds a sequence's prompt and every token it generated but the last (whose KV the next step writes)
        held = [(-(-(r.engine_prompt_tokens + r.engine_generated - 1) // block) * block, float(r.engine_prompt_tokens))
                for r in self._streamed()]  # fmt: skip
        plan.observe_usage(snapshot.kv_usage_ratio * plan.capacity, held, snapshot.waiting)

    # -- reload and shutdown -----------------------------------------------------------

    def replace_core(self, core: Core, *, mode: Mode, max_inflight_batches: int) -> list[Request]:
        """Swap in a core built from a new config; queued requests move over in
        order.  Returns those the new queue refused, ended as "rejected"."""
        old = self.core.former
        old.drain()
        moved: list[Request] = []
        while (batch := old.take()) is not None:
            moved.extend(batch.requests)
        moved.sort(key=lambda r: r.arrival)
        self.core = core
        self.mode, self.max_inflight_batches = mode, max_inflight_batches
        self._binner_version = core.binner.version
        core.former.set_partial_waits_for_server(mode == "gang")
        for name, load in self._tenants.items():  # the new weights apply at once, to the share and to admission
            load.weight = self._weight(name)
        self._active_weight = sum(load.weight for load in self._tenants.values())
        if core.admission != self._pending.order:  # taken requests keep their batch; the new order ranks them
            old_pending, self._pending = self._pending, FairAdmissionQueue(core.admission, self._weight)
            for batch, req in sorted(old_pending, key=lambda e: e[1].arrival):
                self._pending.push(batch, req)
        refused = []
        for req in moved:
            req.bin = None
            req.predicted_tokens = core.predictor.predict(req)
            try:
                core.former.submit(req)
            except QueueFull:
                if self.end(req, "rejected"):
                    refused.append(req)
        return refused

    def start_drain(self) -> None:
        """Stop intake and release every queued request into batches."""
        self.accepting = False
        self.core.former.drain()

    def cut_queued(self) -> list[Request]:
        """The drain ran out of time: end everything not yet sent ("unavailable");
        returns the requests this ended."""
        cut = []
        former = self.core.former
        while (batch := former.take()) is not None:
            cut.extend(r for r in batch.requests if self.end(r, "unavailable"))
        while (head := self._pending.pop(self.clock.now())) is not None:
            _, req = head
            if self.end(req, "unavailable"):
                cut.append(req)
        return cut

    def held(self) -> list[Slot]:
        """Slots of engine calls not yet ended."""
        return self.ledger.held()


def fmt(values) -> str:
    return "[" + ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values) + "]"


def _plan_context(plan: KvPlan) -> tuple[float, int, float | None, float]:
    """What every request's plan (``KvPlan.held``) reads of the plan itself."""
    return plan.prompt_scale, plan.block, plan.step_seconds, plan.shared_blocks


def _held(plan: KvPlan, r: Request, elapsed: float, context: tuple[float, int, float | None, float]) -> Seq:
    """``plan.held`` of ``r``, in flight for ``elapsed`` seconds, kept on ``r`` while nothing
    it reads changed (``context``: ``_plan_context(plan)``): every admission pass lists each
    request in flight, whose plan moves only when its stream tells more, or, before its first
    chunk, with the engine steps the time covers (``KvPlan.steps_in``; not with every pass: the
    HTTP door takes a burst in two requests a turn, and a pass follows each turn).  Its length
    is ``predicted_length(r)``, which reads only the fields in the key."""
    generated = r.engine_generated
    steps = None if generated is not None else plan.steps_in(elapsed)  # step_seconds is in the context
    length = r.length if r.length is not None else (r.predicted_tokens, r.max_tokens)
    key = (generated, r.engine_prompt_tokens, steps, r.prompt_tokens, length, context)
    memo = r.kv_held
    if memo is not None and memo[0] == key:
        return memo[1]
    seq = plan.held(r.prompt_tokens, predicted_length(r), elapsed, generated=generated,
                    engine_prompt=r.engine_prompt_tokens)  # fmt: skip
    r.kv_held = (key, seq)
    return seq
