"""``binbatch bench memory``: many large POSTs at once, and the sidecar's memory.

The sidecar runs as a child process (so its resident memory is its own) in front
of a slow embedded engine (so requests queue), both on 127.0.0.1.  ``posts``
clients POST ``/v1/completions`` at once, each body about ``server.maxRequestBytes``:
half just under it (read, queued, served -- or 429 once the queued bodies reach
``batch.maxQueuedBytes``), a quarter just over it with a ``Content-Length`` (413
before a byte of the body is read), a quarter just over it sent chunked (no length:
read until it passes the limit, then 413).  The child's RSS is sampled every
``sample_ms``; its peak resident set (the kernel's ``VmHWM``, which no sample can
miss) is read at the end.  Every request must get exactly one answer; the figures
say how many got which status, how many got none (must be 0), and whether the
sidecar still serves afterwards.

The sidecar's config is what the operator renders for a policy that sets nothing
(``e2e.policy_default``), with one change: ``engine.maxRequestBodyBytes`` is raised
above the bodies (and the engine's own limit with it), since with the default
(768 KiB, below vLLM's 1 MiB) a ~4 MiB prompt is refused when it leaves the queue
and never reaches the engine.  The second run lowers ``batch.maxQueuedBytes``, sends
only bodies under the limit and holds the engine to ``HELD`` requests at a time
(``batch.sizing: Static``), to show the 429 path on its own: the HTTP door takes a
burst in a few requests a turn (``server/turns.py``) and sends them on at once to an
engine with room, so without the hold the queue would never fill.

The peak is compared with the memory the operator gives the sidecar container
(``builders.DEFAULT_RESOURCES``: the limit, which the request is raised to in a
Guaranteed pod).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes.utils import parse_quantity

from binbatch_operator.builders import DEFAULT_RESOURCES

from ..config import MAX_QUEUED_BYTES_DEFAULT, MAX_REQUEST_BYTES_DEFAULT
from .bench_processes import EngineProcess, EngineShape, served_model, sidecar_doc, start_sidecar
from .chaos_processes import http_port, run_to_end
from .e2e import policy_default

MIB = 1024 * 1024
# Slow enough that the posts queue: ~50 ms a step, at most 4 sequences, each prompt ~4,100 tokens
# to the emulator (one token per whitespace-separated word: the filler's words are 1 KiB long).
SLOW = EngineShape(step_a=0.05, step_c=0.002, num_gpu_blocks=1200, block_size=16, max_num_seqs=4,
                   max_model_len=8192)  # fmt: skip
WORD = "w" * 1023 + " "  # one emulator token per KiB of prompt
MARGIN = 4096  # bytes under / over server.maxRequestBytes
ANSWER_TOKENS = 8
CALL_TIMEOUT_S = 600.0
KINDS = ("under", "over", "over-chunked")  # of every 4 posts: 2 under, 1 over, 1 over chunked
HELD = 2  # the second run's batch.staticSize: the rest of its posts queue in the sidecar


@dataclass(frozen=True)
class MemoryConfig:
    posts: int = 200
    body_bytes: int = MAX_REQUEST_BYTES_DEFAULT  # ~ the size of each post (just under / over it)
    max_request_bytes: int = MAX_REQUEST_BYTES_DEFAULT  # server.maxRequestBytes of the sidecar under test
    max_queued_bytes: int = MAX_QUEUED_BYTES_DEFAULT  # batch.maxQueuedBytes of the first run
    lowered_queued_bytes: int = 16 * MIB  # batch.maxQueuedBytes of the second run (0: no second run)
    sample_ms: int = 50
    engine: EngineShape = SLOW


def quick(cfg: MemoryConfig) -> MemoryConfig:
    """The seconds-long version (the test suite's): 12 posts of ~256 KiB."""
    return replace(cfg, posts=12, body_bytes=256 * 1024, max_request_bytes=256 * 1024, max_queued_bytes=MIB,
                   lowered_queued_bytes=MIB)  # fmt: skip


def stated_bytes() -> int:
    """The memory the operator gives an injected sidecar (its limit; a Guaranteed pod's request too)."""
    return int(parse_quantity(DEFAULT_RESOURCES["limits"]["memory"]))


def completion_body(size: int, model: str) -> bytes:
    """A ``/v1/completions`` JSON body of exactly ``size`` bytes whose prompt is filler words."""
    head = f'{{"model": "{model}", "max_tokens": {ANSWER_TOKENS}, "ignore_eos": true, "prompt": "'.encode()
    tail = b'"}'
    room = size - len(head) - len(tail)
    if room < 1:
        raise ValueError(f"body_bytes: {size} is too small for a request")
    filler = (WORD * (room // len(WORD) + 1))[:room]
    return head + filler.encode() + tail


def _kind(i: int) -> str:
    return KINDS[(0, 0, 1, 2)[i % 4]]


async def _chunks(body: bytes, size: int = 256 * 1024) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start : start + size]


def _peak_rss(pid: int) -> int | None:
    """The process's peak resident set so far (Linux ``VmHWM``), in bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def _post(http: aiohttp.ClientSession, url: str, body: bytes, chunked: bool) -> str:
    """The status the sidecar answered, or "none: <why>" when it answered nothing."""
    data: bytes | AsyncIterator[bytes] = _chunks(body) if chunked else body
    try:
        async with http.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
            await resp.read()
            return str(resp.status)
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        return f"none: {type(exc).__name__}: {exc}"[:200]


async def _one_run(cfg: MemoryConfig, label: str, queued_bytes: int, kinds: tuple[str, ...], tmp: Path,
                   engine_url: str, model: str, say: Callable[[str], None], held: int | None = None) -> dict[str, Any]:  # fmt: skip
    import psutil

    doc = sidecar_doc(engine_url, model, policy_default({}))
    doc["engine"]["maxRequestBodyBytes"] = 2 * cfg.max_request_bytes  # the bodies reach the engine (docstring)
    doc["batch"] = {**doc.get("batch", {}), "maxQueuedBytes": queued_bytes}
    if held is not None:  # at most this many in the engine: the rest queue here (docstring)
        doc["batch"] |= {"sizing": "Static", "staticSize": held}
    doc["server"]["maxRequestBytes"] = cfg.max_request_bytes
    sidecar = await start_sidecar(doc, tmp / f"sidecar-{label}.yaml", tmp)
    try:
        url = f"http://127.0.0.1:{http_port(sidecar.lines)}/v1/completions"
        proc = psutil.Process(sidecar.pid)
        under = completion_body(cfg.body_bytes - MARGIN, model)
        over = completion_body(cfg.body_bytes + MARGIN, model)
        small = completion_body(4096, model)
        timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            warm = await _post(http, url, small, chunked=False)  # the first answer loads what serving needs
            if warm != "200":
                raise RuntimeError(f"the warm-up request was answered {warm}")
            before = proc.memory_info().rss
            samples: list[int] = []
            done = asyncio.Event()

            async def sample() -> None:
                while not done.is_set():
                    with contextlib.suppress(psutil.Error):
                        samples.append(proc.memory_info().rss)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(done.wait(), cfg.sample_ms / 1000)

            sampler = asyncio.create_task(sample())
            started = time.monotonic()
            sent = [kinds[i % len(kinds)] for i in range(cfg.posts)]
            answers = await asyncio.gather(*(_post(http, url, over if k != "under" else under, k == "over-chunked")
                                             for k in sent))  # fmt: skip
            elapsed = time.monotonic() - started
            done.set()
            await sampler
            alive = sidecar.running
            after = await _post(http, url, small, chunked=False) if alive else "none: the sidecar exited"
        peak_hwm = _peak_rss(sidecar.pid)
    finally:
        code = await sidecar.signal_and_wait(signal.SIGTERM, 30)
    by_kind: dict[str, Counter[str]] = {}
    for kind, status in zip(sent, answers, strict=True):
        by_kind.setdefault(kind, Counter())[status if not status.startswith("none") else "none"] += 1
    statuses = Counter(s if s in ("200", "413", "429") else ("none" if s.startswith("none") else "other")
                       for s in answers)  # fmt: skip
    unanswered = [s for s in answers if s.startswith("none")]
    peak_sampled = max(samples, default=before)
    say(f"{label}: {cfg.posts} posts in {elapsed:.1f} s: " + ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))
        + f"; RSS {before / MIB:.0f} MiB before, peak {max(peak_sampled, peak_hwm or 0) / MIB:.0f} MiB")
    return {
        "run": label,
        "posts": cfg.posts,
        "body_bytes": cfg.body_bytes,
        "max_request_bytes": cfg.max_request_bytes,
        "max_queued_bytes": queued_bytes,
        "kinds": dict(Counter(sent)),
        "answers": {k: statuses.get(k, 0) for k in ("200", "413", "429", "other", "none")},
        "answers_by_kind": {k: dict(v) for k, v in by_kind.items()},
        "unanswered_examples": unanswered[:3],
        "elapsed_s": elapsed,
        "rss_before_bytes": before,
        "rss_peak_sampled_bytes": peak_sampled,
        "rss_peak_bytes": max(peak_sampled, peak_hwm or 0),  # VmHWM: the kernel's peak, between samples too
        "rss_samples": len(samples),
        "alive_at_end": alive,
        "answer_after": after,
        "exit_code": code,
    }


async def run_async(cfg: MemoryConfig, say: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="binbatch-bench-memory-") as tmp_name:
        tmp = Path(tmp_name)
        engine = EngineProcess(replace(cfg.engine, max_request_body_bytes=4 * cfg.max_request_bytes), tmp)
        await engine.start()
        try:
            async with aiohttp.ClientSession() as http:
                model, _ = await served_model(http, engine.url)
            say(f"slow engine on {engine.url}: {cfg.engine.describe()}")
            runs = [await _one_run(cfg, "mixed sizes", cfg.max_queued_bytes, KINDS[:1] * 2 + KINDS[1:], tmp,
                                   engine.url, model, say)]  # fmt: skip
            if cfg.lowered_queued_bytes:
                runs.append(await _one_run(cfg, "under only, lowered maxQueuedBytes", cfg.lowered_queued_bytes, ("under",), tmp,
                                           engine.url, model, say, held=HELD))  # fmt: skip
        finally:
            await engine.stop()
    stated = stated_bytes()
    for r in runs:
        r["within_stated"] = r["rss_peak_bytes"] <= stated
    return {"stated_memory_bytes": stated, "stated_memory": DEFAULT_RESOURCES["limits"]["memory"], "runs": runs,
            "unanswered": sum(r["answers"]["none"] for r in runs),
            "all_alive": all(r["alive_at_end"] for r in runs)}  # fmt: skip


def run(cfg: MemoryConfig, say: Callable[[str], None]) -> dict[str, Any]:
    return run_to_end(run_async(cfg, say))


def print_table(doc: dict[str, Any]) -> None:
    print(f"binbatch bench memory: RSS of the sidecar against the memory the operator gives it "
          f"({doc['stated_memory']}, {doc['stated_memory_bytes'] / MIB:.0f} MiB)")  # fmt: skip
    print(f"{'run':24} {'posts':>5} {'queued bytes':>12} {'200':>5} {'413':>5} {'429':>5} {'other':>5} {'none':>5} "
          f"{'RSS before':>10} {'peak':>8} {'within':>6} {'alive':>5}")  # fmt: skip
    for r in doc["runs"]:
        a = r["answers"]
        print(f"{r['run'][:24]:24} {r['posts']:5} {r['max_queued_bytes'] / MIB:9.0f} MiB {a['200']:5} {a['413']:5} "
              f"{a['429']:5} {a['other']:5} {a['none']:5} {r['rss_before_bytes'] / MIB:6.0f} MiB "
              f"{r['rss_peak_bytes'] / MIB:4.0f} MiB {'yes' if r['within_stated'] else 'NO':>6} "
              f"{'yes' if r['alive_at_end'] else 'NO':>5}")  # fmt: skip
