"""``binbatch demo``: the whole data plane on the embedded engine, side by side.

Starts the vLLM-compatible engine emulator and, one after another, sidecars with
different configs in front of it (all on 127.0.0.1), sends the same saturated
workload through each over real gRPC, and reports throughput as ratios to the
one-bin gang baseline (the multi-bin seed's setting: a batch holds its slot
until its longest request is done).  Lengths come from ``max_tokens`` with
``ignore_eos``; clients pass the length as the ``expected_output_tokens`` hint.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc

from ..config import load_config
from ..emulator import EmulatorConfig, running_emulator
from ..server.app import Sidecar

ENGINE = EmulatorConfig(step_a=0.004, step_c=0.0001, num_gpu_blocks=8192, block_size=16, max_num_seqs=256)


@dataclass(frozen=True)
class DemoConfig:
    requests: int = 384
    min_tokens: int = 4
    max_tokens: int = 96
    batch: int = 32
    seed: int = 1


def scenarios(cfg: DemoConfig) -> list[tuple[str, dict[str, Any]]]:
    gang = {"mode": "Gang", "sizing": "Static", "staticSize": cfg.batch, "maxWaitMilliseconds": 200,
            "maxInflightBatches": 1}  # fmt: skip
    bins = {"mode": "Fixed", "maxOutputTokens": cfg.max_tokens}
    return [
        ("gang, 1 bin", {"batch": gang, "bins": {**bins, "count": 1}}),
        ("gang, 2 bins", {"batch": gang, "bins": {**bins, "count": 2}}),
        ("gang, 4 bins", {"batch": gang, "bins": {**bins, "count": 4}}),
        ("continuous, 4 bins, memory-sized", {
            "batch": {"mode": "Continuous", "sizing": "Memory", "staticSize": cfg.batch, "maxWaitMilliseconds": 20},
            "bins": {**bins, "count": 4},
        }),  # fmt: skip
    ]


async def _run_one(url: str, overrides: dict[str, Any], lengths: list[int], tmp: Path) -> dict[str, Any]:
    doc = {
        "engine": {"url": url},
        "metrics": {"url": f"{url}/metrics", "intervalMilliseconds": 200},
        "predictor": {"kind": "Hint"},
        "server": {"grpcPort": 0, "httpPort": 0, "metricsPort": 0},
        "logging": {"level": "Warning"},
        **overrides,
    }
    path = tmp / "demo.yaml"
    path.write_text(yaml.safe_dump(doc))
    sidecar = Sidecar(load_config(path), host="127.0.0.1")
    await sidecar.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            t0 = time.perf_counter()
            replies = await asyncio.gather(*(
                stub.Generate(pb.GenerateRequest(prompt=f"demo request {i}", max_tokens=n, ignore_eos=True,
                                                 expected_output_tokens=n), timeout=600)  # fmt: skip
                for i, n in enumerate(lengths)
            ))  # fmt: skip
            elapsed = time.perf_counter() - t0
    finally:
        await sidecar.stop(grace=5)
    tokens = sum(r.completion_tokens for r in replies)
    assert tokens == sum(lengths), "every request must come back with its exact length"
    return {
        "seconds": elapsed,
        "requests_per_second": len(lengths) / elapsed,
        "tokens_per_second": tokens / elapsed,
        "mean_batch": sum(r.batch_size for r in replies) / len(replies),
        "mean_queue_seconds": sum(r.queue_seconds for r in replies) / len(replies),
    }


async def run_async(cfg: DemoConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    lengths = [rng.randint(cfg.min_tokens, cfg.max_tokens) for _ in range(cfg.requests)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        async with running_emulator(ENGINE) as url:
            for name, overrides in scenarios(cfg):
                progress(f"{name}: {cfg.requests} requests")
                rows.append({"scenario": name, **await _run_one(url, overrides, lengths, Path(tmp))})
    base = rows[0]["requests_per_second"]
    for row in rows:
        row["ratio_to_1_bin"] = row["requests_per_second"] / base
    return {
        "engine": {"step_seconds": f"{ENGINE.step_a} + {ENGINE.step_c}*b", "kv_tokens": ENGINE.kv_capacity_tokens},
        "workload": {"requests": cfg.requests, "lengths": [cfg.min_tokens, cfg.max_tokens], "batch": cfg.batch},
        "rows": rows,
    }


def run(cfg: DemoConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    return asyncio.run(run_async(cfg, progress))


def print_table(doc: dict[str, Any]) -> None:
    w = doc["workload"]
    print(f"binbatch demo: {w['requests']} requests, output lengths ~ U{w['lengths']}, B={w['batch']}, "
          f"embedded engine step {doc['engine']['step_seconds']} s")  # fmt: skip
    print(f"{'scenario':36} {'req/s':>8} {'tok/s':>8} {'mean batch':>10} {'queue s':>8} {'vs 1 bin':>8}")
    for r in doc["rows"]:
        print(f"{r['scenario']:36} {r['requests_per_second']:8.1f} {r['tokens_per_second']:8.0f} "
              f"{r['mean_batch']:10.1f} {r['mean_queue_seconds']:8.2f} {r['ratio_to_1_bin']:8.2f}")  # fmt: skip
