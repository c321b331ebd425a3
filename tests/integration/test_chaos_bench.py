"""``binbatch bench chaos --quick`` end to end, and the pieces it counts with.

The quick bench starts real engine emulators and sidecars as child processes on
127.0.0.1 and breaks them (overload, SIGKILL, config churn, SIGTERM, bad
metrics); the test holds it to the issue's bar: nothing lost, duplicated or
hung, a clean SIGTERM exit, every config change refused or applied as it should
be, and every scenario really exercised its fault.
"""

from __future__ import annotations

import json

import aiohttp
from bench_support import run_binbatch
from prometheus_client.parser import text_string_to_metric_families

from binbatch_sidecar import cli
from binbatch_sidecar.bench import chaos
from binbatch_sidecar.bench.bad_metrics import with_nan_gauges
from binbatch_sidecar.bench.chaos_load import Outcome
from binbatch_sidecar.bench.chaos_processes import read_receipts
from binbatch_sidecar.emulator import Emulator, EmulatorConfig

BENCH_TIMEOUT = 300  # seconds; the quick bench takes about a minute on 2 busy cores
COMMON_KEYS = {"lost", "duplicated", "hung", "exercised", "calls", "codes", "engine_prompts_received",
               "sidecar_exit_code"}  # fmt: skip


async def test_quick_chaos_bench_loses_duplicates_and_hangs_nothing(tmp_path):
    code, out, err = await run_binbatch(tmp_path, "bench", "chaos", "--quick", "--json", "--quiet",
                                        timeout=BENCH_TIMEOUT)  # fmt: skip
    assert code in (0, 1), err.decode()[-3000:]
    doc = json.loads(out)

    for key in ("lost", "duplicated", "hung"):
        assert type(doc[key]) is int
        assert doc[key] == sum(doc[name][key] for name in chaos.SCENARIOS)
    for name in chaos.SCENARIOS:
        assert COMMON_KEYS <= doc[name].keys(), name
    overload, kill, churn, term, faults = (doc[name] for name in chaos.SCENARIOS)
    assert {"ok", "resource_exhausted", "deadline_exceeded", "other"} == overload["fraction"].keys()
    assert [c["change"] for c in churn["changes"]] == [
        "bad YAML", "bad value", "empty file", "valid change", "engine URL change"
    ]  # fmt: skip
    assert [p["phase"] for p in faults["phases"]] == ["healthy", "gone", "healthy", "garbage", "healthy", "nan",
                                                      "healthy"]  # fmt: skip

    # The figures: every miss is collected, so one run names all of them.
    misses = []
    for name in chaos.SCENARIOS:
        s = doc[name]
        if s["exercised"] is not True:
            misses.append(f"{name}: did not exercise its fault")
        if s["engine_prompts_received"] == 0:
            misses.append(f"{name}: the engine's receipt log (which counts duplicates) is empty")
        if s["calls"] != sum(s["codes"].values()):
            misses.append(f"{name}: a call without exactly one terminal status")
        for key in ("lost", "duplicated", "hung"):
            if s[key]:
                misses.append(f"{name}: {key} = {s[key]}")
    if not overload["achieved_rps"] >= 3 * overload["capacity_rps"] > 0:
        misses.append(f"overload: offered {overload['achieved_rps']} req/s, capacity {overload['capacity_rps']}")
    if not overload["rss_mb"]["before"] or not overload["fds"]["before"]:
        misses.append("overload: no RSS / open fds read from /proc")
    if overload["recovered"] is not True:
        misses.append(f"overload: not recovered within {doc['settings']['recovery_timeout_seconds']} s "
                      f"(stuck in flight: {overload['stuck_inflight']})")  # fmt: skip
    if not (kill["in_engine_at_kill"] > 0 and kill["restart_seconds"] >= kill["outage_seconds"]):
        misses.append("engine_kill: the engine was not killed with requests in it, or came back too soon")
    for change in churn["changes"]:
        if not change["ok"]:
            misses.append(f"config_churn: {change['change']} was {change['outcome']}, "
                          f"expected {' or '.join(change['expected'])}")  # fmt: skip
    if churn["failed_calls"]:
        misses.append(f"config_churn: calls failed although both engines were up: {churn['failed_calls']}")
    if term["exit_code"] != 0 or term["drained_within_grace"] is not True or term["inflight_at_term"] == 0:
        misses.append(f"sigterm: exit {term['exit_code']} after {term['drain_seconds']} s "
                      f"(grace {term['grace_seconds']} s, {term['inflight_at_term']} in flight)")  # fmt: skip
    assert misses == [], "\n".join(misses)
    assert code == 0


def test_cli_offers_every_chaos_scenario():
    args = cli.build_parser().parse_args(["bench", "chaos", "--quick", "--only", "sigterm", "--only", "overload"])
    assert args.only == ["sigterm", "overload"] and args.quick
    assert cli._CHAOS_SCENARIOS == chaos.SCENARIOS
    cfg = chaos.configure(True, scenarios=tuple(args.only), overload_seconds=None)
    assert cfg.scenarios == ("sigterm", "overload")
    assert cfg.overload_seconds == chaos.ChaosConfig.quick().overload_seconds


async def test_emulator_receipt_log_counts_a_prompt_sent_twice(tmp_path):
    receipts = tmp_path / "receipts.jsonl"
    body = {"model": "emulated", "prompt": "same prompt\nwith a newline", "max_tokens": 2}
    async with Emulator(EmulatorConfig(step_a=0.0005, step_c=0.0, receipts_file=str(receipts))) as emu:
        async with aiohttp.ClientSession() as http:
            for prompt in (body["prompt"], body["prompt"], "another"):
                async with http.post(f"{emu.base_url}/v1/completions", json={**body, "prompt": prompt}) as resp:
                    assert resp.status == 200
    assert read_receipts(receipts) == {"same prompt\nwith a newline": 2, "another": 1}


def test_nan_metrics_stay_parseable_with_nan_gauges():
    body = (b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            b'vllm:prompt_tokens_total{engine="0",model_name="m"} 7.0\n')  # fmt: skip
    samples = {s.name: s.value for f in text_string_to_metric_families(with_nan_gauges(body).decode())
               for s in f.samples}  # fmt: skip
    assert samples["vllm:kv_cache_usage_perc"] != samples["vllm:kv_cache_usage_perc"]  # NaN
    assert samples["vllm:num_requests_running"] != samples["vllm:num_requests_running"]
    assert samples["vllm:prompt_tokens_total"] == 7.0


def test_a_transport_failure_counts_as_dropped_but_a_sidecar_status_does_not():
    def outcome(code: str, details: str) -> Outcome:
        return Outcome(key="k", tag="t", deadline=1.0, started=0.0, ended=1.0, code=code, details=details)

    assert outcome("UNAVAILABLE", "Socket closed").dropped
    assert outcome("UNAVAILABLE", "failed to connect to all addresses; last error: ...").dropped
    assert not outcome("UNAVAILABLE", "engine: cannot connect to the engine: Connection refused").dropped
    assert not outcome("UNAVAILABLE", "the sidecar is shutting down and accepts no new requests").dropped
    assert not outcome("DEADLINE_EXCEEDED", "Deadline Exceeded").dropped
