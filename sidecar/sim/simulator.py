"""A discrete-event simulator that drives the sidecar's own ``Scheduler``.

It owns only what the outside world would: arrivals, the engine and time.
Requests go through the same ``core.scheduler.Scheduler`` the sidecar's
dispatcher drives -- predictor, binner, batch former, sizer, in-flight ledger, in
gang or continuous mode -- on a ``ManualClock`` that jumps from event to event.
The scheduler's ``next_wake()`` is armed as a timer event, exactly as the asyncio
driver arms a real timer; a metrics scrape (``scrape_interval``) feeds
``on_snapshot`` what the engine model's ``/metrics`` would say.

Engines (``sim/engine_model.py``): ``BatchServers`` for the multi-bin seed's model
(a batch holds its server until its longest request finishes, or ``service_time``
says otherwise: the SMDP bench uses l(b) = αb + β), and ``ContinuousEngine``
(τ(b) = a + c·b per decode step, a KV budget with recompute preemption).
``run_direct`` is the baseline: every request straight into the engine's own
FCFS queue, no sidecar.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..core.binner import Binner
from ..core.clock import ManualClock
from ..core.former import Batch, BatchFormer, DispatchPolicy
from ..core.length_dist import LEVELS, LengthDist
from ..core.predictor import LengthPredictor
from ..core.request import Request
from ..core.scheduler import Core, Dispatch, Mode, Outcome, Scheduler
from ..core.sizer import BatchSizer, EngineSnapshot
from .engine_model import BatchServers, ContinuousEngine

ServiceTime = Callable[[Batch], float]


def longest_request(batch: Batch) -> float:
    """The seed's gang model: a batch takes as long as its longest request."""
    return max(r.actual_tokens for r in batch.requests)  # type: ignore[type-var]


class Engine(Protocol):
    def submit(self, now: float, requests: Sequence[Request]) -> object: ...
    def kick(self, now: float) -> None: ...
    def next_time(self) -> float | None: ...
    def advance(self, now: float) -> list[Request]: ...


@dataclass
class Workload:
    """``n`` requests with output lengths ~ U[lmin, lmax].  ``rate`` None = all at
    time 0 (saturated); else Poisson arrivals at that rate.  ``prompt`` (lo, hi):
    prompt tokens ~ U{lo..hi} (None: 0).  ``hint``: the client's hint is the true
    length (an oracle hint; else no hint)."""

    n: int
    lmin: float = 1.0
    lmax: float = 20.0
    rate: float | None = None
    seed: int = 0
    prompt: tuple[int, int] | None = None
    hint: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.lmin < self.lmax:
            raise ValueError(f"need 0 <= lmin < lmax, got {self.lmin}, {self.lmax}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0 or None, got {self.rate}")
        if self.prompt is not None and not 0 <= self.prompt[0] <= self.prompt[1]:
            raise ValueError(f"prompt must be (lo, hi) with 0 <= lo <= hi, got {self.prompt}")

    def requests(self) -> Iterator[Request]:
        rng = np.random.default_rng(self.seed)
        lengths = rng.uniform(self.lmin, self.lmax, self.n)
        if self.rate is None:
            times = np.zeros(self.n)
        else:
            times = np.cumsum(rng.exponential(1 / self.rate, self.n))
        prompts = (
            rng.integers(self.prompt[0], self.prompt[1] + 1, self.n).tolist() if self.prompt else [0] * self.n
        )
        for i, (t, length, p) in enumerate(zip(times.tolist(), lengths.tolist(), prompts)):
            yield Request(
                id=str(i), arrival=t, actual_tokens=length, max_tokens=0, prompt_tokens=int(p),
                hint_tokens=length if self.hint else None,
            )  # fmt: skip


@dataclass
class SimResult:
    completed: int = 0
    makespan: float = 0.0
    busy: float = 0.0
    latencies: list[float] = field(default_factory=list)  # requests of full batches (gang); every request otherwise
    full_requests: int = 0
    full_service: float = 0.0  # server time spent on full batches
    last_full_done: float = 0.0
    batches: dict[str, int] = field(default_factory=dict)  # count per reason
    batch_sizes: list[int] = field(default_factory=list)
    expired: int = 0
    preemptions: int = 0
    dispatches: list[tuple[float, int, tuple[str, ...]]] = field(default_factory=list)  # (time, bin, request ids)

    @property
    def saturated_throughput(self) -> float:
        """Requests per unit time while the system held full batches (one server:
        B over the mean service time of a full batch, Proposition 4.1)."""
        return self.full_requests / self.full_service if self.full_service else 0.0

    @property
    def throughput(self) -> float:
        return self.completed / self.makespan if self.makespan else 0.0

    @property
    def mean_latency(self) -> float:
        return float(np.mean(self.latencies)) if self.latencies else math.nan

    def latency_quantile(self, q: float) -> float:
        return float(np.quantile(self.latencies, q)) if self.latencies else math.nan


def drive(
    scheduler: Scheduler,
    engine: Engine,
    arrivals: Iterator[Request],
    clock: ManualClock,
    *,
    full_latency_only: bool = True,
    snapshot: Callable[[], EngineSnapshot | None] | None = None,
    scrape_interval: float | None = None,
) -> SimResult:
    """Run ``arrivals`` through ``scheduler`` into ``engine`` until all have ended.

    After the last arrival the scheduler drains (its bins leave as "drain"
    batches).  With ``full_latency_only`` (the theory's steady state) only
    requests of full batches count in ``latencies``.
    """
    res = SimResult()
    events: list[tuple[float, int, str]] = []
    seq = itertools.count()
    armed: set[float] = set()
    slot_of: dict[Request, tuple[Dispatch, list[int]]] = {}  # request -> its dispatch, requests left in it
    uncounted: dict[Request, None] = {}  # dispatched, the engine's count of its prompt not yet seen (in order)
    engine_armed: float | None = None
    done_arriving = False

    def push(t: float, kind: str) -> None:
        heapq.heappush(events, (t, next(seq), kind))

    def step() -> None:
        now = clock.now()
        out = scheduler.step(now)
        res.expired += len(out.expired)
        for batch in out.batches:
            res.batches[batch.reason] = res.batches.get(batch.reason, 0) + 1
            res.batch_sizes.append(batch.size)
        for d in out.dispatches:
            res.dispatches.append((now, d.batch.bin, tuple(r.id for r in d.requests)))
            left = [len(d.requests)]
            for r in d.requests:
                slot_of[r] = (d, left)
            uncounted.update(dict.fromkeys(d.requests))
            dt = engine.submit(now, d.requests)
            if isinstance(dt, float):
                res.busy += dt
                if d.batch.reason == "full" and d.slot.batch:
                    res.full_requests += len(d.requests)
                    res.full_service += dt
        engine.kick(now)

    def finish(now: float) -> None:
        done = engine.advance(now)
        for r in [r for r in uncounted if r.engine_prompt_tokens is not None]:  # its stream's first chunk
            del uncounted[r]  # counted its prompt: the live dispatcher's ``_progress``
            scheduler.prompt_counted(r, r.engine_prompt_tokens)
        for r in done:
            uncounted.pop(r, None)
            d, left = slot_of.pop(r)
            # the prompt as the engine counted it, where its stream said (the live sidecar reads it from usage)
            prompt = r.engine_prompt_tokens if r.engine_prompt_tokens is not None else r.prompt_tokens
            scheduler.complete(r, Outcome(completion_tokens=r.actual_tokens, prompt_tokens=prompt), now)
            res.completed += 1
            full = d.batch.reason == "full"
            if full or not full_latency_only:
                res.latencies.append(now - r.arrival)
            if full:
                res.last_full_done = max(res.last_full_done, now)
            res.makespan = now
            left[0] -= 1
            if left[0] == 0:
                scheduler.release(d.slot, now)

    def arm() -> None:
        nonlocal engine_armed
        wake = scheduler.next_wake()
        if wake is not None and wake not in armed:
            armed.add(wake)
            push(wake, "wake")
        t = engine.next_time()
        if t is not None and t != engine_armed:
            engine_armed = t
            push(t, "engine")

    nxt = next(arrivals, None)
    if nxt is not None:
        push(nxt.arrival, "arrive")
    if scrape_interval is not None:
        push(scrape_interval, "scrape")
    while events:
        t, _, kind = heapq.heappop(events)
        if kind == "scrape" and done_arriving and scheduler.idle():
            continue
        clock.advance_to(t)
        if kind == "arrive":
            # Take every arrival at this instant at once (the saturated case).
            while nxt is not None and nxt.arrival == t:
                scheduler.submit(nxt)
                nxt = next(arrivals, None)
            if nxt is not None:
                push(nxt.arrival, "arrive")
            else:
                push(t, "end-of-arrivals")
        elif kind == "engine":
            if engine_armed == t:
                engine_armed = None
            finish(t)
        elif kind == "wake":
            armed.discard(t)
        elif kind == "scrape":
            scheduler.on_snapshot(snapshot() if snapshot else None, t)
            push(t + scrape_interval, "scrape")  # type: ignore[operator]
        elif kind == "end-of-arrivals":
            done_arriving = True
            scheduler.start_drain()
        step()
        arm()
    if isinstance(engine, ContinuousEngine):
        res.preemptions = engine.stats.preemptions
    return res


class Simulation:
    """Drive the scheduler in gang mode on ``servers`` servers (the seed's model).

    After the last arrival whatever is left in the bins is drained (reason
    "drain"); those requests complete but, not being part of the steady state the
    theory describes, are left out of ``latencies`` and the saturated throughput.
    """

    def __init__(
        self,
        workload: Workload,
        predictor: LengthPredictor,
        binner: Binner,
        *,
        batch_size: int,
        servers: int = 1,
        max_wait: float | None = None,
        policy: DispatchPolicy | None = None,
        service_time: ServiceTime = longest_request,
    ) -> None:
        if servers < 1:
            raise ValueError(f"servers must be >= 1, got {servers}")
        self.clock = ManualClock()
        self.workload = workload
        former = BatchFormer(
            binner, self.clock, target_size=batch_size, max_wait=max_wait, max_queue=workload.n + 1, policy=policy
        )
        sizer = BatchSizer(mode="static", static_size=batch_size, max_size=max(batch_size, 256))
        self.core = Core(predictor, binner, former, sizer)
        self.scheduler = Scheduler(self.core, self.clock, mode="gang", max_inflight_batches=servers)
        self.service_time = service_time

    @property
    def former(self) -> BatchFormer:
        return self.core.former

    def run(self) -> SimResult:
        engine = BatchServers(lambda reqs: self.service_time(Batch(0, list(reqs), "", 0.0)))
        return drive(self.scheduler, engine, self.workload.requests(), self.clock)


def engine_snapshot(engine: ContinuousEngine) -> EngineSnapshot:
    """What the engine model's ``/metrics`` would tell the sizer now."""
    tpot, preempted = engine.snapshot_deltas()
    return EngineSnapshot(
        kv_capacity_tokens=float(engine.kv_tokens), kv_block_tokens=1, kv_usage_ratio=engine.kv_usage(),
        running=len(engine.running), waiting=len(engine.waiting), tpot_seconds=tpot,
        preemptions_delta=float(preempted), fresh=True,
    )  # fmt: skip


def run_sidecar(
    workload: Workload,
    core: Core,
    clock: ManualClock,
    engine: ContinuousEngine,
    *,
    mode: Mode,
    max_inflight_batches: int = 4,
    scrape_interval: float | None = 0.5,
) -> SimResult:
    """``workload`` through the sidecar's scheduler into the engine model; every
    request's latency counts.  ``clock`` must be the one ``core.former`` reads."""
    scheduler = Scheduler(core, clock, mode=mode, max_inflight_batches=max_inflight_batches)
    return drive(
        scheduler, engine, workload.requests(), clock, full_latency_only=False,
        snapshot=lambda: engine_snapshot(engine), scrape_interval=scrape_interval,
    )  # fmt: skip


def run_direct(workload: Workload, engine: ContinuousEngine) -> SimResult:
    """The baseline: every request straight into the engine's own FCFS queue."""
    res = SimResult()
    arrivals = workload.requests()
    nxt = next(arrivals, None)
    while nxt is not None or engine.next_time() is not None:
        t_engine = engine.next_time()
        if nxt is not None and (t_engine is None or nxt.arrival < t_engine):
            now = nxt.arrival
            while nxt is not None and nxt.arrival == now:
                engine.submit(now, [nxt])
                nxt = next(arrivals, None)
            engine.kick(now)
            continue
        assert t_engine is not None
        for r in engine.advance(t_engine):
            res.completed += 1
            res.latencies.append(t_engine - r.arrival)
            res.makespan = t_engine
    res.preemptions = engine.stats.preemptions
    return res


class NoisyBinPredictor:
    """The symmetric bin-error model of multi-bin-batching-v2 §6.2.

    Knows the true length (an oracle) but puts the request in a neighbouring bin
    with probability p: p/2 the bin below, p/2 the bin above.  An edge bin has one
    neighbour, so it is wrong with probability p/2 (the mass that would fall off the
    edge stays in place).  The predicted length keeps its relative place inside the
    chosen bin.
    """

    name = "noisy-oracle"

    def __init__(self, edges: Sequence[float], p: float, seed: int = 0) -> None:
        if not 0 <= p <= 1:
            raise ValueError(f"p must be in [0, 1], got {p}")
        if len(edges) < 2 or any(b <= a for a, b in zip(edges, edges[1:])):
            raise ValueError("edges must be at least two strictly increasing values")
        self.edges = list(edges)  # lmin, interior boundaries..., lmax
        self.p = p
        self._rng = np.random.default_rng(seed)
        self._draws: Iterator[float] = iter(())

    def _uniform(self) -> float:
        u = next(self._draws, None)
        if u is None:
            self._draws = iter(self._rng.random(4096).tolist())
            u = next(self._draws)
        return u

    def predict(self, req: Request) -> float:
        x = float(req.actual_tokens)  # type: ignore[arg-type]
        e = self.edges
        k = len(e) - 1
        i = min(max(bisect.bisect_right(e, x) - 1, 0), k - 1)
        u = self._uniform()
        j = i - 1 if u < self.p / 2 else i + 1 if u < self.p else i
        if not 0 <= j < k:
            j = i
        frac = (x - e[i]) / (e[i + 1] - e[i])
        guess = e[j] + frac * (e[j + 1] - e[j])
        req.length = LengthDist.exact(guess)  # at least 1 token; the simulator's own units may be smaller
        return guess

    def observe(self, req: Request, actual_tokens: float) -> None:
        pass


class OraclePredictor:
    """Knows each request's true length (the seed's oracle)."""

    name = "oracle"

    def predict(self, req: Request) -> float:
        x = float(req.actual_tokens)  # type: ignore[arg-type]
        req.length = LengthDist.exact(x)  # at least 1 token; the simulator's own units may be smaller
        return x

    def observe(self, req: Request, actual_tokens: float) -> None:
        pass


class NoisyLengthPredictor:
    """A stand-in for a learned length predictor that reads the prompt (issue 24),
    for the simulator: it predicts log length ŷ = μ + ρ²(y − μ) + ρ√(1 − ρ²)σε from
    the truth y (ε standard normal; μ, σ of ``train``'s log lengths) -- a calibrated
    regressor whose prediction correlates ρ with the truth, regressed toward the
    mean as a least-squares model's is -- and, as a learned model does, a
    distribution: exp(ŷ) times its residuals' quantiles, measured on ``train``.
    ρ 0.76 ranks ShareGPT's answers at Kendall τ ≈ 0.45, what a learned model is
    expected to reach there.  Each request is predicted once (by id)."""

    name = "noisy-learned"

    def __init__(self, train: Sequence[float], rho: float, seed: int = 0) -> None:
        if not 0 < rho < 1:
            raise ValueError(f"rho must be in (0, 1), got {rho}")
        if len(train) < 2:
            raise ValueError("train: at least two lengths are needed")
        y = np.log(np.maximum(np.asarray(train, dtype=float), 1.0))
        self.mu, self.sd, self.rho = float(y.mean()), float(y.std()), rho
        self._rng = np.random.default_rng(seed)
        residuals = y - np.array([self._log_prediction(v) for v in y])
        self.ratios = tuple(float(np.exp(np.quantile(residuals, p))) for p in LEVELS)
        self._predicted: dict[str, float] = {}

    def _log_prediction(self, y: float) -> float:
        r2 = self.rho**2
        return self.mu + r2 * (y - self.mu) + math.sqrt(r2 * (1 - r2)) * self.sd * float(self._rng.normal())

    def predict(self, req: Request) -> float:
        if req.id not in self._predicted:
            self._predicted[req.id] = self._log_prediction(math.log(max(float(req.actual_tokens or 1), 1.0)))
        req.length = LengthDist.scaled(math.exp(self._predicted[req.id]), self.ratios,
                                       cap=float(req.max_tokens) if req.max_tokens else math.inf)  # fmt: skip
        req.prediction_source = "online"
        return req.length.median

    def observe(self, req: Request, actual_tokens: float) -> None:
        pass
