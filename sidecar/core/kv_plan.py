"""Projected KV admission: admit a request only if the engine's KV cache will
hold every request in flight until each of them finishes (issue 11, win 3).

vLLM admits a waiting request when the blocks of its prompt are free and
preempts (drops and later recomputes) the newest running request when the
running ones outgrow the cache.  From outside, the sidecar knows for each
request it sent its prompt length, its predicted output length and when it went
in; every running sequence gains one token per engine step.  So the cache's
future use is a known function of the step count s:

    U(s) = Σ_{i : r_i > s} (h_i + s)

with h_i the tokens request i holds now and r_i the tokens it has left.  U grows
between completions and drops at each, so its peak is just before a completion:
max_k Σ_{i : r_i ≥ r_k} (h_i + r_k).  A request is admitted only if that peak,
with it included, stays within the capacity (less a reserve).  This is the seed's
memory constraint (memory-sla-dynamic-batching.md, Eq. 2) per request instead of
in distribution.  The tokens a request holds now are the engine's own count when
its answer is streamed: the sidecar asks vLLM for ``continuous_usage_stats``, so
every chunk says how many tokens it generated and how many it counted in the
prompt (``Request.engine_generated``, ``engine_prompt_tokens``), and such a
sequence is counted in whole KV blocks, exactly, at every future step.  A
request answered in one piece (not streamed) has its tokens generated estimated
from the time since it went in and the engine's recent time per step, less one,
and its prompt from the estimate below, plus the mean block rounding.  So with
known lengths (hints) and streamed answers the plan is exact: the bench's
KV-pressure burst on the embedded engine had 0-1 preemptions a run where direct
had 72, and 3-4 while every count was a time estimate.  With predicted lengths
the engine's own preemption counter tightens the plan (``KvPlan.on_snapshot``).  A prompt's tokens are the sidecar's tokenizer-free
estimate (bytes / 4) scaled by what the engine counted for the prompts of the
requests it answered (``observe_prompt``): on the embedded engine, one token a
word, the raw estimate held a chat prompt at 30 tokens for 24, and the plan's
in-flight total ran ~15% above the engine's own KV usage; the 4096-token
vocabulary of the real-vLLM test model counts the same prompts at 2.35x the
estimate.  Until the engine has counted one prompt the scale is
``PROMPT_SCALE_PRIOR``, 2 bytes a token, the dense end of tokenizers (code,
numbers, non-Latin scripts): too high costs a cold sidecar's first requests a
little concurrency, too low costs preemptions.  Block rounding of an estimated
sequence is covered by counting it at half a block more, the mean of what
rounding up to whole blocks adds (a whole block each, the worst case, held the
bench's KV-pressure burst to about half of direct's throughput; the rare sum past
the mean is what the preemption feedback is for).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

# Weight of each answered request in the prompt-token scale (engine count / estimate),
# and the scale before the first (the estimate is bytes / 4: this is 2 bytes a token).
PROMPT_SCALE_EWMA = 0.1
PROMPT_SCALE_PRIOR = 2.0
# The plan's headroom after the engine reported preemptions, and how fast it comes back.
SHRINK = 0.9
RECOVER = 0.02
FLOOR = 0.5


class Seq(NamedTuple):
    """A sequence in the plan: tokens it holds now, tokens it has left to generate,
    and whether ``held`` is the engine's own count (its stream said so: rounded up
    to whole KV blocks exactly) or an estimate that carries the mean rounding."""

    held: float
    left: float
    exact: bool = False


def peak_tokens(seqs: Iterable[Seq], block: int = 1) -> float:
    """The most KV ``seqs`` hold at once from now until all finish, every one
    gaining a token per step; an ``exact`` one holds whole ``block``-token blocks."""
    items = sorted(((max(s.left, 1.0), s.held, s.exact) for s in seqs), reverse=True)  # longest left first
    peak = 0.0
    held = 0.0  # of the running ones, which all hold h_i + r just before the one with r left finishes
    n = 0
    residues: dict[float, int] = {}  # exact ones by held mod block: what rounding adds depends on it alone
    for r, h, exact in items:
        held += h
        n += 1
        if exact and block > 1:
            key = h % block
            residues[key] = residues.get(key, 0) + 1
        rounding = sum(c * (-(j + r) % block) for j, c in residues.items())
        peak = max(peak, held + n * r + rounding)
    return peak


@dataclass
class KvPlan:
    """The admission test and its feedback.  ``capacity``: KV tokens (η); ``block``:
    tokens per KV block (a sequence may hold up to a block more than its tokens);
    ``reserve``: share of η kept free; ``headroom`` falls by ``SHRINK`` on every
    scrape that saw preemptions and recovers by ``RECOVER`` per clean one."""

    reserve: float = 0.0
    capacity: float | None = None
    block: int = 16
    headroom: float = 1.0
    step_seconds: float | None = None  # the engine's recent time per step (its TPOT)
    preemptions_seen: float = field(default=0.0)
    prompt_scale: float = PROMPT_SCALE_PRIOR  # the engine's prompt tokens per estimated one (``observe_prompt``)
    prompts_seen: int = 0

    def observe_prompt(self, estimated: float, counted: float | None) -> None:
        """The engine counted ``counted`` tokens in a prompt estimated at ``estimated``:
        the mean ratio so far for the first answers (the prior is dropped at the
        first), then a moving average."""
        if counted is None or not (estimated > 0 and counted > 0):
            return
        self.prompts_seen += 1
        weight = max(PROMPT_SCALE_EWMA, 1.0 / self.prompts_seen)
        self.prompt_scale += weight * (counted / estimated - self.prompt_scale)

    def on_snapshot(
        self, capacity: float | None, block: int | None, step: float | None, preempted: float | None
    ) -> None:
        """A fresh metrics snapshot: η, block size, time per step, preemptions since the last."""
        if capacity:
            self.capacity = capacity
        if block:
            self.block = block
        if step:
            self.step_seconds = step
        if preempted:
            self.preemptions_seen += preempted
            self.headroom = max(FLOOR, self.headroom * SHRINK)
        elif preempted is not None:
            self.headroom = min(1.0, self.headroom + RECOVER)

    @property
    def budget(self) -> float | None:
        """Tokens the plan may fill (None: capacity unknown, admit freely)."""
        if self.capacity is None:
            return None
        return self.capacity * (1.0 - self.reserve) * self.headroom

    def held(
        self, prompt: float, predicted: float, elapsed: float, *, generated: int | None = None,
        engine_prompt: int | None = None,
    ) -> Seq:  # fmt: skip
        """A request sent ``elapsed`` seconds ago (``prompt``: its estimated prompt
        tokens, scaled here).  ``generated`` and ``engine_prompt``: what the
        engine's stream said of it (``Request.engine_generated``,
        ``engine_prompt_tokens``); with both its tokens are known exactly."""
        if generated is not None:
            done = float(generated)
        else:
            done = 0.0
            if self.step_seconds and elapsed > 0:  # one step less: it may have started a step late
                done = min(max(math.floor(elapsed / self.step_seconds) - 1, 0), max(predicted - 1.0, 0.0))
        left = max(predicted - done, 1.0)
        if generated is not None and engine_prompt is not None:
            return Seq(engine_prompt + done, left, True)
        return Seq(prompt * self.prompt_scale + done + self.margin, left)

    @property
    def margin(self) -> float:
        """Tokens a sequence holds beyond its own by block rounding, on average."""
        return self.block / 2

    def fits(self, inflight: Iterable[Seq], new: Seq) -> bool:
        """Would the cache hold ``inflight`` and ``new`` to the end?"""
        budget = self.budget
        if budget is None:
            return True
        seqs = list(inflight)
        if not seqs:
            return True  # an empty engine takes anything that fits its context at all
        return peak_tokens([*seqs, new], self.block) <= budget
