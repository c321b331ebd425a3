"""``binbatch bench liar``: honest callers beside one whose length hints are 8x too short.

A hint places its request as a known length: the shortest-first queue admits a short
hint first.  A caller that always sends a hint an eighth of its answer's length jumps
the queue with every request; hint trust (``core/hint_trust.py``) takes its hints away
once its answers keep running long.  This bench measures what the lies cost the honest
callers before and after that.

The embedded KV-limited engine of ``bench e2e`` (a child process) and, per run, a fresh
sidecar (a child process) with the configuration the operator renders for a policy that
sets nothing (``e2e.policy_default``) plus one request class, ``liar``.  Direct's
steady-state capacity is measured first, as ``bench e2e`` measures it; the chat workload
then arrives as a Poisson process at ``load`` of it.  Every ``liar_every``-th request is
the liar's (request class ``liar``); the rest are honest callers' (no class), which send
their answer's true length as the hint.  Two runs on the same workload (same seed), each
on a fresh sidecar, repeated ``repeats`` times, ``without`` first and then, in every
second repeat, ``with`` first (ABBA: a drift of the machine moves both alike):

* ``without``: the liar sends no hint (the predictor places its requests);
* ``with``: the liar sends ``expected_output_tokens`` = true length / 8 (at least 1).

Reported: the honest callers' p50 / p99 E2E with lies over without (target: p99 within
1.1x), the liar's own, the engine's preemptions in each run, how many of the liar's hinted completions it took before its hints
were ignored (from the sidecar's log line), and how many of its hints were ignored in all
(``binbatch_ignored_inputs_total{input="hint"}`` on the sidecar's metrics port).

Trust is per request class today, so the liar is told apart by its class; a caller that
lies inside the honest callers' class would take that class's hints away with its own.
"""

from __future__ import annotations

import re
import signal
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc

from . import workloads
from .bench_clients import (RunResult, Sample, closed_loop, completions_caller, length_fields, replay, steady_rate,
                            streamed_sample)  # fmt: skip
from .bench_processes import (EngineProcess, EngineShape, preemptions, served_model, sidecar_doc, sidecar_metric,
                              start_sidecar, write_answer_lengths)  # fmt: skip
from .chaos_load import percentile
from .chaos_processes import SidecarProcess, metrics_port, run_to_end
from .e2e import KV_LIMITED, policy_default

LIAR_CLASS = "liar"
LIE_FACTOR = 8
TARGET_P99 = 1.1
# the pair's order, alternated by repeat (ABBA): a drift of the machine over the run moves both alike
ORDER = (("without", "with"), ("with", "without"))
_DISTRUSTED = re.compile(r"request class 'liar': length hints ignored.*median of the latest (\d+) hinted")


@dataclass(frozen=True)
class LiarConfig:
    requests: int = 400  # per run
    load: float = 0.9  # of direct's steady-state capacity
    liar_every: int = 4  # every 4th request is the liar's: a quarter of the traffic (a fair share among four callers)
    repeats: int = 2
    seed: int = 1
    scale: float = 1.0  # answer lengths
    capacity_concurrency: int = 32
    capacity_requests: int = 512
    engine: EngineShape = KV_LIMITED


def quick(cfg: LiarConfig) -> LiarConfig:
    """The seconds-long version (the test suite's): few short requests, one repeat, a liar
    in every second request so its hints are judged (hint_trust.MIN_SAMPLES completions)."""
    return replace(cfg, requests=48, liar_every=2, repeats=1, scale=0.25, capacity_concurrency=16, capacity_requests=48)


def capped(requests: list[workloads.BenchRequest], cfg: LiarConfig) -> list[workloads.BenchRequest]:
    """The requests as a client sends them, with its usual cap (the chat workload's longest
    answer) as ``max_tokens``; the engine ends each answer at its true length (its
    ``--answer-lengths`` file).  A request sent as ``max_tokens`` = its length with
    ``ignore_eos`` would give the length away, and the sidecar refuses a hint below it."""
    cap = workloads.longest("chat", cfg.scale)
    return [replace(r, max_tokens=cap) for r in requests]


def is_liar(index: int, cfg: LiarConfig) -> bool:
    return index % cfg.liar_every == cfg.liar_every - 1


def lie(tokens: int) -> int:
    """The liar's hint for an answer of ``tokens``: an eighth of it, at least 1."""
    return max(1, tokens // LIE_FACTOR)


def caller(channel: grpc.aio.Channel, liars: set[int], lies: bool) -> Callable[[workloads.BenchRequest], Awaitable[Sample]]:
    """Streams each request through the sidecar's ``GenerateStream``: an honest caller's
    (no class) with its true length as the hint; the liar's (``liars``: the requests'
    ``id``) in class ``liar``, with an eighth of it when ``lies``, else with no hint."""
    stub = pb_grpc.InferenceStub(channel)

    async def call(req: workloads.BenchRequest) -> Sample:
        msg = pb.GenerateRequest(prompt=req.prompt, **length_fields(req, False))
        if id(req) in liars:
            msg.request_class = LIAR_CLASS
            if lies:
                msg.expected_output_tokens = lie(req.output_tokens)
        else:
            msg.expected_output_tokens = req.output_tokens
        return await streamed_sample(stub, msg)

    return call


class _Split:
    """Each answered request's sample kept with whose it was (the run's ``RunResult``
    holds the samples without the request)."""

    def __init__(self, call: Callable[[workloads.BenchRequest], Awaitable[Sample]], liars: set[int]) -> None:
        self.call, self.liars = call, liars
        self.honest: list[float] = []
        self.liar: list[float] = []
        self.liar_ends: list[float] = []  # when each of the liar's answers ended, seconds from the first send
        self._t0: float | None = None

    async def __call__(self, req: workloads.BenchRequest) -> Sample:
        if self._t0 is None:
            self._t0 = time.perf_counter()
        sample = await self.call(req)
        if id(req) in self.liars:
            self.liar.append(sample.e2e_s)
            self.liar_ends.append(time.perf_counter() - self._t0)
        else:
            self.honest.append(sample.e2e_s)
        return sample


def liar_sidecar_doc(engine_url: str, model: str) -> dict[str, Any]:
    """The policy default (``e2e.policy_default``) with the class ``liar`` (hints allowed, the default)."""
    doc = sidecar_doc(engine_url, model, policy_default({}), scrape_ms=None)
    doc["classes"] = {"classes": [{"name": LIAR_CLASS}]}
    return doc


async def _one_run(requests: list[workloads.BenchRequest], liars: set[int], lies: bool, engine_url: str, model: str,
                   tmp: Path, session: aiohttp.ClientSession) -> dict[str, Any]:  # fmt: skip
    before = await preemptions(session, engine_url)
    sidecar: SidecarProcess = await start_sidecar(liar_sidecar_doc(engine_url, model), tmp / "sidecar.yaml", tmp)
    try:
        async with grpc.aio.insecure_channel(sidecar.target) as channel:
            await channel.channel_ready()
            split = _Split(caller(channel, liars, lies), liars)
            result: RunResult = await replay(requests, split)
        port = metrics_port(sidecar.lines)
        ignored = await sidecar_metric(session, port, "binbatch_ignored_inputs", {"input": "hint"})
        distrusted_now = await sidecar_metric(session, port, "binbatch_hints_distrusted", {"request_class": LIAR_CLASS})
    finally:
        await sidecar.signal_and_wait(signal.SIGTERM, 30)
    end = await preemptions(session, engine_url)
    after = [int(m.group(1)) for line in sidecar.lines if (m := _DISTRUSTED.search(line))]
    # trust is judged as each hinted answer is recorded: the N-th of the liar's answers to end
    at = split.liar_ends[after[0] - 1] if after and len(split.liar_ends) >= after[0] else None
    return {"result": result, "honest": split.honest, "liar": split.liar, "hints_ignored": ignored,
            "distrusted_at_end": distrusted_now == 1, "distrusted_after": after[0] if after else None,
            "distrusted_at_s": at, "distrust_events": len(after),
            "preemptions": None if before is None or end is None else end - before}  # fmt: skip


def _pooled(runs: list[dict[str, Any]], who: str) -> dict[str, float | None]:
    e2e = [x for r in runs for x in r[who]]
    return {"n": len(e2e), "e2e_mean_s": statistics.fmean(e2e) if e2e else None,
            "e2e_p50_s": percentile(e2e, 0.5), "e2e_p99_s": percentile(e2e, 0.99)}  # fmt: skip


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


async def run_async(cfg: LiarConfig, say: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="binbatch-bench-liar-") as tmp_name:
        tmp = Path(tmp_name)
        chat = capped(workloads.build("chat", cfg.requests, rate=None, seed=cfg.seed, scale=cfg.scale), cfg)
        loop_requests = capped(workloads.repeated(chat, cfg.capacity_requests), cfg)
        answers = tmp / "answer-lengths.jsonl"
        write_answer_lengths(answers, [(r.prompt, r.output_tokens) for r in (*chat, *loop_requests)])
        engine = EngineProcess(replace(cfg.engine, answer_lengths=str(answers)), tmp)
        await engine.start()
        try:
            async with aiohttp.ClientSession() as session:
                model, _ = await served_model(session, engine.url)
                loop, spans = await closed_loop(loop_requests, completions_caller(session, engine.url, model),
                                                cfg.capacity_concurrency)  # fmt: skip
                if loop.failures:
                    raise RuntimeError(f"capacity: {len(loop.failures)} direct requests failed: {loop.failures[0]}")
                capacity = steady_rate(spans, cfg.capacity_concurrency, statistics.fmean(r.output_tokens for r in chat))
                say(f"engine {cfg.engine.describe()}; direct capacity {capacity:.2f} requests/s; offered "
                    f"{cfg.load:g} of it, {cfg.requests} requests a run, one in {cfg.liar_every} the liar's")  # fmt: skip
                requests = capped(workloads.build("chat", cfg.requests, rate=cfg.load * capacity, seed=cfg.seed,
                                                  scale=cfg.scale), cfg)  # fmt: skip
                liars = {id(r) for i, r in enumerate(requests) if is_liar(i, cfg)}
                runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
                for rep in range(cfg.repeats):
                    for key in ORDER[rep % 2]:
                        got = await _one_run(requests, liars, key == "with", engine.url, model, tmp, session)
                        runs[key].append(got)
                        res = got["result"]
                        say(f"repeat {rep + 1}/{cfg.repeats}, liar {key} lies: {len(res.samples)} answered, "
                            f"{got['preemptions']} preemptions, "
                            f"{len(res.failures)} failed in {res.elapsed_s:.1f} s; honest p99 "
                            f"{percentile(got['honest'], 0.99) or 0:.2f} s; liar's hints ignored {got['hints_ignored']:g}"
                            f" (distrusted after {got['distrusted_after']} hinted completions, "
                            f"{got['distrusted_at_s'] or 0:.1f} s into the run)")  # fmt: skip
        finally:
            await engine.stop()
    pooled = {key: {who: _pooled(rs, who) for who in ("honest", "liar")} for key, rs in runs.items()}
    ratios = {who: {f"e2e_{q}": _ratio(pooled["with"][who][f"e2e_{q}_s"], pooled["without"][who][f"e2e_{q}_s"])
                    for q in ("mean", "p50", "p99")} for who in ("honest", "liar")}  # fmt: skip
    # each repeat's own honest p99 ratio: a run slowed by the shared machine shows as one outlier here
    per_repeat = [_ratio(percentile(w["honest"], 0.99), percentile(wo["honest"], 0.99))
                  for w, wo in zip(runs["with"], runs["without"], strict=True)]  # fmt: skip
    failures = [f for rs in runs.values() for r in rs for f in r["result"].failures]
    liar_count = len(liars)
    return {
        "setup": {"engine": cfg.engine.describe(), "capacity_requests_per_s": capacity, "load": cfg.load,
                  "requests": cfg.requests, "liar_requests": liar_count, "liar_every": cfg.liar_every,
                  "repeats": cfg.repeats, "seed": cfg.seed, "scale": cfg.scale, "lie_factor": LIE_FACTOR,
                  "honest": "no request class, the true answer length as the hint",
                  "liar": f"request class {LIAR_CLASS!r}: true length / {LIE_FACTOR} as the hint ('with'), no hint ('without')",
                  "config": "the policy default (policy_default) plus classes.classes [liar]"},  # fmt: skip
        "pooled": pooled,
        "ratios": ratios,
        "target_honest_p99": TARGET_P99,
        "met": ratios["honest"]["e2e_p99"] is not None and ratios["honest"]["e2e_p99"] <= TARGET_P99,
        "honest_p99_ratio_by_repeat": per_repeat,
        "distrusted_after": [r["distrusted_after"] for r in runs["with"]],
        "distrusted_at_s": [r["distrusted_at_s"] for r in runs["with"]],
        "preemptions": {key: [r["preemptions"] for r in rs] for key, rs in runs.items()},
        "hints_ignored": [r["hints_ignored"] for r in runs["with"]],
        "hints_ignored_without": [r["hints_ignored"] for r in runs["without"]],
        "distrusted_at_end": [r["distrusted_at_end"] for r in runs["with"]],
        "answered": sum(len(r["result"].samples) for rs in runs.values() for r in rs),
        "sent": cfg.requests * 2 * cfg.repeats,
        "failures": len(failures),
        "failure_examples": failures[:3],
    }


def run(cfg: LiarConfig, say: Callable[[str], None]) -> dict[str, Any]:
    return run_to_end(run_async(cfg, say))


def _s(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_table(doc: dict[str, Any]) -> None:
    s = doc["setup"]
    print(f"binbatch bench liar: {s['requests']} chat requests at {s['load']:g} of direct's capacity "
          f"({s['capacity_requests_per_s']:.2f} req/s), {s['liar_requests']} of them the liar's, {s['repeats']} repeats; "
          f"answered {doc['answered']} of {doc['sent']}, failed {doc['failures']}")  # fmt: skip
    print(f"{'callers':10} {'run':8} {'n':>5} {'E2E p50 s':>10} {'E2E p99 s':>10}")
    for who in ("honest", "liar"):
        for key in ("without", "with"):
            p = doc["pooled"][key][who]
            print(f"{who:10} {key:8} {p['n']:5} {_s(p['e2e_p50_s']):>10} {_s(p['e2e_p99_s']):>10}")
    for who in ("honest", "liar"):
        r = doc["ratios"][who]
        print(f"{who} with lies / without: p50 {_s(r['e2e_p50'])}, p99 {_s(r['e2e_p99'])}, mean {_s(r['e2e_mean'])}")
    print(f"honest p99 with lies / without, each repeat: {', '.join(_s(r) for r in doc['honest_p99_ratio_by_repeat'])}")
    print(f"honest p99 target <= {doc['target_honest_p99']:g}: {'met' if doc['met'] else 'MISSED'}; the liar's hints "
          f"ignored after {doc['distrusted_after']} of its hinted completions "
          f"({', '.join(_s(t, 1) for t in doc['distrusted_at_s'])} s into the run), {doc['hints_ignored']} ignored in all")  # fmt: skip
