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
had 72, and 3-4 while every count was a time estimate.

A predicted length is a distribution (``length_dist.py``), and what a running
request has left is its distribution given the tokens it has produced, so the
plan refines as each answer streams: capacity held for a long prediction is
released when the answer ends short, and one that outran its prediction is
planned on past what it produced.  Uncertain lengths are planned together: at
each future step the plan counts each request's tokens weighted by the chance it
is still running, plus the variance of that, and holds the total's
``PLAN_LEVEL`` upper quantile within the capacity (``peak_tokens``; the seed's
P(Σ tokens > η) ≤ ε, per step) -- not each request at its own upper quantile,
which is the sum of a dozen tail events and held the ShareGPT replay in the
engine model to 0.70x direct's throughput.  A hint is a length known: planned
exactly, as above.  When every length in flight was known, the engine's own
preemption counter tightens the plan (``KvPlan.on_snapshot``).  A prompt's tokens are the sidecar's tokenizer-free
estimate (bytes / 4) scaled by what the engine counted for the prompts of the
requests it served (``observe_prompt``, at each request's first streamed chunk,
which carries the engine's count, or at its answer): on the embedded engine, one token a
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
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import NamedTuple

import numpy as np

from .length_dist import OUTRUN, PLAN_LEVEL, LengthDist

# Weight of each answered request in the prompt-token scale (engine count / estimate),
# and the scale before the first (the estimate is bytes / 4: this is 2 bytes a token).
PROMPT_SCALE_EWMA = 0.1
PROMPT_SCALE_PRIOR = 2.0
# The estimate of the prompt tokens the engine holds once for all (``KvPlan.observe_usage``)
# is the most these last scrapes showed, from at least this many sequences.
SHARED_WINDOW = 8
SHARED_MIN_SEQS = 2
# The plan's headroom after the engine reported preemptions, and how fast it comes back.
SHRINK = 0.9
RECOVER = 0.02
FLOOR = 0.5


class Seq(NamedTuple):
    """A sequence in the plan: tokens it holds now, tokens it has left to generate
    (at the plan's quantile), and whether ``held`` is the engine's own count (its
    stream said so: rounded up to whole KV blocks exactly) or an estimate that
    carries the mean rounding.  ``length``: its predicted output length while its
    end is uncertain, given that it has ``produced`` tokens (None: ``left`` is
    known -- a hint, or an answer that outran every quantile)."""

    held: float
    left: float
    exact: bool = False
    length: LengthDist | None = None
    produced: float = 0.0


# The plan holds the cache's total use at its PLAN_LEVEL quantile: the mean plus this
# many standard deviations (normal approximation over independent lengths).
PLAN_Z = NormalDist().inv_cdf(PLAN_LEVEL)
# The steps at which uncertain sequences are looked at: a geometric grid, each step
# this much past the one before, up to where the longest may still run.
GRID_RATIO = 1.2


def peak_tokens(seqs: Iterable[Seq], block: int = 1) -> float:
    """The most KV ``seqs`` hold at once from now until all finish, every one
    gaining a token per step; an ``exact`` one holds whole ``block``-token blocks.

    Sequences whose ``left`` is known count as they are (the peak is then exact,
    just before a completion).  Each uncertain one counts, at step s, the tokens it
    would hold weighted by the chance it is still running, P(L > g + s | L > g),
    and adds that Bernoulli's variance; the peak is the largest mean + ``PLAN_Z``
    standard deviations over the steps where a known one ends and a geometric grid
    (``GRID_RATIO``) -- the total's upper quantile, not the sum of each one's
    (which held the ShareGPT replay in the engine model to 0.70x direct's
    throughput)."""
    seqs = list(seqs)
    known = [s for s in seqs if s.length is None]
    unsure = [s for s in seqs if s.length is not None]
    steps = {max(s.left, 1.0) for s in known}
    if unsure:  # where the longest may still run: past its top quantile, or at least its plan
        last = max(max(s.length.points[-1] - s.produced, s.left, 1.0) for s in unsure)  # type: ignore[union-attr]
        steps.update((last ** np.linspace(0.0, 1.0, 1 + math.ceil(math.log(last) / math.log(GRID_RATIO)))).tolist())
    if not steps:
        return 0.0
    at = np.array(sorted(steps))
    total = np.zeros(len(at))
    if known:  # each holds h + r at step r while r <= its left, rounded up to whole blocks if exact
        left = np.array([max(s.left, 1.0) for s in known])[:, None]
        tokens = np.array([s.held for s in known])[:, None] + at
        if block > 1:
            tokens += np.array([s.exact for s in known])[:, None] * (-tokens % block)
        total += (tokens * (left >= at)).sum(axis=0)
    if unsure:  # an estimated ``held`` carries its rounding already; an exact one rounds up (block - 1) / 2 on average
        running = np.array([s.length.still_running(at, s.produced) for s in unsure])  # type: ignore[union-attr]
        tokens = np.array([s.held + (block - 1) / 2 * s.exact for s in unsure])[:, None] + at
        total += (tokens * running).sum(axis=0) + PLAN_Z * np.sqrt((tokens**2 * running * (1 - running)).sum(axis=0))
    return float(total.max())


def peak_bound(seqs: Sequence[Seq], block: int = 1) -> float:
    """An upper bound of ``peak_tokens(seqs, block)`` in one pass, without its arrays:
    every sequence at the most it could hold by the last step the peak looks at (an
    exact one a whole block more), each uncertain one as if sure to run, plus
    ``PLAN_Z`` times half the root of their squares (a Bernoulli's standard
    deviation is at most half its value).  Far below the budget, as in a cache with
    room to spare, it answers ``fits`` without the peak (the same answer)."""
    sums = BoundSums(block)
    for s in seqs:
        sums.add(s)
    return sums.value()


class BoundSums:
    """``peak_bound`` as running sums, so a sequence more costs one step, not a pass over all."""

    __slots__ = ("block", "certain", "horizon", "unsure", "held", "squares")

    def __init__(self, block: int = 1) -> None:
        self.block = block
        self.certain = 0.0  # the known ones, each at the most it holds
        self.horizon = 1.0  # the last step the peak looks at
        self.unsure = 0  # uncertain ones: how many, their held tokens and those squared
        self.held = 0.0
        self.squares = 0.0

    def add(self, s: Seq) -> None:
        block = self.block
        if s.length is None:
            left = max(s.left, 1.0)
            self.certain += s.held + left + (block if s.exact and block > 1 else 0)
            self.horizon = max(self.horizon, left)
        else:
            self.horizon = max(self.horizon, s.length.points[-1] - s.produced, s.left)
            held = s.held + (block - 1) / 2 * s.exact
            self.unsure += 1
            self.held += held
            self.squares += held * held

    def plus(self, s: Seq) -> BoundSums:
        """These sums with ``s`` added (these stay as they are)."""
        more = BoundSums(self.block)
        more.certain, more.horizon, more.unsure = self.certain, self.horizon, self.unsure
        more.held, more.squares = self.held, self.squares
        more.add(s)
        return more

    def value(self) -> float:
        """The bound: each uncertain one tops out at held + horizon (sum and root of squares expanded)."""
        if not self.unsure:
            return self.certain
        h, n = self.horizon, self.unsure
        tops = self.held + n * h
        squares = self.squares + 2 * h * self.held + n * h * h
        return self.certain + tops + max(PLAN_Z, 0.0) * 0.5 * math.sqrt(squares)


class InFlight(list):
    """The sequences in flight (``Seq``s, a list) with the sums a pass of admissions reads
    kept as it grows (``append``): ``peak_bound``'s (``KvPlan.fits``) and the tokens they
    are planned to hold (``planned``).  A pass admitting a burst of n then costs O(n), not
    O(n^2) as when each admission listed and bounded everything in flight again.  Only
    ``append`` keeps the sums: it is never changed any other way."""

    def __init__(self, seqs: Iterable[Seq] = (), block: int = 1) -> None:
        super().__init__()
        self.sums = BoundSums(block)
        self.planned = 0.0  # the sum of held + left
        for s in seqs:
            self.append(s)

    def append(self, s: Seq) -> None:
        super().append(s)
        self.sums.add(s)
        self.planned += s.held + s.left


# peak_bound is compared with this share of the budget: its float rounding can never flip an answer
BOUND_SLACK = 1e-9


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
    # the engine's KV usage is read as it is now (its own /metrics), not seconds late through Prometheus:
    # only then does it compare with what the sidecar counts in flight now
    usage_live: bool = True
    shared_seen: deque[float] = field(default_factory=lambda: deque(maxlen=SHARED_WINDOW))  # the last scrapes' estimates
    shared_stale: bool = False  # a preemption put the estimate in doubt: the next scrape must allow it

    def observe_prompt(self, estimated: float, counted: float | None) -> None:
        """The engine counted ``counted`` tokens in a prompt estimated at ``estimated``:
        the mean ratio so far for the first answers (the prior is dropped at the
        first), then a moving average."""
        if counted is None or not (estimated > 0 and counted > 0):
            return
        self.prompts_seen += 1
        weight = max(PROMPT_SCALE_EWMA, 1.0 / self.prompts_seen)
        self.prompt_scale += weight * (counted / estimated - self.prompt_scale)

    def observe_usage(self, used: float, held: Sequence[tuple[float, float]], waiting: float = 0.0) -> None:
        """The engine's cache holds ``used`` tokens (its usage, whole blocks) while it
        runs, among others, the sequences ``held``: (the tokens each holds in the
        cache as the engine counted them, in whole blocks; the tokens of its prompt),
        each past its prefill.  What they hold beyond ``used`` the engine holds once
        for several of them: vLLM's prefix cache gives sequences whose prompts begin
        alike the same blocks (a shared system prompt, a few-shot template).  Counted
        as a prefix every sequence shares, it is ``(sum held - used) / (n - 1)``.
        What else the cache holds -- prefills under way, a sequence that has not
        streamed yet, another client's -- only lowers a scrape's figure, so the plan
        takes the most of the last ``SHARED_WINDOW`` scrapes, in whole blocks (the
        prefix cache shares whole blocks only), at most the shortest prompt.  Without
        it, 32 requests sharing an 886-token prompt on the real vLLM test server were
        planned 4 at a time where the engine ran all 32: 0.57x direct's throughput,
        1.05x with it (docs/results/2026-11-29-shared-prefix-real-vllm.md).

        ``waiting`` sequences wait in the engine: any of ``held`` may be one it
        preempted, which holds nothing.  The figure then leaves the ``waiting``
        largest out of the sum, so it stays one the engine's cache proves.

        After a preemption over uncertain lengths (``on_snapshot``) the plan keeps its
        estimate as far as the next scrape allows it: ``(sum held - used) / (n - 1)``
        with every sequence counted as held, the most sharing the cache could show,
        and a block more (a sequence's count may be a token, so a block, off the
        engine's).  If the prompts stopped beginning alike, the engine holds each
        whole and that figure falls to about nothing.  Dropping the estimate at every
        preemption instead held a burst behind one system prompt on the embedded
        engine at 0.92x direct's throughput, where keeping it gave 0.98x (five runs
        each, docs/results/2026-11-29-system-prompt-preemption.md)."""
        if len(held) < SHARED_MIN_SEQS or not self.usage_live:
            return
        top = min(prompt for _, prompt in held)
        tokens = sorted(t for t, _ in held)
        if self.shared_stale:  # none of the scrapes before counts for more than this one allows
            self.shared_stale = False
            most = (sum(tokens) - used) / (len(held) - 1) + self.block  # a sequence's count may be a block off
            self.shared_seen = deque((min(x, most) for x in self.shared_seen), maxlen=SHARED_WINDOW)
        sure = tokens[: max(len(tokens) - math.ceil(max(waiting, 0.0)), 0)]
        if len(sure) >= SHARED_MIN_SEQS:
            estimate = (sum(sure) - used) / (len(held) - 1)
            self.shared_seen.append(min(max(estimate, 0.0), top))

    @property
    def shared(self) -> float:
        """Prompt tokens the engine holds once for every sequence: the most the last scrapes showed."""
        return max(self.shared_seen, default=0.0)

    def on_snapshot(
        self, capacity: float | None, block: int | None, step: float | None, preempted: float | None,
        certain: bool = True,
    ) -> None:  # fmt: skip
        """A fresh metrics snapshot: η, block size, time per step, preemptions since
        the last.  Preemptions tighten the headroom only when the plan held every
        length in flight as ``certain`` (hints, point predictions): it said none
        could happen, so its counts were wrong.  A plan over uncertain lengths took
        the risk of its quantile knowingly; shrinking it after the preemptions that
        risk brings cost the ShareGPT replay in the engine model 1.3% of throughput
        and took its mean E2E from 0.975x to 1.08x direct's, at 0.09x direct's
        preemptions instead of 0.12x."""
        if capacity:
            self.capacity = capacity
        if block:
            self.block = block
        if step:
            self.step_seconds = step
        if preempted:
            self.preemptions_seen += preempted
            if certain:  # no uncertain length explains it: the prompts may no longer begin alike either
                self.shared_seen.clear()
                self.headroom = max(FLOOR, self.headroom * SHRINK)
            self.shared_stale = bool(self.shared_seen)
        elif preempted is not None:
            self.headroom = min(1.0, self.headroom + RECOVER)

    @property
    def budget(self) -> float | None:
        """Tokens the plan may fill (None: capacity unknown, admit freely)."""
        if self.capacity is None:
            return None
        return self.capacity * (1.0 - self.reserve) * self.headroom - self.shared_blocks

    @property
    def shared_blocks(self) -> float:
        """``shared`` in whole blocks (the prefix cache shares whole blocks only): held once,
        out of the budget, and not again in each sequence (``held``)."""
        return self.shared if self.block <= 1 else self.shared // self.block * self.block

    def held(
        self, prompt: float, length: LengthDist, elapsed: float, *, generated: int | None = None,
        engine_prompt: int | None = None,
    ) -> Seq:  # fmt: skip
        """A request sent ``elapsed`` seconds ago (``prompt``: its estimated prompt
        tokens, scaled here), planned to its predicted ``length``'s ``PLAN_LEVEL``
        quantile given the tokens it has produced (``LengthDist.remaining``): a
        short answer's plan ends when it ends, one that outran its quantile is
        planned on past what it has produced.  ``generated`` and
        ``engine_prompt``: what the engine's stream said of it
        (``Request.engine_generated``, ``engine_prompt_tokens``); with both its
        tokens are known exactly.  Without them the tokens generated are estimated
        from the time, at most one short of the plan (a late answer is taken as
        late, not as long).  An answer that outran a length said to be known (a
        hint, or a predictor's bare estimate) is planned ``OUTRUN`` of what it
        produced further, as one past every quantile: the point mass's 2% tail
        to the cap planned it near the cap, and today's Online predictor, whose
        estimates are means, fell to 0.94x direct's throughput on the ShareGPT
        replay in the engine model."""
        if generated is not None:
            done = float(generated)
        else:
            done = 0.0
            if (steps := self.steps_in(elapsed)) is not None:  # one step less: it may have started a step late
                done = min(max(steps - 1, 0), max(length.plan - 1.0, 0.0))
        if not length.known:
            left = max(length.remaining(PLAN_LEVEL, done), 1.0)
        elif done <= length.median:
            left = max(length.median - done, 1.0)
        else:  # it outran a length said to be known: planned on as one past every quantile
            left = max(OUTRUN * done, 1.0)
        unsure = None if length.known or length.cdf(done) >= 1.0 else length
        shared = self.shared_blocks
        if generated is not None and engine_prompt is not None:
            return Seq(max(engine_prompt - shared, 0.0) + done, left, True, unsure, done)
        return Seq(max(prompt * self.prompt_scale - shared, 0.0) + done + self.margin, left, False, unsure, done)

    def steps_in(self, elapsed: float) -> int | None:
        """The whole engine steps ``elapsed`` seconds cover (None: no step time known, or no time
        yet): all ``held`` reads of the time, so what ``scheduler._held`` keeps its plans by."""
        if not self.step_seconds or elapsed <= 0:
            return None
        return math.floor(elapsed / self.step_seconds)

    @property
    def margin(self) -> float:
        """Tokens a sequence holds beyond its own by block rounding, on average."""
        return self.block / 2

    def fits(self, inflight: Iterable[Seq], new: Seq) -> bool:
        """Would the cache hold ``inflight`` and ``new`` to the end?"""
        budget = self.budget
        if budget is None:
            return True
        if isinstance(inflight, InFlight) and inflight.sums.block == self.block:
            if not inflight:
                return True
            bound = inflight.sums.plus(new).value()  # its sums: no pass over what is in flight
            seqs: list[Seq] | None = None
        else:
            seqs = list(inflight)
            if not seqs:
                return True  # an empty engine takes anything that fits its context at all
            seqs.append(new)
            bound = peak_bound(seqs, self.block)
        if bound <= budget * (1.0 - BOUND_SLACK):  # room to spare: the peak is lower still
            return True
        return peak_tokens([*inflight, new] if seqs is None else seqs, self.block) <= budget

    def start_step(self, inflight: Iterable[Seq], new: Seq) -> float:
        """The engine step from which the cache holds ``new`` (0: now): the first
        planned end of a sequence in flight after which the rest, each that many
        tokens further on and taken to end at its plan (``left``), leave room for
        it.  What backfilling (scheduler.py) may not outlast: a request admitted
        past a blocked head must end by then, so the head starts no later."""
        seqs = list(inflight)
        if self.fits(seqs, new):
            return 0.0
        for end in sorted({max(s.left, 1.0) for s in seqs}):
            rest = [Seq(s.held + end, s.left - end, s.exact) for s in seqs if s.left > end]
            if self.fits(rest, new):
                return end
        return math.inf  # not reached: the last end leaves the engine empty, which takes anything
