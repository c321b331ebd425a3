"""Engine models the simulator serves dispatches with.

* ``BatchServers`` -- the multi-bin seed's model (§3): an engine call takes
  ``service_time(batch)`` (by default its longest request) and ends whole.
* ``ContinuousEngine`` -- a continuous-batching engine like vLLM, one decode step
  at a time: a step with b running sequences takes τ(b) = a + c·b (+ a prefill
  cost per prompt token admitted or recomputed in it), and each running sequence
  gains one token.  Its KV cache holds ``kv_tokens`` tokens; a running sequence
  holds prompt + generated tokens.  Waiting sequences are admitted first come,
  first served while fewer than ``max_num_seqs`` run and their tokens fit; when
  the running sequences' next tokens would not fit, the newest is preempted (its
  KV is dropped and recomputed when it is admitted again, vLLM's recompute
  preemption) and goes back to the head of the queue.  With ``streams`` each
  request hears its tokens generated at every step (``Request.engine_generated``),
  as the sidecar hears them from a streamed answer's chunks.  With a
  ``priority`` (a key of each request, lower first) it schedules as vLLM's
  ``--scheduling-policy priority``: the waiting ones are taken by (priority,
  arrival), a preempted one goes back among them by the same key, and the one
  preempted is the running one with the largest key.  Given each request's true
  length as its priority this is shortest-first inside the engine with perfect
  knowledge: what a sidecar's order is measured against.

Both are pure (time passed in) and know nothing of the scheduler: they take
groups of ``Request``s (one engine call) and report which finished.  A driver
calls ``kick(now)`` after it has submitted everything of one instant, so calls
made at the same moment join the same engine step, as in vLLM's loop.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..core.request import Request

ServiceTime = Callable[[Sequence[Request]], float]


def longest(requests: Sequence[Request]) -> float:
    """The seed's gang model: a batch takes as long as its longest request."""
    return max(r.actual_tokens for r in requests)  # type: ignore[type-var]


class BatchServers:
    """Each engine call ends ``service_time(requests)`` after it starts (the
    scheduler's ``max_inflight_batches`` is the number of servers)."""

    def __init__(self, service_time: ServiceTime = longest) -> None:
        self.service_time = service_time
        self._ends: list[tuple[float, int, tuple[Request, ...]]] = []
        self._seq = itertools.count()
        self.busy = 0.0  # server time used

    def submit(self, now: float, requests: Sequence[Request]) -> float:
        """Start one call; returns its service time."""
        dt = self.service_time(requests)
        self.busy += dt
        heapq.heappush(self._ends, (now + dt, next(self._seq), tuple(requests)))
        return dt

    def kick(self, now: float) -> None:
        """Nothing to do: a call starts when it is submitted."""

    def next_time(self) -> float | None:
        return self._ends[0][0] if self._ends else None

    def advance(self, now: float) -> list[Request]:
        done: list[Request] = []
        while self._ends and self._ends[0][0] <= now:
            done.extend(heapq.heappop(self._ends)[2])
        return done


@dataclass(eq=False, slots=True)
class _Seq:
    req: Request
    prompt: int
    output: int
    generated: int = 0
    prefilled: bool = False
    order: int = 0  # when it reached the engine, among all its sequences

    @property
    def tokens(self) -> int:
        return self.prompt + self.generated


@dataclass
class EngineStats:
    steps: int = 0
    step_seconds: float = 0.0
    decoded_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    first_token: dict[Request, float] = field(default_factory=dict)


class ContinuousEngine:
    """A vLLM-like continuous-batching engine (module docstring)."""

    def __init__(
        self,
        *,
        a: float = 0.010,
        c: float = 0.0005,
        kv_tokens: int = 16_384,
        max_num_seqs: int = 256,
        prefill_per_token: float = 0.00002,
        streams: bool = False,
        priority: Callable[[Request], float] | None = None,
        count_prompt: Callable[[Request], int] | None = None,
    ) -> None:
        if a < 0 or c < 0 or prefill_per_token < 0:
            raise ValueError(f"a, c and prefill_per_token must be >= 0, got {a}, {c}, {prefill_per_token}")
        if kv_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"kv_tokens and max_num_seqs must be >= 1, got {kv_tokens}, {max_num_seqs}")
        self.a, self.c, self.kv_tokens, self.max_num_seqs = a, c, kv_tokens, max_num_seqs
        self.prefill_per_token = prefill_per_token
        self.streams = streams  # tell each request its progress at every step, as a streamed answer's chunks do
        self.priority = priority
        # the engine's tokenizer: its count of a request's prompt (None: the request's prompt_tokens, the sidecar's own)
        self.count_prompt = count_prompt
        self.waiting: deque[_Seq] | list[tuple[float, int, _Seq]] = deque() if priority is None else []
        self._arrivals = itertools.count()  # arrival order: the tie-break of equal priorities
        self.running: list[_Seq] = []  # in admission order: the newest is last
        self.stats = EngineStats()
        self._step_end: float | None = None
        self._used = 0  # KV tokens held by the running sequences
        self._snap = (0, 0.0, 0, 0)  # steps, step seconds, decoded tokens, preemptions at the last snapshot

    # -- intake ----------------------------------------------------------------------

    def submit(self, now: float, requests: Sequence[Request]) -> None:
        """Queue ``requests``; they start at the next step (``kick`` starts one if idle)."""
        for r in requests:
            prompt = r.prompt_tokens if self.count_prompt is None else self.count_prompt(r)
            s = _Seq(r, int(prompt), max(1, int(round(r.actual_tokens or 1))), order=next(self._arrivals))
            if self.priority is None:
                self.waiting.append(s)
            else:
                heapq.heappush(self.waiting, (self.priority(r), s.order, s))

    def kick(self, now: float) -> None:
        """Start a step now if none is running and there is work."""
        if self._step_end is None:
            self._start(now)

    # -- time --------------------------------------------------------------------------

    def next_time(self) -> float | None:
        return self._step_end

    def advance(self, now: float) -> list[Request]:
        """End the step in progress if it ends by ``now``; start the next one."""
        done: list[Request] = []
        while self._step_end is not None and self._step_end <= now:
            end = self._step_end
            still = []
            for s in self.running:
                s.generated += 1
                self.stats.decoded_tokens += 1
                if s.generated == 1:
                    self.stats.first_token.setdefault(s.req, end)
                if self.streams and s.req.progress_read:  # vLLM's continuous usage stats in the chunk of this token
                    s.req.engine_generated, s.req.engine_prompt_tokens = s.generated, s.prompt
                if s.generated >= s.output:
                    done.append(s.req)
                    self._used -= s.tokens - 1
                else:
                    self._used += 1
                    still.append(s)
            self.stats.finished += len(self.running) - len(still)
            self.running = still
            self._step_end = None
            self._start(end)
        return done

    def _start(self, now: float) -> None:
        # Running sequences first: each needs one more token; preempt the newest until they fit.
        while len(self.running) > 1 and self._used + len(self.running) > self.kv_tokens:
            s = self._preempt()
            self._used -= s.tokens
            s.prefilled = False
            self.stats.preemptions += 1
        prefill = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            s = self.waiting[0] if self.priority is None else self.waiting[0][2]
            if self.running and self._used + s.tokens + len(self.running) + 1 > self.kv_tokens:
                break
            if self.priority is None:
                self.waiting.popleft()
            else:
                heapq.heappop(self.waiting)
            self.running.append(s)
            self._used += s.tokens
            prefill += s.tokens
        if not self.running:
            return
        dt = self.a + self.c * len(self.running) + self.prefill_per_token * prefill
        self.stats.steps += 1
        self.stats.step_seconds += dt
        self._step_end = now + dt

    def _preempt(self) -> _Seq:
        """Take the running sequence to preempt out and queue it again: the newest
        (FCFS), or the one with the largest (priority, arrival)."""
        if self.priority is None:
            s = self.running.pop()
            self.waiting.appendleft(s)
            return s
        key = self.priority
        s = max(self.running, key=lambda x: (key(x.req), x.order))
        self.running.remove(s)
        heapq.heappush(self.waiting, (key(s.req), s.order, s))
        return s

    # -- what its /metrics would say -------------------------------------------------

    def kv_usage(self) -> float:
        return self._used / self.kv_tokens

    def snapshot_deltas(self) -> tuple[float | None, int]:
        """(mean seconds per decode step since the last call, preemptions since), then restart."""
        steps, secs, _, pre = self._snap
        st = self.stats
        tpot = (st.step_seconds - secs) / (st.steps - steps) if st.steps > steps else None
        self._snap = (st.steps, st.step_seconds, st.decoded_tokens, st.preemptions)
        return tpot, st.preemptions - pre
