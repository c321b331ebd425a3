"""``binbatch bench fleet-model``: what one pod learned, carried to a new pod through its exported records.

A first sidecar (``Learned``, cold) in front of the embedded engine serves
``train_requests`` ShareGPT first turns of the training split; its predictor
refits as they complete (after 64, 128, ... records: with a power of two, its
last fit is on all of them).  Its records are then exported
(``Admin/ExportTrainingRecords``, hashed features only) and fitted with
``training_records.train`` -- what ``binbatch predictor export`` + ``predictor
train`` and the operator's fleet model do -- into a model file.  Then the same
``eval_requests`` turns of the evaluation split go to three sidecars:

* ``first``: the sidecar that learned (its own model);
* ``second``: a new sidecar started from the exported model (``warmStart``);
* ``cold``: a new sidecar without a model (what a new pod has without the fleet model).

Each one's ranking of its requests is Kendall's tau of the predicted against the
actual output lengths (``GenerateResponse.predicted_output_tokens`` /
``completion_tokens``).  The claim: ``second`` is within ``TOLERANCE`` of
``first``.  The engine ends each answer at its recorded length through its
answer-lengths file, which the sidecar never sees; the client cap is
``workloads.SHAREGPT_MAX_TOKENS``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc

from ..config import load_config
from ..emulator import EmulatorConfig, running_emulator
from ..emulator.answers import prompt_key
from ..engine.model_file import save_model
from ..engine.record_export import export_records
from ..engine.training_records import train
from . import sharegpt, workloads

TOLERANCE = 0.02
CONCURRENCY = 32  # requests in flight at once: a refit that starts within a wave is awaited before the next


@dataclass(frozen=True)
class FleetModelBenchConfig:
    train_requests: int = 2048  # a power of two >= 64: the first sidecar's last refit is on all of them
    eval_requests: int = 200
    seed: int = 1

    def __post_init__(self) -> None:
        n = self.train_requests
        if n < 64 or n & (n - 1):
            raise ValueError(f"train_requests: a power of two >= 64 (the learned predictor refits at 64, 128, ...), got {n}")  # fmt: skip
        if self.eval_requests < 8:
            raise ValueError(f"eval_requests: at least 8 (Kendall's tau needs pairs), got {self.eval_requests}")


def quick() -> FleetModelBenchConfig:
    """The seconds-long version (the test suite's)."""
    return FleetModelBenchConfig(train_requests=256, eval_requests=64)


def train_turns(count: int, seed: int) -> list[sharegpt.Turn]:
    """``count`` first turns of the training split (prompts that fit, each once), in a seeded order."""
    turns, seen = [], set()
    for t in sharegpt.split("train"):
        if t.prompt not in seen and sharegpt.count_tokens(t.prompt) <= workloads.SHAREGPT_PROMPT_TOKENS:
            turns.append(t)
        seen.add(t.prompt)
    if count > len(turns):
        raise ValueError(f"train_requests: at most {len(turns)}, got {count}")
    random.Random(f"{seed}/fleet-model").shuffle(turns)
    return turns[:count]


def _sidecar_doc(url: str, predictor: dict[str, Any]) -> dict[str, Any]:
    return {
        "engine": {"url": url},
        "metrics": {"url": f"{url}/metrics", "intervalMilliseconds": 100, "staleAfterMilliseconds": 2000},
        "server": {"grpcPort": 0, "httpPort": 0, "metricsPort": 0, "drainGraceSeconds": 10},
        "predictor": {"kind": "Learned", **predictor},
    }


@contextlib.asynccontextmanager
async def _sidecar(doc: dict[str, Any], folder: Path, name: str) -> AsyncIterator[Any]:
    from ..server.app import Sidecar

    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    sidecar = Sidecar(load_config(path), config_path=str(path), host="127.0.0.1")
    await sidecar.start()
    try:
        yield sidecar
    finally:
        if sidecar.dispatcher.accepting:
            await sidecar.stop(grace=5)


async def _serve(sidecar: Any, turns: list[sharegpt.Turn], wait_for_refits: bool) -> list[tuple[float, int]]:
    """(predicted, actual) of each turn, ``CONCURRENCY`` at a time; with ``wait_for_refits`` a refit the
    wave started is finished before the next wave (so each refit is on the records it was due at)."""
    out: list[tuple[float, int]] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
        stub = pb_grpc.InferenceStub(channel)

        async def one(turn: sharegpt.Turn) -> tuple[float, int]:
            req = pb.GenerateRequest(prompt=turn.prompt, max_tokens=workloads.SHAREGPT_MAX_TOKENS)
            resp = await stub.Generate(req, timeout=300)
            return resp.predicted_output_tokens, resp.completion_tokens

        for start in range(0, len(turns), CONCURRENCY):
            out += await asyncio.gather(*(one(t) for t in turns[start:start + CONCURRENCY]))
            refit = getattr(sidecar.dispatcher, "_refit", None)
            if wait_for_refits and refit is not None:
                await refit
    return out


def _tau(pairs: list[tuple[float, int]]) -> float:
    from scipy.stats import kendalltau

    return float(kendalltau(*zip(*pairs)).statistic)


async def run_async(cfg: FleetModelBenchConfig, say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    started = time.monotonic()
    training = train_turns(cfg.train_requests, cfg.seed)
    evaluation = workloads.sharegpt_turns(cfg.eval_requests, cfg.seed)
    with tempfile.TemporaryDirectory(prefix="binbatch-fleet-model-") as tmp:
        folder = Path(tmp)
        answers = folder / "answers.jsonl"
        answers.write_text("".join(json.dumps({"prompt_sha256": prompt_key(t.prompt), "output_tokens": t.output_tokens})
                                   + "\n" for t in training + evaluation))  # fmt: skip
        engine = EmulatorConfig(step_a=0.0002, step_c=0.00005, num_gpu_blocks=16384, block_size=16,
                                answer_lengths=str(answers), seed=cfg.seed)  # fmt: skip
        learned = {"trainingBufferRecords": cfg.train_requests, "refitEveryRecords": cfg.train_requests}
        async with running_emulator(engine) as url:
            async with _sidecar(_sidecar_doc(url, learned), folder, "first") as first:
                say(f"first sidecar: serving {len(training)} training turns")
                await _serve(first, training, wait_for_refits=True)
                exported = await export_records(f"127.0.0.1:{first.grpc_port}", limit=cfg.train_requests)
                say(f"exported {len(exported.records)} records; fitting")
                model = await asyncio.to_thread(train, exported.records)
                model_path = folder / "model.npz"
                save_model(model_path, model)
                say(f"first sidecar: {len(evaluation)} evaluation turns")
                first_pairs = await _serve(first, evaluation, wait_for_refits=False)
            async with _sidecar(_sidecar_doc(url, {"warmStart": str(model_path)}), folder, "second") as second:
                say("second sidecar (from the exported model): the same evaluation turns")
                second_pairs = await _serve(second, evaluation, wait_for_refits=False)
            async with _sidecar(_sidecar_doc(url, {}), folder, "cold") as cold:
                say("cold sidecar (no model): the same evaluation turns")
                cold_pairs = await _serve(cold, evaluation, wait_for_refits=False)
        size = model_path.stat().st_size if model_path.exists() else 0
    taus = {"first": _tau(first_pairs), "second": _tau(second_pairs), "cold": _tau(cold_pairs)}
    return {
        "setup": {**asdict(cfg), "tolerance": TOLERANCE, "exported_records": len(exported.records),
                  "model_records": model.records, "model_file_bytes": size},  # fmt: skip
        "kendall_tau": taus,
        "difference": taus["second"] - taus["first"],
        "within_tolerance": abs(taus["second"] - taus["first"]) <= TOLERANCE,
        "seconds": time.monotonic() - started,
    }


def run(cfg: FleetModelBenchConfig, say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    return asyncio.run(run_async(cfg, say))


def print_tables(doc: dict[str, Any]) -> None:
    s, tau = doc["setup"], doc["kendall_tau"]
    print(f"binbatch bench fleet-model: a sidecar learned from {s['train_requests']} ShareGPT training turns; "
          f"{s['exported_records']} records exported and fitted ({s['model_file_bytes'] / 1024:.0f} KiB); "
          f"{s['eval_requests']} evaluation turns ranked by")  # fmt: skip
    print(f"{'sidecar':34}{'Kendall tau':>12}")
    for name, label in (("first", "first (learned them)"), ("second", "second (from the exported model)"),
                        ("cold", "cold (no model)")):  # fmt: skip
        print(f"{label:34}{tau[name]:>12.3f}")
    verdict = "within" if doc["within_tolerance"] else "NOT within"
    print(f"second - first: {doc['difference']:+.4f} ({verdict} {s['tolerance']}); {doc['seconds']:.0f} s")
