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
  the sidecar's two doors and, for reference, direct;
* **a streamed request's cost** (the ``stream`` path): the same closed loop through
  the HTTP door, each request streaming ``STREAM_TOKENS`` tokens with no hint, so
  the sidecar predicts its length and relays a chunk a token: its CPU a request
  (``stream_sidecar_cpu_us_per_request``, at the most callers) is mostly the relay's;
* **the relay's cost a token** (``relay``): on that instant engine several tokens
  arrive in one read, where a GPU engine streams each answer a token a step.  So a
  second judged sidecar fronts the e2e bench's ample engine (it steps: one token
  an answer a step) and closed loops of ``relay_concurrency`` callers stream
  answers of two lengths (``RELAY_TOKENS``) directly, through the HTTP door and
  through the gRPC door's ``GenerateStream``; the sidecar's CPU a request grows
  with the answer by its cost a token (``relay_http_cpu_us_per_token``,
  ``relay_grpc_cpu_us_per_token``) from its cost a request.  This is how to size
  the sidecar's CPU for the tokens a pod streams.

The bench client, the sidecar and the engine are three processes on this
machine's cores, so the figures say what the whole stack reaches here; the
table names the direct rate too, which bounds what any front end can reach.
Each rate window also reports the CPU each process spent per request (from
/proc on Linux): the sidecar's share is what it costs, the bench client's says
whether the client, not the sidecar, limited the rate.  It is the figure to
compare runs by on a loaded machine: wall-clock latencies and rates move with
whatever else runs on the cores, CPU per request much less.

The judged sidecar (``sidecar`` and ``http`` rows, the JSON keys) runs the
configuration a user installs: the operator's own rendering of a
``BatchingPolicy`` that sets nothing (``e2e.policy_default``), with only what the
bench needs besides (loopback ports 0, the engine and its scrape URL).  A second
sidecar, ``tuned`` (``HAND_TUNED``: the Hint predictor, a static size of 1024, no
wait), is measured beside it for reference; each sidecar row names the target
batch size ``B_t`` its sizer held at the window's end, so a default that capped
the engine below the callers would show.
``--profile FILE.prof`` runs the sidecar under cProfile (slower: compare the
hot spots, not the rates) and prints its top functions on stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import pstats
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

from .bench_clients import (CallFailed, closed_loop, completion_body, completions_caller, exactly, sidecar_caller,
                            steady_heap)  # fmt: skip
from .bench_processes import (EngineProcess, EngineShape, bench_session, served_model, sidecar_doc, sidecar_samples,
                              started_engine)  # fmt: skip
from .chaos_load import percentile
from .chaos_processes import SIDECAR_READY, SidecarProcess, http_port, metrics_port, run_to_end
from .e2e import AMPLE_KV, policy_default
from .workloads import BenchRequest

JSON_KEYS = ("added_p50_ms", "added_p99_ms", "max_requests_per_s", "http_added_p50_ms", "http_added_p99_ms",
             "http_max_requests_per_s", "stream_sidecar_cpu_us_per_request", "relay_http_cpu_us_per_token",
             "relay_grpc_cpu_us_per_token")  # fmt: skip
# The streamed path's answers: a short chat reply's length, so the sidecar relays as many
# chunks a request as a real stream (its CPU a request is mostly the relay's).
STREAM_TOKENS = 24
# The relay's two answer lengths: a short reply and a long one (the e2e bench's ample engine holds both).
RELAY_TOKENS = (4, 128)
RELAY_DOORS = ("http", "grpc")
INSTANT = EngineShape(step_a=0.0, step_c=0.0, num_gpu_blocks=65536, block_size=16, max_num_seqs=1024,
                      max_model_len=512)  # fmt: skip
# The reference row: admission must never be what limits it: a static size far above
# the concurrency, no wait, every request its own engine call (continuous mode).
HAND_TUNED = {
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
    profile: str | None = None  # cProfile dump of the judged sidecar
    tuned: bool = True  # measure the HAND_TUNED sidecar beside the judged one
    relay_tokens: tuple[int, int] = RELAY_TOKENS  # the relay's short and long answers
    relay_requests: int = 256  # a relay loop's requests (each length, each path)
    relay_concurrency: int = 32


def quick() -> OverheadConfig:
    """The seconds-long version (the test suite's)."""
    return OverheadConfig(latency_calls=40, concurrencies=(8,), window_s=0.5, relay_tokens=(2, 10), relay_requests=16,
                          relay_concurrency=8)  # fmt: skip


def judged_sidecar_doc(engine_url: str, model: str) -> dict[str, Any]:
    """The judged sidecar's config: the policy default (``e2e.policy_default({})``, what a
    ``BatchingPolicy`` that sets nothing renders), given the engine, its scrape URL at the
    default interval and loopback port 0 -- nothing else of the bench's."""
    return sidecar_doc(engine_url, model, policy_default({}), scrape_ms=None)


def tuned_sidecar_doc(engine_url: str, model: str) -> dict[str, Any]:
    """The reference sidecar's config: ``HAND_TUNED`` (admission never the limit)."""
    return sidecar_doc(engine_url, model, HAND_TUNED)


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

    with steady_heap():
        t0 = loop.time()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        return done / (loop.time() - t0), done


async def _start_sidecar(doc: dict[str, Any], path: Path, cwd: Path, profile: str | None) -> SidecarProcess:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    sidecar = _ProfiledSidecar(path, cwd, profile) if profile else SidecarProcess(path, cwd)
    await sidecar.start()
    return sidecar


async def target_batch_size(session: aiohttp.ClientSession, port: int) -> int | None:
    """The largest ``binbatch_target_batch_size`` (B_t, the most requests the
    sidecar lets into the engine at once) its metrics port shows; None if none."""
    sizes = [s.value for s in await sidecar_samples(session, port, "binbatch_target_batch_size")]
    return round(max(sizes)) if sizes else None


def per_token(short: tuple[int, float], long: tuple[int, float]) -> tuple[float, float]:
    """From the CPU a request at two answer lengths ((tokens, us), (tokens, us)): its cost a
    token (the slope) and a request (the intercept, what an answer of no token would cost)."""
    (t0, c0), (t1, c1) = short, long
    if not t1 > t0:
        raise ValueError(f"the long answer must be longer than the short one, got {t0} and {t1} tokens")
    slope = (c1 - c0) / (t1 - t0)
    return slope, c0 - slope * t0


async def relay_cost(cfg: OverheadConfig, session: aiohttp.ClientSession, tmp: Path, stack: contextlib.AsyncExitStack,
                     say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """The ``relay`` measurement (module docstring): closed loops on a stepping engine, direct
    first, each path at each answer length; the CPU the sidecar and the engine spent a request."""
    engine, model = await started_engine(stack, AMPLE_KV, tmp)
    sidecar = await _start_sidecar(judged_sidecar_doc(engine.url, model), tmp / "relay.yaml", tmp, None)
    stack.push_async_callback(sidecar.signal_and_wait, signal.SIGTERM, 30)
    channel = await stack.enter_async_context(grpc.aio.insecure_channel(sidecar.target))
    say(f"the relay: a stepping engine ({AMPLE_KV.describe()}) on {engine.url}, a sidecar (policy default) on "
        f"{sidecar.target}")  # fmt: skip
    paths = {"direct": completions_caller(session, engine.url, model),
             "http": completions_caller(session, f"http://127.0.0.1:{http_port(sidecar.lines)}", model),
             "grpc": sidecar_caller(channel, hint=False)}  # fmt: skip
    pids = {"sidecar": sidecar.pid, "engine": engine.pid}
    runs: list[dict[str, Any]] = []
    for tokens in cfg.relay_tokens:
        requests = [BenchRequest(prompt=f"relay {i}", output_tokens=tokens, arrival_s=0.0)
                    for i in range(cfg.relay_requests)]  # fmt: skip
        for name, call in paths.items():
            before = {k: cpu_seconds(pid) for k, pid in pids.items()}
            result, _ = await closed_loop(requests, call, cfg.relay_concurrency)
            if result.failures:
                raise CallFailed(f"the relay's {name} path, {tokens} tokens: {len(result.failures)} failed, "
                                 f"first: {result.failures[0]}")  # fmt: skip
            n = len(result.samples)
            cpu_us = {k: _per_request_us(before[k], cpu_seconds(pid), n) for k, pid in pids.items()}
            runs.append({"path": name, "tokens": tokens, "requests_per_s": n / result.elapsed_s, "cpu_us_per_request": cpu_us})
            shown = ", ".join(f"{k} {v:.0f}" for k, v in cpu_us.items() if v is not None)
            say(f"relay, {name}, {tokens} tokens an answer, {cfg.relay_concurrency} callers: {n / result.elapsed_s:.1f} "
                f"requests/s (CPU us per request: {shown})")  # fmt: skip
    # a door's cost at each length: what the sidecar spent a request over what it spent idle meanwhile
    # (direct's run at that length, as long: about 8 ms of CPU a second, its timers and scrapes)
    idle = {r["tokens"]: r["cpu_us_per_request"]["sidecar"] for r in runs if r["path"] == "direct"}
    doors: dict[str, dict[str, float | None]] = {}
    for door in RELAY_DOORS:
        spent = [(r["tokens"], r["cpu_us_per_request"]["sidecar"], idle[r["tokens"]]) for r in runs if r["path"] == door]
        if any(us is None or base is None for _, us, base in spent):  # no /proc to read: not measured
            doors[door] = {"cpu_us_per_token": None, "cpu_us_per_request": None}
            continue
        token_us, request_us = per_token(*((tokens, us - base) for tokens, us, base in spent))
        doors[door] = {"cpu_us_per_token": token_us, "cpu_us_per_request": request_us}
    return {"doors": doors, "runs": runs, "concurrency": cfg.relay_concurrency}


async def run_async(cfg: OverheadConfig, say: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="binbatch-bench-overhead-") as tmp_name:
        tmp = Path(tmp_name)
        async with contextlib.AsyncExitStack() as stack:
            engine = EngineProcess(INSTANT, tmp)
            await engine.start()
            stack.push_async_callback(engine.stop)
            session = await stack.enter_async_context(bench_session(60))
            model, _ = await served_model(session, engine.url)
            sidecar = await _start_sidecar(judged_sidecar_doc(engine.url, model), tmp / "sidecar.yaml", tmp, cfg.profile)
            stack.push_async_callback(sidecar.signal_and_wait, signal.SIGTERM, 30)
            say(f"instant engine on {engine.url}, sidecar (policy default) on {sidecar.target}"
                + (f" (under cProfile -> {cfg.profile})" if cfg.profile else ""))  # fmt: skip
            stubs = {"sidecar": pb_grpc.InferenceStub(await stack.enter_async_context(
                grpc.aio.insecure_channel(sidecar.target)))}  # fmt: skip
            procs = {"sidecar": sidecar}
            if cfg.tuned:
                tuned = await _start_sidecar(tuned_sidecar_doc(engine.url, model), tmp / "tuned.yaml", tmp, None)
                stack.push_async_callback(tuned.signal_and_wait, signal.SIGTERM, 30)
                say(f"hand-tuned sidecar (Hint predictor, Static 1024) on {tuned.target}")
                stubs["tuned"] = pb_grpc.InferenceStub(await stack.enter_async_context(
                    grpc.aio.insecure_channel(tuned.target)))  # fmt: skip
                procs["tuned"] = tuned
            door = f"http://127.0.0.1:{http_port(sidecar.lines)}/v1/completions"

            async def direct(i: int) -> None:
                body = completion_body(model, f"overhead {i}", exactly(1), stream=False)
                async with session.post(f"{engine.url}/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        raise CallFailed(f"engine answered HTTP {resp.status}")
                    await resp.read()

            def through(stub: pb_grpc.InferenceStub) -> Callable[[int], Awaitable[None]]:
                async def call(i: int) -> None:
                    reply = await stub.Generate(pb.GenerateRequest(prompt=f"overhead {i}", max_tokens=1, ignore_eos=True,
                                                                   expected_output_tokens=1), timeout=60)  # fmt: skip
                    if reply.completion_tokens != 1:
                        raise CallFailed(f"sidecar answered {reply.completion_tokens} tokens, asked for 1")

                return call

            async def through_http(i: int) -> None:
                body = {"model": model, "prompt": f"overhead {i}", "max_tokens": 1, "ignore_eos": True}
                async with session.post(door, json=body, headers={"x-expected-output-tokens": "1"}) as resp:
                    if resp.status != 200:
                        raise CallFailed(f"the HTTP door answered HTTP {resp.status}: {await resp.text()}")
                    tokens = (await resp.json())["usage"]["completion_tokens"]
                if tokens != 1:
                    raise CallFailed(f"the HTTP door answered {tokens} tokens, asked for 1")

            async def through_http_streamed(i: int) -> None:  # a client that sends no hint, as the judged rows
                body = {"model": model, "prompt": f"overhead {i}", "max_tokens": STREAM_TOKENS, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
                tokens = None
                async with session.post(door, json=body) as resp:
                    if resp.status != 200:
                        raise CallFailed(f"the HTTP door answered HTTP {resp.status}: {await resp.text()}")
                    async for line in resp.content:
                        if line.startswith(b"data: {") and b'"usage":{' in line:
                            tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                if tokens != STREAM_TOKENS:
                    raise CallFailed(f"the HTTP door streamed {tokens} tokens, asked for {STREAM_TOKENS}")

            paths: tuple[tuple[str, Callable[[int], Awaitable[None]]], ...] = (
                ("direct", direct), ("sidecar", through(stubs["sidecar"])), ("http", through_http),
                ("stream", through_http_streamed),
                *((("tuned", through(stubs["tuned"])),) if cfg.tuned else ()))  # fmt: skip
            for i in range(20):  # warm every path (connections, first-call imports)
                for _, call in paths:
                    await call(i)
            lat: dict[str, list[float]] = {name: [] for name, _ in paths}
            with steady_heap():
                for i in range(cfg.latency_calls):
                    k = i % len(paths)
                    for name, call in paths[k:] + paths[:k]:  # each path first in turn
                        t0 = time.perf_counter()
                        await call(i)
                        lat[name].append(time.perf_counter() - t0)
            p = {name: (percentile(v, 0.5), percentile(v, 0.99)) for name, v in lat.items()}
            say(f"one at a time, {cfg.latency_calls} calls each: "
                + ", ".join(f"{name} p50 {v[0] * 1e3:.2f} ms" for name, v in p.items()))  # fmt: skip
            rates: list[dict[str, Any]] = []
            for c in cfg.concurrencies:
                for name, call in paths:
                    # on the direct path the sidecar column is the judged sidecar's idle cost
                    pids = {"client": None, "sidecar": procs.get(name, sidecar).pid, "engine": engine.pid}
                    before = {k: cpu_seconds(pid) for k, pid in pids.items()}
                    rate, n = await _closed_loop(call, c, cfg.window_s)
                    cpu_us = {k: _per_request_us(before[k], cpu_seconds(pid), n) for k, pid in pids.items()}
                    row = {"path": name, "concurrency": c, "requests_per_s": rate, "cpu_us_per_request": cpu_us}
                    if name in procs:
                        row["target_batch_size"] = await target_batch_size(session, metrics_port(procs[name].lines))
                    rates.append(row)
                    shown = ", ".join(f"{k} {v:.0f}" for k, v in cpu_us.items() if v is not None)
                    cap = f", B_t {row['target_batch_size']}" if row.get("target_batch_size") is not None else ""
                    say(f"{name}, {c} callers: {rate:.0f} requests/s (CPU us per request: {shown}{cap})")
                    if row.get("target_batch_size") is not None and row["target_batch_size"] < c:
                        say(f"note: the {name} sidecar's batch sizing caps the engine at {row['target_batch_size']} "
                            f"requests, below the {c} callers")  # fmt: skip
            relay = await relay_cost(cfg, session, tmp, stack, say)
    out = {
        "added_p50_ms": (p["sidecar"][0] - p["direct"][0]) * 1e3,
        "added_p99_ms": (p["sidecar"][1] - p["direct"][1]) * 1e3,
        "max_requests_per_s": max(r["requests_per_s"] for r in rates if r["path"] == "sidecar"),
        "http_max_requests_per_s": max(r["requests_per_s"] for r in rates if r["path"] == "http"),
        "http_added_p50_ms": (p["http"][0] - p["direct"][0]) * 1e3,
        "http_added_p99_ms": (p["http"][1] - p["direct"][1]) * 1e3,
        # the judged sidecar's CPU a streamed request, at the most callers (mostly relaying its chunks)
        "stream_sidecar_cpu_us_per_request": next(
            r["cpu_us_per_request"]["sidecar"] for r in reversed(rates) if r["path"] == "stream"),
        # the judged sidecar's CPU a streamed token, each answer a token a step (the relay's slope)
        "relay_http_cpu_us_per_token": relay["doors"]["http"]["cpu_us_per_token"],
        "relay_grpc_cpu_us_per_token": relay["doors"]["grpc"]["cpu_us_per_token"],
        "latency_ms": {name: {"p50": v[0] * 1e3, "p99": v[1] * 1e3} for name, v in p.items()},
        "rates": rates,
        "relay": relay,
    }
    if cfg.profile:
        out["profile_top"] = hot_spots(cfg.profile)
        say("sidecar hot spots (cProfile, by own time):\n" + out["profile_top"])
    return out


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
    print("sidecar/http: the policy default (gRPC and HTTP doors); tuned: hand-tuned (Hint predictor, Static 1024)")
    print(f"{'path':10} {'p50 ms':>8} {'p99 ms':>8}")
    for name in ("direct", "sidecar", "http", "stream", "tuned"):
        if name in lat:
            print(f"{name:10} {lat[name]['p50']:8.2f} {lat[name]['p99']:8.2f}")
    print(f"{'added':10} {doc['added_p50_ms']:8.2f} {doc['added_p99_ms']:8.2f}  (gRPC door)")
    print(f"{'added':10} {doc['http_added_p50_ms']:8.2f} {doc['http_added_p99_ms']:8.2f}  (HTTP door)")
    if "tuned" in lat:
        print(f"{'added':10} {lat['tuned']['p50'] - lat['direct']['p50']:8.2f} "
              f"{lat['tuned']['p99'] - lat['direct']['p99']:8.2f}  (gRPC door, hand-tuned)")  # fmt: skip
    procs = ("client", "sidecar", "engine")
    print(f"{'path':10} {'callers':>8} {'req/s':>8} {'B_t':>6}   CPU us per request: " + " ".join(f"{p:>8}" for p in procs))
    for r in doc["rates"]:
        cpu = r.get("cpu_us_per_request", {})
        shown = " ".join("       -" if cpu.get(p) is None else f"{cpu[p]:8.0f}" for p in procs)
        cap = "-" if r.get("target_batch_size") is None else str(r["target_batch_size"])
        print(f"{r['path']:10} {r['concurrency']:8d} {r['requests_per_s']:8.0f} {cap:>6}   {'':20}{shown}")
    if doc.get("stream_sidecar_cpu_us_per_request") is not None:
        print(f"sidecar CPU a streamed request ({STREAM_TOKENS} tokens, no hint): "
              f"{doc['stream_sidecar_cpu_us_per_request']:.0f} us")  # fmt: skip
    if (relay := doc.get("relay")) is not None:
        print(f"the sidecar's CPU relaying answers streamed a token a step ({relay['concurrency']} callers):")
        for door, v in relay["doors"].items():
            name = "HTTP" if door == "http" else "gRPC"
            if v["cpu_us_per_token"] is None:
                print(f"  {name} door: not measured (no /proc to read the CPU from)")
                continue
            per_second = f" ({1e6 / v['cpu_us_per_token']:,.0f} tokens a CPU second)" if v["cpu_us_per_token"] > 0 else ""
            print(f"  {name} door: {v['cpu_us_per_token']:.0f} us a token + {v['cpu_us_per_request']:.0f} us a "
                  f"request{per_second}")  # fmt: skip
    print(f"max requests/s through the sidecar (policy default): {doc['max_requests_per_s']:.0f}; "
          f"through its HTTP door: {doc['http_max_requests_per_s']:.0f}")
    sys.stdout.flush()
