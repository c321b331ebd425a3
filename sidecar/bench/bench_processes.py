"""The e2e and overhead benches' processes: the embedded engine and the sidecars.

Each runs as its own child of this interpreter on 127.0.0.1, so the bench's
client, the sidecar and the engine do not share one event loop (or one core's
GIL) and a user's view is reproduced: a client, a sidecar process, an engine.

The engine is started through the ``binbatch emulate-engine`` command only
(:func:`emulator_args` is the one place that knows its flags), never imported,
so the emulator can move between packages without touching the bench.  The
sidecar is ``binbatch sidecar --config FILE``.  Readiness is the line each
prints when it serves (see :mod:`.chaos_processes`), never a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from ..engine.engine_client import KEEPALIVE_SECONDS
from .chaos_processes import ChildProcess, SidecarProcess

_ENGINE_READY = re.compile(r"binbatch emulate-engine: .* on http://127\.0\.0\.1:(\d+)")
# vLLM's preemption counter: the family name the parser reports for
# ``vllm:num_preemptions_total`` (and the pre-0.10 spelling without _total).
_PREEMPTIONS = ("vllm:num_preemptions", "vllm:num_preemptions_total")


@dataclass(frozen=True, slots=True)
class EngineShape:
    """The embedded engine: τ(b) = a + c·b seconds per step, plus ``prefill_per_token``
    per token the step prefills (prompts admitted, or recomputed after a
    preemption), and a KV budget."""

    step_a: float
    step_c: float
    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_model_len: int = 512
    prefill_per_token: float = 0.0
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy
    answer_lengths: str = ""  # --answer-lengths: recorded answer lengths by prompt (write_answer_lengths)
    max_request_body_bytes: int = 0  # --max-request-body-bytes (0: the emulator's own, 1 MiB as vLLM's)
    enable_prefix_caching: bool = False  # --enable-prefix-caching: prompt blocks that begin alike held once

    def describe(self) -> str:
        policy = "" if self.scheduling_policy == "fcfs" else f", {self.scheduling_policy} scheduling"
        prefix = ", prefix caching" if self.enable_prefix_caching else ""
        return (f"tau(b) = {self.step_a * 1e3:g} ms + {self.step_c * 1e3:g} ms*b "
                f"+ {self.prefill_per_token * 1e3:g} ms per prefilled token, "
                f"KV {self.num_gpu_blocks}x{self.block_size} tokens, max {self.max_num_seqs} seqs{policy}{prefix}")  # fmt: skip


def emulator_args(shape: EngineShape) -> list[str]:
    """``binbatch emulate-engine`` flags for ``shape`` on a free loopback port."""
    return ["-m", "binbatch_sidecar.cli", "emulate-engine", "--host", "127.0.0.1", "--port", "0",
            "--step-a", repr(shape.step_a), "--step-c", repr(shape.step_c),
            "--prefill-per-token", repr(shape.prefill_per_token),
            "--num-gpu-blocks", str(shape.num_gpu_blocks), "--block-size", str(shape.block_size),
            "--max-num-seqs", str(shape.max_num_seqs), "--max-model-len", str(shape.max_model_len),
            "--scheduling-policy", shape.scheduling_policy,
            *(("--answer-lengths", shape.answer_lengths) if shape.answer_lengths else ()),
            *(("--max-request-body-bytes", str(shape.max_request_body_bytes)) if shape.max_request_body_bytes else ()),
            *(("--enable-prefix-caching",) if shape.enable_prefix_caching else ())]  # fmt: skip


def write_answer_lengths(path: Path, answers: Iterable[tuple[str, int]]) -> None:
    """``emulate-engine --answer-lengths``'s file for (prompt, recorded output tokens)
    pairs: one JSON line each, the prompt keyed by the SHA-256 of its UTF-8 text."""
    with path.open("w", encoding="utf-8") as f:
        for prompt, tokens in answers:
            key = hashlib.sha256(prompt.encode("utf-8")).hexdigest()
            f.write(json.dumps({"prompt_sha256": key, "output_tokens": tokens}) + "\n")


class EngineProcess(ChildProcess):
    """The embedded engine as a child process."""

    def __init__(self, shape: EngineShape, cwd: Path) -> None:
        super().__init__("embedded engine")
        self.shape = shape
        self.cwd = cwd
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.port = await self._spawn(emulator_args(self.shape), _ENGINE_READY, self.cwd)

    async def stop(self) -> None:
        await self.signal_and_wait(signal.SIGTERM, 15)


async def start_sidecar(doc: dict[str, Any], path: Path, cwd: Path, cpus: frozenset[int] | None = None) -> SidecarProcess:
    """Write ``doc`` to ``path`` and start ``binbatch sidecar --config path`` (on ``cpus`` when given)."""
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = SidecarProcess(path, cwd, cpus)
    await proc.start()
    return proc


def sidecar_doc(engine_url: str, model: str, overrides: dict[str, Any], *, scrape_ms: int | None = 200) -> dict[str, Any]:
    """A sidecar config for ``engine_url``: loopback ports, Info logs (the ready
    line is an Info record), metrics scraped every ``scrape_ms`` (None: the
    default interval), then ``overrides``."""
    every = {} if scrape_ms is None else {"intervalMilliseconds": scrape_ms}
    return {
        "engine": {"url": engine_url, "model": model},
        "metrics": {"url": f"{engine_url}/metrics", **every},
        "server": {"grpcPort": 0, "httpPort": 0, "metricsPort": 0, "drainGraceSeconds": 5},
        "logging": {"level": "Info"},
        **overrides,
    }


async def started_engine(stack: contextlib.AsyncExitStack, shape: EngineShape, cwd: Path) -> tuple[EngineProcess, str]:
    """The embedded engine of ``shape`` as a child process, stopped when ``stack`` closes, and the model it serves."""
    engine = EngineProcess(shape, cwd)
    await engine.start()
    stack.push_async_callback(engine.stop)
    async with aiohttp.ClientSession() as http:
        model, _ = await served_model(http, engine.url)
    return engine, model


async def served_model(session: aiohttp.ClientSession, url: str) -> tuple[str, int | None]:
    """The first model the engine lists on ``/v1/models`` and its context length
    (vLLM's ``max_model_len``; None when the engine does not say)."""
    async with session.get(f"{url}/v1/models") as resp:
        resp.raise_for_status()
        data = (await resp.json())["data"]
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model")
    context = data[0].get("max_model_len")
    return str(data[0]["id"]), context if type(context) is int else None


METRICS_RETRY_SECONDS = 0.2  # between reads of the engine's metrics that failed


def bench_session(timeout_s: float) -> aiohttp.ClientSession:
    """A bench client's session: as many connections as callers, each pooled for less than
    vLLM's (uvicorn's) 5 s keep-alive, as the sidecar's own engine client keeps them: a
    connection the server closed while idle fails the next request sent on it."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s))


async def sidecar_samples(session: aiohttp.ClientSession, port: int, family: str) -> list[Sample]:
    """The samples of ``family`` on a sidecar's metrics port (its ``_created`` ones left out)."""
    async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
        text = await resp.text()
    return [s for fam in text_string_to_metric_families(text) if fam.name == family
            for s in fam.samples if not s.name.endswith("_created")]  # fmt: skip


async def sidecar_metric(session: aiohttp.ClientSession, port: int, family: str, labels: dict[str, str] | None = None) -> float:
    """The value of ``family``'s sample with ``labels`` on a sidecar's metrics port (0 when it has none)."""
    wanted = (labels or {}).items()
    samples = await sidecar_samples(session, port, family)
    return next((s.value for s in samples if all(s.labels.get(k) == v for k, v in wanted)), 0.0)


async def preemptions(session: aiohttp.ClientSession, url: str, attempts: int = 3) -> float | None:
    """The engine's cumulative preemption count from ``/metrics`` (summed over
    its label sets), or None when the engine exposes none or its metrics cannot
    be read in ``attempts`` tries: a GET, so a broken connection or an error status
    is tried again a moment later (one lost read left a real-vLLM run's row without
    its count)."""
    text = None
    for attempt in range(attempts):
        if attempt:
            await asyncio.sleep(METRICS_RETRY_SECONDS)
        try:
            async with session.get(f"{url}/metrics") as resp:
                if resp.status == 200:
                    text = await resp.text()
                    break
        except aiohttp.ClientError:
            pass
    if text is None:
        return None
    total = None
    for family in text_string_to_metric_families(text):
        if family.name in _PREEMPTIONS:
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    total = (total or 0.0) + sample.value
    return total
