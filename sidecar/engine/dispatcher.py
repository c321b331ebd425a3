"""The dispatcher: moves batches from the batch former into the engine (DESIGN §2).

It owns the asyncio side of the request path.  A caller ``submit``s a ``Request``
whose ``payload`` is a ``Call`` (the engine request plus the future the caller
awaits); the dispatcher predicts its length, queues it in the former, and its one
loop (``run``) forms, dispatches and completes batches.  Two modes:

* ``gang`` - the multi-bin seed's model: a batch holds one of
  ``max_inflight_batches`` slots until every request in it has finished; its
  requests go to the engine together (one ``/v1/completions`` call per group of
  equal sampling parameters, see ``EngineClient.complete_batch``).
* ``continuous`` - for engines that batch continuously (vLLM): requests leave the
  former in batches of one bin, so similar lengths still enter the engine
  together, but each is its own engine call and is admitted only while the
  requests in flight are below that bin's target size B_t; capacity is released
  per request as each finishes.  ``max_inflight_batches`` does not apply.

Every accepted request ends exactly once (``_finish`` resolves a future only if it
is not done) with a ``Completion`` or an exception: ``Rejected`` for requests the
sidecar itself ended (expired, cancelled, shutdown) and ``EngineError`` for the
engine's failures.  The loop sleeps until something happens: a submit, a
completion, a new size, or the former's next deadline / maxWait (an armed timer).

Two gates protect the engine and the callers (``_refusal``, ``_note_engine``):
``breaker`` (``EngineBreaker``) holds dispatch while the engine is down -- queued
requests wait up to their deadlines, a request the engine never received
(connection refused) is queued again, new requests without a deadline or beyond
the full queue get UNAVAILABLE at once -- and ``service_rate`` refuses a request
whose predicted queue wait exceeds its deadline with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Literal, get_args

from ..core.binner import AdaptiveBinner, Binner, n_max_from_memory
from ..core.clock import Clock
from ..core.former import Batch, BatchFormer, QueueFull
from ..core.inflight import InflightLedger, Slot
from ..core.predictor import AccuracyTracker, LengthPredictor
from ..core.queue_wait import ServiceRate, refusal
from ..core.request import Request
from ..core.sizer import BatchSizer, EngineSnapshot, SizeDecision
from .breaker import STATES, EngineBreaker
from .engine_client import EngineClient, EngineError, EngineRequest, EngineResult, StreamDelta
from .sidecar_metrics import SidecarMetrics

log = logging.getLogger("binbatch.dispatcher")

Mode = Literal["gang", "continuous"]
MAX_ADJUSTMENTS = 32
STOPPED = "the sidecar stopped before the engine answered"
ADJUSTMENT_LOG_SECONDS = 30.0  # at most one INFO line per field this often, unless the reason changes
# Adjustment.field values (binbatch.proto lists them).  Adjustment.reason is
# "<reason>: <detail>": for a batch size the sizer's reason (sizer.REASONS), for
# bin boundaries REBALANCE_REASON.
AdjustmentField = Literal["batchSize", "binBoundaries", "binCount"]
ADJUSTMENT_FIELDS: tuple[AdjustmentField, ...] = get_args(AdjustmentField)
REBALANCE_REASON = "rebalance"


class Rejected(Exception):
    """The sidecar ended a request itself.  ``kind``: resource_exhausted |
    unavailable | deadline | cancelled; the servicer maps it to a gRPC status."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True, slots=True)
class Completion:
    """What a caller gets back for a finished request."""

    result: EngineResult
    queue_seconds: float
    engine_seconds: float
    bin: int
    batch_size: int
    predicted_tokens: float


@dataclass(eq=False)
class Call:
    """The caller's handle, kept in ``Request.payload``."""

    engine_request: EngineRequest
    future: asyncio.Future[Completion]
    deltas: asyncio.Queue[str] | None = None  # streaming callers read text pieces here
    task: asyncio.Task[None] | None = None  # its own engine call (continuous mode)
    dispatched_at: float | None = None
    slot: Slot | None = None  # the engine call holding it now; None while queued (again)


@dataclass
class Core:
    """The scheduling core one config builds; swapped whole on a config reload."""

    predictor: LengthPredictor
    binner: Binner
    former: BatchFormer
    sizer: BatchSizer
    accuracy: AccuracyTracker = field(default_factory=AccuracyTracker)


@dataclass(frozen=True, slots=True)
class Adjustment:
    time: float
    field: str
    old: str
    new: str
    reason: str


class Dispatcher:
    def __init__(
        self,
        core: Core,
        client: EngineClient,
        clock: Clock,
        metrics: SidecarMetrics,
        *,
        mode: Mode = "continuous",
        max_inflight_batches: int = 4,
        engine_timeout: float | None = None,
        wall_time=None,
    ) -> None:
        if mode not in ("gang", "continuous"):
            raise ValueError(f"mode must be 'gang' or 'continuous', got {mode!r}")
        if max_inflight_batches < 1:
            raise ValueError(f"max_inflight_batches must be >= 1, got {max_inflight_batches}")
        self.core = core
        self.client = client
        self.clock = clock
        self.metrics = metrics
        self.mode: Mode = mode
        self.max_inflight_batches = max_inflight_batches
        self.engine_timeout = engine_timeout
        self.accepting = True
        self.totals: Counter[str] = Counter()  # accepted, and each outcome
        self.ledger = InflightLedger(clock.now())  # what holds engine capacity, per bin
        self.last_decision: SizeDecision | None = None
        self.adjustments: deque[Adjustment] = deque(maxlen=MAX_ADJUSTMENTS)
        self._logged: dict[str, tuple[float, str, int]] = {}  # field -> (last INFO time, reason kind, changes since)
        self._wall_time = wall_time
        self._pending: deque[tuple[Batch, Request]] = deque()  # continuous: taken, not yet admitted
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._binner_version = core.binner.version
        self.breaker = EngineBreaker()
        self.service_rate = ServiceRate()
        self._opens_published = 0
        self._publish_sizes()
        self._publish_breaker()

    @property
    def inflight_requests(self) -> int:
        """Requests in the engine now (their calls not yet ended)."""
        return self.ledger.requests

    @property
    def inflight_batches(self) -> int:
        """Gang batches in the engine now (0 in continuous mode)."""
        return self.ledger.batches

    def pending_requests(self) -> int:
        """Requests out of their bins but not yet sent: in formed batches the former
        still holds, or taken and waiting for an admission slot (continuous mode).
        With the bins' depths and ``inflight_requests`` this counts every request
        accepted and not yet ended."""
        former = self.core.former
        formed = former.queued() - sum(former.bin_depths())
        return formed + sum(1 for _, r in self._pending if not r.payload.future.done())

    # -- intake ---------------------------------------------------------------------

    def submit(self, req: Request, call: Call) -> int:
        """Queue ``req``; returns its bin.  Raises ``Rejected`` when draining or full."""
        if not self.accepting:
            raise Rejected("unavailable", "the sidecar is shutting down and accepts no new requests")
        req.payload = call
        refused = self._refusal(req)
        if refused is not None:
            self.metrics.requests.labels("rejected").inc()
            self.totals["rejected"] += 1
            raise refused
        req.predicted_tokens = self.core.predictor.predict(req)
        try:
            bin_ = self.core.former.submit(req)
        except QueueFull as exc:
            self.metrics.requests.labels("rejected").inc()
            self.totals["rejected"] += 1
            if self.breaker.state == "open":
                raise Rejected("unavailable", f"{self.breaker.describe(self.clock.now())}; queue full: {exc}") from None
            raise Rejected("resource_exhausted", f"queue full: {exc}") from None
        self.metrics.accepted.inc()
        self.totals["accepted"] += 1
        self._idle.clear()
        self._wake.set()
        return bin_

    def cancel(self, req: Request) -> None:
        """The caller went away (cancelled or its deadline passed): drop or abort it.

        A request still queued leaves its bin; one taken but not admitted is skipped
        at admission (``req.cancelled``); one in the engine has its task cancelled,
        which closes the HTTP request (vLLM aborts it).  Its slot is released by the
        task's done-callback, which runs even if the task never started.
        """
        call: Call = req.payload
        if req.cancelled and call.future.done():
            return
        self.core.former.cancel(req)  # marks req.cancelled; leaves the bin if still there
        if call.task is not None and not call.task.done():
            call.task.cancel()
        if req.expired(self.clock.now()):
            self._finish(req, "expired", exc=Rejected("deadline", "the deadline passed"))
        else:
            self._finish(req, "cancelled", exc=Rejected("cancelled", "the caller cancelled the request"))
        self._wake.set()

    # -- the loop ------------------------------------------------------------------

    async def run(self) -> None:
        """Dispatch until cancelled."""
        while True:
            self._wake.clear()
            self._step()
            wake_at = self.core.former.next_wake()
            timeout = None if wake_at is None else max(0.0, wake_at - self.clock.now())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass

    def _step(self) -> None:
        former = self.core.former
        for req in former.poll().expired:
            self._finish(req, "expired", exc=Rejected("deadline", "deadline passed while queued"))
        if self.mode == "gang":
            while self.inflight_batches < self.max_inflight_batches and self.breaker.allows_dispatch(
                self.inflight_batches
            ):
                batch = former.take(idle=True)
                if batch is None:
                    break
                self._count_batch(batch)
                live = [r for r in batch.requests if not r.cancelled]
                slot = self._enter(batch.bin, live, batch=True)  # counted now: this loop sees it taken
                self._spawn(self._run_gang(live), slot)
        else:
            self._admit_continuous()
        self._publish_queue()
        if former.queued() == 0 and not self._pending and self.inflight_requests == 0:
            self._idle.set()

    def _admit_continuous(self) -> None:
        former = self.core.former
        while self.breaker.allows_dispatch(self.inflight_requests):
            if not self._pending:
                batch = former.take(idle=self.inflight_requests == 0)
                if batch is None:
                    return
                self._count_batch(batch)
                self._pending.extend((batch, r) for r in batch.requests)
            batch, req = self._pending[0]
            if req.payload.future.done():  # cancelled while waiting: finished already
                self._pending.popleft()
                continue
            sizes = former.target_sizes
            limit = sizes[batch.bin] if batch.bin < len(sizes) else min(sizes)
            if self.inflight_requests >= limit:
                return
            self._pending.popleft()
            if req.expired(self.clock.now()):
                self._finish(req, "expired", exc=Rejected("deadline", "deadline passed while queued"))
                continue
            call: Call = req.payload
            slot = self._enter(batch.bin, [req], batch=False)
            call.task = self._spawn(self._run_single(req, batch.size), slot)

    def _spawn(self, coro, slot: Slot) -> asyncio.Task[None]:
        """Run one engine call holding ``slot``; ``_ended`` releases it when the task
        ends, however it ends (a task cancelled before its first step never runs its
        body, but its done-callbacks do run)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._ended(t, slot))
        return task

    def _ended(self, task: asyncio.Task[None], slot: Slot) -> None:
        """An engine call's task ended: end what it left unanswered, release its slot."""
        self._tasks.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:  # a bug, not an engine answer
            log.error("engine call failed in dispatch", exc_info=error)
        for req in slot.requests:
            if req.payload.slot is not slot:
                continue  # queued again (the engine never received it), maybe already sent anew
            if task.cancelled():
                self._finish(req, "unavailable", exc=Rejected("unavailable", STOPPED))
            else:
                why = f"dispatch failed: {error}" if error else "the engine call ended without an answer"
                self._finish(req, "failed", exc=EngineError("internal", None, why))
        if self.ledger.release(slot, self.clock.now()):
            self._publish_inflight()
            self._wake.set()

    # -- engine calls ----------------------------------------------------------------

    async def _run_gang(self, live: list[Request]) -> None:
        """One gang batch; it holds a slot (``_enter``) that ``_ended`` releases."""
        try:
            requests = [r.payload.engine_request for r in live]
            results = await self.client.complete_batch(requests, timeout=self.engine_timeout)
            for req, result in zip(live, results, strict=True):
                self._complete(req, result, len(live))
        except asyncio.CancelledError:
            for req in live:
                self._finish(req, "unavailable", exc=Rejected("unavailable", "the sidecar stopped before the engine answered"))
            raise
        except Exception as exc:  # a bug, not an engine answer: fail the batch, keep serving
            log.exception("batch of %d failed", len(live))
            for req in live:
                self._finish(req, "failed", exc=EngineError("internal", None, f"dispatch failed: {exc}"))

    async def _run_single(self, req: Request, batch_size: int) -> None:
        """One request's own engine call (continuous mode); it holds a slot that ``_ended`` releases."""
        call: Call = req.payload
        try:
            if call.deltas is not None:
                result: EngineResult | EngineError | None = None
                try:
                    async for item in self.client.stream(call.engine_request, timeout=self.engine_timeout):
                        if isinstance(item, StreamDelta):
                            call.deltas.put_nowait(item.text)
                        else:
                            result = item
                except EngineError as exc:
                    result = exc
                if result is None:
                    result = EngineError("internal", None, "the engine's stream ended without a result")
            else:
                result = (await self.client.complete_batch([call.engine_request], timeout=self.engine_timeout))[0]
            self._complete(req, result, batch_size)
        except asyncio.CancelledError:
            if req.cancelled:
                return  # cancel() already finished it
            self._finish(req, "unavailable", exc=Rejected("unavailable", "the sidecar stopped before the engine answered"))
            raise
        except Exception as exc:
            log.exception("request failed in dispatch")
            self._finish(req, "failed", exc=EngineError("internal", None, f"dispatch failed: {exc}"))

    def _enter(self, bin_: int, reqs: list[Request], *, batch: bool) -> Slot:
        now = self.clock.now()
        slot = self.ledger.acquire(bin_, reqs, batch=batch, now=now)
        for req in reqs:
            req.payload.dispatched_at = now
            req.payload.slot = slot
            self.metrics.wait.observe(max(0.0, now - req.arrival))
        self._publish_inflight()
        return slot

    def _complete(self, req: Request, result: EngineResult | EngineError, batch_size: int) -> None:
        if self._note_engine(req, result):
            return  # the engine never received it: queued again
        if isinstance(result, EngineError):
            self._finish(req, "failed", exc=result)
            return
        core = self.core
        actual = float(result.completion_tokens)
        req.actual_tokens = actual
        predicted = req.predicted_tokens if req.predicted_tokens is not None else actual
        core.predictor.observe(req, actual)
        core.binner.observe(actual)
        if req.bin is not None:
            core.sizer.observe(req.bin, result.prompt_tokens, actual)
        core.accuracy.record(predicted, actual, req.prediction_source)
        self.metrics.predicted_tokens.observe(predicted)
        self.metrics.actual_tokens.observe(actual)
        now = self.clock.now()
        call: Call = req.payload
        started = call.dispatched_at if call.dispatched_at is not None else now
        self.metrics.service.observe(max(0.0, now - started))
        completion = Completion(
            result=result,
            queue_seconds=max(0.0, started - req.arrival),
            engine_seconds=max(0.0, now - started),
            bin=req.bin or 0,
            batch_size=batch_size,
            predicted_tokens=predicted,
        )
        self._finish(req, "completed", result=completion)

    def _finish(
        self, req: Request, outcome: str, *, result: Completion | None = None, exc: BaseException | None = None
    ) -> bool:
        """End ``req`` exactly once; later calls for the same request do nothing (False)."""
        fut = req.payload.future
        if fut.done():
            return False
        if exc is not None:
            fut.set_exception(exc)
            fut.exception()  # mark it retrieved: a caller that left must not log "never retrieved"
        else:
            fut.set_result(result)
        self.metrics.requests.labels(outcome).inc()
        self.totals[outcome] += 1
        if req.payload.deltas is not None:
            req.payload.deltas.put_nowait("")  # wakes a streaming reader to see the end
        return True

    # -- engine health and queue time ------------------------------------------------

    def on_engine_health(self, ok: bool) -> None:
        """A health probe's result (the sidecar probes every second): opens the
        breaker, or lets it try the engine again (half-open)."""
        if self.breaker.on_probe(ok, self.clock.now()):
            self._breaker_changed()

    def _refusal(self, req: Request) -> Rejected | None:
        """Why ``req`` is refused before it is queued (None: accept it)."""
        now = self.clock.now()
        remaining = None if req.deadline is None else req.deadline - now
        if self.breaker.state == "open":
            if remaining is None:
                return Rejected("unavailable", f"{self.breaker.describe(now)}; a request without a deadline "
                                               "is not held for its return")  # fmt: skip
            return None  # held up to its deadline (bounded by the queue)
        if self.breaker.state == "half_open":
            return None  # the measured rate describes the engine before the outage
        why = refusal(self._backlog(), self.service_rate.rate(now), remaining)
        return None if why is None else Rejected("resource_exhausted", why)

    def _note_engine(self, req: Request, result: EngineResult | EngineError) -> bool:
        """Feed the breaker and the service rate with an engine call's outcome; queue
        ``req`` again if the engine never received it.  True if queued again."""
        now = self.clock.now()
        if self.breaker.on_result(result, now):
            self._breaker_changed()
        if not isinstance(result, EngineError) or result.kind != "unavailable":
            self.service_rate.completed(now, self._saturated())
            return False
        if result.sent or req.cancelled or req.payload.future.done() or req.expired(now) or not self.accepting:
            return False
        try:
            self.core.former.submit(req)
        except QueueFull:
            return False
        req.payload.slot = None  # its old call's end must not answer it
        self.metrics.requeued.inc()
        self._wake.set()
        return True

    def _backlog(self) -> int:
        """Requests accepted and not yet sent to the engine."""
        return self.core.former.queued() + len(self._pending)

    def _saturated(self) -> bool:
        """Are requests waiting for engine capacity (not merely for their bin to fill)?"""
        return bool(self._pending) or self.core.former.ready_batches() > 0

    def _breaker_changed(self) -> None:
        b = self.breaker
        now = self.clock.now()
        if b.state == "open":
            log.warning("engine circuit open: dispatch held, %d requests queued (%s)", self._backlog(), b.reason)
        else:
            log.info("engine circuit %s after %.1f s", b.state.replace("_", "-"), b.open_seconds(now))
        self._publish_breaker()
        self._wake.set()

    # -- sizing ----------------------------------------------------------------------

    def on_snapshot(self, snapshot: EngineSnapshot | None) -> SizeDecision:
        """Recompute B_t from a metrics snapshot (None: no metrics source)."""
        core = self.core
        now = self.clock.now()
        observed = self.ledger.mean_requests(now)
        if isinstance(core.binner, AdaptiveBinner) and snapshot is not None and snapshot.kv_capacity_tokens:
            mu = core.sizer.overall.mu
            if mu:
                core.binner.n_max = n_max_from_memory(snapshot.kv_capacity_tokens, mu)
        core.binner.rebalance(core.former.queued_predictions())
        if core.binner.version != self._binner_version:
            self._binner_version = core.binner.version
            core.sizer.reset_bins()
            why = f"{REBALANCE_REASON}: the binner moved its boundaries"
            self._adjust("binBoundaries", "", _fmt(core.binner.boundaries), why, REBALANCE_REASON)
        core.former.poll()  # re-bins the queue if the binner moved, before sizes are set
        old = list(core.former.target_sizes)
        decision = core.sizer.update(snapshot, core.binner.k, observed_batch=observed)
        core.former.set_target_sizes(decision.sizes)
        self.last_decision = decision
        if decision.sizes != old:
            self.metrics.size_changes.labels(decision.reason).inc()
            self._adjust(
                "batchSize", _fmt(old), _fmt(decision.sizes), f"{decision.reason}: {decision.detail}", decision.reason
            )
        self._publish_sizes()
        self._wake.set()
        return decision

    def _adjust(self, field_: AdjustmentField, old: str, new: str, reason: str, kind: str) -> None:
        """Record an adjustment (Stats keeps every one).  The log gets an INFO line when
        the kind of reason changes, else at most one per ``ADJUSTMENT_LOG_SECONDS``
        per field: under load the memory-bound size moves by a request or two on
        every scrape, which is news in Stats and metrics but noise in the log."""
        t = self._wall_time() if self._wall_time else self.clock.now()
        self.adjustments.append(Adjustment(t, field_, old, new, reason))
        now = self.clock.now()
        last = self._logged.get(field_)
        if last is None or last[1] != kind or now - last[0] >= ADJUSTMENT_LOG_SECONDS:
            quiet = f"; {last[2]} more changes since the last report" if last and last[2] else ""
            log.info("adjusted %s: %s -> %s (%s%s)", field_, old, new, reason, quiet)
            self._logged[field_] = (now, kind, 0)
        else:
            log.debug("adjusted %s: %s -> %s (%s)", field_, old, new, reason)
            self._logged[field_] = (last[0], kind, last[2] + 1)

    # -- reload and shutdown -----------------------------------------------------------

    def replace_core(self, core: Core, *, mode: Mode, max_inflight_batches: int, engine_timeout: float | None) -> None:
        """Swap in a core built from a new config; queued requests move over in order."""
        old = self.core.former
        old.drain()
        moved: list[Request] = []
        while (batch := old.take()) is not None:
            moved.extend(batch.requests)
        moved.sort(key=lambda r: r.arrival)
        self.core = core
        self.mode, self.max_inflight_batches, self.engine_timeout = mode, max_inflight_batches, engine_timeout
        self._binner_version = core.binner.version
        for req in moved:
            req.bin = None
            req.predicted_tokens = core.predictor.predict(req)
            try:
                core.former.submit(req)
            except QueueFull:
                self._finish(req, "rejected", exc=Rejected("resource_exhausted", "queue full after a config reload"))
        self._publish_sizes()
        self._wake.set()

    def replace_client(self, client: EngineClient) -> list[asyncio.Task[None]]:
        """New dispatches go to ``client`` (a reload changed the engine); returns
        the engine tasks that may still use the old one, for the caller to await
        before it closes the old client."""
        self.client = client
        return list(self._tasks)

    async def drain(self, grace: float) -> int:
        """Stop intake, dispatch everything held, wait up to ``grace`` seconds; then
        end what is left with UNAVAILABLE.  Returns how many requests were cut off."""
        self.accepting = False
        self.metrics.draining.set(1)
        self.core.former.drain()
        self._wake.set()
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
            return 0
        except TimeoutError:
            pass
        # Count only requests this drain itself ends: a caller already answered (or a
        # slot already released) is not "cut off".
        cut = 0
        former = self.core.former
        while (batch := former.take()) is not None:
            for req in batch.requests:
                cut += self._finish(req, "unavailable", exc=Rejected("unavailable", "shut down before dispatch"))
        while self._pending:
            _, req = self._pending.popleft()
            cut += self._finish(req, "unavailable", exc=Rejected("unavailable", "shut down before dispatch"))
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for slot in self.ledger.held():
            for req in slot.requests:
                cut += self._finish(req, "unavailable", exc=Rejected("unavailable", STOPPED))
        await asyncio.gather(*tasks, return_exceptions=True)
        return cut

    # -- observability -----------------------------------------------------------------

    def _count_batch(self, batch: Batch) -> None:
        label = str(batch.bin)
        self.metrics.batches.labels(label, batch.reason).inc()
        self.metrics.batch_size.labels(label).observe(batch.size)

    def _publish_queue(self) -> None:
        for i, depth in enumerate(self.core.former.bin_depths()):
            self.metrics.queue_depth.labels(str(i)).set(depth)
        self.metrics.pending_requests.set(self.pending_requests())

    def _publish_inflight(self) -> None:
        self.metrics.inflight_requests.set(self.inflight_requests)
        self.metrics.inflight_batches.set(self.inflight_batches)

    def _publish_breaker(self) -> None:
        for state in STATES:
            self.metrics.breaker_state.labels(state).set(1 if self.breaker.state == state else 0)
        self.metrics.breaker_opens.inc(self.breaker.opens - self._opens_published)
        self._opens_published = self.breaker.opens

    def _publish_sizes(self) -> None:
        core = self.core
        self.metrics.bins.set(core.binner.k)
        for i, size in enumerate(core.former.target_sizes):
            self.metrics.target_batch_size.labels(str(i)).set(size)
        d = self.last_decision
        reason = d.reason if d is not None else ""
        for fallback in ("last-good", "static", "pressure"):
            self.metrics.sizer_fallback.labels(fallback).set(1 if reason == f"stale-{fallback}" else 0)
        if d is not None:
            for i, m in enumerate(d.b_mem):
                self.metrics.b_mem.labels(str(i)).set(-1 if m is None else m)
            self.metrics.b_sla.set(-1 if d.b_sla is None else d.b_sla)
        b = core.binner.boundaries
        acc = core.accuracy
        for gauge, value in (
            (self.metrics.bin_accuracy, acc.bin_accuracy(b)),
            (self.metrics.within_one_accuracy, acc.within_one_bin_accuracy(b)),
        ):
            if value is not None:
                gauge.set(value)
        for source in acc.sources():
            self.metrics.bin_accuracy_by_source.labels(source).set(acc.bin_accuracy(b, source) or 0.0)
            self.metrics.within_one_accuracy_by_source.labels(source).set(acc.within_one_bin_accuracy(b, source) or 0.0)


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values) + "]"
