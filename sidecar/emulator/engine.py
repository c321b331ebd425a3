"""The engine loop: one asyncio task stepping every running sequence by one token."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from .config import EmulatorConfig
from .kv_blocks import BlockScheduler, StepPlan
from .metrics import EmulatorMetrics
from .model import SeqEvent, SeqStatus, Sequence, append_token


def step_seconds(config: EmulatorConfig, plan: StepPlan) -> float:
    """How long the step ``plan`` takes: every sequence in its batch decodes or
    prefills (a chunk of) its prompt (a preempted one's prompt and generated tokens again)."""
    return config.step_seconds(len(plan.batch), plan.prefill_tokens)


class EngineStopped(Exception):
    """The engine is shutting down and takes no more work."""


@dataclass(slots=True)
class EngineStats:
    """What the engine has done, for tests and the demo (not exported as metrics)."""

    steps: int = 0
    submitted: int = 0
    finished: int = 0
    preemptions: int = 0
    peak_running: int = 0
    peak_kv_usage: float = 0.0


class EmulatedEngine:
    """The token-step loop: schedule, sleep the step time, emit one token per running sequence."""

    def __init__(self, config: EmulatorConfig, metrics: EmulatorMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.scheduler = BlockScheduler(config.num_gpu_blocks, config.block_size, config.max_num_seqs,
                                        priority=config.scheduling_policy == "priority",
                                        prefix_caching=config.enable_prefix_caching,
                                        max_num_batched_tokens=config.max_num_batched_tokens)  # fmt: skip
        self.stats = EngineStats()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._deadline = 0.0
        self._waiters: list[tuple[Callable[[EmulatedEngine], bool], asyncio.Future[None]]] = []

    # -- lifecycle

    @property
    def loop_task(self) -> asyncio.Task[None] | None:
        return self._task

    @property
    def idle(self) -> bool:
        """Nothing running or waiting."""
        return not (self.scheduler.running or self.scheduler.waiting)

    @property
    def accepting(self) -> bool:
        return not self._closed and self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the step loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="emulated-engine")
            self._task.add_done_callback(self._on_loop_exit)

    async def stop(self) -> None:
        """Refuse new work, fail every pending sequence (503), cancel and await the loop."""
        self._closed = True
        self._fail_pending("the engine is shutting down")
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        """If the loop dies of a bug, nobody may wait forever."""
        self._closed = True
        if not task.cancelled() and task.exception() is not None:
            self._fail_pending(f"engine loop failed: {task.exception()!r}")

    def _fail_pending(self, reason: str) -> None:
        for seq in self.scheduler.drain():
            seq.events.put_nowait(SeqEvent(seq.index, error=reason))
        self._publish()

    # -- requests

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue the sequences of one HTTP request (FIFO behind everything waiting)."""
        if not self.accepting:
            raise EngineStopped("the engine is shutting down")
        for seq in seqs:
            self.scheduler.add(seq)
        self.stats.submitted += len(seqs)
        self._publish()
        self._wake.set()

    def abort(self, seqs: list[Sequence]) -> None:
        """Drop sequences whose client went away."""
        if any([self.scheduler.abort(seq) for seq in seqs]):
            self._publish()

    async def wait_for(self, condition: Callable[[EmulatedEngine], bool]) -> None:
        """Resolve once ``condition(engine)`` holds; it is checked after every change of
        state, so tests and the demo synchronise on events, not on sleeps."""
        if condition(self):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((condition, fut))
        await fut

    def _wake_waiters(self) -> None:
        pending = []
        for condition, fut in self._waiters:
            if fut.done():
                continue
            if condition(self):
                fut.set_result(None)
            else:
                pending.append((condition, fut))
        self._waiters = pending

    # -- the step loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.idle:
                self._wake.clear()
                await self._wake.wait()
                self._deadline = loop.time()
                continue
            await self._step(loop)

    async def _step(self, loop: asyncio.AbstractEventLoop) -> None:
        """One engine iteration."""
        plan = self.scheduler.schedule()
        now = loop.time()
        self._account_schedule(plan, now)
        if not plan.batch:  # cannot happen while max_model_len fits the cache; never spin
            self._wake.clear()
            await self._wake.wait()
            return
        tau = step_seconds(self.config, plan)
        # Steps follow a drift-free timetable; a late loop may catch up one step, no more.
        self._deadline = max(self._deadline, now - tau) + tau
        await asyncio.sleep(max(0.0, self._deadline - now))
        now = loop.time()
        emitted = [seq for seq in plan.emits if seq.status is SeqStatus.RUNNING]
        for seq in emitted:
            self._emit(seq, now)
        self.metrics.generation_tokens.inc(len(emitted))
        self.stats.steps += 1
        self._publish()

    def _account_schedule(self, plan: StepPlan, now: float) -> None:
        for seq in plan.admitted:
            if seq.scheduled_at is None:
                seq.scheduled_at = now
                self.metrics.queue_time.observe(now - seq.arrival)
        if plan.preempted:
            self.stats.preemptions += len(plan.preempted)
            self.metrics.preemptions.inc(len(plan.preempted))
        self.stats.peak_running = max(self.stats.peak_running, len(plan.batch))
        self.stats.peak_kv_usage = max(self.stats.peak_kv_usage, self.scheduler.usage)
        self._check_invariants()
        self._publish()

    def _check_invariants(self) -> None:
        s = self.scheduler
        if len(s.running) > s.max_num_seqs or not 0 <= s.free_blocks <= s.usable_blocks:
            raise AssertionError(f"scheduler invariant broken: {len(s.running)} running, {s.free_blocks} free")

    def _emit(self, seq: Sequence, now: float) -> None:
        """Give ``seq`` its token of this step and tell its handler."""
        text = append_token(seq)
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.metrics.ttft.observe(now - seq.arrival)
            self.metrics.prompt_tokens.inc(seq.prompt_tokens)
        else:
            self.metrics.itl.observe(now - (seq.last_token_at or now))
        seq.last_token_at = now
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
            self.stats.finished += 1
            self.metrics.request_finished(seq, now)
        seq.events.put_nowait(SeqEvent(seq.index, text, seq.finish_reason, tokens=seq.output_tokens))

    def _publish(self) -> None:
        self.metrics.publish_state(self.scheduler)
        if self._waiters:
            self._wake_waiters()
