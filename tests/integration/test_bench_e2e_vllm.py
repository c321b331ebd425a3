"""``binbatch bench e2e --engine URL --quick`` against a REAL vLLM CPU server.

The bench's promise is that a user reruns it against their own engine; this is
that run, short enough for CI: the 2-layer model with a KV cache small enough
that the burst is preempted (profile ``small_kv``; the 8-layer one took ten
minutes here for the same contract).  It holds the document to its
contract -- direct first in every scenario, every ratio present and computed,
preemptions read from vLLM's own ``/metrics`` -- not to its figures.
"""

from __future__ import annotations

import math

import pytest
from test_bench_e2e import _bench

from binbatch_sidecar.bench.e2e import RATIO_KEYS, ROW_KEYS

pytestmark = pytest.mark.vllm

# The default SLO (TTFT 500 ms, TPOT 20 ms) is the embedded engine's; this model's
# inter-token latency alone is ~35 ms, so a CI smoke run takes a loose one: every
# ratio then has a direct figure to divide by.
SLO = ("--slo-ttft-ms", "20000", "--slo-tpot-ms", "1000")
# This cache holds ~4 short chat sequences; 32 outstanding made vLLM thrash (recompute
# after recompute) so the capacity loop alone ran for minutes on a CPU without AVX-512.
CAPACITY = ("--capacity-concurrency", "6", "--capacity-requests", "18")
# --quick's 12-request burst preempted only 2-3 times on this cache, and once not at all in a
# clean CI run (no direct preemptions: no KV-pressure ratio); 48 preempted 8 times, 2 s a run.
BURST = ("--requests", "48")
# The clients every ratio needs (the contract under test) and the judged policy default, not the yardsticks
# beside them (online, priority): each row costs this CPU engine seconds, and the suite's time is shared.
CLIENTS = tuple(arg for key in ("direct", "default", "hint", "packed", "free", "ideal1", "ideal4", "ideal8", "gang1",
                                "gang4", "gang8") for arg in ("--client", key))  # fmt: skip
VLLM_BENCH_TIMEOUT = 900  # seconds; a few minutes where vLLM's CPU kernels are fast, far more where they are not


@pytest.mark.parametrize("vllm_server", ["small_kv"], indirect=True)
async def test_quick_e2e_bench_against_real_vllm_runs_direct_first_and_reads_its_preemptions(vllm_server, tmp_path):
    doc = await _bench(tmp_path, "e2e", "--engine", vllm_server.base_url, *SLO, *CAPACITY, *BURST, *CLIENTS,
                       timeout=VLLM_BENCH_TIMEOUT)  # fmt: skip

    assert list(doc) == ["setup", "runs", "ratios"]
    runs = doc["runs"]
    scenarios = [r["name"].split(" | ")[0] for r in runs]
    for i, row in enumerate(runs):
        assert tuple(row) == ROW_KEYS
        if i == 0 or scenarios[i] != scenarios[i - 1]:
            assert row["mode"] == "direct", row["name"]
        assert row["requests_per_s"] > 0, row["name"]
        # vLLM's vllm:num_preemptions_total, before/after each run
        assert isinstance(row["preemptions"], float) and row["preemptions"] >= 0, row["name"]
    assert {"direct", "continuous", "gang", "ideal-gang"} == {r["mode"] for r in runs}
    # what a user installs is run beside direct in every scenario
    assert {s for s, r in zip(scenarios, runs) if "policy default" in r["name"]} == set(scenarios)

    burst = {r["mode"]: r for r in runs if r["name"].startswith("chat burst")
             and "online" not in r["name"] and "policy default" not in r["name"]}  # the packing sidecar's row
    assert burst["direct"]["preemptions"] > 0, "the squeezed KV cache must preempt a direct burst"
    # the ShareGPT replay needs a 2,048-token context, more than this server's: left out, its ratios null
    assert tuple(doc["ratios"]) == (*RATIO_KEYS, "sharegpt") and set(doc["ratios"].pop("sharegpt").values()) == {None}
    assert not any(r["name"].startswith("ShareGPT") for r in runs)
    # so does the burst behind a 256-word system prompt (this server's context is 256 tokens)
    assert not any("system prompt" in r["name"] for r in runs)
    for key, value in doc["ratios"].items():
        assert type(value) is float and math.isfinite(value), (key, value)
    assert doc["ratios"]["preemptions_under_kv_pressure"] == pytest.approx(
        burst["continuous"]["preemptions"] / burst["direct"]["preemptions"]
    )
