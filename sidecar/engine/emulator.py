"""A vLLM-compatible engine emulator (``binbatch emulate-engine``).

It speaks the part of vLLM's OpenAI server that binbatch uses -- ``POST
/v1/completions``, ``POST /v1/chat/completions`` (both with SSE streaming),
``GET /health``, ``GET /v1/models`` and ``GET /metrics`` with vLLM's metric names --
and behind it runs a token-step engine that batches the way vLLM does:

* **Continuous batching.** Each engine step takes τ(b) = a + c·b seconds for b
  running sequences (DESIGN §4), and every running sequence emits one token per step.
  A newly admitted sequence's first step is its prefill and yields its first token.
* **Paged KV cache.** ``num_gpu_blocks`` blocks of ``block_size`` tokens. Before a
  step a sequence must hold ceil((prompt + generated) / block_size) blocks -- the
  tokens whose KV the step computes. Running sequences grow first, in admission
  order; when a block is missing the most recently admitted sequence is preempted
  (recompute mode: its blocks are freed, it goes back to the front of the FIFO
  waiting queue and its prompt and the tokens generated so far are prefilled again
  on readmission; already streamed tokens stand). Waiting sequences are admitted in
  FIFO order while their blocks fit, fewer than ``max_num_seqs`` run and nothing was
  preempted in this step -- the order of vLLM v1's scheduler. Chunked prefill and
  ``max_num_batched_tokens`` are not modelled.
* **Tokens.** The emulated tokenizer counts one token per whitespace-separated word
  of the prompt (a chat prompt is rendered with a tiny template first, see
  :func:`render_chat`; a prompt given as token ids counts its ids). Every output
  token is one word `` <word>`` from :data:`VOCABULARY`.
* **Output length.** Exactly ``max_tokens`` with ``ignore_eos``; otherwise the
  emulated model emits EOS after a pseudo-random number of tokens drawn uniformly
  from [max(1, min_tokens), max_tokens], seeded from the emulator's seed, the
  request's ``seed`` and the prompt -- the same request gives the same answer.
  ``temperature`` and ``top_p`` are validated but do not change the output.
  Stop strings end a sequence (finish_reason "stop") once ``min_tokens`` are out,
  as in vLLM; in a stream, text already sent before a stop string that spans
  tokens is not taken back.
* **Metrics** with vLLM's names and bucket boundaries (see :class:`EmulatorMetrics`),
  or with the pre-0.10 names when ``legacy_names`` is set.

Everything runs on one asyncio loop, without threads. Tests start it in-process::

    async with running_emulator(EmulatorConfig(step_a=0.001)) as base_url:
        ...

and :class:`Emulator` gives access to the engine (peaks, counters) as well.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import random
import signal
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# --------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """How the emulated engine behaves; every field has a CLI flag of the same name."""

    model: str = "emulated"
    """Served model name: the only ``model`` accepted and the ``model_name`` label."""
    step_a: float = 0.002
    """Fixed part a of the step time τ(b) = a + c·b, seconds."""
    step_c: float = 0.0002
    """Per-sequence part c of the step time τ(b) = a + c·b, seconds."""
    num_gpu_blocks: int = 512
    """KV cache blocks."""
    block_size: int = 16
    """Tokens per KV cache block."""
    max_num_seqs: int = 256
    """Most sequences running in one step (vLLM's ``--max-num-seqs``)."""
    max_model_len: int = 2048
    """Longest prompt + output, tokens; must fit in the KV cache, as vLLM requires."""
    legacy_names: bool = False
    """Expose the pre-0.10 metric names (``vllm:gpu_cache_usage_perc``,
    ``vllm:time_per_output_token_seconds``) instead of the current ones."""
    seed: int = 0
    """Seed mixed into every sequence's output length and words."""
    max_request_body_bytes: int = 1024 * 1024
    """Largest request body accepted; a larger one gets HTTP 413 "Maximum request
    body size ... exceeded", as from aiohttp's ``client_max_size`` (1 MiB by default)
    in front of vLLM."""
    receipts_file: str = ""
    """Append every prompt the engine accepts to this file, one JSON string a line, so
    a chaos bench can count prompts sent twice across engine restarts; "" is off."""

    def __post_init__(self) -> None:
        if not self.model or not self.model.strip():
            raise ValueError("model: must be a non-empty name")
        for name in ("step_a", "step_c"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_model_len", "max_request_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)!r}")
        if self.max_model_len > self.kv_capacity_tokens:
            raise ValueError(
                f"max_model_len: {self.max_model_len} tokens do not fit in the KV cache "
                f"({self.num_gpu_blocks} blocks x {self.block_size} = {self.kv_capacity_tokens} tokens)"
            )

    @property
    def kv_capacity_tokens(self) -> int:
        """η = num_gpu_blocks × block_size (DESIGN §3.2)."""
        return self.num_gpu_blocks * self.block_size

    def step_seconds(self, running: int) -> float:
        """τ(b) = a + c·b (DESIGN §4)."""
        return self.step_a + self.step_c * running


# ----------------------------------------------------------------- the token model

VOCABULARY: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was",
    "on", "be", "at", "by", "this", "had", "not", "are", "but", "from", "or", "have",
    "an", "they", "which", "one", "you", "were", "all", "we", "her", "she", "there",
    "would", "their", "will", "when", "who", "him", "been", "has", "more", "if", "no",
    "out", "so", "said", "what", "up", "its", "about", "than", "into", "them", "can",
    "only", "other", "time", "new", "some", "could", "these",
)  # fmt: skip
"""The emulated model's output words."""

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def count_prompt_tokens(text: str) -> int:
    """The emulated tokenizer: one token per whitespace-separated word."""
    return len(text.split())


def render_chat(messages: list[tuple[str, str]]) -> str:
    """A minimal chat template: ``<|role|>`` before each message, then ``<|assistant|>``.

    So a chat prompt costs one token per message plus one, plus its words.
    """
    parts = [f"<|{role}|>\n{content}\n" for role, content in messages]
    return "".join(parts) + "<|assistant|>\n"


def sequence_rng(engine_seed: int, request_seed: int | None, prompt_key: str) -> random.Random:
    """The deterministic source of one sequence's length and words.

    A string seed is hashed with SHA-512 by :mod:`random`, so it does not depend on
    ``PYTHONHASHSEED``: the same request gets the same output in every process.
    """
    return random.Random(f"{engine_seed}|{request_seed}|{prompt_key}")


def eos_position(rng: random.Random, *, max_tokens: int, min_tokens: int, ignore_eos: bool) -> int | None:
    """After how many tokens the emulated model emits EOS; None when EOS is ignored."""
    if ignore_eos:
        return None
    return rng.randint(max(1, min_tokens), max_tokens)


# ----------------------------------------------------------------------- sequences


class SeqStatus(Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class SeqEvent:
    """What a sequence tells its HTTP handler: one token's text, its end, or an error."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


_seq_ids = itertools.count()


@dataclass(eq=False, slots=True)
class Sequence:
    """One prompt being served (vLLM's ``Request`` with n=1)."""

    index: int
    """The choice index in its HTTP request."""
    prompt_tokens: int
    max_tokens: int
    min_tokens: int
    eos_after: int | None
    stop: tuple[str, ...]
    rng: random.Random
    arrival: float
    events: asyncio.Queue[SeqEvent]
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SeqStatus = SeqStatus.WAITING
    blocks: int = 0
    output_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | None = None
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    preemptions: int = 0

    @property
    def context_tokens(self) -> int:
        """Tokens whose KV the next step needs: the prompt and every generated token."""
        return self.prompt_tokens + self.output_tokens

    @property
    def done(self) -> bool:
        return self.status in (SeqStatus.FINISHED, SeqStatus.ABORTED)


def append_token(seq: Sequence) -> str:
    """Generate one token for ``seq``, settle whether it finished, return the new text.

    The checks run in vLLM's order: nothing stops a sequence before ``min_tokens``;
    then EOS ("stop"), stop strings ("stop", with ``stop_reason``), ``max_tokens``
    ("length").
    """
    token = " " + seq.rng.choice(VOCABULARY)
    seq.output_tokens += 1
    before = len(seq.text)
    seq.text += token
    if seq.output_tokens < seq.min_tokens:
        return token
    if seq.eos_after is not None and seq.output_tokens >= seq.eos_after:
        seq.finish_reason = "stop"
    elif (hit := _find_stop(seq.text, seq.stop)) is not None:
        cut, seq.stop_reason = hit
        seq.text = seq.text[:cut]
        seq.finish_reason = "stop"
    elif seq.output_tokens >= seq.max_tokens:
        seq.finish_reason = "length"
    return seq.text[before:]


def _find_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string in ``text``: (where it starts, which one)."""
    hits = [(text.find(s), s) for s in stops if s and s in text]
    return min(hits) if hits else None


# ----------------------------------------------------------------------- scheduler


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step runs, and how the scheduler got there."""

    batch: list[Sequence]
    admitted: list[Sequence]
    preempted: list[Sequence]


class BlockScheduler:
    """vLLM-style continuous batching over a paged KV budget (no I/O, no clock)."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.free_blocks = num_blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def usage(self) -> float:
        """Fraction of KV blocks in use, 0..1 (vLLM's ``kv_cache_usage_perc``)."""
        return self.used_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence) -> int:
        """ceil((prompt + generated) / block_size)."""
        return -(-seq.context_tokens // self.block_size)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue."""
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def schedule(self) -> StepPlan:
        """Grow the running sequences (preempting if needed), then admit waiting ones."""
        preempted = self._grow_running()
        admitted = [] if preempted else self._admit_waiting()
        return StepPlan(batch=list(self.running), admitted=admitted, preempted=preempted)

    def _grow_running(self) -> list[Sequence]:
        """Give every running sequence the blocks of its next step, in admission
        order; preempt from the most recently admitted end when none are free."""
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running):
            if self._reserve(self.running[i]):
                i += 1
                continue
            victim = self.running.pop()  # possibly running[i] itself
            self._preempt(victim)
            preempted.append(victim)
        return preempted

    def _admit_waiting(self) -> list[Sequence]:
        """FIFO admission while blocks and sequence slots last (no skipping ahead)."""
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            if not self._reserve(self.waiting[0]):
                break
            seq = self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _reserve(self, seq: Sequence) -> bool:
        """Allocate the blocks ``seq`` lacks for its next step, if they are free."""
        lacking = self.blocks_needed(seq) - seq.blocks
        if lacking > self.free_blocks:
            return False
        if lacking > 0:
            self.free_blocks -= lacking
            seq.blocks += lacking
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-mode preemption: free the blocks, back to the front of waiting."""
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.free_blocks += seq.blocks
        seq.blocks = 0

    def finish(self, seq: Sequence) -> None:
        """A running sequence is done: free its blocks."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED

    def abort(self, seq: Sequence) -> bool:
        """Drop a sequence wherever it is; False if it had already ended."""
        if seq.done:
            return False
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.ABORTED
        return True

    def drain(self) -> list[Sequence]:
        """Abort everything (shutdown); returns what was aborted."""
        pending = [*self.running, *self.waiting]
        for seq in pending:
            self.abort(seq)
        return pending


# ------------------------------------------------------------------------- metrics

# Bucket boundaries as in vLLM's Prometheus stat logger (vllm/v1/metrics/loggers.py;
# factored out into vllm/v1/metrics/buckets.py in later releases).
TIME_TO_FIRST_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# quantity -> (current name, pre-0.10 name)
METRIC_NAMES: dict[str, tuple[str, str]] = {
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
}

_LABELS = ("model_name", "engine")


class EmulatorMetrics:
    """vLLM's Prometheus metrics in a private registry, labelled like vLLM
    (``model_name``, ``engine="0"``); ``vllm:cache_config_info`` carries the cache
    config as labels (and, as in vLLM, no ``model_name``)."""

    def __init__(self, config: EmulatorConfig, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._labels = {"model_name": config.model, "engine": "0"}
        legacy = int(config.legacy_names)
        self.running = self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = self._gauge(METRIC_NAMES["kv_usage"][legacy], "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = self._counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            [*_LABELS, "finished_reason"], registry=self.registry,
        )  # fmt: skip
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )  # fmt: skip
        self.itl = self._histogram(
            METRIC_NAMES["itl"][legacy], "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )  # fmt: skip
        self.e2e = self._histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.queue_time = self._histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self._cache_config_info(config)

    def _gauge(self, name: str, doc: str) -> Any:
        return Gauge(name, doc, _LABELS, registry=self.registry).labels(**self._labels)

    def _counter(self, name: str, doc: str) -> Any:
        return Counter(name, doc, _LABELS, registry=self.registry).labels(**self._labels)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Any:
        return Histogram(name, doc, _LABELS, registry=self.registry, buckets=buckets).labels(**self._labels)

    def _cache_config_info(self, config: EmulatorConfig) -> None:
        """An info-style gauge fixed at 1, like vLLM's ``log_metrics_info``."""
        info = {
            "block_size": str(config.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "False",
            "gpu_memory_utilization": "0.9",
            "num_gpu_blocks": str(config.num_gpu_blocks),
            "engine": "0",
        }
        gauge = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
                      registry=self.registry)  # fmt: skip
        gauge.labels(**info).set(1)

    def publish_state(self, scheduler: BlockScheduler) -> None:
        """Scheduler gauges, set after every change as vLLM sets them every step."""
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.kv_usage.set(scheduler.usage)

    def request_finished(self, seq: Sequence, now: float) -> None:
        self._success.labels(**self._labels, finished_reason=seq.finish_reason or "abort").inc()
        self.e2e.observe(now - seq.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# -------------------------------------------------------------------------- engine


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
    """The token-step loop: schedule, sleep τ(b), emit one token per running sequence."""

    def __init__(self, config: EmulatorConfig, metrics: EmulatorMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.scheduler = BlockScheduler(config.num_gpu_blocks, config.block_size, config.max_num_seqs)
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
        tau = self.config.step_seconds(len(plan.batch))
        # Steps follow a drift-free timetable; a late loop may catch up one step, no more.
        self._deadline = max(self._deadline, now - tau) + tau
        await asyncio.sleep(max(0.0, self._deadline - now))
        now = loop.time()
        emitted = [seq for seq in plan.batch if seq.status is SeqStatus.RUNNING]
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
        if len(s.running) > s.max_num_seqs or not 0 <= s.free_blocks <= s.num_blocks:
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
        seq.events.put_nowait(SeqEvent(seq.index, text, seq.finish_reason))

    def _publish(self) -> None:
        self.metrics.publish_state(self.scheduler)
        if self._waiters:
            self._wake_waiters()


# ------------------------------------------------------------------ request parsing


class RequestError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def _bad(param: str, message: str) -> RequestError:
    return RequestError(400, f"{param}: {message}", param)


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt: what seeds it and how many tokens it costs."""

    key: str
    tokens: int


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """The validated sampling fields shared by every prompt of a request."""

    max_tokens: int | None
    min_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    ignore_eos: bool
    stream: bool
    include_usage: bool


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated completion or chat request."""

    chat: bool
    prompts: list[Prompt]
    sampling: SamplingSpec


def _int(body: dict[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise _bad(name, f"must be >= {minimum}, got {value}")
    return value


def _number(
    body: dict[str, Any], name: str, default: float, low: float, high: float, low_open: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(name, f"must be a number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise _bad(name, f"must be in {interval}, got {value}")
    return float(value)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"must be true or false, got {value!r}")
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise _bad("stop", f"must be a string or a list of strings, got {value!r}")


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise _bad("stream_options", "must be an object")
    if not stream:
        raise _bad("stream_options", "is only allowed when stream is true")
    return _bool(options, "include_usage", False)


def _reject_unsupported(body: dict[str, Any], chat: bool) -> None:
    """Fields whose silent neglect would change what the client gets back."""
    if body.get("n", 1) != 1:
        raise _bad("n", f"the emulator serves n=1 only, got {body.get('n')!r}")
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of", "the emulator does not support best_of")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise _bad("logprobs", "the emulator does not produce logprobs")
    if not chat and body.get("echo"):
        raise _bad("echo", "the emulator does not echo prompts")


def parse_sampling(body: dict[str, Any], chat: bool) -> SamplingSpec:
    """Validate the sampling fields; a 400 names the first bad one."""
    _reject_unsupported(body, chat)
    max_tokens = _int(body, "max_tokens", None, 1)
    if chat:
        max_tokens = _int(body, "max_completion_tokens", max_tokens, 1)
    min_tokens = _int(body, "min_tokens", 0, 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise _bad("min_tokens", f"must be <= max_tokens ({max_tokens}), got {min_tokens}")
    stream = _bool(body, "stream", False)
    return SamplingSpec(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, math.inf),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        stop=_stop(body),
        seed=_int(body, "seed", None, -(2**63)),
        ignore_eos=_bool(body, "ignore_eos", False),
        stream=stream,
        include_usage=_include_usage(body, stream),
    )


def parse_prompts(value: Any) -> list[Prompt]:
    """``prompt``: a string, a list of strings, a list of token ids or a list of those."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise _bad("prompt", "must be a non-empty string or a non-empty list of prompts")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]
    prompts = []
    for i, item in enumerate(value):
        if isinstance(item, str) and item.strip():
            prompts.append(Prompt(key=item, tokens=count_prompt_tokens(item)))
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            prompts.append(Prompt(key=",".join(map(str, item)), tokens=len(item)))
        else:
            raise _bad(f"prompt[{i}]" if len(value) > 1 else "prompt", "must be non-empty text or token ids")
    return prompts


def parse_messages(value: Any) -> Prompt:
    """``messages``: a list of {role, content}; content is text or a list of text parts."""
    if not isinstance(value, list) or not value:
        raise _bad("messages", "must be a non-empty list of messages")
    rendered: list[tuple[str, str]] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, "must be an object with role and content")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise _bad(f"{where}.role", f"must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        rendered.append((role, _message_text(message.get("content"), f"{where}.content")))
    text = render_chat(rendered)
    return Prompt(key=text, tokens=count_prompt_tokens(text))


def _message_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(f"{where}[{j}]", "the emulator takes text parts only")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad(where, "must be a string or a list of text parts")


def parse_request(body: Any, config: EmulatorConfig, chat: bool) -> ParsedRequest:
    """Validate a request body: 404 for another model, 400 naming a bad field."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    model = body.get("model", config.model)
    if model != config.model:
        raise RequestError(404, f"The model `{model}` does not exist.", "model", "NotFoundError")
    if chat:
        prompts = [parse_messages(body.get("messages"))]
    else:
        prompts = parse_prompts(body.get("prompt"))
    sampling = parse_sampling(body, chat)
    for prompt in prompts:
        _check_context(prompt, sampling, config, "messages" if chat else "prompt")
    return ParsedRequest(chat=chat, prompts=prompts, sampling=sampling)


def _check_context(prompt: Prompt, sampling: SamplingSpec, config: EmulatorConfig, prompt_field: str) -> None:
    """Prompt plus output must fit ``max_model_len``, as vLLM checks."""
    limit = config.max_model_len
    if prompt.tokens >= limit:
        raise _bad(prompt_field, f"this model's maximum context length is {limit} tokens, "
                                 f"the prompt has {prompt.tokens}")  # fmt: skip
    if sampling.max_tokens is not None and prompt.tokens + sampling.max_tokens > limit:
        raise _bad("max_tokens", f"this model's maximum context length is {limit} tokens; you requested "
                                 f"{prompt.tokens + sampling.max_tokens} ({prompt.tokens} in the prompt, "
                                 f"{sampling.max_tokens} for the completion)")  # fmt: skip
    if sampling.min_tokens > limit - prompt.tokens:
        raise _bad("min_tokens", f"must leave room for the prompt in {limit} tokens")


def build_sequences(
    parsed: ParsedRequest, config: EmulatorConfig, arrival: float, events: asyncio.Queue[SeqEvent]
) -> list[Sequence]:
    """One sequence per prompt; without max_tokens a prompt may use the whole context."""
    seqs = []
    s = parsed.sampling
    for index, prompt in enumerate(parsed.prompts):
        max_tokens = s.max_tokens if s.max_tokens is not None else config.max_model_len - prompt.tokens
        rng = sequence_rng(config.seed, s.seed, prompt.key)
        eos = eos_position(rng, max_tokens=max_tokens, min_tokens=s.min_tokens, ignore_eos=s.ignore_eos)
        seqs.append(Sequence(index=index, prompt_tokens=prompt.tokens, max_tokens=max_tokens,
                             min_tokens=s.min_tokens, eos_after=eos, stop=s.stop, rng=rng,
                             arrival=arrival, events=events))  # fmt: skip
    return seqs


# --------------------------------------------------------------------- HTTP: shapes


def usage(seqs: list[Sequence]) -> dict[str, int]:
    prompt = sum(s.prompt_tokens for s in seqs)
    completion = sum(s.output_tokens for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class ResponseShape:
    """The JSON of one request kind (completion or chat), whole or as stream chunks."""

    def __init__(self, chat: bool, model: str, token_ids: bool = False) -> None:
        self.chat = chat
        self.model = model
        self.token_ids = token_ids  # vLLM's ``return_token_ids``: per-choice ids (placeholders here)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def whole(self, seqs: list[Sequence]) -> dict[str, Any]:
        choices = [self._choice(s) for s in seqs]
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage(seqs)
        return body

    def _choice(self, seq: Sequence) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": seq.index}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": seq.text}
        else:
            choice["text"] = seq.text
        choice |= {"logprobs": None, "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}
        if self.token_ids and not self.chat:
            choice["prompt_token_ids"] = list(range(seq.prompt_tokens))
            choice["token_ids"] = list(range(seq.output_tokens))
        return choice

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", choices)

    def role_chunk(self) -> dict[str, Any]:
        """Chat streams open with the assistant role, as vLLM's do."""
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}])  # fmt: skip

    def token_chunk(self, event: SeqEvent) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": event.index}
        if self.chat:
            choice["delta"] = {"content": event.text}
        else:
            choice["text"] = event.text
        choice |= {"logprobs": None, "finish_reason": event.finish_reason}
        return self._chunk([choice])

    def usage_chunk(self, seqs: list[Sequence]) -> dict[str, Any]:
        body = self._chunk([])
        body["usage"] = usage(seqs)
        return body


# ------------------------------------------------------------------ HTTP: handlers

class ReceiptLog:
    """Prompts the engine accepted, appended to ``receipts_file`` as they arrive.

    One ``write`` per line into a file opened for append, so every line already
    written survives a SIGKILL of the emulator and a restarted emulator appends
    after it: the file counts receipts across the engine's lives.
    """

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1, encoding="utf-8") if path else None  # noqa: SIM115 - closed on app cleanup

    def record(self, keys: Iterable[str]) -> None:
        if self._file is not None:
            self._file.write("".join(json.dumps(k) + "\n" for k in keys))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


CONFIG_KEY = web.AppKey("emulator_config", EmulatorConfig)
RECEIPTS_KEY = web.AppKey("emulator_receipts", ReceiptLog)
ENGINE_KEY = web.AppKey("emulator_engine", EmulatedEngine)
METRICS_KEY = web.AppKey("emulator_metrics", EmulatorMetrics)


def _error_response(err: RequestError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


def _unavailable(message: str) -> RequestError:
    return RequestError(503, message, None, "ServiceUnavailableError")


@web.middleware
async def _openai_errors(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    """Domain errors become OpenAI-style JSON in one place."""
    try:
        return await handler(request)
    except RequestError as err:
        return _error_response(err)
    except EngineStopped as err:
        return _error_response(_unavailable(str(err)))


async def _read_json(request: web.Request) -> Any:
    try:
        return await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RequestError(400, "the request body is not valid JSON") from None


async def handle_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    return await _generate(request, chat=False)


async def handle_chat(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    config, engine = request.app[CONFIG_KEY], request.app[ENGINE_KEY]
    body = await _read_json(request)
    parsed = parse_request(body, config, chat)
    events: asyncio.Queue[SeqEvent] = asyncio.Queue()
    seqs = build_sequences(parsed, config, asyncio.get_running_loop().time(), events)
    engine.submit(seqs)
    request.app[RECEIPTS_KEY].record(p.key for p in parsed.prompts)
    shape = ResponseShape(chat, config.model, token_ids=body.get("return_token_ids") is True)
    try:
        if parsed.sampling.stream:
            return await _stream(request, shape, seqs, events, parsed.sampling.include_usage)
        return await _whole(shape, seqs, events)
    finally:
        engine.abort(seqs)  # a client that went away frees its blocks; no-op when done


async def _whole(shape: ResponseShape, seqs: list[Sequence], events: asyncio.Queue[SeqEvent]) -> web.Response:
    open_seqs = len(seqs)
    while open_seqs:
        event = await events.get()
        if event.error is not None:
            raise _unavailable(event.error)
        if event.finish_reason is not None:
            open_seqs -= 1
    return web.json_response(shape.whole(seqs))


async def _stream(
    request: web.Request, shape: ResponseShape, seqs: list[Sequence], events: asyncio.Queue[SeqEvent],
    include_usage: bool,
) -> web.StreamResponse:  # fmt: skip
    """Server-sent events: one chunk per token, the error if the engine stops, [DONE]."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        if shape.chat:
            await _sse(response, shape.role_chunk())
        open_seqs = len(seqs)
        while open_seqs:
            event = await events.get()
            if event.error is not None:
                await _sse(response, _unavailable(event.error).body())
                break
            await _sse(response, shape.token_chunk(event))
            if event.finish_reason is not None:
                open_seqs -= 1
        else:
            if include_usage:
                await _sse(response, shape.usage_chunk(seqs))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left; _generate aborts its sequences
    return response


async def _sse(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")


async def handle_health(request: web.Request) -> web.Response:
    """``GET /health``: 200 while the engine loop runs, 503 once it stopped."""
    if request.app[ENGINE_KEY].accepting:
        return web.Response(status=200)
    return web.Response(status=503)


async def handle_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the one served model."""
    config = request.app[CONFIG_KEY]
    card = {"id": config.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": config.model, "parent": None, "max_model_len": config.max_model_len}  # fmt: skip
    return web.json_response({"object": "list", "data": [card]})


async def handle_metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text exposition."""
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(config: EmulatorConfig) -> web.Application:
    """The aiohttp application; the engine loop starts with the app and stops on shutdown."""
    app = web.Application(middlewares=[_openai_errors], client_max_size=config.max_request_body_bytes)
    metrics = EmulatorMetrics(config)
    engine = EmulatedEngine(config, metrics)
    app[CONFIG_KEY], app[METRICS_KEY], app[ENGINE_KEY] = config, metrics, engine
    app[RECEIPTS_KEY] = ReceiptLog(config.receipts_file)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/metrics", handle_metrics)

    async def start_engine(_: web.Application) -> None:
        engine.start()

    async def stop_engine(_: web.Application) -> None:
        # on_shutdown runs after the listening sockets closed and before open
        # connections are drained, so every pending request gets its 503.
        await engine.stop()

    async def close_receipts(_: web.Application) -> None:
        app[RECEIPTS_KEY].close()

    app.on_startup.append(start_engine)
    app.on_shutdown.append(stop_engine)
    app.on_cleanup.append(close_receipts)
    return app


# ---------------------------------------------------------------- server lifecycle


class Emulator:
    """An emulator serving on ``host:port`` (port 0 picks a free one), as a context manager."""

    def __init__(self, config: EmulatorConfig | None = None, host: str = "127.0.0.1", port: int = 0,
                 shutdown_timeout: float = 5.0) -> None:  # fmt: skip
        self.config = config or EmulatorConfig()
        self.host = host
        self.app = build_app(self.config)
        self._requested_port = port
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=shutdown_timeout)  # fmt: skip
        self.port: int | None = None
        self._stopped = False

    @property
    def engine(self) -> EmulatedEngine:
        return self.app[ENGINE_KEY]

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the emulator is not serving")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> str:
        """Bind, start the engine loop; returns the base URL (with the bound port)."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._requested_port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self.base_url

    async def stop(self) -> None:
        """Stop listening, answer pending requests with 503, stop the loop, close.

        Idempotent: a test may stop the emulator inside its ``async with``.
        """
        if self._stopped:
            return
        self._stopped = True
        await self._runner.cleanup()

    async def __aenter__(self) -> Emulator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


@contextlib.asynccontextmanager
async def running_emulator(config: EmulatorConfig | None = None, host: str = "127.0.0.1",
                           port: int = 0) -> AsyncIterator[str]:  # fmt: skip
    """``async with running_emulator(config) as base_url:`` -- an emulator for a test."""
    async with Emulator(config, host, port) as emulator:
        yield emulator.base_url


async def serve(host: str, port: int, config: EmulatorConfig) -> None:
    """Serve until SIGINT or SIGTERM, then shut down cleanly."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    async with Emulator(config, host, port) as emulator:
        print(f"binbatch emulate-engine: model {config.model!r} on {emulator.base_url} "
              f"(step {config.step_a * 1e3:g} ms + {config.step_c * 1e3:g} ms/seq, "
              f"{config.num_gpu_blocks}x{config.block_size} KV tokens)", file=sys.stderr, flush=True)  # fmt: skip
        handled = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
                handled.append(sig)
        try:
            await stop.wait()
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)


# ----------------------------------------------------------------------------- CLI


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The emulator's flags: ``--host``, ``--port`` and one per :class:`EmulatorConfig` field."""
    d = EmulatorConfig()
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to bind, 0 for any (default 8000)")
    parser.add_argument("--model", "--served-model-name", dest="model", default=d.model,
                        help=f"served model name (default {d.model!r})")  # fmt: skip
    parser.add_argument("--step-a", type=_seconds, default=d.step_a,
                        help=f"fixed step time a in tau(b) = a + c*b, seconds (default {d.step_a})")  # fmt: skip
    parser.add_argument("--step-c", type=_seconds, default=d.step_c,
                        help=f"per-sequence step time c, seconds (default {d.step_c})")  # fmt: skip
    parser.add_argument("--num-gpu-blocks", type=_positive_int, default=d.num_gpu_blocks,
                        help=f"KV cache blocks (default {d.num_gpu_blocks})")  # fmt: skip
    parser.add_argument("--block-size", type=_positive_int, default=d.block_size,
                        help=f"tokens per KV block (default {d.block_size})")  # fmt: skip
    parser.add_argument("--max-num-seqs", type=_positive_int, default=d.max_num_seqs,
                        help=f"most sequences per step (default {d.max_num_seqs})")  # fmt: skip
    parser.add_argument("--max-model-len", type=_positive_int, default=d.max_model_len,
                        help=f"longest prompt + output in tokens (default {d.max_model_len})")  # fmt: skip
    parser.add_argument("--legacy-names", action="store_true",
                        help="expose vLLM's pre-0.10 metric names (gpu_cache_usage_perc, "
                             "time_per_output_token_seconds)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=d.seed, help=f"output seed (default {d.seed})")
    parser.add_argument("--max-request-body-bytes", type=_positive_int, default=d.max_request_body_bytes,
                        help=f"largest request body; larger ones get HTTP 413 (default {d.max_request_body_bytes})")  # fmt: skip
    parser.add_argument("--receipts-file", default=d.receipts_file, metavar="FILE",
                        help="append every accepted prompt to FILE, one JSON string a line (default: off)")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    """An :class:`EmulatorConfig` from parsed flags (raises ValueError naming a field)."""
    return EmulatorConfig(**{f.name: getattr(args, f.name) for f in fields(EmulatorConfig)})


def run_from_args(args: argparse.Namespace) -> int:
    """Run the emulator until interrupted; the exit status."""
    try:
        config = config_from_args(args)
    except ValueError as err:
        print(f"binbatch emulate-engine: {err}", file=sys.stderr)
        return 2
    asyncio.run(serve(args.host, args.port, config))
    return 0


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``emulate-engine`` on a ``binbatch`` subparsers object; it sets ``func``."""
    parser = subparsers.add_parser(
        "emulate-engine", help="run a vLLM-compatible engine emulator (OpenAI API, /metrics, KV blocks)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )  # fmt: skip
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m binbatch_sidecar.engine.emulator [flags]``."""
    parser = argparse.ArgumentParser(
        prog="binbatch emulate-engine", description="A vLLM-compatible engine emulator."
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
