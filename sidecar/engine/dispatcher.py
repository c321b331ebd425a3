"""The dispatcher: the asyncio driver of the core's ``Scheduler`` (DESIGN §2).

Every scheduling decision -- predict, bin, refuse, what to dispatch or admit now,
in-flight accounting, requeue, reacting to a metrics snapshot or a health probe --
is the ``Scheduler``'s (``core/scheduler.py``), which the simulator drives too.
This module only runs it: one loop (``run``) that calls ``Scheduler.step`` when
something happens (a submit, a completion, a new size, or the former's next
deadline / maxWait as an armed timer), one asyncio task per engine call, the
callers' futures and stream deltas, cancellation, the engine client, metrics
and logs.  It keeps its own map from ``Request`` to the caller's ``Call``.

Two modes (the scheduler decides, see there): ``gang`` sends a batch as one
engine call (``EngineClient.complete_batch`` groups equal sampling parameters);
``continuous`` sends each admitted request as its own call.

Every accepted request ends exactly once (``Scheduler.end`` is True only the first
time, and only then is the future resolved) with a ``Completion`` or an
exception: ``Rejected`` for requests the sidecar itself ended (expired,
cancelled, shutdown) and ``EngineError`` for the engine's failures.  A call's
slot is released from its task's done-callback, which runs even for a task
cancelled before its first step.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..core.admission import engine_priority
from ..core.breaker import STATES
from ..core.clock import Clock
from ..core.inflight import Slot
from ..core.length_model import fit as fit_length_model
from ..core.predictor import ExternalFirst, LearnedPredictor
from ..core.request import Request
from ..core.scheduler import (
    ADJUSTMENT_FIELDS,
    REBALANCE_REASON,
    AdjustmentField,
    Change,
    Core,
    Dispatch,
    Mode,
    Outcome,
    Rejected,
    Scheduler,
)
from ..core.sizer import EngineSnapshot, SizeDecision
from .breaker import outage_reason
from .engine_client import EngineClient, EngineError, EngineRequest, EngineResult
from .sidecar_metrics import SidecarMetrics

log = logging.getLogger("binbatch.dispatcher")

__all__ = [
    "ADJUSTMENT_FIELDS", "REBALANCE_REASON", "Adjustment", "AdjustmentField", "Call", "Completion", "Core",
    "Dispatcher", "Mode", "Rejected",
]  # fmt: skip

MAX_ADJUSTMENTS = 32
STOPPED = "the sidecar stopped before the engine answered"
ADJUSTMENT_LOG_SECONDS = 30.0  # at most one INFO line per field this often, unless the reason changes


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
    """The caller's handle for one request (the dispatcher maps each Request to it)."""

    engine_request: EngineRequest
    future: asyncio.Future[Completion]
    deltas: asyncio.Queue[str] | None = None  # streaming callers read text pieces here
    task: asyncio.Task[None] | None = None  # its own engine call (continuous mode)
    dispatched_at: float | None = None  # None: not (or no longer, after a requeue) sent to the engine
    first_token_at: float | None = None  # a stream's first delta


@dataclass(frozen=True, slots=True)
class Adjustment:
    time: float
    field: str
    old: str
    new: str
    reason: str


class Wakeup:
    """What the dispatch loop sleeps on: ``set()`` wakes it (several calls before it
    runs again wake it once), ``wait(timeout)`` sleeps until then or the timeout.

    ``asyncio.wait_for(event.wait(), timeout)`` made a task (and a timer) for every
    pass of the loop -- about two passes per request -- so this waits on a bare
    future and arms a timer only when the scheduler has a deadline."""

    __slots__ = ("_set", "_waiter")

    def __init__(self) -> None:
        self._set = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._set = True
        _fire(self._waiter)

    def clear(self) -> None:
        self._set = False

    async def wait(self, timeout: float | None = None) -> None:
        """Return once ``set()`` was called (at once if it was since ``clear()``),
        or after ``timeout`` seconds."""
        if self._set:
            return
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, _fire, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()


def _fire(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


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
        self.scheduler = Scheduler(core, clock, mode=mode, max_inflight_batches=max_inflight_batches)
        self.client = client
        self.clock = clock
        self.metrics = metrics
        self.engine_timeout = engine_timeout
        self.adjustments: deque[Adjustment] = deque(maxlen=MAX_ADJUSTMENTS)
        self._logged: dict[str, tuple[float, str, int]] = {}  # field -> (last INFO time, reason kind, changes since)
        self._sla_infeasible = False  # the sizer gave the TPOT SLO up (SlaSizer.infeasible): warned once a change
        self._wall_time = wall_time
        self._calls: dict[Request, Call] = {}  # accepted and not yet answered
        self._sent: dict[str, int] = {}  # requests sent to the engine so far, by model (sent_by_model)
        self._tasks: set[asyncio.Task[None]] = set()
        self._refit: asyncio.Task[None] | None = None  # predictor.kind Learned: the fit running in a thread
        self._wake = Wakeup()
        self.scrape_soon: Callable[[], None] | None = None  # asks the metrics feed for an early scrape (app.py)
        self._idle = asyncio.Event()
        self._idle.set()
        self._opens_published = 0
        self._children: dict[tuple[object, ...], Any] = {}  # labelled metric children (_child)
        self._depth_bins = 0  # binbatch_queue_depth children made so far (_publish_queue)
        self._epoch = clock.now()  # batch.order EnginePriority: the keys count ms from here
        self._tpot: float | None = None  # the engine's last time per token, for those keys
        # Read when /metrics is scraped, not written on every loop pass.
        metrics.inflight_requests.set_function(lambda: self.inflight_requests)
        metrics.inflight_batches.set_function(lambda: self.inflight_batches)
        metrics.pending_requests.set_function(self.pending_requests)
        metrics.queued_bytes.set_function(lambda: self.scheduler.queued_bytes)
        metrics.tenant_queued.queued = lambda: self.scheduler.queued_by_tenant()
        metrics.predictor_model_version.set_function(lambda: self._learned_model("version", 0))
        metrics.predictor_model_records.set_function(lambda: self._learned_model("records", 0))
        metrics.predictor_model_age.set_function(self._model_age)
        metrics.predictor_model_loaded.set_function(self._warm_start_loaded)
        metrics.accuracy.window = lambda: (self.core.accuracy, self.core.binner.boundaries)
        metrics.predictor_buffered_records.set_function(
            lambda: p.buffered if isinstance(p := self.core.predictor, LearnedPredictor) else 0)
        self._publish_queue()
        self._publish_sizes()
        self._publish_breaker()
        metrics.requests_waiting.sidecar = self.waiting_by_model

    # -- the scheduler's state, read by the server and tests -------------------------

    def byte_room(self) -> int | None:
        """Bytes of request bodies batch.maxQueuedBytes leaves room for now (None: no bound)."""
        limit = self.scheduler.core.max_queued_bytes
        return None if limit is None else limit - self.scheduler.queued_bytes

    @property
    def core(self) -> Core:
        return self.scheduler.core

    @property
    def mode(self) -> Mode:
        return self.scheduler.mode

    @property
    def max_inflight_batches(self) -> int:
        return self.scheduler.max_inflight_batches

    @property
    def accepting(self) -> bool:
        return self.scheduler.accepting

    @accepting.setter
    def accepting(self, value: bool) -> None:
        self.scheduler.accepting = value

    @property
    def totals(self):
        return self.scheduler.totals

    @property
    def ledger(self):
        return self.scheduler.ledger

    @property
    def breaker(self):
        return self.scheduler.breaker

    @property
    def service_rate(self):
        return self.scheduler.service_rate

    @property
    def last_decision(self) -> SizeDecision | None:
        return self.scheduler.last_decision

    @property
    def inflight_requests(self) -> int:
        """Requests in the engine now (their calls not yet ended)."""
        return self.scheduler.inflight_requests

    @property
    def inflight_batches(self) -> int:
        """Gang batches in the engine now (0 in continuous mode)."""
        return self.scheduler.inflight_batches

    def pending_requests(self) -> int:
        """Requests out of their bins but not yet sent: in formed batches the former
        still holds, or taken and waiting for an admission slot (continuous mode).
        With the bins' depths and ``inflight_requests`` this counts every request
        accepted and not yet ended."""
        return self.scheduler.pending_requests()

    def backlog(self) -> int:
        """Requests accepted and not yet sent to the engine."""
        return self.scheduler.backlog()

    def waiting_by_model(self) -> dict[str, int]:
        """Open requests the engine has not been sent (in bins, or pending), by the
        model each names: binbatch_requests_waiting's sidecar part, read when
        /metrics is scraped (one pass over the open calls then, none per step)."""
        counts: dict[str, int] = {}
        for call in self._calls.values():
            if call.dispatched_at is None:
                model = call.engine_request.params.model
                counts[model] = counts.get(model, 0) + 1
        return counts

    def unstarted_by_model(self) -> dict[str, int]:
        """Open requests sent to the engine with no token seen yet, by model: what may
        wait in the engine's own queue now (``MetricsFeed.own``)."""
        counts: dict[str, int] = {}
        for req, call in self._calls.items():  # a token: a stream's delta, or the KV plan's progress
            if call.dispatched_at is not None and call.first_token_at is None and not req.engine_generated:
                model = call.engine_request.params.model
                counts[model] = counts.get(model, 0) + 1
        return counts

    def sent_by_model(self) -> dict[str, int]:
        """Requests sent to the engine so far, by model (only grows; a copy)."""
        return dict(self._sent)

    # -- intake ---------------------------------------------------------------------

    def submit(self, req: Request, call: Call) -> int:
        """Queue ``req``; returns its bin.  Raises ``Rejected`` when draining or full."""
        try:
            bin_ = self.scheduler.submit(req)
        except Rejected:
            if self.accepting:
                self._child(self.metrics.requests, "rejected").inc()
            self._child(self.metrics.tenant_rejected, self.metrics.tenant_label(req.tenant)).inc()
            raise
        self._calls[req] = call
        self.metrics.accepted.inc()
        self._idle.clear()
        self._wake.set()
        return bin_

    def cancel(self, req: Request) -> None:
        """The caller went away (cancelled or its deadline passed): drop or abort it.

        A request still queued leaves its bin; one taken but not admitted is skipped
        at admission; one in the engine has its task cancelled, which closes the
        HTTP request (vLLM aborts it).  Its slot is released by the task's
        done-callback, which runs even if the task never started.
        """
        if req.cancelled and not self.scheduler.is_open(req):
            return
        call = self._calls.get(req)
        outcome = self.scheduler.cancel(req, self.clock.now())
        if call is not None and call.task is not None and not call.task.done():
            call.task.cancel()
        if outcome == "expired":
            self._resolve(req, outcome, exc=Rejected("deadline", "the deadline passed"))
        elif outcome == "cancelled":
            self._resolve(req, outcome, exc=Rejected("cancelled", "the caller cancelled the request"))
        self._wake.set()

    # -- the loop ------------------------------------------------------------------

    async def run(self) -> None:
        """Dispatch until cancelled."""
        while True:
            self._wake.clear()
            self._step()
            wake_at = self.scheduler.next_wake()
            await self._wake.wait(None if wake_at is None else max(0.0, wake_at - self.clock.now()))

    def _step(self) -> None:
        """One pass: let the scheduler decide, then start what it dispatched."""
        now = self.clock.now()
        decided = self.scheduler.step(now)
        for req in decided.expired:
            self._resolve(req, "expired", exc=Rejected("deadline", "deadline passed while queued"))
        for batch in decided.batches:
            label = str(batch.bin)
            self._child(self.metrics.batches, label, batch.reason).inc()
            self._child(self.metrics.batch_size, label).observe(batch.size)
        for d in decided.dispatches:
            self._start(d, now)
        if self.core.former.k > self._depth_bins:
            self._publish_queue()
        if self.scheduler.idle():
            self._idle.set()

    def _start(self, d: Dispatch, now: float) -> None:
        calls = []
        ordered_there = self.core.admission.engine_priority and not d.slot.batch
        for req in d.requests:
            call = self._calls[req]
            call.dispatched_at = now
            calls.append(call)
            model = call.engine_request.params.model
            self._sent[model] = self._sent.get(model, 0) + 1
            self.metrics.wait.observe(max(0.0, now - req.arrival))
            self._child(self.metrics.tenant_admitted, self.metrics.tenant_label(req.tenant)).inc()
            if ordered_there:  # the engine orders its queue: tell it where this one goes
                key = engine_priority(req, self._tpot, self._epoch)
                call.engine_request.params = replace(call.engine_request.params, priority=key)
        if d.slot.batch:
            self._spawn(self._run_gang(list(d.requests), calls), d.slot)
        else:
            calls[0].task = self._spawn(self._run_single(d.requests[0], calls[0], d.batch.size), d.slot)

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
        orphans, released = self.scheduler.release(slot, self.clock.now())
        for req in orphans:
            if task.cancelled():
                self._finish(req, "unavailable", exc=Rejected("unavailable", STOPPED))
            else:
                why = f"dispatch failed: {error}" if error else "the engine call ended without an answer"
                self._finish(req, "failed", exc=EngineError("internal", None, why))
        if released:
            self._wake.set()

    # -- engine calls ----------------------------------------------------------------

    async def _run_gang(self, live: list[Request], calls: list[Call]) -> None:
        """One gang batch; it holds a slot that ``_ended`` releases."""
        try:
            requests = [c.engine_request for c in calls]
            results = await self.client.complete_batch(requests, timeout=self.engine_timeout)
            for req, call, result in zip(live, calls, results, strict=True):
                self._complete(req, call, result, len(live))
        except asyncio.CancelledError:
            for req in live:
                self._finish(req, "unavailable", exc=Rejected("unavailable", STOPPED))
            raise
        except Exception as exc:  # a bug, not an engine answer: fail the batch, keep serving
            log.exception("batch of %d failed", len(live))
            for req in live:
                self._finish(req, "failed", exc=EngineError("internal", None, f"dispatch failed: {exc}"))

    async def _run_single(self, req: Request, call: Call, batch_size: int) -> None:
        """One request's own engine call (continuous mode); it holds a slot that ``_ended`` releases.

        A streaming caller's call streams; so does a unary one's while the KV plan
        is on (``memory.admission: Projected``) and wants its progress
        (``Scheduler.reads_progress``): the plan reads each answer's progress from
        the stream's chunks (the tokens it has produced condition what remains,
        kv_plan.py), and the text is reassembled for the caller."""
        try:
            if call.deltas is not None or (self.scheduler.core.kv_plan is not None and req.progress_read):
                result: EngineResult | EngineError | None = None
                req.engine_generated = req.engine_prompt_tokens = None  # a requeued request starts over
                try:
                    async for item in self.client.stream(call.engine_request, timeout=self.engine_timeout,
                                                         on_progress=functools.partial(self._progress, req)):  # fmt: skip
                        if isinstance(item, EngineResult):
                            result = item
                        elif call.deltas is not None:
                            if call.first_token_at is None:
                                self._first_token(req, call)
                            call.deltas.put_nowait(item.text)
                except EngineError as exc:
                    result = exc
                if result is None:
                    result = EngineError("internal", None, "the engine's stream ended without a result")
            else:
                result = (await self.client.complete_batch([call.engine_request], timeout=self.engine_timeout))[0]
            self._complete(req, call, result, batch_size)
        except asyncio.CancelledError:
            if req.cancelled:
                return  # cancel() already finished it
            self._finish(req, "unavailable", exc=Rejected("unavailable", STOPPED))
            raise
        except Exception as exc:
            log.exception("request failed in dispatch", extra={"request_id": req.id})
            self._finish(req, "failed", exc=EngineError("internal", None, f"dispatch failed: {exc}"))

    def _progress(self, req: Request, generated: int, prompt_tokens: int | None) -> None:
        """A streamed chunk's progress, for the KV plan (``Scheduler._inflight_left``); the first
        chunk's prompt count teaches the plan its prompt scale (``Scheduler.prompt_counted``), and a
        scale that moved may let more of the queue in: the loop looks again."""
        req.engine_generated = generated
        if prompt_tokens is not None:
            req.engine_prompt_tokens = prompt_tokens
            if not req.prompt_counted:  # its first chunk: the plan may learn from it, and from a scrape now
                if self.scheduler.prompt_counted(req, prompt_tokens):
                    self._wake.set()
                if self.scrape_soon is not None and self.scheduler.usage_wanted():
                    self.scrape_soon()

    def _complete(self, req: Request, call: Call, result: EngineResult | EngineError, batch_size: int) -> None:
        """Hand the engine's answer to the scheduler; answer the caller as it decides."""
        sched = self.scheduler
        state = sched.breaker.state
        now = self.clock.now()
        if isinstance(result, EngineError):
            outcome = Outcome(unavailable=result.kind == "unavailable", sent=result.sent, outage=outage_reason(result))
        else:
            outcome = Outcome(completion_tokens=float(result.completion_tokens), prompt_tokens=result.prompt_tokens)
        verdict = sched.complete(req, outcome, now)
        self._maybe_refit()
        if sched.breaker.state != state:
            self._breaker_changed()
        if verdict == "requeued":
            call.dispatched_at = None  # queued again: waiting, not in the engine
            self.metrics.requeued.inc()
            self._wake.set()
        elif verdict == "failed":
            assert isinstance(result, EngineError)
            self._resolve(req, "failed", exc=result)
        if isinstance(result, EngineError):
            return
        actual = float(result.completion_tokens)
        predicted = req.predicted_tokens if req.predicted_tokens is not None else actual
        self.metrics.predicted_tokens.observe(predicted)
        self.metrics.actual_tokens.observe(actual)
        started = call.dispatched_at if call.dispatched_at is not None else now
        self.metrics.service.observe(max(0.0, now - started))
        if verdict == "completed":
            completion = Completion(
                result=result,
                queue_seconds=max(0.0, started - req.arrival),
                engine_seconds=max(0.0, now - started),
                bin=req.bin or 0,
                batch_size=batch_size,
                predicted_tokens=predicted,
            )
            self._observe_latency(req, call, now)
            self._resolve(req, "completed", result=completion)

    def _maybe_refit(self) -> None:
        """A learned predictor with enough new completions: fit a new model in a worker
        thread (seconds of CPU: never on the event loop), then swap it in whole."""
        predictor = self.core.predictor
        if isinstance(predictor, LearnedPredictor) and predictor.refit_due():
            self._refit = asyncio.get_running_loop().create_task(self._fit(predictor, *predictor.training_set()))

    async def _fit(self, predictor: LearnedPredictor, features: list, tokens: list[float]) -> None:
        started = self.clock.now()
        try:
            model = await asyncio.to_thread(fit_length_model, features, tokens, prior=predictor.prior)
        except Exception:  # noqa: BLE001 - a failed fit keeps the running model
            log.exception("length model refit on %d records failed; keeping the running model", len(tokens))
            self.metrics.predictor_refits.labels("failed").inc()
            predictor.install(None, self.clock.now())
            return
        predictor.install(model, self.clock.now())
        self.metrics.predictor_refits.labels("installed").inc()
        log.info("length model v%d installed: fitted on %d records in %.1f s", model.version, len(tokens),
                 self.clock.now() - started)  # fmt: skip

    def _first_token(self, req: Request, call: Call) -> None:
        """A stream's first delta: its TTFT, from acceptance (both doors share this path)."""
        call.first_token_at = now = self.clock.now()
        model = self.metrics.model_label(call.engine_request.params.model)
        self._child(self.metrics.ttft, model).observe(max(0.0, now - req.arrival))

    def _observe_latency(self, req: Request, call: Call, now: float) -> None:
        """A completed request's E2E from acceptance; its TTFT too when no delta came
        first (not streamed, or gang mode: the whole answer is its first token)."""
        model = self.metrics.model_label(call.engine_request.params.model)
        e2e = max(0.0, now - req.arrival)
        self._child(self.metrics.e2e, model).observe(e2e)
        if call.first_token_at is None:
            self._child(self.metrics.ttft, model).observe(e2e)

    def _finish(
        self, req: Request, outcome: str, *, result: Completion | None = None, exc: BaseException | None = None
    ) -> bool:
        """End ``req`` exactly once; later calls for the same request do nothing (False)."""
        if not self.scheduler.end(req, outcome):
            return False
        self._resolve(req, outcome, result=result, exc=exc)
        return True

    def _resolve(
        self, req: Request, outcome: str, *, result: Completion | None = None, exc: BaseException | None = None
    ) -> None:
        """Answer the caller of ``req``, which the scheduler has just ended."""
        self._child(self.metrics.requests, outcome).inc()
        call = self._calls.pop(req, None)
        if call is None or call.future.done():
            return
        if exc is not None:
            call.future.set_exception(exc)
            call.future.exception()  # mark it retrieved: a caller that left must not log "never retrieved"
        else:
            call.future.set_result(result)
        if call.deltas is not None:
            call.deltas.put_nowait("")  # wakes a streaming reader to see the end

    # -- engine health ----------------------------------------------------------------

    def on_engine_health(self, ok: bool) -> None:
        """A health probe's result (the sidecar probes every second): opens the
        breaker, or lets it try the engine again (half-open)."""
        if self.scheduler.on_engine_health(ok, self.clock.now()):
            self._breaker_changed()

    def _breaker_changed(self) -> None:
        b = self.breaker
        now = self.clock.now()
        if b.state == "open":
            log.warning("engine circuit open: dispatch held, %d requests queued (%s)", self.backlog(), b.reason)
        else:
            log.info("engine circuit %s after %.1f s", b.state.replace("_", "-"), b.open_seconds(now))
        self._publish_breaker()
        self._wake.set()

    # -- sizing ----------------------------------------------------------------------

    def on_snapshot(self, snapshot: EngineSnapshot | None) -> SizeDecision:
        """Recompute B_t from a metrics snapshot (None: no metrics source)."""
        if snapshot is not None and snapshot.fresh and snapshot.tpot_seconds:
            self._tpot = snapshot.tpot_seconds  # the engine's pace, whoever's tokens it was
        decision, changes = self.scheduler.on_snapshot(snapshot, self.clock.now())
        sla = self.scheduler.core.sizer.sla
        if sla is not None and sla.infeasible != self._sla_infeasible:
            self._sla_infeasible = sla.infeasible
            if sla.infeasible:
                log.warning("the TPOT SLO (%.1f ms) is beyond the engine even at %d running: the batch size no "
                            "longer shrinks for it until a TPOT within it is seen (%s)", sla.d_sla * 1e3, sla.b_min,
                            decision.detail)  # fmt: skip
            else:
                log.info("the engine's TPOT is within the SLO (%.1f ms) again: the batch size follows it",
                         sla.d_sla * 1e3)  # fmt: skip
        for change in changes:
            if change.field == "batchSize":
                self.metrics.size_changes.labels(decision.reason).inc()
            self._adjust(change)
        self._publish_sizes()
        self._wake.set()
        return decision

    def _adjust(self, c: Change) -> None:
        """Record an adjustment (Stats keeps every one).  The log gets an INFO line when
        the kind of reason changes, else at most one per ``ADJUSTMENT_LOG_SECONDS``
        per field: under load the memory-bound size moves by a request or two on
        every scrape, which is news in Stats and metrics but noise in the log."""
        t = self._wall_time() if self._wall_time else self.clock.now()
        self.adjustments.append(Adjustment(t, c.field, c.old, c.new, c.reason))
        now = self.clock.now()
        last = self._logged.get(c.field)
        if last is None or last[1] != c.kind or now - last[0] >= ADJUSTMENT_LOG_SECONDS:
            quiet = f"; {last[2]} more changes since the last report" if last and last[2] else ""
            log.info("adjusted %s: %s -> %s (%s%s)", c.field, c.old, c.new, c.reason, quiet)
            self._logged[c.field] = (now, c.kind, 0)
        else:
            log.debug("adjusted %s: %s -> %s (%s)", c.field, c.old, c.new, c.reason)
            self._logged[c.field] = (last[0], c.kind, last[2] + 1)

    # -- reload and shutdown -----------------------------------------------------------

    def replace_core(self, core: Core, *, mode: Mode, max_inflight_batches: int, engine_timeout: float | None) -> None:
        """Swap in a core built from a new config; queued requests move over in order."""
        self._sla_infeasible = False  # a new sizer searches anew
        self.engine_timeout = engine_timeout
        for req in self.scheduler.replace_core(core, mode=mode, max_inflight_batches=max_inflight_batches):
            self._resolve(req, "rejected", exc=Rejected("resource_exhausted", "queue full after a config reload"))
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
        self.scheduler.start_drain()
        self.metrics.draining.set(1)
        self._wake.set()
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
            return 0
        except TimeoutError:
            pass
        # Count only requests this drain itself ends: a caller already answered (or a
        # slot already released) is not "cut off".
        cut = self.scheduler.cut_queued()
        for req in cut:
            self._resolve(req, "unavailable", exc=Rejected("unavailable", "shut down before dispatch"))
        n = len(cut)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for slot in self.scheduler.held():
            for req in slot.requests:
                n += self._finish(req, "unavailable", exc=Rejected("unavailable", STOPPED))
        await asyncio.gather(*tasks, return_exceptions=True)
        return n

    # -- observability -----------------------------------------------------------------

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once: ``labels()`` validates, hashes
        and takes a lock on every call, several times per request."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _publish_queue(self) -> None:
        """A depth gauge per bin, read when /metrics is scraped (a bin a reload
        removed reads 0).  The step makes the children of new bins only."""
        k = self.core.former.k
        for i in range(self._depth_bins, k):
            self.metrics.queue_depth.labels(str(i)).set_function(lambda i=i: self._bin_depth(i))
        self._depth_bins = max(self._depth_bins, k)

    def _bin_depth(self, i: int) -> int:
        depths = self.core.former.bin_depths()
        return depths[i] if i < len(depths) else 0

    def _publish_breaker(self) -> None:
        for state in STATES:
            self.metrics.breaker_state.labels(state).set(1 if self.breaker.state == state else 0)
        self.metrics.breaker_opens.inc(self.breaker.opens - self._opens_published)
        self._opens_published = self.breaker.opens

    def _publish_sizes(self) -> None:
        core = self.core
        self.metrics.bins.set(core.binner.k)
        plan = core.kv_plan
        budget = None if plan is None else plan.budget
        self.metrics.kv_plan_budget.set(-1 if budget is None else budget)
        self.metrics.kv_plan_shared.set(0 if plan is None else plan.shared_blocks)
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

    def _learned_model(self, attr: str, none: float) -> float:
        p = self.core.predictor
        model = p.model if isinstance(p, LearnedPredictor) else None
        return none if model is None else float(getattr(model, attr))

    def _warm_start_loaded(self) -> float:
        p = self.core.predictor
        p = p.inner if isinstance(p, ExternalFirst) else p
        if not isinstance(p, LearnedPredictor) or not p.warm_start:
            return -1.0
        return 1.0 if p.prior is not None else 0.0

    def _model_age(self) -> float:
        p = self.core.predictor
        if not isinstance(p, LearnedPredictor) or p.model is None or p.installed_at is None:
            return -1.0
        return max(0.0, self.clock.now() - p.installed_at)


