"""One workload, two drivers of the same Scheduler, the same dispatch sequence.

The sidecar's asyncio ``Dispatcher`` (with a fake engine client that serves its
calls on the simulator's own engine model, on a manual clock) and the
discrete-event simulator must send the same requests, in the same batches or
admissions, in the same order, at the same times: the simulator then predicts
what the sidecar does, not what a copy of its logic would do.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest

from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.former import BatchFormer
from binbatch_sidecar.core.kv_plan import KvPlan
from binbatch_sidecar.core.predictor import HintPredictor
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.core.scheduler import Core, Scheduler
from binbatch_sidecar.core.sizer import BatchSizer
from binbatch_sidecar.engine.dispatcher import Call, Dispatcher
from binbatch_sidecar.engine.engine_client import EngineRequest, EngineResult, SamplingParams
from binbatch_sidecar.engine.sidecar_metrics import SidecarMetrics
from binbatch_sidecar.sim.engine_model import BatchServers, ContinuousEngine
from binbatch_sidecar.sim.simulator import drive, engine_snapshot

SCRAPE = 0.5


def spec(n: int = 60, rate: float = 6.0, seed: int = 11) -> list[tuple[float, int, int]]:
    """(arrival, prompt tokens, output tokens) per request."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append((t, rng.randint(8, 64), rng.randint(1, 40)))
    return out


def requests(sp) -> list[Request]:
    return [
        Request(id=str(i), arrival=t, prompt_tokens=p, max_tokens=o, hint_tokens=float(o), actual_tokens=float(o))
        for i, (t, p, o) in enumerate(sp)
    ]


def core(clock: ManualClock, sizing: str) -> Core:
    binner = FixedBinner.uniform(2, 1, 40)
    former = BatchFormer(binner, clock, target_size=3, max_wait=0.3, max_queue=1000)
    projected = sizing == "projected"  # memory.admission: Projected, the per-request KV plan
    sizer = BatchSizer(mode="memory" if projected else sizing, static_size=3, max_size=64, min_samples=4,  # type: ignore[arg-type]
                       kv_plan=projected)  # fmt: skip
    return Core(HintPredictor(), binner, former, sizer, kv_plan=KvPlan() if projected else None)


def engine(kind: str, sizing: str):
    # Gang: the seed's servers, one time unit per token.  Continuous: a small KV budget, so it preempts; under the
    # KV plan every call streams (the dispatcher asks for the engine's counts), so the model tells each its progress
    if kind == "servers":
        return BatchServers()
    return ContinuousEngine(a=0.02, c=0.002, kv_tokens=300, max_num_seqs=8, streams=sizing == "projected")


class EngineModelClient:
    """A fake engine client: each call is served by the simulator's engine model."""

    def __init__(self, model, clock: ManualClock, by_id: dict[str, Request]) -> None:
        self.model, self.clock, self.by_id = model, clock, by_id
        self.waiting: list[tuple[list[Request], asyncio.Future]] = []
        self.unreported: dict[Request, Callable[[int, int | None], None]] = {}  # streams whose first chunk is to come

    async def complete_batch(self, engine_requests, *, timeout=None):
        reqs = [self.by_id[e.prompt] for e in engine_requests]
        self.model.submit(self.clock.now(), reqs)
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((reqs, fut))
        return await fut

    async def stream(self, engine_request, *, timeout=None, on_progress=None):
        """The whole answer at its end; the model tells the request its progress itself (``streams``),
        and ``progressed`` hands the first chunk's counts to ``on_progress``, as a real stream does."""
        if on_progress is not None:
            self.unreported[self.by_id[engine_request.prompt]] = on_progress
        (result,) = await self.complete_batch([engine_request])
        yield result

    def progressed(self) -> None:
        """The first chunk of each stream the model has started, in the order they were sent (the
        simulator's ``finish`` order)."""
        for r in [r for r in self.unreported if r.engine_prompt_tokens is not None]:
            self.unreported.pop(r)(r.engine_generated, r.engine_prompt_tokens)

    def finish(self, done: set[Request]) -> None:
        still = []
        for reqs, fut in self.waiting:
            if all(r in done for r in reqs):
                fut.set_result([EngineResult("x", "length", r.prompt_tokens, int(r.actual_tokens)) for r in reqs])
            else:
                still.append((reqs, fut))
        self.waiting = still


async def settle() -> None:
    for _ in range(6):
        await asyncio.sleep(0)  # ok-sleep: bare yields so engine tasks and done-callbacks run; no time passes


async def through_the_dispatcher(sp, mode: str, kind: str, sizing: str, scrape: bool):
    clock = ManualClock()
    reqs = requests(sp)
    model = engine(kind, sizing)
    client = EngineModelClient(model, clock, {r.id: r for r in reqs})
    d = Dispatcher(core(clock, sizing), client, clock, SidecarMetrics(), mode=mode, max_inflight_batches=2)  # type: ignore[arg-type]
    log: list[tuple[float, int, tuple[str, ...]]] = []
    step = d.scheduler.step

    def recording_step(now: float):
        out = step(now)
        log.extend((now, x.batch.bin, tuple(r.id for r in x.requests)) for x in out.dispatches)
        return out

    d.scheduler.step = recording_step  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    calls = {}
    done: set[Request] = set()
    drain = None
    i, next_scrape = 0, SCRAPE if scrape else None
    while True:
        times = [t for t in (reqs[i].arrival if i < len(reqs) else None, model.next_time(), d.scheduler.next_wake(),
                             next_scrape) if t is not None]  # fmt: skip
        if not times:
            break
        t = min(times)
        clock.advance_to(t)
        if i < len(reqs) and reqs[i].arrival == t:
            while i < len(reqs) and reqs[i].arrival == t:
                r = reqs[i]
                call = Call(EngineRequest(SamplingParams(model="m", max_tokens=r.max_tokens), prompt=r.id),
                            loop.create_future())  # fmt: skip
                d.submit(r, call)
                calls[r] = call
                i += 1
            d._step()
            await settle()
            model.kick(t)
            if i == len(reqs):
                drain = asyncio.create_task(d.drain(grace=3600.0))  # no more arrivals: drain, as the simulator does
                await settle()
        elif model.next_time() == t:
            ended = model.advance(t)
            client.progressed()
            done.update(ended)
            client.finish(done)
            await settle()
        elif next_scrape == t:
            d.on_snapshot(engine_snapshot(model))
            next_scrape = None if drain is not None and d.scheduler.idle() else t + SCRAPE
        d._step()
        await settle()
        model.kick(t)  # the engine's loop picks up what this instant's calls sent
    assert drain is not None and await drain == 0
    assert all(c.future.done() and c.future.exception() is None for c in calls.values())
    return log, d


def through_the_simulator(sp, mode: str, kind: str, sizing: str, scrape: bool):
    clock = ManualClock()
    s = Scheduler(core(clock, sizing), clock, mode=mode, max_inflight_batches=2)  # type: ignore[arg-type]
    model = engine(kind, sizing)
    res = drive(s, model, iter(requests(sp)), clock, full_latency_only=False,
                snapshot=(lambda: engine_snapshot(model)) if scrape else None,
                scrape_interval=SCRAPE if scrape else None)  # fmt: skip
    return res.dispatches, res


@pytest.mark.parametrize(
    ("mode", "kind", "sizing", "scrape"),
    [
        ("gang", "servers", "static", False),
        ("gang", "continuous", "static", False),
        ("continuous", "continuous", "static", False),
        ("continuous", "continuous", "memory", True),
        ("continuous", "continuous", "projected", True),
    ],
)
async def test_the_dispatcher_and_the_simulator_dispatch_the_same_sequence(mode, kind, sizing, scrape):
    # The seed's servers take one time unit per token: at 6 arrivals per unit every
    # batch is full (a partial one waits for a free server and fills meanwhile); at
    # 0.1 servers idle and max_wait cuts partial batches too.
    sp = spec(rate=0.1 if kind == "servers" else 6.0)
    driver_log, d = await through_the_dispatcher(sp, mode, kind, sizing, scrape)
    sim_log, res = through_the_simulator(sp, mode, kind, sizing, scrape)
    assert res.completed == len(sp) == d.totals["completed"]
    assert sorted(r for _, _, ids in sim_log for r in ids) == sorted(str(i) for i in range(len(sp)))
    assert len({len(ids) for _, _, ids in sim_log}) > 1 or mode == "continuous"  # batches of several sizes formed
    if (mode, kind) == ("gang", "continuous"):
        assert res.preemptions > 0  # two gang batches outgrow the KV budget: recompute in both drivers alike
    assert driver_log == sim_log
