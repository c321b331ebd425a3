"""vLLM's scheduler in miniature: paged KV blocks, FIFO (or priority) admission,
recompute preemption, and (with a token budget) chunked prefill."""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

from .model import SeqStatus, Sequence


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one step runs, and how the scheduler got there."""

    batch: list[Sequence]
    admitted: list[Sequence]
    preempted: list[Sequence]
    prefill_tokens: int = 0
    """Tokens this step prefills: every admitted sequence's prompt and, for one
    preempted before, the tokens it had generated (recompute) -- with a token
    budget, only the chunk of them that fits this step."""
    emitting: list[Sequence] | None = None
    """The sequences this step gives a token: those decoding and those whose prefill
    ends in it (None: the whole batch -- every prefill fits its first step)."""

    @property
    def emits(self) -> list[Sequence]:
        return self.batch if self.emitting is None else self.emitting


class BlockScheduler:
    """vLLM-style continuous batching over a paged KV budget (no I/O, no clock)."""

    def __init__(
        self, num_blocks: int, block_size: int, max_num_seqs: int, *, priority: bool = False,
        prefix_caching: bool = False, max_num_batched_tokens: int = 0,
    ) -> None:  # fmt: skip
        if num_blocks < 2:
            raise ValueError(f"num_blocks: must be >= 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        # vLLM v1's BlockPool holds one block back as its null block (never given to
        # a sequence), and its usage gauge counts the others
        self.usable_blocks = num_blocks - 1
        self.free_blocks = self.usable_blocks
        # vLLM's --scheduling-policy priority: waiting in (priority, arrival) order, the largest preempted
        self.priority = priority
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # vLLM's prefix cache: a full prompt block (its key, ``Sequence.prefix``) is held once
        # for every running sequence whose prompt begins with it; the count of those sequences
        self.prefix_caching = prefix_caching
        self.block_refs: dict[int, int] = {}
        # vLLM's --max-num-batched-tokens: the tokens one step computes (a decode is one, a
        # prefill its prompt), running sequences first; a prefill larger than what is left is
        # chunked over steps (vLLM v1's chunked prefill).  0: no budget, every prefill whole.
        self.max_num_batched_tokens = max_num_batched_tokens

    @property
    def used_blocks(self) -> int:
        return self.usable_blocks - self.free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable KV blocks in use, 0..1 (vLLM's ``kv_cache_usage_perc``)."""
        return self.used_blocks / self.usable_blocks

    def blocks_needed(self, seq: Sequence) -> int:
        """ceil((prompt + generated) / block_size)."""
        return -(-seq.context_tokens // self.block_size)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue (priority: in its place)."""
        seq.status = SeqStatus.WAITING
        if self.priority:
            self._insert(seq)
        else:
            self.waiting.append(seq)

    def _insert(self, seq: Sequence) -> None:
        """Put ``seq`` among the waiting ones by (priority, arrival)."""
        keys = [s.priority_key for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.priority_key), seq)

    def schedule(self) -> StepPlan:
        """Grow the running sequences (preempting if needed), then admit waiting ones;
        with a token budget, hand it out in that order (``_chunk``)."""
        preempted = self._grow_running()
        admitted = [] if preempted else self._admit_waiting()
        if not self.max_num_batched_tokens:
            prefill = sum(seq.prefill_left for seq in admitted)
            for seq in admitted:
                seq.prefill_left = 0
            return StepPlan(batch=list(self.running), admitted=admitted, preempted=preempted, prefill_tokens=prefill)
        return self._chunk(admitted, preempted)

    def _chunk(self, admitted: list[Sequence], preempted: list[Sequence]) -> StepPlan:
        """vLLM v1's token budget: running sequences in order, then those just admitted,
        each takes what its step computes -- one token to decode, the rest of its prefill
        -- or what is left of the budget; a sequence the budget does not reach waits a step
        (it keeps its blocks), one whose prefill is cut emits nothing until it ends."""
        budget = self.max_num_batched_tokens
        batch: list[Sequence] = []
        emitting: list[Sequence] = []
        prefill = 0
        for seq in self.running:  # the just admitted are at its end, in admission order
            if budget <= 0:
                break
            if not seq.prefill_left:  # decoding: one token
                budget -= 1
                batch.append(seq)
                emitting.append(seq)
                continue
            take = min(seq.prefill_left, budget)
            budget -= take
            prefill += take
            seq.prefill_left -= take
            batch.append(seq)
            if not seq.prefill_left:
                emitting.append(seq)
        return StepPlan(batch=batch, admitted=admitted, preempted=preempted, prefill_tokens=prefill,
                        emitting=emitting)  # fmt: skip

    def _grow_running(self) -> list[Sequence]:
        """Give every running sequence the blocks of its next step, in admission
        order; preempt from the most recently admitted end when none are free
        (priority: the running one with the largest (priority, arrival))."""
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running):
            if self._reserve(self.running[i]):
                i += 1
                continue
            if self.priority:
                victim = max(self.running, key=lambda s: s.priority_key)
                if self.running.index(victim) < i:
                    i -= 1
                self.running.remove(victim)
            else:
                victim = self.running.pop()  # possibly running[i] itself
            self._preempt(victim)
            preempted.append(victim)
        return preempted

    def _admit_waiting(self) -> list[Sequence]:
        """FIFO admission while blocks and sequence slots last (no skipping ahead), and,
        with a token budget, while some of it is left after the running sequences'."""
        admitted: list[Sequence] = []
        budget = self._budget_left()
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            if not self._reserve(self.waiting[0]):
                break
            seq = self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.prefill_left = seq.context_tokens - seq.cached_tokens
            if self.max_num_batched_tokens:
                budget -= seq.prefill_left
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _budget_left(self) -> float:
        """What the running sequences leave of the step's token budget (no budget: unbounded)."""
        if not self.max_num_batched_tokens:
            return math.inf
        return self.max_num_batched_tokens - sum(seq.prefill_left or 1 for seq in self.running)

    def _reserve(self, seq: Sequence) -> bool:
        """Allocate the blocks ``seq`` lacks for its next step, if they are free."""
        if self.prefix_caching and seq.prefix and not seq.cached and not seq.blocks:
            return self._admit_prefix(seq)
        lacking = self.blocks_needed(seq) - seq.blocks - len(seq.cached)
        if lacking > self.free_blocks:
            return False
        if lacking > 0:
            self.free_blocks -= lacking
            seq.blocks += lacking
        return True

    def _admit_prefix(self, seq: Sequence) -> bool:
        """Admission with the prefix cache: the leading prompt blocks some running
        sequence holds already are shared (their tokens not prefilled again); the rest
        of the prompt's full blocks are allocated and shared from now on."""
        hits = 0
        while hits < len(seq.prefix) and seq.prefix[hits] in self.block_refs:
            hits += 1
        lacking = self.blocks_needed(seq) - hits
        if lacking > self.free_blocks:
            return False
        for key in seq.prefix:
            self.block_refs[key] = self.block_refs.get(key, 0) + 1
        self.free_blocks -= lacking
        seq.cached = list(seq.prefix)
        seq.blocks = lacking - (len(seq.prefix) - hits)
        seq.cached_tokens = min(hits * self.block_size, seq.context_tokens - 1)  # vLLM computes one token at least
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-mode preemption: free the blocks, back to the front of waiting
        (priority: back in its place, ahead of every later arrival of its priority)."""
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.preemptions += 1
        if self.priority:
            self._insert(seq)
        else:
            self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.free_blocks += seq.blocks
        seq.blocks = 0
        for key in seq.cached:  # a shared block is freed with the last sequence that holds it
            left = self.block_refs[key] - 1
            if left:
                self.block_refs[key] = left
            else:
                del self.block_refs[key]
                self.free_blocks += 1
        seq.cached = []
        seq.cached_tokens = 0

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
