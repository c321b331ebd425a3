"""``binbatch bench overhead``: what one sidecar costs in front of an instant engine.

The engine is the emulator with zero step time (it answers as fast as its HTTP
server can), so what is left of a call's latency is transport and scheduling.
In one run, interleaved call by call:

* **added latency**: one call at a time, in turn direct (``POST
  /v1/completions``), through the sidecar's gRPC door (``Generate``) and through
  its OpenAI-compatible HTTP door (``POST /v1/completions`` on ``httpPort``);
  added p50/p99 = a door's percentile minus the direct path's;
* **most requests per second**: closed-loop callers (each sends its next request
  when the last one is answered) at a few concurrencies for a fixed time, through
  the sidecar and, for reference, direct.

The bench client, the sidecar and the engine are three processes on this
machine's cores, so the figures say what the whole stack reaches here; the
table names the direct rate too, which bounds what any front end can reach.
Each rate window also reports the CPU each process spent per request (from
/proc on Linux): the sidecar's share is what it costs, the bench client's says
whether the client, not the sidecar, limited the rate.
``--profile FILE.prof`` runs the sidecar under cProfile (slower: compare the
hot spots, not the rates) and prints its top functions on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import pstats
import re
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc

from .bench_clients import CallFailed, completion_body, exactly
from .chaos_load import percentile
from .bench_processes import EngineProcess, EngineShape, served_model, sidecar_doc
from .chaos_processes import SIDECAR_READY, SidecarProcess, run_to_end

JSON_KEYS = ("added_p50_ms", "added_p99_ms", "max_requests_per_s", "http_added_p50_ms", "http_added_p99_ms")
_HTTP_PORT = re.compile(r"HTTP on :(\d+)")  # in the sidecar's "serving gRPC on ..." line
INSTANT = EngineShape(step_a=0.0, step_c=0.0, num_gpu_blocks=65536, block_size=16, max_num_seqs=1024,
                      max_model_len=512)  # fmt: skip
# Admission must never be what limits this bench: a static size far above the
# concurrency, no wait, every request its own engine call (continuous mode).
SIDECAR = {
    "predictor": {"kind": "Hint"},
    "bins": {"count": 4, "maxOutputTokens": 16},
    "batch": {"mode": "Continuous", "sizing": "Static", "staticSize": 1024, "maxBatchSize": 1024,
              "maxWaitMilliseconds": 0, "maxInflightBatches": 1024},
}  # fmt: skip


@dataclass(frozen=True)
class OverheadConfig:
    latency_calls: int = 1000
    concurrencies: tuple[int, ...] = (16, 64, 256)
    window_s: float = 4.0
    profile: str | None = None


def quick() -> OverheadConfig:
    """The seconds-long version (the test suite's)."""
    return OverheadConfig(latency_calls=40, concurrencies=(8,), window_s=0.5)


class _ProfiledSidecar(SidecarProcess):
    """The sidecar under ``python -m cProfile -o FILE`` (stats written at its exit)."""

    def __init__(self, config_path: Path, cwd: Path, profile: str) -> None:
        super().__init__(config_path, cwd)
        self.profile = profile

    async def start(self) -> None:
        args = ["-m", "cProfile", "-o", self.profile, "-m", "binbatch_sidecar.cli", "sidecar",
                "--config", str(self.config_path), "--host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "0", "--http-port", "0"]  # fmt: skip
        self.grpc_port = await self._spawn(args, SIDECAR_READY, self.cwd)


def cpu_seconds(pid: int | None = None) -> float | None:
    """CPU seconds (user + system, all threads) ``pid`` has used; None for this
    process means ``os.times``; None when /proc cannot say (not Linux, gone)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # the command name may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _per_request_us(before: float | None, after: float | None, n: int) -> float | None:
    return None if before is None or after is None or n == 0 else (after - before) / n * 1e6


async def _closed_loop(call: Callable[[int], Awaitable[None]], concurrency: int, window_s: float) -> tuple[float, int]:
    """Requests per second that ``concurrency`` closed-loop callers complete in
    ``window_s``, and how many they completed."""
    loop = asyncio.get_running_loop()
    end = loop.time() + window_s
    done = 0

    async def worker(w: int) -> None:
        nonlocal done
        i = 0
        while loop.time() < end:
            await call(w * 1_000_000 + i)
            i += 1
            done += 1

    t0 = loop.time()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return done / (loop.time() - t0), done


async def run_async(cfg: OverheadConfig, say: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="binbatch-bench-overhead-") as tmp_name:
        tmp = Path(tmp_name)
        async with contextlib.AsyncExitStack() as stack:
            engine = EngineProcess(INSTANT, tmp)
            await engine.start()
            stack.push_async_callback(engine.stop)
            session = await stack.enter_async_context(aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=60)))  # fmt: skip
            model, _ = await served_model(session, engine.url)
            path = tmp / "sidecar.yaml"
            doc = sidecar_doc(engine.url, model, SIDECAR)
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
            sidecar = _ProfiledSidecar(path, tmp, cfg.profile) if cfg.profile else SidecarProcess(path, tmp)
            await sidecar.start()
            stack.push_async_callback(sidecar.signal_and_wait, signal.SIGTERM, 30)
            say(f"instant engine on {engine.url}, sidecar on {sidecar.target}"
                + (f" (under cProfile -> {cfg.profile})" if cfg.profile else ""))  # fmt: skip
            channel = await stack.enter_async_context(grpc.aio.insecure_channel(sidecar.target))
            stub = pb_grpc.InferenceStub(channel)
            door = f"http://127.0.0.1:{http_port(sidecar.lines)}/v1/completions"

            async def direct(i: int) -> None:
                body = completion_body(model, f"overhead {i}", exactly(1), stream=False)
                async with session.post(f"{engine.url}/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        raise CallFailed(f"engine answered HTTP {resp.status}")
                    await resp.read()

            async def through(i: int) -> None:
                reply = await stub.Generate(pb.GenerateRequest(prompt=f"overhead {i}", max_tokens=1, ignore_eos=True,
                                                               expected_output_tokens=1), timeout=60)  # fmt: skip
                if reply.completion_tokens != 1:
                    raise CallFailed(f"sidecar answered {reply.completion_tokens} tokens, asked for 1")

            async def through_http(i: int) -> None:
                body = {"model": model, "prompt": f"overhead {i}", "max_tokens": 1, "ignore_eos": True}
                async with session.post(door, json=body, headers={"x-expected-output-tokens": "1"}) as resp:
                    if resp.status != 200:
                        raise CallFailed(f"the HTTP door answered HTTP {resp.status}: {await resp.text()}")
                    tokens = (await resp.json())["usage"]["completion_tokens"]
                if tokens != 1:
                    raise CallFailed(f"the HTTP door answered {tokens} tokens, asked for 1")

            paths = (("direct", direct), ("sidecar", through), ("http", through_http))
            for i in range(20):  # warm every path (connections, first-call imports)
                for _, call in paths:
                    await call(i)
            lat: dict[str, list[float]] = {name: [] for name, _ in paths}
            for i in range(cfg.latency_calls):
                for name, call in paths[i % 3:] + paths[:i % 3]:  # each path first in turn
                    t0 = time.perf_counter()
                    await call(i)
                    lat[name].append(time.perf_counter() - t0)
            p = {name: (percentile(v, 0.5), percentile(v, 0.99)) for name, v in lat.items()}
            say(f"one at a time, {cfg.latency_calls} calls each: direct p50 {p['direct'][0] * 1e3:.2f} ms, "
                f"sidecar (gRPC) p50 {p['sidecar'][0] * 1e3:.2f} ms, "
                f"HTTP door p50 {p['http'][0] * 1e3:.2f} ms")  # fmt: skip
            rates: list[dict[str, Any]] = []
            pids = {"client": None, "sidecar": sidecar.pid, "engine": engine.pid}
            for c in cfg.concurrencies:
                for name, call in (("direct", direct), ("sidecar", through)):
                    before = {k: cpu_seconds(pid) for k, pid in pids.items()}
                    rate, n = await _closed_loop(call, c, cfg.window_s)
                    cpu_us = {k: _per_request_us(before[k], cpu_seconds(pid), n) for k, pid in pids.items()}
                    rates.append({"path": name, "concurrency": c, "requests_per_s": rate, "cpu_us_per_request": cpu_us})
                    shown = ", ".join(f"{k} {v:.0f}" for k, v in cpu_us.items() if v is not None)
                    say(f"{name}, {c} callers: {rate:.0f} requests/s (CPU us per request: {shown})")
    out = {
        "added_p50_ms": (p["sidecar"][0] - p["direct"][0]) * 1e3,
        "added_p99_ms": (p["sidecar"][1] - p["direct"][1]) * 1e3,
        "max_requests_per_s": max(r["requests_per_s"] for r in rates if r["path"] == "sidecar"),
        "http_added_p50_ms": (p["http"][0] - p["direct"][0]) * 1e3,
        "http_added_p99_ms": (p["http"][1] - p["direct"][1]) * 1e3,
        "latency_ms": {name: {"p50": v[0] * 1e3, "p99": v[1] * 1e3} for name, v in p.items()},
        "rates": rates,
    }
    if cfg.profile:
        out["profile_top"] = hot_spots(cfg.profile)
        say("sidecar hot spots (cProfile, by own time):\n" + out["profile_top"])
    return out


def http_port(lines: list[str]) -> int:
    """The HTTP door's port from the sidecar's start-up lines (the process was
    started with ``--http-port 0``; ``serving gRPC on ...`` names both ports)."""
    for line in lines:
        if match := _HTTP_PORT.search(line):
            return int(match.group(1))
    raise RuntimeError("the sidecar named no HTTP port:\n" + "".join(lines[-20:]))


def hot_spots(path: str, limit: int = 20) -> str:
    """The top functions of a cProfile dump by their own time."""
    buf = io.StringIO()
    pstats.Stats(path, stream=buf).strip_dirs().sort_stats("tottime").print_stats(limit)
    return buf.getvalue()


def run(cfg: OverheadConfig, say: Callable[[str], None]) -> dict[str, Any]:
    return run_to_end(run_async(cfg, say))


def print_table(doc: dict[str, Any]) -> None:
    lat = doc["latency_ms"]
    print("binbatch bench overhead: one sidecar in front of an instant engine (emulator, zero step time)")
    print(f"{'path':10} {'p50 ms':>8} {'p99 ms':>8}")
    for name in ("direct", "sidecar", "http"):
        print(f"{name:10} {lat[name]['p50']:8.2f} {lat[name]['p99']:8.2f}")
    print(f"{'added':10} {doc['added_p50_ms']:8.2f} {doc['added_p99_ms']:8.2f}  (gRPC door)")
    print(f"{'added':10} {doc['http_added_p50_ms']:8.2f} {doc['http_added_p99_ms']:8.2f}  (HTTP door)")
    procs = ("client", "sidecar", "engine")
    print(f"{'path':10} {'callers':>8} {'req/s':>8}   CPU us per request: " + " ".join(f"{p:>8}" for p in procs))
    for r in doc["rates"]:
        cpu = r.get("cpu_us_per_request", {})
        shown = " ".join("       -" if cpu.get(p) is None else f"{cpu[p]:8.0f}" for p in procs)
        print(f"{r['path']:10} {r['concurrency']:8d} {r['requests_per_s']:8.0f}   {'':20}{shown}")
    print(f"max requests/s through the sidecar: {doc['max_requests_per_s']:.0f}")
    sys.stdout.flush()
