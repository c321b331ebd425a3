"""``binbatch bench chaos``: the faults an adversary would try, on the embedded engine.

Each scenario starts its own engine emulator and sidecar as child processes on
127.0.0.1 (free ports), drives them over real gRPC with the shared load generator
(``chaos_load``) and breaks something:

* ``overload`` -- 10x the capacity measured just before, for ``overload_seconds``:
  share of OK / RESOURCE_EXHAUSTED / DEADLINE_EXCEEDED / other, rejection latency,
  the sidecar's RSS and open descriptors every few seconds, and the time until a
  probe succeeds at normal latency with nothing queued or in flight.
* ``engine_kill`` -- SIGKILL the engine with requests in flight, restart it on the
  same port after ``outage_seconds``: every caller one status, no prompt sent
  twice (the engine's receipt log spans both of its lives), and how many requests
  queued at the kill succeeded after the restart.
* ``config_churn`` -- under load, rewrite the config file: bad YAML, a bad value,
  an empty file, a valid change, an engine URL change (to a second engine).  Each
  must be refused or applied as ``Admin/GetConfig`` says -- and an applied engine
  URL must move the traffic, which the second engine's receipts show.
* ``sigterm`` -- SIGTERM with long and short-deadline calls queued and in flight:
  drained within the grace period, exit status 0.
* ``metrics_faults`` -- the sidecar scrapes a loopback endpoint that goes away,
  serves garbage, then NaN gauges: B_t and throughput over time, per phase.

Totals over the scenarios: ``lost`` (accepted requests whose caller got no answer
from the sidecar -- the connection dropped -- plus requests the sidecar's own
counters accepted but never ended), ``duplicated`` (prompts the engine received
more than once) and ``hung`` (calls still unfinished at deadline + margin, and a
sidecar that would not exit).  All three must be 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc

from .bad_metrics import BadMetricsServer
from .chaos_load import LoadGenerator, Outcome, percentile
from .chaos_processes import EmulatorProcess, SidecarProcess, free_port, read_receipts, rss_and_fds, run_to_end

SCENARIOS = ("overload", "engine_kill", "config_churn", "sigterm", "metrics_faults")
# A small engine: ~100 req/s of 32-token outputs here, so 10x its capacity is a rate
# this one bench process can still offer over gRPC.
ENGINE_ARGS = ["--step-a", "0.004", "--step-c", "0.0002", "--num-gpu-blocks", "1024", "--block-size", "16"]
POLL = 0.02  # seconds between Admin polls while the bench waits for a state it caused


@dataclass(frozen=True)
class ChaosConfig:
    """Sizes and durations of the scenarios; ``quick()`` is the seconds-long version."""

    scenarios: tuple[str, ...] = SCENARIOS
    max_tokens: int = 32
    margin_seconds: float = 3.0
    # overload
    overload_seconds: float = 60.0
    overload_factor: float = 10.0
    overload_max_tokens: int = 128  # long outputs: a capacity whose 10x this process can offer
    overload_deadline_seconds: float = 5.0
    capacity_concurrency: int = 128
    capacity_calls: int = 256
    sample_seconds: float = 5.0
    recovery_timeout_seconds: float = 30.0
    # engine_kill
    kill_requests: int = 300
    outage_seconds: float = 5.0
    outage_rate: float = 10.0
    # config_churn
    churn_concurrency: int = 16
    churn_dwell_seconds: float = 1.0
    # sigterm
    sigterm_requests: int = 300
    sigterm_short_requests: int = 100
    short_deadline_seconds: float = 3.0  # the short calls' deadlines spread over [0.05 s, this]
    grace_seconds: int = 10
    # metrics_faults
    phase_seconds: float = 10.0
    faults_concurrency: int = 64
    metrics_interval_ms: int = 500
    metrics_stale_ms: int = 3000

    @classmethod
    def quick(cls) -> ChaosConfig:
        return cls(
            overload_seconds=3.0, overload_deadline_seconds=2.0, overload_max_tokens=64, capacity_concurrency=64,
            capacity_calls=64, sample_seconds=1.0,
            recovery_timeout_seconds=10.0, kill_requests=100, outage_seconds=1.5, churn_dwell_seconds=0.3,
            sigterm_requests=100, grace_seconds=5, phase_seconds=1.2,
            metrics_interval_ms=100, metrics_stale_ms=500,
        )  # fmt: skip


@dataclass
class Bench:
    """What every scenario shares: settings, a scratch directory, a run id, progress."""

    cfg: ChaosConfig
    tmp: Path
    say: Callable[[str], None]
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    def sidecar_doc(self, engine_url: str, metrics_url: str | None = None, **sections: dict[str, Any]) -> dict:
        doc: dict[str, Any] = {
            "engine": {"url": engine_url},
            "metrics": {"url": metrics_url or f"{engine_url}/metrics",
                        "intervalMilliseconds": self.cfg.metrics_interval_ms,
                        "staleAfterMilliseconds": self.cfg.metrics_stale_ms},  # fmt: skip
            "bins": {"maxOutputTokens": 256},
            # the faults are the subject, not the order: the batch-size bound keeps the sigterm scenario's long
            # requests in the engine at SIGTERM (under the default projected plan they can finish or wait elsewhere)
            "memory": {"admission": "BatchSize"},
            "server": {"grpcPort": 0, "httpPort": 0, "metricsPort": 0, "drainGraceSeconds": self.cfg.grace_seconds,
                       "configPollMilliseconds": 100},  # fmt: skip
            "logging": {"level": "Info"},
        }
        for name, values in sections.items():
            doc.setdefault(name, {}).update(values)
        return doc

    @contextlib.asynccontextmanager
    async def engine(self, name: str) -> AsyncIterator[EmulatorProcess]:
        eng = EmulatorProcess(free_port(), self.tmp / f"{name}.receipts", ENGINE_ARGS, self.tmp)
        await eng.start()
        try:
            yield eng
        finally:
            await eng.stop()

    @contextlib.asynccontextmanager
    async def sidecar(self, doc: dict[str, Any], name: str) -> AsyncIterator[SidecarProcess]:
        side = SidecarProcess(self.tmp / f"{name}.yaml", self.tmp)
        side.write_config(doc)
        await side.start()
        try:
            yield side
        finally:
            await side.signal_and_wait(signal.SIGKILL, 10)  # only if a scenario left it running

    def load(self, channel: grpc.aio.Channel, scenario: str, max_tokens: int | None = None) -> LoadGenerator:
        return LoadGenerator(channel, f"chaos {self.run_id} {scenario}", max_tokens=max_tokens or self.cfg.max_tokens,
                             margin=self.cfg.margin_seconds)  # fmt: skip


# ----------------------------------------------------------------- shared figures


async def stats_of(channel: grpc.aio.Channel) -> pb.Stats:
    return await pb_grpc.AdminStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)


def queued(stats: pb.Stats) -> int:
    """Requests the sidecar holds that are not in flight: in the bins, and taken
    from them but not yet sent (``pending_requests``, where the proto has it)."""
    return sum(b.queue_depth for b in stats.bins) + getattr(stats, "pending_requests", 0)


def unaccounted(stats: pb.Stats) -> int:
    """Requests the sidecar accepted that neither ended nor are still held."""
    t = stats.totals
    ended = t.completed + t.expired + t.cancelled + t.failed
    return max(0, t.accepted - ended - queued(stats) - stats.inflight_requests)


async def settle(channel: grpc.aio.Channel, timeout: float = 5.0) -> tuple[pb.Stats, bool]:
    """Wait (bounded) until the sidecar holds nothing and has ended all it accepted
    (a caller's deadline may reach the sidecar a moment after the caller); the
    last stats and whether it settled."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await stats_of(channel)
        if queued(stats) == 0 and stats.inflight_requests == 0 and unaccounted(stats) == 0:
            return stats, True
        if time.monotonic() >= deadline:
            return stats, False
        await asyncio.sleep(POLL)  # ok-sleep: polling another process's state


async def wait_stats(channel: grpc.aio.Channel, ready: Callable[[pb.Stats], bool], timeout: float) -> pb.Stats:
    """Poll Admin/GetStats until ``ready`` holds (bounded); the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await stats_of(channel)
        if ready(stats) or time.monotonic() >= deadline:
            return stats
        await asyncio.sleep(POLL)  # ok-sleep: polling another process's state


def duplicates(*paths: Path) -> int:
    return sum(n - 1 for n in read_receipts(*paths).values() if n > 1)


def share(codes: dict[str, int]) -> dict[str, float]:
    total = sum(codes.values()) or 1
    main = ("OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")
    out = {k.lower(): codes.get(k, 0) / total for k in main}
    out["other"] = sum(v for k, v in codes.items() if k not in main) / total
    return out


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def accounting(load: LoadGenerator, stats: pb.Stats, side: SidecarProcess, exit_code: int | None,
               receipts: list[Path], accepted_tags: tuple[str, ...] | None = None) -> dict[str, Any]:  # fmt: skip
    """The keys every scenario reports: lost, duplicated, hung and how they arose."""
    tags = accepted_tags or tuple({o.tag for o in load.outcomes})
    dropped = sum(load.dropped(t) for t in tags)
    vanished = unaccounted(stats)
    return {
        "calls": len(load.outcomes),
        "codes": load.codes(),
        "dropped": dropped,
        "sidecar_unaccounted": vanished,
        "lost": dropped + vanished,
        "duplicated": duplicates(*receipts),
        "engine_prompts_received": sum(read_receipts(*receipts).values()),
        "hung": load.hung() + (1 if side.proc is not None and exit_code is None else 0),
        "stuck_inflight": stats.inflight_requests,
        "sidecar_totals": {k: getattr(stats.totals, k) for k in
                           ("accepted", "completed", "rejected", "expired", "cancelled", "failed")},  # fmt: skip
        "sidecar_exit_code": exit_code,
        "sidecar_log_levels": side.log_levels(),
        "sidecar_errors": side.error_messages(),
    }


async def terminate(side: SidecarProcess, grace: float) -> int | None:
    return await side.signal_and_wait(signal.SIGTERM, grace + 15)


# ---------------------------------------------------------------------- scenarios


async def overload(b: Bench) -> dict[str, Any]:
    """(a) 10x the measured capacity; rejections, memory, descriptors, recovery."""
    c = b.cfg
    async with b.engine("overload") as eng, b.sidecar(b.sidecar_doc(eng.url), "overload") as side:
        async with grpc.aio.insecure_channel(side.target) as ch:
            load = b.load(ch, "overload", max_tokens=c.overload_max_tokens)
            probes = [await load.call(10.0, "probe", max_tokens=4) for _ in range(3)]
            normal = statistics.median(p.latency or 0 for p in probes)
            b.say(f"overload: measuring capacity ({c.capacity_concurrency} calls outstanding)")
            capacity = await _capacity(load, c.capacity_concurrency, c.capacity_calls)
            await settle(ch, 30)
            rate = c.overload_factor * max(capacity, 1.0)
            samples: list[dict[str, Any]] = []
            lags: list[float] = []
            sampler = asyncio.create_task(_sample(side, ch, c.sample_seconds, samples))
            lagger = asyncio.create_task(load.lag_monitor(lags))
            b.say(f"overload: capacity {capacity:.0f} req/s, offering {rate:.0f} req/s for {c.overload_seconds:g} s")
            t_start = time.monotonic()
            sent = await load.open_loop(rate, c.overload_seconds, c.overload_deadline_seconds, "overload")
            t_stop = time.monotonic()
            recovery = await _recover(load, ch, t_stop, normal, c.recovery_timeout_seconds)
            await load.wait_all()
            for task in (sampler, lagger):
                task.cancel()
            await asyncio.gather(sampler, lagger, return_exceptions=True)
            samples.append(await _snapshot(side, ch, t_start))
            stats, _ = await settle(ch)
        exit_code = await terminate(side, c.grace_seconds)
    over = load.select("overload")
    codes = load.codes("overload")
    rejected = [o.latency for o in over if o.code == "RESOURCE_EXHAUSTED" and o.latency is not None]
    expired = [o.latency for o in over if o.code == "DEADLINE_EXCEEDED" and o.latency is not None]
    achieved = sent / c.overload_seconds
    not_ok = 1 - share(codes)["ok"]
    rss = [s["rss_mb"] for s in samples if s["rss_mb"] is not None]
    return {
        "capacity_rps": round(capacity, 1),
        "offered_rps": round(rate, 1),
        "achieved_rps": round(achieved, 1),
        "seconds": c.overload_seconds,
        "deadline_seconds": c.overload_deadline_seconds,
        "overload_codes": codes,
        "fraction": {k: round(v, 4) for k, v in share(codes).items()},
        "rejection_latency_ms": {"p50": ms(percentile(rejected, 0.5)), "p99": ms(percentile(rejected, 0.99)),
                                 "count": len(rejected)},  # fmt: skip
        "deadline_latency_ms": {"p50": ms(percentile(expired, 0.5)), "count": len(expired)},
        "normal_probe_ms": ms(normal),
        "bench_loop_lag_ms": {"p50": ms(percentile(lags, 0.5)), "p99": ms(percentile(lags, 0.99)),
                              "max": ms(max(lags, default=None))},  # fmt: skip
        "rss_mb": {"before": rss[0] if rss else None, "peak": max(rss) if rss else None,
                   "after": rss[-1] if rss else None},  # fmt: skip
        "fds": {"before": samples[0]["fds"], "peak": max(s["fds"] or 0 for s in samples), "after": samples[-1]["fds"]},
        "samples": samples,
        **recovery,
        "exercised": achieved >= 3 * capacity and not_ok > 0,
        **accounting(load, stats, side, exit_code, [eng.receipts]),
    }


async def _capacity(load: LoadGenerator, concurrency: int, calls: int) -> float:
    """Completions per second of a closed loop, over ``calls`` completions after a
    warm-up of one round (B_t has grown by then); counted, not timed, so the
    window spans whole rounds of equally long calls."""
    stop = asyncio.Event()
    runner = asyncio.create_task(load.closed_loop(concurrency, stop, 60.0, "capacity"))
    t_warm = time.monotonic()
    while load.ok_since(t_warm) < concurrency and time.monotonic() - t_warm < 30:
        await asyncio.sleep(0.05)  # ok-sleep: the count check's pace
    t0 = time.monotonic()
    while load.ok_since(t0) < calls and time.monotonic() - t0 < 60:
        await asyncio.sleep(0.05)  # ok-sleep: the count check's pace
    capacity = load.ok_since(t0) / (time.monotonic() - t0)
    stop.set()
    await load.wait_all()
    await runner
    return capacity


async def _snapshot(side: SidecarProcess, ch: grpc.aio.Channel, t0: float) -> dict[str, Any]:
    usage = rss_and_fds(side.pid)
    stats = await stats_of(ch)
    return {"t": round(time.monotonic() - t0, 1), "rss_mb": None if usage is None else round(usage[0] / 2**20, 1),
            "fds": None if usage is None else usage[1], "queued": queued(stats),
            "inflight": stats.inflight_requests}  # fmt: skip


async def _sample(side: SidecarProcess, ch: grpc.aio.Channel, every: float, out: list[dict[str, Any]]) -> None:
    t0 = time.monotonic()
    while True:
        out.append(await _snapshot(side, ch, t0))
        await asyncio.sleep(every)  # ok-sleep: the sampling period


async def _recover(load: LoadGenerator, ch: grpc.aio.Channel, since: float, normal: float,
                   timeout: float) -> dict[str, Any]:  # fmt: skip
    """Probe until one succeeds at normal latency and the sidecar holds nothing."""
    limit = max(3 * normal, normal + 0.2)
    probes = 0
    while time.monotonic() - since < timeout:
        probes += 1
        probe = await load.call(5.0, "probe", max_tokens=4)
        if probe.code == "OK" and (probe.latency or 0) <= limit:
            stats = await stats_of(ch)
            if queued(stats) == 0 and stats.inflight_requests == 0:
                return {"recovered": True, "recovery_seconds": round(time.monotonic() - since, 2),
                        "recovery_probes": probes}  # fmt: skip
        await asyncio.sleep(0.1)  # ok-sleep: the probing pace
    return {"recovered": False, "recovery_seconds": None, "recovery_probes": probes}


async def engine_kill(b: Bench) -> dict[str, Any]:
    """(b) SIGKILL the engine with requests in flight; restart it on its port."""
    c = b.cfg
    deadline = c.outage_seconds + 20.0
    async with b.engine("engine_kill") as eng, b.sidecar(b.sidecar_doc(eng.url), "engine_kill") as side:
        async with grpc.aio.insecure_channel(side.target) as ch:
            load = b.load(ch, "engine_kill")
            for _ in range(c.kill_requests):
                load.spawn(deadline, "load")
            before = await wait_stats(
                ch, lambda s: s.totals.accepted + s.totals.rejected >= c.kill_requests and s.inflight_requests > 0, 15
            )
            t_kill = time.monotonic()
            await eng.kill()
            life1 = read_receipts(eng.receipts)
            b.say(f"engine_kill: engine killed with {before.inflight_requests} in flight, {queued(before)} queued; "
                  f"restart in {c.outage_seconds:g} s")  # fmt: skip
            await load.open_loop(c.outage_rate, c.outage_seconds, deadline, "outage")
            await eng.start()
            restarted = eng.running
            t_up = time.monotonic()
            resumed = await _first_ok(load, deadline=10.0, timeout=20.0)
            await load.wait_all()
            stats, _ = await settle(ch)
        exit_code = await terminate(side, c.grace_seconds)
    ongoing = [o for o in load.select("load") if o.ended is None or o.ended > t_kill]
    in_engine = [o for o in ongoing if o.key in life1]
    held = [o for o in ongoing if o.key not in life1]
    outage = load.select("outage")
    failed_fast = [o.latency for o in outage if o.code != "OK" and o.latency is not None]
    after_up = [o.ended - t_up for o in load.outcomes if o.code == "OK" and o.ended and o.ended > t_up]
    return {
        "outage_seconds": c.outage_seconds,
        "restart_seconds": round(t_up - t_kill, 2),
        "sidecar_inflight_at_kill": before.inflight_requests,
        "sidecar_queued_at_kill": queued(before),
        "in_engine_at_kill": len(in_engine),
        "in_engine_codes": _codes(in_engine),
        "queued_at_kill": len(held),
        "queued_codes": _codes(held),
        "queued_survived": sum(o.code == "OK" for o in held),
        "outage_calls": len(outage),
        "outage_codes": _codes(outage),
        "outage_failure_latency_ms": {"p50": ms(percentile(failed_fast, 0.5)),
                                      "p99": ms(percentile(failed_fast, 0.99))},  # fmt: skip
        "first_ok_after_restart_ms": ms(min(after_up) if after_up else None),
        "new_call_ok_after_restart_ms": ms(None if resumed is None else resumed - t_up),
        "exercised": len(in_engine) > 0 and restarted,
        **accounting(load, stats, side, exit_code, [eng.receipts]),
    }


async def _first_ok(load: LoadGenerator, deadline: float, timeout: float) -> float | None:
    """Call until one call succeeds (bounded); when that call ended, or None."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        out = await load.call(deadline, "after_restart", max_tokens=4)
        if out.code == "OK":
            return out.ended
        await asyncio.sleep(0.05)  # ok-sleep: the probing pace
    return None


def _codes(outcomes: list[Outcome]) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in outcomes:
        out[o.code] = out.get(o.code, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


async def config_churn(b: Bench) -> dict[str, Any]:
    """(c) Rewrite the config file under load; each change refused or applied."""
    c = b.cfg
    async with b.engine("churn_a") as e1, b.engine("churn_b") as e2:
        async with b.sidecar(b.sidecar_doc(e1.url), "config_churn") as side:
            async with grpc.aio.insecure_channel(side.target) as ch:
                load = b.load(ch, "config_churn")
                stop = asyncio.Event()
                runner = asyncio.create_task(load.closed_loop(c.churn_concurrency, stop, 10.0, "load"))
                changes = await _churn(b, side, ch, e1, e2)
                await asyncio.sleep(c.churn_dwell_seconds)  # ok-sleep: traffic after the last change
                stop.set()
                await load.wait_all()
                await runner
                stats, _ = await settle(ch)
            exit_code = await terminate(side, c.grace_seconds)
    return {
        "changes": changes,
        "changes_not_as_expected": sum(not ch["ok"] for ch in changes),
        # both engines stay up: a call that fails here failed because of a config change
        "failed_calls": {code: n for code, n in load.codes().items() if code != "OK"},
        "engine_prompts": {"first": sum(read_receipts(e1.receipts).values()),
                           "second": sum(read_receipts(e2.receipts).values())},  # fmt: skip
        "exercised": len(changes) == 5 and all(ch["outcome"] != "unanswered" for ch in changes),
        **accounting(load, stats, side, exit_code, [e1.receipts, e2.receipts]),
    }


async def _churn(b: Bench, side: SidecarProcess, ch: grpc.aio.Channel, e1: EmulatorProcess,
                 e2: EmulatorProcess) -> list[dict[str, Any]]:  # fmt: skip
    """Write the five files one after another; how the sidecar answered each."""
    steps: list[tuple[str, bytes | dict[str, Any], tuple[str, ...]]] = [
        ("bad YAML", b"engine: {url: [unclosed\n  batch: :\n", ("refused",)),
        ("bad value", b.sidecar_doc(e1.url, batch={"staticSize": 0}), ("refused",)),
        ("empty file", b"", ("refused",)),
        ("valid change", b.sidecar_doc(e1.url, batch={"maxWaitMilliseconds": 20}), ("applied",)),
        # live, or refused as needing a restart: either is honest (issue 9, defect 2)
        ("engine URL change", b.sidecar_doc(e2.url, batch={"maxWaitMilliseconds": 20}), ("applied", "refused")),
    ]
    admin = pb_grpc.AdminStub(ch)
    changes = []
    for name, content, expected in steps:
        await asyncio.sleep(b.cfg.churn_dwell_seconds)  # ok-sleep: traffic between two changes
        before = await admin.GetConfig(pb.GetConfigRequest(), timeout=10)
        if isinstance(content, bytes):
            written = side.write_config(None, raw=content)
        else:
            written = side.write_config(content)
        outcome, view = await _answer(ch, before, written)
        if name == "engine URL change" and outcome == "applied":
            outcome = await _traffic_moved(e2.receipts)
        changes.append({"change": name, "expected": list(expected), "outcome": outcome, "ok": outcome in expected,
                        "generation": view.generation, "last_reload_error": view.last_reload_error[:200]})  # fmt: skip
        b.say(f"config_churn: {name}: {outcome}")
    return changes


async def _answer(ch: grpc.aio.Channel, before: pb.ConfigView, written: bytes,
                  timeout: float = 5.0) -> tuple[str, pb.ConfigView]:  # fmt: skip
    """How the sidecar answered a rewritten file (``before``: GetConfig just before
    the write): applied (its hash under a new generation), refused (a new
    last_reload_error) or unanswered."""
    admin = pb_grpc.AdminStub(ch)
    digest = hashlib.sha256(written).hexdigest()
    deadline = time.monotonic() + timeout
    view = before
    while time.monotonic() < deadline:
        view = await admin.GetConfig(pb.GetConfigRequest(), timeout=10)
        if view.sha256 == digest and view.generation > before.generation:
            return "applied", view
        if view.last_reload_error and view.last_reload_error != before.last_reload_error:
            return "refused", view
        await asyncio.sleep(POLL)  # ok-sleep: polling another process's state
    return "unanswered", view


async def _traffic_moved(receipts: Path, timeout: float = 3.0) -> str:
    """An applied engine URL must bring prompts to the new engine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if read_receipts(receipts):
            return "applied"
        await asyncio.sleep(0.05)  # ok-sleep: polling another process's file
    return "shown_not_applied"


async def sigterm(b: Bench) -> dict[str, Any]:
    """(d) SIGTERM with requests queued and in flight; drain within grace, exit 0."""
    c = b.cfg
    async with b.engine("sigterm") as eng, b.sidecar(b.sidecar_doc(eng.url), "sigterm") as side:
        async with grpc.aio.insecure_channel(side.target) as ch:
            load = b.load(ch, "sigterm")
            for _ in range(c.sigterm_requests):
                load.spawn(c.grace_seconds + 30.0, "long")
            await wait_stats(ch, lambda s: s.totals.accepted + s.totals.rejected >= c.sigterm_requests, 15)
            for i in range(c.sigterm_short_requests):  # deadlines spread so some pass just as they are admitted
                load.spawn(0.05 + (c.short_deadline_seconds - 0.05) * i / c.sigterm_short_requests, "short")
            n = c.sigterm_requests + c.sigterm_short_requests
            at_term = await wait_stats(ch, lambda s: s.totals.accepted + s.totals.rejected >= n, 5)
            t_term = time.monotonic()
            waiter = asyncio.create_task(side.signal_and_wait(signal.SIGTERM, c.grace_seconds + 15))
            b.say(f"sigterm: SIGTERM with {at_term.inflight_requests} in flight, {queued(at_term)} queued")
            while not waiter.done():  # new callers during the drain must be refused, not lost
                load.spawn(5.0, "after")
                await asyncio.wait([waiter], timeout=0.05)
            exit_code = waiter.result()
            drain = (side.exited_at or time.monotonic()) - t_term
            await load.wait_all()
    accepted = ("long", "short")
    # The sidecar is gone, so its counters cannot be read after the drain: the
    # callers' statuses are the whole account (its totals as at SIGTERM are shown).
    doc = accounting(load, pb.Stats(totals=at_term.totals), side, exit_code, [eng.receipts], accepted_tags=accepted)
    doc["sidecar_unaccounted"] = 0
    doc["lost"] = doc["dropped"]
    return {
        "grace_seconds": c.grace_seconds,
        "drain_seconds": round(drain, 2),
        "exit_code": exit_code,
        "drained_within_grace": exit_code == 0 and drain <= c.grace_seconds + 3,
        "cut_off_reported": side.cut_off_reported(),
        "inflight_at_term": at_term.inflight_requests,
        "queued_at_term": queued(at_term),
        "long_codes": load.codes("long"),
        "short_codes": load.codes("short"),
        "after_sigterm_codes": load.codes("after"),
        "exercised": exit_code is not None and at_term.inflight_requests + queued(at_term) > 0,
        **doc,
    }


async def metrics_faults(b: Bench) -> dict[str, Any]:
    """(e) The scraped /metrics goes away, serves garbage, serves NaN: B_t and throughput."""
    c = b.cfg
    phases = [("healthy", "proxy"), ("gone", "gone"), ("healthy", "proxy"), ("garbage", "garbage"),
              ("healthy", "proxy"), ("nan", "nan"), ("healthy", "proxy")]  # fmt: skip
    timeline: list[dict[str, Any]] = []
    async with b.engine("metrics_faults") as eng:
        bad = BadMetricsServer(f"{eng.url}/metrics", free_port())
        await bad.start()
        try:
            async with b.sidecar(b.sidecar_doc(eng.url, metrics_url=bad.url), "metrics_faults") as side:
                async with grpc.aio.insecure_channel(side.target) as ch:
                    load = b.load(ch, "metrics_faults")
                    stop = asyncio.Event()
                    runner = asyncio.create_task(load.closed_loop(c.faults_concurrency, stop, 10.0, "load"))
                    t0 = time.monotonic()
                    for i, (name, mode) in enumerate(phases):
                        await bad.set_mode(mode)
                        b.say(f"metrics_faults: phase {i + 1}/{len(phases)}: {name}")
                        await _watch_phase(ch, load, f"{i}:{name}", c.phase_seconds, t0, timeline)
                    stop.set()
                    await load.wait_all()
                    await runner
                    stats, _ = await settle(ch)
                exit_code = await terminate(side, c.grace_seconds)
        finally:
            await bad.stop()
    summary = _phase_summary(timeline)
    healthy_rps = summary[0]["rps_mean"] or 1.0
    for row in summary:
        row["throughput_ratio"] = round((row["rps_mean"] or 0.0) / healthy_rps, 2)
    faulty = [row for row in summary if row["phase"] != "healthy"]
    return {
        "phase_seconds": c.phase_seconds,
        "phases": summary,
        "timeline": timeline,
        "scrapes_served": bad.served,
        "exercised": bad.served > 0 and all(row["saw_fault"] for row in faulty),
        **accounting(load, stats, side, exit_code, [eng.receipts]),
    }


async def _watch_phase(ch: grpc.aio.Channel, load: LoadGenerator, phase: str, seconds: float, t0: float,
                       out: list[dict[str, Any]]) -> None:  # fmt: skip
    every = max(0.1, seconds / 10)
    end = time.monotonic() + seconds
    last = time.monotonic()
    while (now := time.monotonic()) < end:
        await asyncio.sleep(min(every, end - now))  # ok-sleep: the sampling period
        stats = await stats_of(ch)
        now = time.monotonic()
        ms_ = stats.metrics_source
        out.append({"t": round(now - t0, 2), "phase": phase, "target_batch_size": stats.target_batch_size,
                    "rps": round(load.ok_since(last) / (now - last), 1),
                    "metrics_state": pb.MetricsState.Name(ms_.state).removeprefix("METRICS_STATE_"),
                    "last_error": ms_.last_error[:160], "sizer_reason": stats.sizer_reason[:80]})  # fmt: skip
        last = now


def _phase_summary(timeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for phase in dict.fromkeys(s["phase"] for s in timeline):
        points = [s for s in timeline if s["phase"] == phase]
        sizes = [s["target_batch_size"] for s in points]
        states: dict[str, int] = {}
        for s in points:
            states[s["metrics_state"]] = states.get(s["metrics_state"], 0) + 1
        errors = list(dict.fromkeys(s["last_error"] for s in points if s["last_error"]))[:3]
        name = phase.split(":", 1)[1]
        rows.append({
            "phase": name, "b_t_min": min(sizes), "b_t_mean": round(statistics.fmean(sizes), 1),
            "b_t_last": sizes[-1], "rps_mean": round(statistics.fmean(s["rps"] for s in points), 1),
            "states": states, "last_errors": errors,
            "saw_fault": any(s["metrics_state"] != "FRESH" or s["last_error"] for s in points),
        })  # fmt: skip
    return rows


RUNNERS = {"overload": overload, "engine_kill": engine_kill, "config_churn": config_churn,
           "sigterm": sigterm, "metrics_faults": metrics_faults}  # fmt: skip


# ------------------------------------------------------------------------- the run


async def run_async(cfg: ChaosConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    doc: dict[str, Any] = {"settings": asdict(cfg)}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="binbatch-chaos-") as tmp:
        bench = Bench(cfg, Path(tmp), progress)
        for name in cfg.scenarios:
            progress(f"{name}: start")
            t0 = time.monotonic()
            result = await RUNNERS[name](bench)
            result["scenario_seconds"] = round(time.monotonic() - t0, 1)
            doc[name] = result
            progress(f"{name}: done in {result['scenario_seconds']:g} s (lost {result['lost']}, "
                     f"duplicated {result['duplicated']}, hung {result['hung']})")  # fmt: skip
    for key in ("lost", "duplicated", "hung"):
        doc[key] = int(sum(doc[name][key] for name in cfg.scenarios))
    doc["seconds"] = round(time.monotonic() - started, 1)
    return doc


def run(cfg: ChaosConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    return run_to_end(run_async(cfg, progress))


def configure(quick: bool, **overrides: Any) -> ChaosConfig:
    """The quick or full settings with explicit values (None: keep) applied."""
    base = ChaosConfig.quick() if quick else ChaosConfig()
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


# ---------------------------------------------------------------------- the tables


def _row(label: str, value: Any) -> None:
    print(f"  {label:38} {value}")


def print_tables(doc: dict[str, Any], out=sys.stdout) -> None:
    print(f"binbatch bench chaos: lost {doc['lost']}, duplicated {doc['duplicated']}, hung {doc['hung']} "
          f"({doc['seconds']:g} s)", file=out)  # fmt: skip
    for name in doc["settings"]["scenarios"]:
        s = doc[name]
        print(f"\n[{name}] lost {s['lost']}  duplicated {s['duplicated']}  hung {s['hung']}  "
              f"exercised {'yes' if s['exercised'] else 'NO'}  calls {s['calls']}  {s['codes']}", file=out)  # fmt: skip
        for label, value in _scenario_rows(name, s):
            _row(label, value)
        _row("sidecar exit / stuck in flight", f"{s['sidecar_exit_code']} / {s['stuck_inflight']}")
        _row("sidecar log lines by level", s["sidecar_log_levels"])


def _slash(*values: Any) -> str:
    return " / ".join(str(v) for v in values)


def _scenario_rows(name: str, s: dict[str, Any]) -> list[tuple[str, Any]]:
    if name == "overload":
        f, rej = s["fraction"], s["rejection_latency_ms"]
        return [
            ("capacity / offered / achieved req/s", _slash(s["capacity_rps"], s["offered_rps"], s["achieved_rps"])),
            ("OK / RESOURCE_EXH. / DEADLINE / other",
             _slash(*(f"{f[k]:.1%}" for k in ("ok", "resource_exhausted", "deadline_exceeded", "other")))),
            ("rejection latency p50 / p99 ms", _slash(rej["p50"], rej["p99"])),
            ("RSS MB before / peak / after", _slash(*s["rss_mb"].values())),
            ("open fds before / peak / after", _slash(*s["fds"].values())),
            ("recovered / seconds", _slash(s["recovered"], s["recovery_seconds"])),
        ]  # fmt: skip
    if name == "engine_kill":
        return [
            ("in engine at kill / their codes", f"{s['in_engine_at_kill']} / {s['in_engine_codes']}"),
            ("queued at kill / survived", f"{s['queued_at_kill']} / {s['queued_survived']} {s['queued_codes']}"),
            ("new calls in outage / codes", f"{s['outage_calls']} / {s['outage_codes']}"),
            ("outage failure latency p50 ms", s["outage_failure_latency_ms"]["p50"]),
            ("restart to a new call's OK, ms", s["new_call_ok_after_restart_ms"]),
        ]
    if name == "config_churn":
        rows = [(c["change"], f"{c['outcome']} (expected {' or '.join(c['expected'])})") for c in s["changes"]]
        return [*rows, ("calls failed during the churn", s["failed_calls"] or 0)]
    if name == "sigterm":
        return [
            ("exit code / drain s / grace s", f"{s['exit_code']} / {s['drain_seconds']} / {s['grace_seconds']}"),
            ("in flight / queued at SIGTERM", f"{s['inflight_at_term']} / {s['queued_at_term']}"),
            ("cut off (sidecar's count)", s["cut_off_reported"]),
            ("long / short / after codes", f"{s['long_codes']} / {s['short_codes']} / {s['after_sigterm_codes']}"),
        ]
    return [
        (f"{p['phase']:8} B_t min/mean/last, req/s", f"{p['b_t_min']}/{p['b_t_mean']}/{p['b_t_last']}, "
                                                      f"{p['rps_mean']} (x{p['throughput_ratio']}) {p['states']}")
        for p in s["phases"]
    ]  # fmt: skip
