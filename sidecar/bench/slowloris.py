"""``binbatch bench slowloris``: a normal request's latency while many clients hold
half-sent requests open on the HTTP door.

An instant engine (the emulator with zero step time) and one sidecar run as child
processes, all on 127.0.0.1.  The bench measures normal requests (``POST
/v1/completions``, one token, each on a new connection, one at a time) before the
flood, then opens ``connections`` connections that each send half a request header
and then nothing, and measures normal requests again while they are held.  Then it
waits for the sidecar to cut the half-sent connections
(``server.httpRequestReadTimeoutMilliseconds``) and says when it did.

A half-sent connection past ``server.maxConnections`` is closed at once; so is a
normal request's connection while the cap is full: the figures say how many were.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from .bench_processes import sidecar_doc, sidecar_metric, started_engine
from .chaos_load import percentile
from .chaos_processes import SidecarProcess, metrics_port, run_to_end
from .overhead import HAND_TUNED, INSTANT, http_port

HALF_HEADER = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty"
OPEN_AT_ONCE = 200  # connects in flight at a time (the listen backlog is 128)
IDLE_WITHIN_S = 10  # for the normal requests' connections to be gone from the sidecar before the flood


@dataclass(frozen=True)
class SlowlorisConfig:
    connections: int = 2000
    max_connections: int = 4096  # server.maxConnections of the sidecar under test
    read_timeout_ms: int = 5000  # server.httpRequestReadTimeoutMilliseconds (the default is 30000)
    requests: int = 50  # normal requests before and during the flood


def _raise_file_limit(wanted: int) -> None:
    """The soft limit on open files up to ``wanted`` (within the hard limit); the sidecar inherits it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def _normal(url: str, model: str, n: int) -> tuple[list[float], int]:
    """``n`` normal requests one at a time, each on its own connection: latencies of the answered, refusals."""
    body = {"model": model, "prompt": "a normal request", "max_tokens": 1, "ignore_eos": True}
    latencies, refused = [], 0
    timeout = aiohttp.ClientTimeout(total=60)
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            async with aiohttp.ClientSession(timeout=timeout) as http, http.post(url, json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"the HTTP door answered {resp.status}")
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):  # closed at once: the cap is full
            refused += 1
            continue
        latencies.append(time.perf_counter() - t0)
    return latencies, refused


async def _until_no_connection_open(metrics: int) -> None:
    """Until the sidecar's HTTP door holds no connection (``binbatch_http_connections`` reads 0).

    A normal request's client closes its connection as it reads the answer; the sidecar
    drops it when its loop reads the close.  A flood opened before then would find one
    place fewer under the cap than the bench counts on.  Each read is a round trip
    through the sidecar's loop, which is what lets it see the close."""
    async with aiohttp.ClientSession() as http, asyncio.timeout(IDLE_WITHIN_S):
        while await sidecar_metric(http, metrics, "binbatch_http_connections"):
            pass


async def _open_half_sent(port: int, n: int) -> list[tuple[float, asyncio.StreamReader, asyncio.StreamWriter]]:
    gate = asyncio.Semaphore(OPEN_AT_ONCE)

    async def one() -> tuple[float, asyncio.StreamReader, asyncio.StreamWriter]:
        async with gate:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            opened = time.monotonic()
            writer.write(HALF_HEADER)
            await writer.drain()
            return opened, reader, writer

    return await asyncio.gather(*(one() for _ in range(n)))


async def _cut_after(opened: float, reader: asyncio.StreamReader, bound: float) -> float | None:
    """Seconds from ``opened`` until the server closed the connection; None if not within ``bound``."""
    try:
        async with asyncio.timeout(bound):
            await reader.read()
    except TimeoutError:
        return None
    except ConnectionError:  # closed with our half header unread: the kernel resets it
        pass
    return time.monotonic() - opened


async def run_async(cfg: SlowlorisConfig, say: Callable[[str], None]) -> dict[str, Any]:
    _raise_file_limit(2 * cfg.connections + 1024)
    with tempfile.TemporaryDirectory(prefix="binbatch-bench-slowloris-") as tmp_name:
        tmp = Path(tmp_name)
        async with contextlib.AsyncExitStack() as stack:
            engine, model = await started_engine(stack, INSTANT, tmp)
            server = {"maxConnections": cfg.max_connections, "httpRequestReadTimeoutMilliseconds": cfg.read_timeout_ms}
            doc = sidecar_doc(engine.url, model, HAND_TUNED)
            doc["server"].update(server)
            path = tmp / "sidecar.yaml"
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
            sidecar = SidecarProcess(path, tmp)
            await sidecar.start()
            stack.push_async_callback(sidecar.signal_and_wait, signal.SIGTERM, 30)
            port = http_port(sidecar.lines)
            url = f"http://127.0.0.1:{port}/v1/completions"
            say(f"instant engine on {engine.url}, sidecar HTTP door on :{port} (maxConnections "
                f"{cfg.max_connections}, read deadline {cfg.read_timeout_ms} ms)")  # fmt: skip
            await _normal(url, model, 10)  # warm-up
            baseline, refused_before = await _normal(url, model, cfg.requests)
            if refused_before or not baseline:
                raise RuntimeError(f"{refused_before} normal requests refused before any flood")
            await _until_no_connection_open(metrics_port(sidecar.lines))
            flood_started = time.monotonic()
            held = await _open_half_sent(port, cfg.connections)
            say(f"{cfg.connections} half-sent connections opened in {time.monotonic() - flood_started:.2f} s")
            during, during_refused = await _normal(url, model, cfg.requests)
            within = time.monotonic() - flood_started
            bound = cfg.read_timeout_ms / 1000 * 3 + 10
            cuts = await asyncio.gather(*(_cut_after(opened, reader, bound) for opened, reader, _ in held))
            for _, _, writer in held:
                writer.close()
            cut = sorted(c for c in cuts if c is not None)
            after_cut, _ = await _normal(url, model, 5)
    if within >= cfg.read_timeout_ms / 1000:
        say(f"warning: the normal requests ended {within:.1f} s into the flood, past the read deadline")
    ms = 1e3
    half = cfg.read_timeout_ms / 1000 * 0.5
    held_open = [c for c in cut if c >= half]  # cut by the deadline; the rest were closed at once (the cap)
    return {
        "connections": cfg.connections,
        "max_connections": cfg.max_connections,
        "read_timeout_ms": cfg.read_timeout_ms,
        "held": len(held_open),
        "refused_at_once": sum(1 for c in cut if c < half),
        "baseline_p50_ms": percentile(baseline, 0.5) * ms,
        "baseline_p99_ms": percentile(baseline, 0.99) * ms,
        "during_p50_ms": percentile(during, 0.5) * ms if during else None,
        "during_p99_ms": percentile(during, 0.99) * ms if during else None,
        "during_answered": len(during),
        "during_refused": during_refused,
        "during_window_s": within,
        "cut_after_p50_s": percentile(held_open, 0.5) if held_open else None,
        "cut_after_max_s": max(held_open) if held_open else None,
        "not_cut": cuts.count(None),
        "answered_after_cut": len(after_cut),
    }


def run(cfg: SlowlorisConfig, say: Callable[[str], None]) -> dict[str, Any]:
    return run_to_end(run_async(cfg, say))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def print_table(doc: dict[str, Any]) -> None:
    print(f"binbatch bench slowloris: {doc['connections']} half-sent connections on the HTTP door "
          f"(maxConnections {doc['max_connections']}, read deadline {doc['read_timeout_ms']} ms)")  # fmt: skip
    print(f"held open {doc['held']}, closed at once (past the cap) {doc['refused_at_once']}, "
          f"cut at p50 {_ms(doc['cut_after_p50_s'])} s / max {_ms(doc['cut_after_max_s'])} s, "
          f"never cut {doc['not_cut']}")  # fmt: skip
    print(f"{'normal requests':24} {'p50 ms':>8} {'p99 ms':>8} {'refused':>8}")
    print(f"{'before the flood':24} {_ms(doc['baseline_p50_ms']):>8} {_ms(doc['baseline_p99_ms']):>8} {0:>8}")
    print(f"{'during the flood':24} {_ms(doc['during_p50_ms']):>8} {_ms(doc['during_p99_ms']):>8} "
          f"{doc['during_refused']:>8}")  # fmt: skip
    print(f"answered after the cut: {doc['answered_after_cut']} of 5")
