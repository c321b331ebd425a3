"""A discrete-event simulator that drives the real scheduling core.

It owns only what the outside world would: arrivals, servers and time.  Requests
go through the same predictor -> binner -> batch former path the sidecar uses, on a
``ManualClock`` that jumps from event to event.  The former's ``next_wake()`` is
armed as a timer event, exactly as the asyncio server arms a real timer.

Service model (multi-bin-batching-v1.md §3): a batch holds its server until its
longest request finishes, unless a ``service_time`` function says otherwise (the
SMDP bench uses l(b) = αb + β).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from ..core.binner import Binner
from ..core.clock import ManualClock
from ..core.former import Batch, BatchFormer, DispatchPolicy
from ..core.predictor import LengthPredictor
from ..core.request import Request

ServiceTime = Callable[[Batch], float]


def longest_request(batch: Batch) -> float:
    """The seed's gang model: a batch takes as long as its longest request."""
    return max(r.actual_tokens for r in batch.requests)  # type: ignore[type-var]


@dataclass
class Workload:
    """``n`` requests with lengths ~ U[lmin, lmax].  ``rate`` None = all at time 0
    (saturated); else Poisson arrivals at that rate."""

    n: int
    lmin: float = 1.0
    lmax: float = 20.0
    rate: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.lmin < self.lmax:
            raise ValueError(f"need 0 <= lmin < lmax, got {self.lmin}, {self.lmax}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0 or None, got {self.rate}")

    def requests(self) -> Iterator[Request]:
        rng = np.random.default_rng(self.seed)
        lengths = rng.uniform(self.lmin, self.lmax, self.n)
        if self.rate is None:
            times = np.zeros(self.n)
        else:
            times = np.cumsum(rng.exponential(1 / self.rate, self.n))
        for i, (t, length) in enumerate(zip(times.tolist(), lengths.tolist())):
            yield Request(id=str(i), arrival=t, actual_tokens=length, max_tokens=0)


@dataclass
class SimResult:
    completed: int = 0
    makespan: float = 0.0
    busy: float = 0.0
    latencies: list[float] = field(default_factory=list)  # requests of full batches
    full_requests: int = 0
    full_service: float = 0.0  # server time spent on full batches
    last_full_done: float = 0.0
    batches: dict[str, int] = field(default_factory=dict)  # count per reason
    batch_sizes: list[int] = field(default_factory=list)
    expired: int = 0

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


class Simulation:
    """Drive ``former`` with ``workload`` on ``servers`` servers.

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
        self.predictor = predictor
        self.former = BatchFormer(
            binner,
            self.clock,
            target_size=batch_size,
            max_wait=max_wait,
            max_queue=workload.n + 1,
            policy=policy,
        )
        self.servers = servers
        self.service_time = service_time

    def run(self) -> SimResult:
        res = SimResult()
        events: list[tuple[float, int, str, object]] = []
        seq = itertools.count()
        arrivals = self.workload.requests()
        free = self.servers
        armed: set[float] = set()

        def push(t: float, kind: str, data: object = None) -> None:
            heapq.heappush(events, (t, next(seq), kind, data))

        def arm() -> None:
            wake = self.former.next_wake()
            if wake is not None and wake not in armed:
                armed.add(wake)
                push(wake, "wake")

        def dispatch() -> None:
            nonlocal free
            while free:
                batch = self.former.take(idle=True)
                if batch is None:
                    return
                free -= 1
                dt = self.service_time(batch)
                res.busy += dt
                res.batches[batch.reason] = res.batches.get(batch.reason, 0) + 1
                res.batch_sizes.append(batch.size)
                if batch.reason == "full":
                    res.full_requests += batch.size
                    res.full_service += dt
                push(self.clock.now() + dt, "done", batch)

        nxt = next(arrivals, None)
        if nxt is not None:
            push(nxt.arrival, "arrive", nxt)
        while events:
            t, _, kind, data = heapq.heappop(events)
            self.clock.advance_to(t)
            if kind == "arrive":
                # Take every arrival at this instant at once (the saturated case).
                req = data
                while req is not None and req.arrival == t:  # type: ignore[union-attr]
                    req.predicted_tokens = self.predictor.predict(req)  # type: ignore[union-attr]
                    self.former.submit(req)  # type: ignore[arg-type]
                    req = next(arrivals, None)
                if req is not None:
                    push(req.arrival, "arrive", req)
                else:
                    push(t, "end-of-arrivals")
            elif kind == "done":
                free += 1
                batch = data
                for r in batch.requests:  # type: ignore[attr-defined]
                    self.predictor.observe(r, r.actual_tokens)  # type: ignore[arg-type]
                res.completed += batch.size  # type: ignore[attr-defined]
                if batch.reason == "full":  # type: ignore[attr-defined]
                    res.latencies.extend(t - r.arrival for r in batch.requests)  # type: ignore[attr-defined]
                    res.last_full_done = max(res.last_full_done, t)
                res.makespan = t
            elif kind == "wake":
                armed.discard(t)
                res.expired += len(self.former.poll().expired)
            elif kind == "end-of-arrivals":
                self.former.drain()
            dispatch()
            arm()
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
        return e[j] + frac * (e[j + 1] - e[j])

    def observe(self, req: Request, actual_tokens: float) -> None:
        pass


class OraclePredictor:
    """Knows each request's true length (the seed's oracle)."""

    name = "oracle"

    def predict(self, req: Request) -> float:
        return float(req.actual_tokens)  # type: ignore[arg-type]

    def observe(self, req: Request, actual_tokens: float) -> None:
        pass
