"""``binbatch bench e2e``: the sidecar against calling the engine directly, side by side.

What a platform team compares binbatch with is its engine called directly, so
every scenario runs "direct to the engine" first and then the sidecar
configurations on the very same workload (same prompts, lengths and arrival
times), in one run, interleaved and repeated (``--repeats``) so a noisy machine
moves both sides alike.  Ratios are always sidecar over direct from the same run.

The engine is the embedded one by default -- the emulator as a child process
with a GPU-like step time τ(b) = a + c·b (a fixed cost a per step dominates), a
prefill cost per prompt token admitted or recomputed after a preemption (every
real engine pays for prefill, so recompute costs time; see ``KV_LIMITED``) and a
KV budget small enough that concurrency is KV-limited, as on a GPU serving a
large model -- or, with ``--engine URL``, any OpenAI-compatible server (a real
vLLM included).  Each sidecar is a ``binbatch sidecar --config FILE`` child
process in front of the same engine.

Scenarios (DESIGN §3.6, issue 11):

* ``chat``, KV-limited engine: direct's saturated throughput is measured first
  (below); then Poisson arrivals at fractions of it (``--loads``) and a burst
  (KV pressure).  Clients: direct, sidecar with oracle hints, sidecar with
  the online predictor (no hint); in the burst also the hinted sidecar with
  ``batch.drainOrder: LongestFitFirst``, which packs the KV cache once arrivals
  stop -- the burst's KV-pressure ratios are its (the sidecar's best
  configuration for a batch), the default drain order's row is beside it.  The sidecars get the SLOs of ``--slo-ttft-ms``
  / ``--slo-tpot-ms``; goodput counts requests meeting both.
* ``short``, ample KV, burst: nothing to win; the sidecar without SLOs must not
  cost throughput.
* ``mixed``, ample KV, burst, gang mode: the sidecar's k = 4 and k = 8 over
  k = 1 gains against an ideal gang client that knows every length
  (batch-locked engines).

In every scenario the policy default, no hint, is judged (``DEFAULT_CLIENT``)
through the gRPC door, and again through the OpenAI-compatible HTTP door by
direct's own client (``DEFAULT_HTTP_CLIENT``): what vLLM's clients and gateways
speak, differing from direct by the sidecar's hop alone.

Capacity is direct's *steady-state* saturated throughput, the rate the
issue's loads are fractions of ("95% of direct's saturated throughput"): a
closed loop keeps ``capacity_concurrency`` chat requests outstanding (each
answer immediately replaced by the next request; ``capacity_requests`` in all,
cycling through the very ``load_requests`` chat requests the loads replay, twice,
so the capacity is that of their lengths, not of another sample of a
long-tailed distribution, whose mean moves ±10% between samples of a few
hundred).  Between the ``capacity_concurrency``-th completion and the
``capacity_concurrency``-th last -- warm-up and drain discarded -- the engine
always had that many requests; the tokens it generated there, per second, over
the workload's mean answer length, are its requests per second
(:func:`.bench_clients.steady_rate`).  Counting completions inside that window
instead (the estimator before) read the embedded engine at 17.7 requests/s
where it answered 19.1-19.4 under closed loops of 12 to 64 and under a Poisson
overload -- its "load 1.1" was below saturation.  A bounded request count rather
than a timed window keeps the cost fixed and the estimate free of a clock
choice.  The old figure, requests / elapsed of one all-at-once burst, is still
measured and reported as ``burst_capacity_requests_per_s``, but it is not a
capacity: the burst's tail runs its longest answers alone, so it reads
0.7-0.85 of the saturated rate and "0.95" would really be ~0.75 of saturation.
The outstanding count must exceed what the engine runs at once (the embedded
KV-limited engine holds ~12 chat sequences); against an ``--engine`` that runs
more, the figure is a lower bound -- raise ``capacity_concurrency``.

A Poisson load sends ``load_requests`` (256) requests, a burst ``requests``
(64).  Ordering and admission only matter where a queue forms, and near
saturation a queue needs time to build: in a 64-request run at 95% of capacity
(about 3 s of arrivals) direct's time to first token stayed at 4% of its E2E,
so every order measured the same; 256 requests are about 15 s of arrivals.

Goodput at the SLO is taken at the lowest planned load where direct misses the
SLO (< 90% of its requests meet it); if direct meets it at every planned load,
the top load is used and ``_setup`` says so (``goodput_direct_missed_slo``
false): no load is added to find a win.

Preemptions are the delta of the engine's ``vllm:num_preemptions_total`` around
each run (runs never overlap).  A run's row pools the requests of all repeats:
requests/s = all answered / all wall time; percentiles over all samples;
preemptions the mean per repeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from binbatch_operator import builders

from ..engine.model_file import save_model
from ..engine.training_records import train
from . import sharegpt, workloads
from .bench_clients import (RunResult, closed_loop, completions_caller, ideal_gang, replay, sidecar_caller,
                            steady_rate)  # fmt: skip
from .chaos_load import percentile
from .bench_processes import (EngineProcess, EngineShape, bench_session, preemptions, served_model, sidecar_doc,
                              start_sidecar, write_answer_lengths)  # fmt: skip
from .chaos_processes import cpus_left, pin, run_to_end

# GPU-like: the fixed step cost dominates (a large model's weights are read once
# per step), so batching pays; the KV cache holds ~12 chat sequences at a time.
# Prefill is compute-bound (~2 x params FLOPs per token) while the fixed step cost
# is the weights read from memory (2 bytes x params), so a prefilled token costs
# memory bandwidth / (peak FLOPs x MFU) of a step, whatever the model size: on an
# A100 2.0e12 B/s / (312e12 x 0.5) = 0.0128 (8B on one: step 16 GB / 2 TB/s = 8 ms,
# prefill 1.6e10 / 1.56e14 = 0.10 ms/token; 70B on two: 35 ms and 0.45 ms/token).
# At a 6 ms step that is 0.077 ms, ~0.08 ms per prefilled token -- so recomputing a
# preempted sequence costs time here, as on every real engine.
STEP_A, STEP_C, PREFILL_PER_TOKEN = 0.006, 0.0002, 0.00008
KV_LIMITED = EngineShape(step_a=STEP_A, step_c=STEP_C, num_gpu_blocks=48, block_size=16, max_model_len=512,
                         prefill_per_token=PREFILL_PER_TOKEN)  # fmt: skip
AMPLE_KV = EngineShape(step_a=STEP_A, step_c=STEP_C, num_gpu_blocks=8192, block_size=16, max_model_len=512,
                       prefill_per_token=PREFILL_PER_TOKEN)  # fmt: skip
# The ShareGPT replay's engine: the same step time, KV for ~10 of its answers at once (~275 tokens
# on average, up to the client's 1,024-token cap), a context for the longest prompt replayed plus it.
SHAREGPT_KV = EngineShape(step_a=STEP_A, step_c=STEP_C, num_gpu_blocks=240, block_size=16,
                          max_model_len=workloads.SHAREGPT_PROMPT_TOKENS + workloads.SHAREGPT_MAX_TOKENS,
                          prefill_per_token=PREFILL_PER_TOKEN)  # fmt: skip

# The "system" burst's engine: the same step time, vLLM's prefix cache on, KV for four of its
# requests counted whole (256-word system prompt, a question, a chat answer) or ~15 sharing the prompt.
SYSTEM_KV = EngineShape(step_a=STEP_A, step_c=STEP_C, num_gpu_blocks=96, block_size=16, max_model_len=1024,
                        prefill_per_token=PREFILL_PER_TOKEN, enable_prefix_caching=True)  # fmt: skip

RATIO_KEYS = (
    "e2e_mean_at_95pct_load", "e2e_p99_at_95pct_load", "goodput_at_slo", "preemptions_under_kv_pressure",
    "throughput_under_kv_pressure", "throughput_nothing_to_win", "gang_k4_gain_vs_ideal",
    "gang_k8_gain_vs_ideal",
)  # fmt: skip
ROW_KEYS = (
    "name", "mode", "k", "load", "requests_per_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
    "tpot_p50_s", "tpot_p99_s", "e2e_p50_s", "e2e_p99_s", "goodput_per_s", "preemptions",
)  # fmt: skip
# ratios["sharegpt"]: the judged sidecar (no hint, Learned) over direct on the ShareGPT replay
SHAREGPT_RATIO_KEYS = ("e2e_mean", "e2e_p99", "throughput", "preemptions")
SHAREGPT_JUDGED = "learned"
RATIO_LOAD = 0.95  # the load of the latency ratios (fraction of direct's steady-state capacity)
SLO_MISS_SHARE = 0.9  # direct "misses" the SLO at a load where fewer than this share of requests meet it


@dataclass(frozen=True)
class E2EConfig:
    engine_url: str | None = None
    # an engine like engine_url but started with --scheduling-policy priority, for the "priority" client
    # (embedded: one is started; with engine_url and none given, that client is left out)
    priority_engine_url: str | None = None
    requests: int = 64  # per burst (chat KV pressure, short)
    load_requests: int = 256  # per Poisson load: long enough for a queue to form near saturation (module docstring)
    gang_requests: int = 64
    gang_batch: int = 8
    loads: tuple[float, ...] = (0.5, 0.8, 0.95, 1.1)
    repeats: int = 2
    seed: int = 1
    capacity_concurrency: int = 32  # requests outstanding while measuring capacity (> the engine's concurrency)
    capacity_requests: int = 512  # requests of that closed loop (>= 3x concurrency: warm-up, window, drain)
    slo_ttft_s: float = 0.5
    slo_tpot_s: float = 0.020
    scale: float = 1.0
    gang_scale: float = 0.5
    kv_engine: EngineShape = KV_LIMITED
    ample_engine: EngineShape = AMPLE_KV
    sharegpt_engine: EngineShape = SHAREGPT_KV
    system_engine: EngineShape = SYSTEM_KV
    sharegpt_requests: int = 500  # ShareGPT first turns replayed at load sharegpt_load
    sharegpt_load: float = RATIO_LOAD  # the replay's load, a fraction of direct's ShareGPT capacity
    sharegpt_capacity_requests: int = 192  # the ShareGPT capacity's closed loop (capacity_concurrency outstanding)
    sharegpt_scale: float = 1.0  # ShareGPT answers and their cap shortened by this (a slow engine's run)
    warm_start_records: int = 0  # the judged sidecar's model is fitted on this many training records (0: all)
    sharegpt_repeats: int | None = None  # repeats of the ShareGPT replay (None: ``repeats``; the demo's: 1)
    only: tuple[str, ...] = ()  # scenario keys ("mixed@gang") or shapes ("chat"); empty: all
    clients: tuple[str, ...] = ()  # client keys ("direct", "hint", ...) to send with; empty: all
    samples_path: str | None = None  # each answered request's timings, a JSON line each, written as runs end
    # the sidecars on these CPUs and the bench, its client and engines on the rest (a pod's own CPU); empty: shared
    sidecar_cpus: frozenset[int] = frozenset()


SCENARIO_NAMES = ("chat", "short", "mixed", "system", "chat@burst", "short@ample", "mixed@gang", "system@burst",
                  "sharegpt")  # fmt: skip


def quick(cfg: E2EConfig) -> E2EConfig:
    """The seconds-long version (the test suite's): few, short requests, one repeat;
    the capacity from 16 outstanding (a lower bound where the engine runs more:
    this version checks the document, not the figures)."""
    return replace(cfg, requests=12, load_requests=12, gang_requests=16, gang_batch=4, loads=(RATIO_LOAD,), repeats=1,
                   scale=0.25, gang_scale=0.25, capacity_concurrency=16, capacity_requests=48, sharegpt_requests=12,
                   sharegpt_capacity_requests=48, warm_start_records=1000)  # fmt: skip


@dataclass(frozen=True)
class Client:
    """One way of sending a scenario's workload."""

    key: str
    label: str
    mode: str  # direct | engine-priority | continuous | gang | ideal-gang
    k: int
    sidecar: str | None = None  # key of the sidecar process it goes through
    hint: bool = True
    engine: str | None = None  # the engine it calls, if not the scenario's ("kv-priority")
    door: str = "grpc"  # the sidecar's door: GenerateStream, or "http" (/v1/completions, direct's own client)


@dataclass(frozen=True)
class Scenario:
    key: str
    label: str
    engine: str  # "kv" | "ample"
    shape: str
    count: int
    load: float | None  # fraction of direct capacity; None is all at once
    clients: tuple[Client, ...]
    scale: float


DIRECT = Client("direct", "direct", "direct", 1)
# vLLM's own shortest-first: the same engine started with --scheduling-policy priority, each request's
# true length its priority (what a user who can restart vLLM and knows the lengths could do without us)
PRIORITY = Client("priority", "direct, vLLM priority scheduling by hint", "engine-priority", 1, engine="kv-priority")
HINT = Client("hint", "sidecar continuous k=4 hint", "continuous", 4, "kv-hint")
# the same, packing the cache once arrivals stop (batch.drainOrder LongestFitFirst): the burst's throughput
PACKED = Client("packed", "sidecar continuous k=4 hint, drain LongestFitFirst", "continuous", 4, "kv-packed")
ONLINE = Client("online", "sidecar continuous k=4 online", "continuous", 4, "kv-online", hint=False)
# the hinted sidecar handing the order to that engine (batch.order EnginePriority): no queue held here
ENGINE_ORDER = Client("engine-order", "sidecar continuous k=4 hint, order in engine", "continuous", 4, "kvp-hint",
                      engine="kv-priority")
FREE = Client("free", "sidecar continuous k=4 hint, no SLO", "continuous", 4, "ample-free")
# What a user installs, in every scenario: the policy default (policy_default), no hint, the Learned
# predictor starting cold (these synthetic workloads have no training split to warm it)
DEFAULT_KV = Client("default", "sidecar, policy default, no hint", "continuous", 4, "kv-default", hint=False)
DEFAULT_AMPLE = Client("default", "sidecar, policy default, no hint", "continuous", 4, "ample-default", hint=False)
DEFAULT_SYSTEM = Client("default", "sidecar, policy default, no hint", "continuous", 4, "system-default", hint=False)
# The same through the OpenAI-compatible HTTP door, the one vLLM's clients and gateways speak, with the very
# client that calls the engine directly; each its own sidecar, so neither learns from the other's run
DEFAULT_KV_HTTP = Client("default-http", "sidecar, policy default, no hint, HTTP door", "continuous", 4,
                         "kv-default-http", hint=False, door="http")  # fmt: skip
DEFAULT_AMPLE_HTTP = replace(DEFAULT_KV_HTTP, sidecar="ample-default-http")
DEFAULT_SYSTEM_HTTP = replace(DEFAULT_KV_HTTP, sidecar="system-default-http")
IDEAL1 = Client("ideal1", "ideal gang k=1", "ideal-gang", 1)
IDEAL4 = Client("ideal4", "ideal gang k=4", "ideal-gang", 4)
GANG1 = Client("gang1", "sidecar gang k=1", "gang", 1, "ample-gang1")
GANG4 = Client("gang4", "sidecar gang k=4", "gang", 4, "ample-gang4")
IDEAL8 = Client("ideal8", "ideal gang k=8", "ideal-gang", 8)
GANG8 = Client("gang8", "sidecar gang k=8", "gang", 8, "ample-gang8")
# The ShareGPT replay's sidecars: as a new user runs one (no hint; the judged row), and the
# oracle (the recorded length as the hint), the yardstick
SG_LEARNED = Client("learned", "sidecar, policy default, no hint, Learned (warm start)", "continuous", 4, "sg-learned", hint=False)
SG_LEARNED_HTTP = Client("learned-http", "sidecar, policy default, no hint, Learned (warm start), HTTP door",
                         "continuous", 4, "sg-learned-http", hint=False, door="http")  # fmt: skip
SG_COLD = Client("cold", "sidecar, policy default, no hint, Learned (cold start)", "continuous", 4, "sg-cold", hint=False)
SG_ONLINE = Client("online", "sidecar, no hint, Online", "continuous", 4, "sg-online", hint=False)
SG_HINT = Client("hint", "sidecar, true length as hint (oracle)", "continuous", 4, "sg-hint")
# the judged sidecar handing its order to an engine started with --scheduling-policy priority
SG_ENGINE_ORDER = Client("learned-engine-order", "sidecar, no hint, Learned (warm start), order in engine",
                         "continuous", 4, "sg-engine-order", hint=False, engine="sharegpt-priority")  # fmt: skip
CLIENT_NAMES = tuple(c.key for c in (DIRECT, PRIORITY, HINT, ENGINE_ORDER, PACKED, ONLINE, FREE, DEFAULT_KV,
                                     DEFAULT_KV_HTTP, IDEAL1, IDEAL4, IDEAL8, GANG1, GANG4, GANG8, SG_LEARNED,
                                     SG_LEARNED_HTTP, SG_COLD, SG_ENGINE_ORDER))  # fmt: skip
# the client judged as "the default" in each scenario (the ShareGPT replay's is warm-started: SHAREGPT_JUDGED),
# and the same through the HTTP door
DEFAULT_CLIENT = {"sharegpt": "learned"}
DEFAULT_HTTP_CLIENT = {"sharegpt": "learned-http"}


def scenarios(cfg: E2EConfig) -> list[Scenario]:
    # vLLM's priority scheduling needs an engine started so: embedded, or given as priority_engine_url
    there = cfg.engine_url is None or cfg.priority_engine_url is not None
    chat = [Scenario(f"chat@{x:g}", f"chat load {x:g}", "kv", "chat", cfg.load_requests, x,
                     (DIRECT, *((PRIORITY,) if there else ()), HINT, *((ENGINE_ORDER,) if there else ()), ONLINE,
                      DEFAULT_KV, DEFAULT_KV_HTTP), cfg.scale) for x in cfg.loads]  # fmt: skip
    plan = [
        *chat,
        Scenario("chat@burst", "chat burst, KV pressure", "kv", "chat", cfg.requests, None,
                 (DIRECT, HINT, PACKED, ONLINE, DEFAULT_KV, DEFAULT_KV_HTTP), cfg.scale),  # fmt: skip
        Scenario("short@ample", "short burst, ample KV", "ample", "short", cfg.requests, None,
                 (DIRECT, FREE, DEFAULT_AMPLE, DEFAULT_AMPLE_HTTP), cfg.scale),  # fmt: skip
        Scenario("mixed@gang", "mixed burst, gang", "ample", "mixed", cfg.gang_requests, None,
                 (DIRECT, IDEAL1, IDEAL4, IDEAL8, GANG1, GANG4, GANG8, DEFAULT_AMPLE, DEFAULT_AMPLE_HTTP),
                 cfg.gang_scale),  # fmt: skip
        Scenario("system@burst", "chat burst, one system prompt, prefix cache", "system", "system", cfg.requests, None,
                 (DIRECT, DEFAULT_SYSTEM, DEFAULT_SYSTEM_HTTP), cfg.scale),  # fmt: skip
        Scenario("sharegpt", f"ShareGPT replay, load {cfg.sharegpt_load:g}", "sharegpt", "sharegpt",
                 cfg.sharegpt_requests, cfg.sharegpt_load,
                 (DIRECT, SG_LEARNED, SG_LEARNED_HTTP, SG_COLD, SG_ONLINE, SG_HINT, *((SG_ENGINE_ORDER,) if there else ())), 1.0),  # fmt: skip
    ]
    if cfg.only:
        plan = [sc for sc in plan if sc.key in cfg.only or sc.shape in cfg.only]
    if cfg.clients:
        plan = [replace(sc, clients=tuple(c for c in sc.clients if c.key in cfg.clients)) for sc in plan]
    return [sc for sc in plan if sc.clients]


VLLM_MAX_NUM_SEQS = 256  # vLLM's default --max-num-seqs
# The sidecars whose config is the policy default (policy_default): scraped at the default interval too
POLICY_DEFAULT = {"sg-learned", "sg-learned-http", "sg-cold", "sg-online", "sg-hint", "kv-default", "ample-default",
                  "system-default", "kv-default-http", "ample-default-http", "system-default-http"}  # fmt: skip


def policy_default(predictor: dict[str, Any]) -> dict[str, Any]:
    """The config the operator renders for a BatchingPolicy that sets nothing but ``spec.predictor``
    (its selector, engine and metrics URLs aside), by the operator's own builder: the CRD's defaults,
    not the bench's, so the judged row is what a user installs.  ``server`` is left out: the bench's
    sidecars bind port 0; ``sidecar_doc`` adds the engine and its scrape URL."""
    doc = builders.sidecar_config({"selector": {}, "predictor": predictor})
    doc.pop("server")
    return doc
WARM_STARTED = {"sg-learned", "sg-learned-http", "sg-engine-order"}  # the sidecars that start from the training split's model


def sharegpt_cap(cfg: E2EConfig) -> int:
    """The replay's ``max_tokens``: the client's usual cap, shortened by ``sharegpt_scale``."""
    return workloads.sharegpt_scaled(workloads.SHAREGPT_MAX_TOKENS, cfg.sharegpt_scale)


def sharegpt_context(cfg: E2EConfig) -> int:
    """The context the ShareGPT replay needs: its longest prompt and its answers' cap."""
    return workloads.SHAREGPT_PROMPT_TOKENS + sharegpt_cap(cfg)


def system_context(cfg: E2EConfig) -> int:
    """The context the system-prompt burst needs, at a token a word at least: the shared
    prompt, the longest question (``workloads.build``: 40 words and its label) and the
    longest answer."""
    return workloads.SYSTEM_PROMPT_WORDS + 41 + workloads.longest("system", cfg.scale)


def sidecar_overrides(cfg: E2EConfig, warm_start: str = "") -> dict[str, tuple[str, dict[str, Any]]]:
    """Each sidecar process: the engine it fronts and its config (the one place a
    scheduling change picks the configuration the bench measures); ``warm_start``:
    the Learned model the judged ShareGPT sidecar starts from (``_warm_start``)."""
    slo = {"tpotMilliseconds": round(cfg.slo_tpot_s * 1e3), "ttftMilliseconds": round(cfg.slo_ttft_s * 1e3)}
    chat_max = workloads.longest("chat", cfg.scale)
    # ShortestFirst with followEngineQueue: the queue forms here, ordered (the config defaults, spelled out)
    cont = {"mode": "Continuous", "sizing": "Combined", "maxWaitMilliseconds": 0, "order": "ShortestFirst",
            "followEngineQueue": True}  # fmt: skip
    # memory: each request enters only if the KV cache holds it to its end (kv_plan.py): no preemption with hints
    memory = {"admission": "Projected"}
    gang = {"mode": "Gang", "sizing": "Static", "staticSize": cfg.gang_batch, "maxWaitMilliseconds": 200,
            "maxInflightBatches": 1}  # fmt: skip
    # bins learned from the arriving hints (what a user who does not know the length distribution sets): a
    # batch-locked engine's bins are those with the least expected batch time, here cut between the two peaks
    gang_bins = {"mode": "Auto", "maxOutputTokens": workloads.longest("mixed", cfg.gang_scale)}
    kv_hint = {"predictor": {"kind": "Hint"}, "bins": {"count": 4, "maxOutputTokens": chat_max}, "batch": cont,
               "memory": memory, "latency": slo}  # fmt: skip
    # the ShareGPT replay's tuned row (the order handed to vLLM) keeps the bins at the replay's cap
    sharegpt = {"bins": {"count": 4, "maxOutputTokens": sharegpt_cap(cfg)}, "memory": memory, "batch": cont}
    # vLLM orders the queue (--scheduling-policy priority): nothing held here by a KV plan or an engine cap
    engine_order = {"memory": {"admission": "BatchSize"},
                    "batch": {**cont, "order": "EnginePriority", "followEngineQueue": False}}
    return {
        "kv-hint": ("kv", kv_hint),
        "kv-packed": ("kv", {**kv_hint, "batch": {**cont, "drainOrder": "LongestFitFirst"}}),
        "kv-online": ("kv", {**kv_hint, "predictor": {"kind": "Online"}}),
        # the same, B_t only from the TPOT SLO
        "kvp-hint": ("kv-priority", {**kv_hint, **engine_order, "batch": {**engine_order["batch"], "sizing": "Sla"}}),
        "kv-default": ("kv", policy_default({})),
        "ample-default": ("ample", policy_default({})),
        "system-default": ("system", policy_default({})),
        "kv-default-http": ("kv", policy_default({})),
        "ample-default-http": ("ample", policy_default({})),
        "system-default-http": ("system", policy_default({})),
        "ample-free": ("ample", {"predictor": {"kind": "Hint"},
                                 "bins": {"count": 4, "maxOutputTokens": workloads.longest("short", cfg.scale)},
                                 "batch": cont}),  # fmt: skip
        "ample-gang1": ("ample", {"predictor": {"kind": "Hint"}, "bins": {**gang_bins, "count": 1}, "batch": gang}),
        "ample-gang4": ("ample", {"predictor": {"kind": "Hint"}, "bins": {**gang_bins, "count": 4}, "batch": gang}),
        "ample-gang8": ("ample", {"predictor": {"kind": "Hint"}, "bins": {**gang_bins, "count": 8}, "batch": gang}),
        # the ShareGPT replay: a new user's sidecar, exactly what the operator renders for a policy that sets
        # only its predictor (policy_default); the oracle is the same sidecar told the true lengths
        "sg-learned": ("sharegpt", policy_default({"warmStart": warm_start})),
        "sg-learned-http": ("sharegpt", policy_default({"warmStart": warm_start})),
        "sg-cold": ("sharegpt", policy_default({})),
        "sg-online": ("sharegpt", policy_default({"kind": "Online"})),
        "sg-hint": ("sharegpt", policy_default({"kind": "Hint"})),
        # with no SLO nothing bounds B_t but b_mem, which held a fifth of the engine's throughput back here:
        # vLLM's own limit (its default --max-num-seqs), so every request reaches its ordered queue at once
        "sg-engine-order": ("sharegpt-priority", {**sharegpt, "predictor": {"kind": "Learned", "warmStart": warm_start},
                                                  **engine_order, "batch": {**engine_order["batch"], "sizing": "Static",
                                                                            "staticSize": VLLM_MAX_NUM_SEQS}}),  # fmt: skip
    }


@dataclass
class _Acc:
    """The pooled repeats of one (scenario, client)."""

    scenario: Scenario
    client: Client
    runs: list[RunResult] = field(default_factory=list)

    def row(self, slo_ttft: float, slo_tpot: float) -> dict[str, Any]:
        samples = [s for r in self.runs for s in r.samples]
        wall = sum(r.elapsed_s for r in self.runs)
        tpots = [t for s in samples if (t := s.tpot_s) is not None]
        good = sum(1 for s in samples if s.ttft_s <= slo_ttft and (s.tpot_s or 0.0) <= slo_tpot)
        pre = [r.preemptions for r in self.runs if r.preemptions is not None]
        return {
            "name": f"{self.scenario.label} | {self.client.label}",
            "mode": self.client.mode,
            "k": self.client.k,
            "load": self.scenario.load,
            "requests_per_s": len(samples) / wall if wall > 0 else 0.0,
            "output_tokens_per_s": sum(s.tokens for s in samples) / wall if wall > 0 else 0.0,
            "ttft_p50_s": percentile([s.ttft_s for s in samples], 0.5),
            "ttft_p99_s": percentile([s.ttft_s for s in samples], 0.99),
            "tpot_p50_s": percentile(tpots, 0.5),
            "tpot_p99_s": percentile(tpots, 0.99),
            "e2e_p50_s": percentile([s.e2e_s for s in samples], 0.5),
            "e2e_p99_s": percentile([s.e2e_s for s in samples], 0.99),
            "goodput_per_s": good / wall if wall > 0 else 0.0,
            "preemptions": statistics.fmean(pre) if pre else None,
        }

    def e2e_mean(self) -> float | None:
        values = [s.e2e_s for r in self.runs for s in r.samples]
        return statistics.fmean(values) if values else None

    def ttft_mean(self) -> float | None:
        values = [s.ttft_s for r in self.runs for s in r.samples]
        return statistics.fmean(values) if values else None

    def failures(self) -> int:
        return sum(len(r.failures) for r in self.runs)


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or not den > 0 or not math.isfinite(num / den):
        return None
    return num / den


def ordering_bound(direct: _Acc) -> float | None:
    """The lowest mean-E2E ratio any admission order can reach at this load if it
    leaves decoding as fast as direct's: 1 - direct's mean TTFT / its mean E2E.
    An order only moves waiting; if direct hardly waits, nothing is left to win."""
    ttft, e2e_ = direct.ttft_mean(), direct.e2e_mean()
    return None if ttft is None or not e2e_ else 1.0 - ttft / e2e_


def goodput_ceiling(direct_row: dict[str, Any]) -> float | None:
    """The highest goodput ratio any admission can reach at a load: the sidecar
    serves the same offered requests, so at best every one of them meets the SLO
    -- direct's requests/s over its goodput.  Where direct meets the SLO for 88%
    of its requests, no sidecar gets past 1.14x."""
    return _ratio(direct_row["requests_per_s"], direct_row["goodput_per_s"])


def goodput_load(direct_rows: dict[float, dict[str, Any]]) -> tuple[float, bool]:
    """The load of the goodput ratio and whether direct missed the SLO there:
    the lowest load where direct meets it for fewer than SLO_MISS_SHARE of its
    requests (where an upstream admission can make a difference); if it never
    misses, the highest planned load, reported as not missed."""
    for x in sorted(direct_rows):
        d = direct_rows[x]
        if d["requests_per_s"] > 0 and d["goodput_per_s"] < SLO_MISS_SHARE * d["requests_per_s"]:
            return x, True
    return max(direct_rows), False


# Below this share of direct's requests meeting the SLO even at the lowest load, the SLO
# is beyond the engine (the bench's 20 ms TPOT default on a CPU engine): say so.
SLO_UNREACHABLE_SHARE = 0.1


def slo_warning(direct_rows: dict[float, dict[str, Any]], cfg: E2EConfig) -> str | None:
    """A warning when direct meets the SLO for almost no request even at the lowest
    load: goodput ratios then compare two near-zero figures, and an engine slower
    than the SLO alone needs an SLO of its own (``--slo-tpot-ms``, ``--slo-ttft-ms``)."""
    if not direct_rows:
        return None
    low = min(direct_rows)
    d = direct_rows[low]
    share = d["goodput_per_s"] / d["requests_per_s"] if d["requests_per_s"] else 0.0
    if share >= SLO_UNREACHABLE_SHARE:
        return None
    measured = ", ".join(f"{name} p50 {d[key] * 1e3:.0f} ms" for name, key in (("TTFT", "ttft_p50_s"), ("TPOT", "tpot_p50_s"))
                         if d.get(key) is not None)  # fmt: skip
    return (f"direct meets the SLO (TTFT <= {cfg.slo_ttft_s * 1e3:g} ms, TPOT <= {cfg.slo_tpot_s * 1e3:g} ms) for "
            f"{share:.0%} of its requests even at load {low:g} ({measured}): this engine is slower than the SLO, "
            f"so the goodput ratios compare near-zero figures; give it an SLO it can meet with --slo-tpot-ms and "
            f"--slo-ttft-ms")  # fmt: skip


def compute_ratios(accs: dict[tuple[str, str], _Acc], cfg: E2EConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """The headline ratios, each sidecar (hinted; on the ShareGPT replay the judged
    one, no hint) over direct from the same run; also where each came from (for the
    table)."""
    rows = {key: acc.row(cfg.slo_ttft_s, cfg.slo_tpot_s) for key, acc in accs.items()}
    out: dict[str, Any] = dict.fromkeys(RATIO_KEYS)
    notes: dict[str, Any] = {}
    at95 = f"chat@{RATIO_LOAD:g}"
    if (at95, "direct") in accs and (at95, "hint") in accs:
        out["e2e_mean_at_95pct_load"] = _ratio(accs[at95, "hint"].e2e_mean(), accs[at95, "direct"].e2e_mean())
        out["e2e_p99_at_95pct_load"] = _ratio(rows[at95, "hint"]["e2e_p99_s"], rows[at95, "direct"]["e2e_p99_s"])
        notes["ordering_bound_at_95pct_load"] = ordering_bound(accs[at95, "direct"])
    for client, note in (("priority", "vllm_priority_at_95pct_load"), ("engine-order", "engine_order_at_95pct_load")):
        # vLLM's own priority scheduling told the same hints (the order's yardstick), and the sidecar
        # handing its order to it: each over direct
        if (at95, "direct") in accs and (at95, client) in accs:
            notes[note] = {
                "e2e_mean": _ratio(accs[at95, client].e2e_mean(), accs[at95, "direct"].e2e_mean()),
                "e2e_p99": _ratio(rows[at95, client]["e2e_p99_s"], rows[at95, "direct"]["e2e_p99_s"]),
            }
    loads = {x: rows[f"chat@{x:g}", "direct"] for x in cfg.loads if (f"chat@{x:g}", "direct") in rows}
    if loads:
        pick, missed = goodput_load(loads)
        notes["goodput_load"] = pick
        notes["goodput_direct_missed_slo"] = missed
        if (f"chat@{pick:g}", "hint") in rows:  # else left out (--client): null
            out["goodput_at_slo"] = _ratio(rows[f"chat@{pick:g}", "hint"]["goodput_per_s"],
                                           rows[f"chat@{pick:g}", "direct"]["goodput_per_s"])  # fmt: skip
        notes["goodput_ceiling"] = goodput_ceiling(loads[pick])
        if (warning := slo_warning(loads, cfg)) is not None:
            notes["slo_warning"] = warning
        for client, note in (("hint", "goodput_ratio_by_load"), ("engine-order", "goodput_ratio_by_load_engine_order")):
            by_load = {f"{x:g}": _ratio(rows[f"chat@{x:g}", client]["goodput_per_s"], d["goodput_per_s"])
                       for x, d in sorted(loads.items()) if (f"chat@{x:g}", client) in rows}  # fmt: skip
            if by_load:
                notes[note] = by_load
    def pair(num: tuple[str, str], den: tuple[str, str], key: str) -> float | None:
        return _ratio(rows[num][key], rows[den][key]) if num in rows and den in rows else None

    # the burst is a batch once it is in: its best configuration packs the cache (LongestFitFirst)
    packer = "packed" if ("chat@burst", "packed") in rows else "hint"
    burst = ("chat@burst", packer), ("chat@burst", "direct")
    out["preemptions_under_kv_pressure"] = pair(*burst, "preemptions")
    out["throughput_under_kv_pressure"] = pair(*burst, "requests_per_s")
    out["throughput_nothing_to_win"] = pair(("short@ample", "free"), ("short@ample", "direct"), "requests_per_s")
    for k in (4, 8):
        clients = ("ideal1", f"ideal{k}", "gang1", f"gang{k}")
        if all(("mixed@gang", c) in rows for c in clients):
            g = {c: rows["mixed@gang", c]["requests_per_s"] for c in clients}
            out[f"gang_k{k}_gain_vs_ideal"] = _ratio(_ratio(g[f"gang{k}"], g["gang1"]),
                                                     _ratio(g[f"ideal{k}"], g["ideal1"]))  # fmt: skip
    notes["default_by_scenario"] = default_ratios(accs, rows)
    notes["default_http_by_scenario"] = default_ratios(accs, rows, DEFAULT_HTTP_CLIENT, "default-http")
    by_client = sharegpt_ratios(accs, rows)
    out["sharegpt"] = by_client.get(SHAREGPT_JUDGED, dict.fromkeys(SHAREGPT_RATIO_KEYS))
    if by_client:
        notes["sharegpt_by_client"] = by_client
        notes["sharegpt_ordering_bound"] = ordering_bound(accs["sharegpt", "direct"])
    return out, notes


def _over_direct(accs: dict[tuple[str, str], _Acc], rows: dict[tuple[str, str], dict[str, Any]], scenario: str,
                 client: str) -> dict[str, float | None]:  # fmt: skip
    """One client over direct in one scenario of the same run (``SHAREGPT_RATIO_KEYS``)."""
    d, row = (scenario, "direct"), rows[scenario, client]
    return {
        "e2e_mean": _ratio(accs[scenario, client].e2e_mean(), accs[d].e2e_mean()),
        "e2e_p99": _ratio(row["e2e_p99_s"], rows[d]["e2e_p99_s"]),
        "throughput": _ratio(row["requests_per_s"], rows[d]["requests_per_s"]),
        "preemptions": _ratio(row["preemptions"], rows[d]["preemptions"]),
    }


def sharegpt_ratios(accs: dict[tuple[str, str], _Acc], rows: dict[tuple[str, str], dict[str, Any]]
                    ) -> dict[str, dict[str, float | None]]:  # fmt: skip
    """Each sidecar over direct on the ShareGPT replay, in the same run, by client
    (``SHAREGPT_RATIO_KEYS``); the judged one's (``SHAREGPT_JUDGED``) are ``ratios.sharegpt``."""
    if ("sharegpt", "direct") not in accs:
        return {}
    return {client: _over_direct(accs, rows, scenario, client)
            for scenario, client in accs if scenario == "sharegpt" and client != "direct"}


def default_ratios(accs: dict[tuple[str, str], _Acc], rows: dict[tuple[str, str], dict[str, Any]],
                   judged: dict[str, str] = DEFAULT_CLIENT, usual: str = "default",
                   ) -> dict[str, dict[str, float | None]]:  # fmt: skip
    """The policy default over direct in every scenario that ran both (``judged``, else ``usual``:
    through the gRPC door, or ``DEFAULT_HTTP_CLIENT`` through the HTTP door): what a user installs
    must not lose to its engine called directly anywhere."""
    return {scenario: _over_direct(accs, rows, scenario, client) for scenario, client in accs
            if client == judged.get(scenario, usual) and (scenario, "direct") in accs}


async def run_async(cfg: E2EConfig, say: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="binbatch-bench-e2e-") as tmp:
        async with contextlib.AsyncExitStack() as stack:
            return await _run(cfg, say, Path(tmp), stack)


async def _run(cfg: E2EConfig, say: Callable[[str], None], tmp: Path, stack: contextlib.AsyncExitStack) -> dict[str, Any]:
    urls: dict[str, str] = {}
    plan = scenarios(cfg)
    if cfg.sidecar_cpus:  # before any child starts: the engines inherit the bench's CPUs, the sidecars get theirs
        available = frozenset(os.sched_getaffinity(0))
        rest = cpus_left(cfg.sidecar_cpus, available)
        pin(os.getpid(), rest)
        stack.callback(pin, os.getpid(), available)
        say(f"sidecars on CPU {_cpu_list(cfg.sidecar_cpus)}; this bench, its client and the engines on CPU {_cpu_list(rest)}")
    if cfg.engine_url:
        urls = dict.fromkeys(("kv", "ample", "sharegpt", "system"), cfg.engine_url.rstrip("/"))
        say(f"engine {urls['kv']} (every scenario on it)")
        if cfg.priority_engine_url:
            urls["kv-priority"] = urls["sharegpt-priority"] = cfg.priority_engine_url.rstrip("/")
            say(f"engine {urls['kv-priority']} (started with --scheduling-policy priority: the priority client)")
    else:
        shapes = [("kv", cfg.kv_engine), ("ample", cfg.ample_engine)]
        if any(sc.engine == "system" for sc in plan):
            shapes.append(("system", cfg.system_engine))
        if any(c.engine == "kv-priority" for sc in plan for c in sc.clients):
            shapes.append(("kv-priority", replace(cfg.kv_engine, scheduling_policy="priority")))
        if any(sc.engine == "sharegpt" for sc in plan):  # it knows each replayed answer's length (module docstring)
            answers = tmp / "answer-lengths.jsonl"
            most = max(cfg.sharegpt_requests, cfg.sharegpt_capacity_requests)
            write_answer_lengths(answers, ((r.prompt, r.output_tokens) for r in workloads.sharegpt_replay(
                most, rate=None, seed=cfg.seed, scale=cfg.sharegpt_scale)))  # fmt: skip
            shapes.append(("sharegpt", replace(cfg.sharegpt_engine, answer_lengths=str(answers))))
            if any(c.engine == "sharegpt-priority" for sc in plan for c in sc.clients):
                shapes.append(("sharegpt-priority", replace(shapes[-1][1], scheduling_policy="priority")))
        for name, shape in shapes:
            engine = EngineProcess(shape, tmp)
            await engine.start()
            stack.push_async_callback(engine.stop)
            urls[name] = engine.url
            say(f"embedded engine ({name}): {shape.describe()} on {engine.url}")
    session = await stack.enter_async_context(bench_session(600))
    served = {name: await served_model(session, url) for name, url in urls.items()}
    models = {name: model for name, (model, _) in served.items()}
    context, needed = served.get("sharegpt", ("", None))[1], sharegpt_context(cfg)
    if context is not None and context < needed:
        plan = [sc for sc in plan if sc.engine != "sharegpt"]
        say(f"the ShareGPT replay is left out: its prompts (up to {workloads.SHAREGPT_PROMPT_TOKENS} tokens) and "
            f"answers (up to {needed - workloads.SHAREGPT_PROMPT_TOKENS}) need a context of {needed} tokens, the engine "
            f"serves {context} (a smaller --sharegpt-scale shortens the answers)")  # fmt: skip
    context, needed = served.get("system", ("", None))[1], system_context(cfg)
    if context is not None and context < needed:
        plan = [sc for sc in plan if sc.engine != "system"]
        say(f"the system-prompt burst is left out: its {workloads.SYSTEM_PROMPT_WORDS}-word shared prompt, a "
            f"question and an answer need a context of {needed} tokens at least, the engine serves {context}")  # fmt: skip
    used = {c.sidecar for sc in plan for c in sc.clients}
    warm_start = await asyncio.to_thread(_warm_start, cfg, tmp / "sharegpt-train.npz") if used & WARM_STARTED else ""
    channels: dict[str, grpc.aio.Channel] = {}
    doors: dict[str, str] = {}  # each sidecar's HTTP door
    for key, (engine, overrides) in sidecar_overrides(cfg, warm_start).items():
        if key not in used:
            continue
        doc = sidecar_doc(urls[engine], models[engine], overrides, scrape_ms=None if key in POLICY_DEFAULT else 200)
        proc = await start_sidecar(doc, tmp / f"{key}.yaml", tmp, cfg.sidecar_cpus or None)
        stack.push_async_callback(proc.signal_and_wait, signal.SIGTERM, 15)
        channels[key] = await stack.enter_async_context(grpc.aio.insecure_channel(proc.target))
        doors[key] = proc.http_url
        # connect before measuring: a burst on an idle channel pays the connection
        # setup inside the run and reaches the sidecar out of order (in gang mode that
        # reshuffles the k = 1 batches: 13% more model service time on mixed@gang)
        await channels[key].channel_ready()
        say(f"sidecar {key} on {proc.target}")
        if engine != "ample" and overrides.get("predictor", {}).get("kind") == "Hint":  # the KV-limited engines'
            await _warm(channels[key])

    async def run_one(sc: Scenario, client: Client, requests: list[workloads.BenchRequest]) -> RunResult:
        engine = client.engine or sc.engine
        url, model = urls[engine], models[engine]
        before = await preemptions(session, url)
        if client.mode == "ideal-gang":
            result = await ideal_gang(session, url, model, requests, k=client.k, batch=cfg.gang_batch)
        elif client.sidecar is None:
            result = await replay(requests, completions_caller(session, url, model, priority=client is PRIORITY,
                                                          recorded=recorded))  # fmt: skip
        elif client.door == "http":  # no hint: a caller of the HTTP door says nothing of the length here
            result = await replay(requests, completions_caller(session, doors[client.sidecar], model, recorded=recorded))
        else:
            result = await replay(requests, sidecar_caller(channels[client.sidecar], hint=client.hint, recorded=recorded))
        after = await preemptions(session, url)
        result.preemptions = None if before is None or after is None else after - before
        return result

    recorded = cfg.engine_url is not None  # an engine that does not know the replayed lengths: min_tokens + stops
    capacity = burst_capacity = sharegpt_capacity = 0.0
    if any(sc.load is not None and sc.engine == "kv" for sc in plan):  # the Poisson loads are fractions of it
        chat = workloads.build("chat", cfg.load_requests, rate=None, seed=cfg.seed, scale=cfg.scale)
        capacity = await _steady_capacity(cfg, session, urls["kv"], models["kv"],
                                          workloads.repeated(chat, cfg.capacity_requests), chat)  # fmt: skip
        say(f"direct capacity (steady state, {cfg.capacity_concurrency} outstanding, {cfg.capacity_requests} chat "
            f"requests, warm-up and drain discarded): {capacity:.2f} requests/s")  # fmt: skip
        cap_reqs = workloads.build("chat", cfg.requests, rate=None, seed=cfg.seed, scale=cfg.scale)
        cap_sc = Scenario("cap", "capacity", "kv", "chat", cfg.requests, None, (), cfg.scale)
        cap_run = await run_one(cap_sc, DIRECT, cap_reqs)
        burst_capacity = len(cap_run.samples) / cap_run.elapsed_s
        say(f"direct burst rate (chat burst of {cfg.requests}, not the capacity: its tail runs alone): "
            f"{burst_capacity:.2f} requests/s = {burst_capacity / capacity:.2f} x the steady capacity")  # fmt: skip

    if any(sc.engine == "sharegpt" for sc in plan):  # its own engine, its own lengths: its own capacity
        replayed = workloads.sharegpt_replay(cfg.sharegpt_requests, rate=None, seed=cfg.seed, scale=cfg.sharegpt_scale)
        loop = workloads.sharegpt_replay(cfg.sharegpt_capacity_requests, rate=None, seed=cfg.seed,
                                         scale=cfg.sharegpt_scale)  # fmt: skip
        sharegpt_capacity = await _steady_capacity(cfg, session, urls["sharegpt"], models["sharegpt"], loop, replayed,
                                                   recorded=recorded)  # fmt: skip
        say(f"direct capacity on the ShareGPT replay (steady state, {cfg.capacity_concurrency} outstanding, "
            f"{cfg.sharegpt_capacity_requests} first turns): {sharegpt_capacity:.2f} requests/s")  # fmt: skip

    accs: dict[tuple[str, str], _Acc] = {}
    for rep in range(cfg.repeats):
        for sc in plan:
            if sc.engine == "sharegpt" and cfg.sharegpt_repeats is not None and rep >= cfg.sharegpt_repeats:
                continue
            rate = None if sc.load is None else sc.load * (sharegpt_capacity if sc.engine == "sharegpt" else capacity)
            if sc.shape == "sharegpt":
                reqs = workloads.sharegpt_replay(sc.count, rate=rate, seed=cfg.seed, scale=cfg.sharegpt_scale)
            else:
                reqs = workloads.build(sc.shape, sc.count, rate=rate, seed=cfg.seed, scale=sc.scale)
            for client in sc.clients:
                result = await run_one(sc, client, reqs)
                acc = accs.setdefault((sc.key, client.key), _Acc(sc, client))
                acc.runs.append(result)
                if cfg.samples_path:
                    write_samples(cfg.samples_path, sc, client, rep, result)
                failed = f", {len(result.failures)} FAILED: {result.failures[0]}" if result.failures else ""
                say(f"repeat {rep + 1}/{cfg.repeats} {sc.label} | {client.label}: {len(result.samples)} answered "
                    f"in {result.elapsed_s:.2f} s{failed}")  # fmt: skip
    rows = [acc.row(cfg.slo_ttft_s, cfg.slo_tpot_s) for acc in accs.values()]
    ratios, notes = compute_ratios(accs, cfg)
    failures = sum(acc.failures() for acc in accs.values())
    setup = {
        "engine": cfg.engine_url or (f"embedded: {cfg.kv_engine.describe()} (ample: {cfg.ample_engine.num_gpu_blocks} "
                                     f"blocks; ShareGPT: {cfg.sharegpt_engine.num_gpu_blocks}; system: "
                                     f"{cfg.system_engine.num_gpu_blocks}, prefix caching)"),
        "capacity_requests_per_s": capacity, "capacity_method": "steady-state closed loop",
        "sharegpt_capacity_requests_per_s": sharegpt_capacity, "sharegpt_load": cfg.sharegpt_load,
        "burst_capacity_requests_per_s": burst_capacity, "repeats": cfg.repeats, "seed": cfg.seed, "failures": failures,
        "slo": f"TTFT <= {cfg.slo_ttft_s * 1e3:g} ms and TPOT <= {cfg.slo_tpot_s * 1e3:g} ms", **notes,
    }  # fmt: skip
    if cfg.sidecar_cpus:
        setup["sidecar_cpus"] = sorted(cfg.sidecar_cpus)
    say("setup: " + ", ".join(f"{k} {v}" for k, v in setup.items() if k != "slo_warning"))
    if "slo_warning" in setup:
        say("WARNING: " + setup["slo_warning"])
    return {"runs": rows, "ratios": ratios, "_setup": setup}


def _warm_start(cfg: E2EConfig, path: Path) -> str:
    """The judged ShareGPT sidecar's model: fitted on the training split's records
    (its first turns and later turns; the first ``warm_start_records`` of them when
    set), as ``binbatch predictor train`` fits one, written to ``path``.  Their
    answers are shortened as the replay's are (``sharegpt_scale``): the lengths a
    user of that engine logged.  (Fitted on the full lengths, the model predicted
    four times the answers of the real-vLLM run at x0.25, most of them at its cap.)"""
    cap = sharegpt_cap(cfg)
    records = [replace(r, output_tokens=min(workloads.sharegpt_scaled(r.output_tokens, cfg.sharegpt_scale), cap))
               for r in sharegpt.records("train")[: cfg.warm_start_records or None]]  # fmt: skip
    save_model(path, train(records))
    return str(path)


# Answers a KV-planning sidecar gets before it is measured (``_warm``).
WARM_UP_REQUESTS = 4


async def _warm(channel: grpc.aio.Channel) -> None:
    """A few hinted requests, one at a time, before any run: a sidecar in service
    has long learned how many tokens its engine counts in a prompt (the KV plan's
    prompt scale, kv_plan.py) and its time per step; a fresh one assumes a dense
    tokenizer until its first answer, so a burst sent to it cold measured its first
    admissions (4% of the packing sidecar's first burst here).  Direct's engine is
    warmed by the capacity run.  Hinted only: a length predictor or bins learned
    from traffic would learn from these too."""
    call = sidecar_caller(channel, hint=True)
    for i in range(WARM_UP_REQUESTS):
        words = " ".join(f"warm{j}" for j in range(8 + 8 * i))
        await call(workloads.BenchRequest(prompt=f"warm-up {i}: {words}", output_tokens=4, arrival_s=0.0))


async def _steady_capacity(
    cfg: E2EConfig, session: aiohttp.ClientSession, url: str, model: str, loop: list[workloads.BenchRequest],
    replayed: list[workloads.BenchRequest], *, recorded: bool = False,
) -> float:  # fmt: skip
    """Direct's saturated throughput (module docstring): ``loop`` sent in a closed
    loop, its tokens per second over the mean answer of the ``replayed`` workload
    (whose lengths the loop sends: the chat loads' repeated, the ShareGPT replay's
    first turns and more of them)."""
    result, spans = await closed_loop(loop, completions_caller(session, url, model, recorded=recorded),
                                      cfg.capacity_concurrency)  # fmt: skip
    if result.failures:
        raise RuntimeError(f"capacity: {len(result.failures)} direct requests failed, first: {result.failures[0]}")
    return steady_rate(spans, cfg.capacity_concurrency, statistics.fmean(r.output_tokens for r in replayed))


def _cpu_list(cpus: frozenset[int]) -> str:
    return ", ".join(map(str, sorted(cpus)))


def write_samples(path: str, sc: Scenario, client: Client, rep: int, result: RunResult) -> None:
    """Append one run's answered requests to ``path``, a JSON line each: which run
    (scenario, load, client, repeat from 1) and which request (``index``: its place
    in the workload, the same request in every client's run of the scenario), its
    output tokens, TTFT and E2E in seconds.  Which requests make a tail, and how
    each fared through the sidecar against direct, is read from here."""
    with open(path, "a", encoding="utf-8") as f:
        for s in result.samples:
            f.write(json.dumps({"scenario": sc.key, "load": sc.load, "client": client.key, "repeat": rep + 1,
                                "index": s.index, "tokens": s.tokens, "ttft_s": s.ttft_s, "e2e_s": s.e2e_s}) + "\n")


def run(cfg: E2EConfig, say: Callable[[str], None]) -> dict[str, Any]:
    """The bench's document: ``runs``, ``ratios`` and ``_setup`` (what they came from; ``--json``
    prints it as ``setup``)."""
    return run_to_end(run_async(cfg, say))


def _fmt(v: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def print_tables(doc: dict[str, Any]) -> None:
    setup = doc.get("_setup", {})
    print(f"binbatch bench e2e: engine {setup.get('engine')}; direct capacity (steady state) "
          f"{setup.get('capacity_requests_per_s', 0):.2f} req/s, one burst "
          f"{setup.get('burst_capacity_requests_per_s', 0):.2f} req/s; SLO {setup.get('slo')}; repeats {setup.get('repeats')}, "
          f"seed {setup.get('seed')}; failed requests {setup.get('failures')}")  # fmt: skip
    head = (f"{'run':62} {'req/s':>7} {'tok/s':>7} {'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} "
            f"{'E2E p50/p99 s':>14} {'goodput':>7} {'preempt':>7}")  # fmt: skip
    print(head)
    for r in doc["runs"]:
        print(f"{r['name'][:62]:62} {r['requests_per_s']:7.2f} {r['output_tokens_per_s']:7.0f} "
              f"{_fmt(r['ttft_p50_s'], 1e3):>7}/{_fmt(r['ttft_p99_s'], 1e3):<8} "
              f"{_fmt(r['tpot_p50_s'], 1e3, 1):>7}/{_fmt(r['tpot_p99_s'], 1e3, 1):<8} "
              f"{_fmt(r['e2e_p50_s'], 1, 2):>6}/{_fmt(r['e2e_p99_s'], 1, 2):<7} "
              f"{r['goodput_per_s']:7.2f} {_fmt(r['preemptions'], 1, 1):>7}")  # fmt: skip
    print("ratios, sidecar over direct in this run" + goodput_note(setup) + ":")
    for key, value in doc["ratios"].items():
        if not isinstance(value, dict):
            print(f"  {key:32} {_fmt(value, 1, 3)}")
    for note, door in (("default_by_scenario", "gRPC"), ("default_http_by_scenario", "HTTP")):
        for scenario, got in setup.get(note, {}).items():
            print(f"  the policy default, no hint, {door} door, {scenario}: "
                  + ", ".join(f"{k} {_fmt(v, 1, 3)}" for k, v in got.items()))
    for client, got in setup.get("sharegpt_by_client", {}).items():
        judged = " (judged: ratios.sharegpt)" if client == SHAREGPT_JUDGED else ""
        print(f"  ShareGPT replay, {client}{judged}: " + ", ".join(f"{k} {_fmt(v, 1, 3)}" for k, v in got.items()))
    if setup.get("sharegpt_ordering_bound") is not None:
        print(f"  (ShareGPT: the lowest mean E2E ratio any order could reach there, all of direct's waiting removed: "
              f"{setup['sharegpt_ordering_bound']:.3f})")  # fmt: skip
    if setup.get("ordering_bound_at_95pct_load") is not None:
        print(f"  (the lowest e2e_mean_at_95pct_load any order could reach here, all of direct's waiting removed: "
              f"{setup['ordering_bound_at_95pct_load']:.3f})")  # fmt: skip
    for note, what in (("vllm_priority_at_95pct_load", "vLLM's own priority scheduling told the same hints"),
                       ("engine_order_at_95pct_load", "the sidecar handing its order to it (order EnginePriority)")):
        if (prio := setup.get(note)) is not None:
            print(f"  ({what}, over direct at load {RATIO_LOAD:g}: mean E2E {_fmt(prio['e2e_mean'], 1, 3)}, "
                  f"p99 {_fmt(prio['e2e_p99'], 1, 3)})")  # fmt: skip
    if setup.get("slo_warning"):
        print(f"  WARNING: {setup['slo_warning']}")
    if setup.get("goodput_ceiling") is not None:
        by_load = ", ".join(f"{x} {_fmt(v, 1, 3)}" for x, v in setup.get("goodput_ratio_by_load", {}).items())
        there = ", ".join(f"{x} {_fmt(v, 1, 3)}" for x, v in setup.get("goodput_ratio_by_load_engine_order", {}).items())
        there = f"; with the order in the engine: {there}" if there else ""
        print(f"  (the highest goodput_at_slo any admission could reach there, every request within the SLO: "
              f"{setup['goodput_ceiling']:.3f}; goodput ratio at each load: {by_load}{there})")  # fmt: skip


def goodput_note(setup: dict[str, Any]) -> str:
    """Where the goodput ratio was taken, and whether direct missed the SLO there."""
    if "goodput_load" not in setup:
        return ""
    if setup.get("goodput_direct_missed_slo"):
        return f" (goodput at load {setup['goodput_load']:g}, where direct misses the SLO)"
    return (f" (goodput at load {setup['goodput_load']:g}, the top planned load: direct met the SLO at every planned "
            f"load, so this is not where it misses)")  # fmt: skip


def plot(doc: dict[str, Any], path: str) -> None:
    """Latency vs load and goodput vs load, direct and the sidecars on the same axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, good) = plt.subplots(1, 2, figsize=(12, 4.8))
    series: dict[str, list[dict[str, Any]]] = {}
    for r in doc["runs"]:
        if r["load"] is not None and r["name"].startswith("chat"):  # the chat loads (not the ShareGPT replay)
            series.setdefault(r["name"].split(" | ", 1)[1], []).append(r)
    for (label, rows), color in zip(series.items(), ("black", "tab:blue", "tab:orange", "tab:green", "tab:red"), strict=False):
        rows.sort(key=lambda r: r["load"])
        x = [r["load"] for r in rows]
        lat.plot(x, [r["e2e_p50_s"] for r in rows], "-o", color=color, label=f"{label} p50")
        lat.plot(x, [r["e2e_p99_s"] for r in rows], "--s", color=color, label=f"{label} p99")
        good.plot(x, [r["goodput_per_s"] for r in rows], "-o", color=color, label=label)
    capacity = doc.get("_setup", {}).get("capacity_requests_per_s")
    if capacity and series:
        xs = sorted({r["load"] for rows in series.values() for r in rows})
        good.plot(xs, [x * capacity for x in xs], ":", color="grey", label="offered load")
    lat.set(xlabel="offered load (fraction of direct capacity)", ylabel="E2E latency (s)", title="latency vs load")
    good.set(xlabel="offered load (fraction of direct capacity)", ylabel="goodput (requests/s meeting the SLO)",
             title=f"goodput vs load ({doc.get('_setup', {}).get('slo', 'SLO')})")  # fmt: skip
    lat.set_yscale("log")
    for ax in (lat, good):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"binbatch bench e2e: {doc.get('_setup', {}).get('engine', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
