"""Per-tenant weighted fair share: of admission (continuous mode) and of the queue.

A request's tenant (``Request.tenant``) is who it is served for: the caller's
``x-llm-d-inference-fairness-id`` / ``x-gateway-inference-fairness-id`` (as the
llm-d router and the Gateway API Inference Extension name the flow a request is
queued in), "" for the one shared tenant of every request that names none.  Each
tenant has a weight (``tenants.tenants[].weight``, else ``tenants.defaultWeight``).

Admission (``FairAdmissionQueue``, continuous mode): each tenant keeps its own
``AdmissionQueue``, so within a tenant the order is exactly the queue's
(ShortestFirst with aging, ``max_wait``, priorities, send-by, the drain rules).
Between tenants, start-time fair queuing over predicted tokens: a tenant's tag
``served`` grows by each admitted request's expected tokens over its weight, and
the next request comes from the waiting tenant of the lowest tag -- the one
furthest below its weighted share of what was admitted.  A tenant that starts
waiting takes the tag the last admitted request started at (start-time fair
queuing's virtual time) less a credit of at most ``BURST_REQUESTS`` mean
requests of the share it left unused while it did not wait (none for a tenant
new or forgotten): shares are of recent admission, and a tenant sending less than
its share finds its next requests first in line.  Without that credit a steady
tenant at 90% of its share queued as if it had a server of its own at 0.9 load
(in a model of the flood bench: mean wait 2.2 s, p99 8.1 s for 2 s answers; with
32 requests of credit 0.8 s and 1.7 s); a flood, always waiting, never has any.
The unit is the one the queue ranks by (predicted output tokens, what an answer
holds the engine for), so a tenant of long answers gets fewer requests, not more
engine.  A request's ``max_wait`` and priority hold within its tenant only:
across tenants the share bounds the wait (a waiting tenant is served at least its
weight's share), and a flood's old requests must not pass the steady tenant's.

With one tenant waiting the queue is that tenant's ``AdmissionQueue`` and answers
exactly as it does alone; with one tenant ever, exactly as a lone ``AdmissionQueue``
(the shared tenant's queue lives from the start, like the scheduler's one queue).

Cost: O(log n) per push and pop (the tenant's heaps, and one heap of waiting
tenants).  Distinct tenant state is bounded (``MAX_TENANTS``): a tenant's queue is
kept while it waits; past the bound the idle ones are forgotten, and while every
kept one waits, further tenants share one overflow queue.

Pure: no I/O, time is passed in.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, Iterator, TypeVar

from .admission import AdmissionOrder, AdmissionQueue, Backlog
from .request import Request, expected_tokens

T = TypeVar("T")
SHARED_TENANT = ""  # requests that name no tenant
MAX_TENANTS = 10_000  # distinct tenants with state kept at once
OVERFLOW_TENANT = "\x00overflow"  # past MAX_TENANTS (no header can hold a NUL)
# A tenant that starts waiting keeps up to this many (mean) requests of the share it left unused (module docstring)
BURST_REQUESTS = 32
COST_EWMA = 0.05  # weight of each admitted request in the mean cost


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """The weights (``tenants`` config section) and the queue bound's floor.

    ``floor_percent`` (``tenants.maxQueuedSharePercent``): the least share of
    ``batch.maxQueuedRequests`` / ``maxQueuedBytes`` any tenant may hold, whatever
    its weight; 100 turns the per-tenant bound off."""

    weights: Mapping[str, int] = field(default_factory=dict)
    default_weight: int = 1
    floor_percent: int = 10

    def __post_init__(self) -> None:
        if self.default_weight < 1 or any(w < 1 for w in self.weights.values()):
            raise ValueError("weights must be >= 1")
        if not 1 <= self.floor_percent <= 100:
            raise ValueError(f"floor_percent must be in [1, 100], got {self.floor_percent}")

    def weight(self, tenant: str) -> int:
        return self.weights.get(tenant, self.default_weight)


def queue_share(weight: int, active_weight: int, floor_percent: int) -> float:
    """The share of the queue bounds a tenant of ``weight`` may hold while tenants
    of ``active_weight`` in all (itself included) have requests queued or in
    flight: its weighted share, at least ``floor_percent``."""
    return max(weight / active_weight, floor_percent / 100) if active_weight > 0 else 1.0


def cost(req: Request) -> float:
    """What admitting ``req`` counts against its tenant's share: its expected tokens (at least 1)."""
    return max(1.0, expected_tokens(req))


class _Tenant(Generic[T]):
    __slots__ = ("name", "queue", "served", "version")

    def __init__(self, name: str, queue: AdmissionQueue[T]) -> None:
        self.name = name
        self.queue = queue
        self.served: float | None = None  # admitted cost over weight: the start-time fair queuing tag (None: new)
        self.version = 0  # its entry in ``_waiting`` is current only at this version


class FairAdmissionQueue(Generic[T]):
    """``AdmissionQueue``'s interface over one queue per tenant (module docstring).
    ``weight`` gives a tenant's weight, read at each admission (a reload applies live)."""

    def __init__(self, order: AdmissionOrder | None = None, weight: Callable[[str], int] = lambda tenant: 1) -> None:
        self.order = order or AdmissionOrder()
        self.weight = weight
        self._tenants: OrderedDict[str, _Tenant[T]] = OrderedDict()  # the least recently active first
        self._shared = self._tenant(SHARED_TENANT)
        self._waiting: list[tuple[float, int, int, _Tenant[T]]] = []  # (served, seq, version): tenants with entries
        self._seq = itertools.count()
        self._len = 0
        self._vtime = 0.0  # the tag of the tenant admitted last
        self._mean_cost = 0.0  # of the requests admitted (EWMA): the unit of the credit a returning tenant keeps
        self._tenant_of: dict[Request, _Tenant[T]] = {}
        self._deadlines: list[tuple[float, int, Request]] = []  # every tenant's, so expiry is O(log n)

    # -- the tenants ------------------------------------------------------------------

    def _tenant(self, name: str) -> _Tenant[T]:
        t = self._tenants.get(name)
        if t is not None:
            self._tenants.move_to_end(name)
            return t
        if len(self._tenants) >= MAX_TENANTS and name != OVERFLOW_TENANT:
            self._forget_idle()
            if len(self._tenants) >= MAX_TENANTS:  # every kept tenant waits: the rest share one queue
                return self._tenant(OVERFLOW_TENANT)
        q: AdmissionQueue[T] = AdmissionQueue(self.order)
        if self._tenants:  # the pace the others age at (every queue is told each tpot from then on)
            q.adopt_aging(self._shared.queue)
        t = self._tenants[name] = _Tenant(name, q)
        return t

    def _forget_idle(self) -> None:
        """Drop the state of tenants with nothing waiting, the least recently active first (not the shared one)."""
        for name in [n for n, t in self._tenants.items() if not t.queue and n != SHARED_TENANT]:
            del self._tenants[name]
            if len(self._tenants) < MAX_TENANTS * 9 // 10:
                return

    def tenants(self) -> int:
        """Tenants whose state is kept."""
        return len(self._tenants)

    def waiting_tenants(self) -> int:
        return sum(1 for t in self._tenants.values() if t.queue)

    def _mark_waiting(self, t: _Tenant[T]) -> None:
        t.version += 1
        heapq.heappush(self._waiting, (t.served or 0.0, next(self._seq), t.version, t))

    def _chosen(self, skip: str | None = None) -> _Tenant[T] | None:
        """The waiting tenant of the lowest tag (the one furthest below its share), other than ``skip``."""
        w = self._waiting
        while w and (not w[0][3].queue or w[0][2] != w[0][3].version):
            heapq.heappop(w)
        if not w or skip is None or w[0][3].name != skip:
            return w[0][3] if w else None
        current = [e for e in w if e[3].queue and e[2] == e[3].version and e[3].name != skip]
        return min(current, key=lambda e: (e[0], e[1]))[3] if current else None

    def _charge(self, t: _Tenant[T], req: Request) -> None:
        """``req`` of ``t`` was taken: its cost over ``t``'s weight moves ``t``'s tag."""
        self._vtime = t.served = t.served or 0.0
        c = cost(req)
        self._mean_cost += COST_EWMA * (c - self._mean_cost) if self._mean_cost else c
        t.served += c / max(1, self.weight(t.name))
        if t.queue:
            self._mark_waiting(t)

    # -- AdmissionQueue's interface ------------------------------------------------------

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[tuple[T, Request]]:
        return itertools.chain.from_iterable(list(t.queue) for t in list(self._tenants.values()))

    def push(self, item: T, req: Request) -> None:
        t = self._tenant(req.tenant)
        if not t.queue:  # it starts waiting: at most BURST_REQUESTS of credit banked while it did not (none if new)
            credit = BURST_REQUESTS * self._mean_cost / max(1, self.weight(t.name)) if t.served is not None else 0.0
            t.served = max(t.served or 0.0, self._vtime - credit)
            t.queue.push(item, req)
            self._mark_waiting(t)
        else:
            t.queue.push(item, req)
        self._tenant_of[req] = t
        self._len += 1
        if req.deadline is not None:
            heapq.heappush(self._deadlines, (req.deadline, next(self._seq), req))

    def set_tpot(self, tpot: float | None) -> None:
        for t in self._tenants.values():
            t.queue.set_tpot(tpot)

    def arrivals_stopped(self, now: float) -> bool:
        """The next tenant's arrivals stopped (its queue's drain rules then apply)."""
        t = self._chosen()
        return t is not None and t.queue.arrivals_stopped(now)

    def peek(self, now: float, backlog: Backlog | None = None, skip: str | None = None) -> tuple[T, Request] | None:
        """The next request; with ``skip``, the next of any other tenant (take it with ``remove``)."""
        t = self._chosen(skip)
        return None if t is None else t.queue.peek(now, backlog)

    def pop(self, now: float, backlog: Backlog | None = None) -> tuple[T, Request] | None:
        t = self._chosen()
        if t is None:
            return None
        head = t.queue.pop(now, backlog)
        if head is not None:
            self._taken(t, head[1])
            self._charge(t, head[1])
        return head

    def packed(self, now: float, fits: Callable[[Request], bool]) -> tuple[T, Request] | None:
        t = self._chosen()
        return None if t is None else t.queue.packed(now, fits)

    def behind(self, head: Request, n: int) -> list[tuple[T, Request]]:
        """Backfill candidates: those after ``head`` in its tenant's order."""
        t = self._tenant_of.get(head)
        return [] if t is None else t.queue.behind(head, n)

    def remove(self, req: Request) -> None:
        t = self._tenant_of[req]
        t.queue.remove(req)
        self._taken(t, req)
        self._charge(t, req)

    def pop_expired(self, now: float) -> list[tuple[T, Request]]:
        out = []
        while self._deadlines and self._deadlines[0][0] <= now:
            t = self._tenant_of.get(heapq.heappop(self._deadlines)[2])
            if t is None:
                continue  # admitted or expired already
            for item, req in t.queue.pop_expired(now):
                self._taken(t, req)
                out.append((item, req))
        return out

    def next_deadline(self) -> float | None:
        d = self._deadlines
        while d and d[0][2] not in self._tenant_of:
            heapq.heappop(d)
        return d[0][0] if d else None

    def _taken(self, t: _Tenant[T], req: Request) -> None:
        self._tenant_of.pop(req, None)
        self._len -= 1
