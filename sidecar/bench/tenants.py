"""``binbatch bench tenants``: one tenant's flood beside a steady tenant, on the embedded engine.

The embedded engine and one sidecar run as child processes on 127.0.0.1; the
bench calls the sidecar's OpenAI-compatible HTTP door, each call naming its
tenant in ``x-llm-d-inference-fairness-id``.  Every request asks the same
answer length distribution (``ignore_eos``, ``answer_tokens``), so the engine's
capacity is a rate:

1. ``capacity`` -- closed-loop calls through the sidecar: completions a second.
2. ``alone`` -- the steady tenant alone, Poisson at ``steady_load`` of that
   capacity (its fair share of a ``total_load`` the two tenants would offer at
   fair shares: weights 1:1, 0.9 load).
3. ``flood`` -- the same steady stream beside a flooding tenant sending
   ``flood_factor`` times the steady tenant's rate (10x its share: the total
   offered is several times the capacity).  The flood must get 429s; the steady
   tenant's p99 E2E should stay within 1.5x of its run alone, and it loses none.
4. ``unfair`` -- the same two streams under ONE tenant name: what the fair share
   prevents (the steady requests queue behind the flood's and share its 429s).

Reported: each phase's p50 / p99 E2E of the steady tenant's completed calls, the
statuses of both tenants' calls, and the ratios flood / alone and unfair / alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from .bench_processes import EngineProcess, EngineShape, sidecar_doc, start_sidecar
from .chaos_load import percentile
from .chaos_processes import run_to_end

TENANT_HEADER = "x-llm-d-inference-fairness-id"
STEADY, FLOOD = "steady", "flood"
# bench e2e's KV-limited engine four times slower: about nine 64-token answers fit at once, some 4 answers a
# second (low rates: the
# client, the sidecar and the engine share the machine's cores, and the flood must not measure their contention)
ENGINE = EngineShape(step_a=0.024, step_c=0.0008, num_gpu_blocks=48, block_size=16, max_num_seqs=256, max_model_len=512)


@dataclass(frozen=True)
class TenantsConfig:
    """The run's sizes; ``quick()`` is the seconds-long version the test suite runs."""

    max_tokens: int = 64  # the mean answer (answer_tokens)
    phase_seconds: float = 30.0
    total_load: float = 0.9  # of the measured capacity, both tenants at their fair shares
    flood_factor: float = 10.0  # the flood's rate over its fair share's (= the steady tenant's)
    capacity_concurrency: int = 32
    capacity_calls: int = 200
    max_queued_requests: int = 64  # batch.maxQueuedRequests: small, so the flood reaches its share soon
    timeout_seconds: float = 60.0  # the client's bound on each call
    seed: int = 1
    phases: tuple[str, ...] = ("alone", "flood", "unfair")

    def quick(self) -> TenantsConfig:
        return replace(self, phase_seconds=4.0, capacity_calls=48, capacity_concurrency=16)


@dataclass
class Call:
    tenant: str
    status: int = 0  # HTTP status; 0: no answer (connection error)
    e2e: float | None = None  # seconds, for a completed call
    queue: float | None = None  # seconds it waited in the sidecar (x-binbatch-queue-ms), for a completed call


@dataclass
class Phase:
    name: str
    calls: list[Call] = field(default_factory=list)

    def statuses(self, tenant: str) -> dict[str, int]:
        return {str(k): v for k, v in sorted(Counter(c.status for c in self.calls if c.tenant == tenant).items())}

    def latency(self, tenant: str) -> dict[str, float | None]:
        e2e = [c.e2e for c in self.calls if c.tenant == tenant and c.e2e is not None]
        queue = [c.queue for c in self.calls if c.tenant == tenant and c.queue is not None]
        return {"p50_ms": _ms(percentile(e2e, 0.5)), "p99_ms": _ms(percentile(e2e, 0.99)), "completed": len(e2e),
                "queue_p50_ms": _ms(percentile(queue, 0.5)), "queue_p99_ms": _ms(percentile(queue, 0.99))}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


class Client:
    """Calls /v1/completions on the sidecar's HTTP door."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, cfg: TenantsConfig) -> None:
        self.session, self.url, self.model, self.cfg = session, url, model, cfg
        self._n = 0

    async def call(self, tenant: str, header: str, phase: Phase, tokens: int) -> Call:
        self._n += 1
        out = Call(tenant)
        phase.calls.append(out)
        body = {"model": self.model, "prompt": f"{tenant} {self._n} please write something", "ignore_eos": True,
                "max_tokens": tokens}  # fmt: skip
        headers = {TENANT_HEADER: header, "x-expected-output-tokens": str(tokens)}
        start = time.monotonic()
        try:
            async with self.session.post(f"{self.url}/v1/completions", json=body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_seconds)) as resp:  # fmt: skip
                await resp.read()
                out.status = resp.status
                if (waited := resp.headers.get("x-binbatch-queue-ms")) is not None:
                    out.queue = float(waited) / 1000
        except (aiohttp.ClientError, TimeoutError):
            out.status = 0
        if out.status == 200:
            out.e2e = time.monotonic() - start
        return out


async def poisson(client: Client, tenant: str, header: str, rate: float, seconds: float, phase: Phase,
                  rng: random.Random, tasks: set[asyncio.Task[Call]]) -> None:  # fmt: skip
    """Start calls at Poisson arrivals of ``rate`` a second for ``seconds``, whatever the answers."""
    start = time.monotonic()
    due = start
    while True:
        due += rng.expovariate(rate)
        if due - start >= seconds:
            return
        await asyncio.sleep(max(0.0, due - time.monotonic()))  # ok-sleep: the pace of an open-loop generator
        task = asyncio.get_running_loop().create_task(client.call(tenant, header, phase, answer_tokens(client.cfg, rng)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


def answer_tokens(cfg: TenantsConfig, rng: random.Random) -> int:
    """An answer's length: uniform over half to one and a half ``max_tokens`` (all of one length, the
    engine's batch runs in lockstep: its requests end together, and an arrival waits for the next such
    end, ~half an answer's time, whatever the order)."""
    return rng.randint(cfg.max_tokens // 2, cfg.max_tokens * 3 // 2)


async def capacity(client: Client, cfg: TenantsConfig) -> float:
    """Completions a second through the sidecar with ``capacity_concurrency`` calls outstanding."""
    phase = Phase("capacity")
    left = cfg.capacity_calls
    rng = random.Random(cfg.seed - 1)

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await client.call(STEADY, STEADY, phase, answer_tokens(cfg, rng))

    start = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(cfg.capacity_concurrency)))
    done = sum(c.status == 200 for c in phase.calls)
    if done == 0:
        raise RuntimeError(f"no call completed while measuring capacity: statuses {phase.statuses(STEADY)}")
    return done / (time.monotonic() - start)


async def run_phase(client: Client, name: str, steady_rate: float, flood_rate: float, cfg: TenantsConfig,
                    seed: int) -> Phase:  # fmt: skip
    """One phase: the steady stream, and the flood's unless ``flood_rate`` is 0 (``unfair``: both one tenant).
    The same ``seed`` gives every phase the same steady arrivals and answer lengths: the phases differ only
    by what runs beside them."""
    phase = Phase(name)
    tasks: set[asyncio.Task[Call]] = set()
    flood_header = STEADY if name == "unfair" else FLOOD
    streams = [poisson(client, STEADY, STEADY, steady_rate, cfg.phase_seconds, phase, random.Random(seed), tasks)]
    if flood_rate > 0:
        streams.append(poisson(client, FLOOD, flood_header, flood_rate, cfg.phase_seconds, phase,
                               random.Random(seed + 1000), tasks))  # fmt: skip
    await asyncio.gather(*streams)
    while tasks:
        await asyncio.wait(list(tasks))  # each call is bounded by its own timeout
    return phase


def sidecar_overrides(cfg: TenantsConfig) -> dict[str, Any]:
    """The policy under test: the defaults, a small queue bound, the two tenants at weight 1."""
    return {
        "batch": {"maxQueuedRequests": cfg.max_queued_requests},
        "tenants": {"tenants": [{"name": STEADY, "weight": 1}, {"name": FLOOD, "weight": 1}]},
    }


async def run_async(cfg: TenantsConfig, say: Callable[[str], None]) -> dict[str, Any]:
    async with contextlib.AsyncExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="binbatch-bench-tenants-")))
        engine = EngineProcess(ENGINE, tmp)
        await engine.start()
        stack.push_async_callback(engine.stop)
        model = "emulated"
        session = await stack.enter_async_context(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))
        async with session.get(f"{engine.url}/v1/models") as resp:
            model = str((await resp.json())["data"][0]["id"])
        doc = sidecar_doc(engine.url, model, sidecar_overrides(cfg))
        side = await start_sidecar(doc, tmp / "sidecar.yaml", tmp)
        stack.push_async_callback(side.signal_and_wait, 15, 20)
        client = Client(session, side.http_url, model, cfg)
        say(f"engine {ENGINE.describe()}; measuring capacity")
        cap = await capacity(client, cfg)
        steady_rate = cap * cfg.total_load / 2
        flood_rate = steady_rate * cfg.flood_factor
        say(f"capacity {cap:.1f} completions/s; steady {steady_rate:.1f}/s, flood {flood_rate:.1f}/s")
        phases: dict[str, Phase] = {}
        for name in cfg.phases:
            say(f"phase {name} ({cfg.phase_seconds:g} s)")
            phases[name] = await run_phase(client, name, steady_rate, 0.0 if name == "alone" else flood_rate, cfg,
                                           cfg.seed)  # fmt: skip
        return report(cfg, cap, steady_rate, flood_rate, phases)


def report(cfg: TenantsConfig, cap: float, steady_rate: float, flood_rate: float,
           phases: dict[str, Phase]) -> dict[str, Any]:  # fmt: skip
    rows = {}
    for name, p in phases.items():
        rows[name] = {"steady": {**p.latency(STEADY), "statuses": p.statuses(STEADY)},
                      "flood": {**p.latency(FLOOD), "statuses": p.statuses(FLOOD)}}  # fmt: skip
    alone = rows.get("alone", {}).get("steady", {})
    ratios: dict[str, float | None] = {}
    for name in ("flood", "unfair"):
        row = rows.get(name, {}).get("steady", {})
        for q in ("p50_ms", "p99_ms"):
            a, b = alone.get(q), row.get(q)
            ratios[f"{name}_over_alone_{q.removesuffix('_ms')}"] = round(b / a, 3) if a and b else None
    flood = rows.get("flood", {})
    steady_lost = sum(v for k, v in flood.get("steady", {}).get("statuses", {}).items() if k != "200")
    return {
        "setup": {**asdict(cfg), "engine": ENGINE.describe(), "capacity_per_second": round(cap, 2),
                  "steady_per_second": round(steady_rate, 2), "flood_per_second": round(flood_rate, 2),
                  "offered_over_capacity": round((steady_rate + flood_rate) / cap, 2)},
        "phases": rows,
        "ratios": ratios,
        "flood_429": flood.get("flood", {}).get("statuses", {}).get("429", 0),
        "steady_not_ok_in_flood": steady_lost,
        "target_met": (ratios.get("flood_over_alone_p99") is not None and ratios["flood_over_alone_p99"] <= 1.5
                       and flood.get("flood", {}).get("statuses", {}).get("429", 0) > 0 and steady_lost == 0),
    }  # fmt: skip


def run(cfg: TenantsConfig, say: Callable[[str], None]) -> dict[str, Any]:
    return run_to_end(run_async(cfg, say))


def print_tables(doc: dict[str, Any], out=sys.stdout) -> None:
    s = doc["setup"]
    print(f"engine: {s['engine']}", file=out)
    print(f"capacity {s['capacity_per_second']}/s; steady {s['steady_per_second']}/s, flood {s['flood_per_second']}/s "
          f"(offered {s['offered_over_capacity']}x capacity); {s['phase_seconds']:g} s a phase", file=out)  # fmt: skip
    print(f"{'phase':<8} {'tenant':<7} {'p50 ms':>8} {'p99 ms':>8} {'queued p50/p99 ms':>18} {'done':>6}  statuses",
          file=out)  # fmt: skip
    for name, row in doc["phases"].items():
        for tenant in (STEADY, FLOOD):
            r = row[tenant]
            if not r["statuses"]:
                continue
            p50 = "-" if r["p50_ms"] is None else f"{r['p50_ms']:.0f}"
            p99 = "-" if r["p99_ms"] is None else f"{r['p99_ms']:.0f}"
            queued = "-" if r["queue_p50_ms"] is None else f"{r['queue_p50_ms']:.0f}/{r['queue_p99_ms']:.0f}"
            print(f"{name:<8} {tenant:<7} {p50:>8} {p99:>8} {queued:>18} {r['completed']:>6}  {r['statuses']}",
                  file=out)  # fmt: skip
    for key, value in doc["ratios"].items():
        print(f"{key}: {'-' if value is None else f'{value:.2f}x'}", file=out)
    print(f"flood's 429s: {doc['flood_429']}; steady calls not answered 200 in the flood: "
          f"{doc['steady_not_ok_in_flood']}; target met: {doc['target_met']}", file=out)  # fmt: skip
