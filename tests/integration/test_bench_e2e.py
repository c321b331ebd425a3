"""``binbatch bench e2e`` and ``binbatch bench overhead``, quick, end to end.

The benches start the embedded engine and sidecars as child processes on
127.0.0.1.  The test holds their output to its contract -- the exact JSON schema,
direct first, ratios computed from the same run's rows, a PNG -- and makes no
claim about the figures themselves (timing belongs in benchmarks, not tests).
"""

from __future__ import annotations

import json
import math

import pytest
from bench_support import run_binbatch

from binbatch_sidecar.bench import workloads
from binbatch_sidecar.bench.e2e import RATIO_KEYS, ROW_KEYS, SHAREGPT_RATIO_KEYS

BENCH_TIMEOUT = 300  # seconds; the quick e2e bench takes about a minute on 2 busy cores
NUMBER_OR_NONE = (int, float, type(None))


async def _bench(tmp_path, *args: str, timeout: float = BENCH_TIMEOUT) -> dict:
    code, out, err = await run_binbatch(tmp_path, "bench", *args, "--quick", "--json", timeout=timeout)
    assert code == 0, err.decode()[-3000:]
    assert b"[bench " in err, "progress goes to stderr"
    return json.loads(out)  # exactly one JSON document on stdout


def _row(runs: list[dict], *, mode: str, load: float | None, k: int = 1, name_has: str = "", client: str = "") -> dict:
    """The one row of ``mode`` at ``load`` (``client``: exactly this client label)."""
    (row,) = [r for r in runs if r["mode"] == mode and r["load"] == load and r["k"] == k and name_has in r["name"]
              and (not client or r["name"].split(" | ", 1)[1] == client)]  # fmt: skip
    return row


async def test_quick_e2e_bench_prints_runs_direct_first_and_ratios_from_the_same_rows(tmp_path):
    png, samples = tmp_path / "e2e.png", tmp_path / "samples.jsonl"
    doc = await _bench(tmp_path, "e2e", "--plot", str(png), "--samples", str(samples))

    assert list(doc) == ["setup", "runs", "ratios"]
    runs = doc["runs"]
    assert runs and runs[0]["mode"] == "direct"
    for row in runs:
        assert tuple(row) == ROW_KEYS, row
        assert type(row["name"]) is str and type(row["mode"]) is str and type(row["k"]) is int
        assert isinstance(row["load"], NUMBER_OR_NONE)
        for key in ROW_KEYS[4:]:
            assert isinstance(row[key], NUMBER_OR_NONE), (row["name"], key)
        assert row["requests_per_s"] > 0 and row["output_tokens_per_s"] > 0, row["name"]
    # every scenario sends direct first: the row before a scenario's first non-direct row is its direct row
    scenarios = [r["name"].split(" | ")[0] for r in runs]
    for i, row in enumerate(runs):
        if i == 0 or scenarios[i] != scenarios[i - 1]:
            assert row["mode"] == "direct", row["name"]
    assert {"direct", "engine-priority", "continuous", "gang", "ideal-gang"} == {r["mode"] for r in runs}

    # the setup carries what the figures came from, the policy default's ratios in every scenario among it
    setup = doc["setup"]
    assert setup["engine"].startswith("embedded") and set(setup["default_by_scenario"]) >= {"chat@burst"}
    # and the same sidecar configuration through the OpenAI HTTP door, called by direct's own client, in
    # every scenario the gRPC door was judged in; its ratios come from its rows and direct's
    assert set(setup["default_http_by_scenario"]) == set(setup["default_by_scenario"])
    short = {c: _row(runs, mode=m, load=None, k=k, name_has="short burst", client=c)
             for c, m, k in [("direct", "direct", 1), ("sidecar, policy default, no hint, HTTP door", "continuous", 4)]}
    assert setup["default_http_by_scenario"]["short@ample"]["throughput"] == pytest.approx(
        short["sidecar, policy default, no hint, HTTP door"]["requests_per_s"] / short["direct"]["requests_per_s"])
    assert "learned-http" in setup["sharegpt_by_client"]
    ratios = doc["ratios"]
    assert tuple(ratios) == (*RATIO_KEYS, "sharegpt")
    assert tuple(ratios["sharegpt"]) == SHAREGPT_RATIO_KEYS
    for key, value in (*((k, v) for k, v in ratios.items() if k != "sharegpt"), *ratios["sharegpt"].items()):
        assert value is None or (type(value) is float and math.isfinite(value)), key
    # the ShareGPT replay: real prompts, recorded lengths the embedded engine ends each answer at, direct first
    replay = [r["name"].split(" | ", 1)[1] for r in runs if r["name"].startswith("ShareGPT replay")]
    assert replay[0] == "direct" and "sidecar, true length as hint (oracle)" in replay
    direct = _row(runs, mode="direct", load=0.95, name_has="chat load")
    sidecar = _row(runs, mode="continuous", load=0.95, k=4, client="sidecar continuous k=4 hint")
    # vLLM's priority scheduling (the embedded engine's twin) and the sidecar handing its order to it both answered
    assert _row(runs, mode="engine-priority", load=0.95)["requests_per_s"] > 0
    assert _row(runs, mode="continuous", load=0.95, k=4, client="sidecar continuous k=4 hint, order in engine",
                name_has="chat load")["requests_per_s"] > 0  # fmt: skip
    # and on the ShareGPT replay, the judged sidecar (no hint) handing its order to that engine
    assert _row(runs, mode="continuous", load=0.95, k=4, name_has="ShareGPT replay",
                client="sidecar, no hint, Learned (warm start), order in engine")["requests_per_s"] > 0  # fmt: skip
    assert ratios["e2e_p99_at_95pct_load"] == pytest.approx(sidecar["e2e_p99_s"] / direct["e2e_p99_s"])
    # the KV-pressure ratios are the packing sidecar's (drainOrder LongestFitFirst), the hinted one's row beside it
    burst = {name: _row(runs, mode=mode, load=None, k=k, name_has=name)
             for name, mode, k in [("chat burst, KV pressure | direct", "direct", 1), ("LongestFitFirst", "continuous", 4)]}  # fmt: skip
    assert ratios["throughput_under_kv_pressure"] == pytest.approx(
        burst["LongestFitFirst"]["requests_per_s"] / burst["chat burst, KV pressure | direct"]["requests_per_s"])
    assert "chat burst, KV pressure | sidecar continuous k=4 hint" in {r["name"] for r in runs}
    gain = {(m, k): _row(runs, mode=m, load=None, k=k)["requests_per_s"] for m in ("gang", "ideal-gang") for k in (1, 4, 8)}
    for k in (4, 8):
        assert ratios[f"gang_k{k}_gain_vs_ideal"] == pytest.approx(
            (gain["gang", k] / gain["gang", 1]) / (gain["ideal-gang", k] / gain["ideal-gang", 1])
        )

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # --samples: every answered request once, by its place in the workload, so one request is followed across
    # clients: each client's run of a scenario answered the same requests, each with the same length
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    assert doc["setup"]["failures"] == 0 and lines
    runs_of: dict[tuple, dict[int, int]] = {}
    for s in lines:
        assert set(s) == {"scenario", "load", "client", "repeat", "index", "tokens", "ttft_s", "e2e_s"}, s
        assert 0 < s["ttft_s"] <= s["e2e_s"] and s["repeat"] == 1
        tokens = runs_of.setdefault((s["scenario"], s["client"]), {})
        assert s["index"] not in tokens, s  # each request once a run
        tokens[s["index"]] = s["tokens"]
    by_scenario: dict[str, list[dict[int, int]]] = {}
    for (scenario, _), tokens in runs_of.items():
        by_scenario.setdefault(scenario, []).append(tokens)
    assert {"chat@burst", "sharegpt"} <= set(by_scenario)
    for scenario, runs_here in by_scenario.items():
        assert sorted(runs_here[0]) == list(range(len(runs_here[0]))), scenario
        assert all(r == runs_here[0] for r in runs_here), scenario  # same indices, same lengths, every client


async def test_quick_overhead_bench_prints_its_keys_for_both_doors(tmp_path):
    doc = await _bench(tmp_path, "overhead")

    assert list(doc) == ["added_p50_ms", "added_p99_ms", "max_requests_per_s", "http_added_p50_ms", "http_added_p99_ms",
                         "http_max_requests_per_s", "stream_sidecar_cpu_us_per_request", "relay_http_cpu_us_per_token",
                         "relay_grpc_cpu_us_per_token"]  # fmt: skip
    # (the quick relay's few short answers are too few for /proc's clock ticks to price a token: finite, not signed)
    assert all(type(v) is float and math.isfinite(v) for v in doc.values()), doc
    assert doc["max_requests_per_s"] > 0 and doc["http_max_requests_per_s"] > 0
    assert doc["stream_sidecar_cpu_us_per_request"] > 0  # the streamed path ran, and its sidecar worked


def test_workload_replays_the_same_requests_at_every_load():
    burst = workloads.build("chat", 50, rate=None, seed=3)
    poisson = workloads.build("chat", 50, rate=10.0, seed=3)

    assert [(r.prompt, r.output_tokens) for r in burst] == [(r.prompt, r.output_tokens) for r in poisson]
    assert all(r.arrival_s == 0 for r in burst)
    arrivals = [r.arrival_s for r in poisson]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert workloads.build("chat", 50, rate=None, seed=4) != burst


def test_a_seed_fixes_the_arrival_pattern_at_every_rate():
    # the rate is a fraction of a measured capacity, a new float each run: the same
    # seed must give the same arrivals scaled, not a new sample (workloads.build)
    at_10 = [r.arrival_s for r in workloads.build("chat", 50, rate=10.0, seed=3)]
    at_9_37 = [r.arrival_s for r in workloads.build("chat", 50, rate=9.37, seed=3)]
    assert at_9_37 == pytest.approx([t * 10.0 / 9.37 for t in at_10], rel=1e-12)
    assert [r.arrival_s for r in workloads.build("chat", 50, rate=10.0, seed=4)] != at_10


def test_ideal_gang_bins_cut_by_length_and_keep_arrival_order():
    lengths = [5, 90, 7, 60, 1, 33, 2, 8]

    assert [[lengths[i] for i in b] for b in workloads.equal_mass_bins(lengths, 4)] == [
        [1, 2], [5, 7], [33, 8], [90, 60]
    ]  # fmt: skip
    # one bin is the arrival order itself: k = 1 must not sort (that would be binning)
    assert workloads.equal_mass_bins(lengths, 1) == [list(range(len(lengths)))]


@pytest.mark.parametrize("shape", workloads.SHAPES)
def test_lengths_stay_within_the_shape_bounds(shape):
    lengths = [r.output_tokens for r in workloads.build(shape, 400, rate=None, seed=1)]

    assert 2 <= min(lengths) and max(lengths) <= workloads.longest(shape, 1.0)
    assert len(set(lengths)) > 5


async def test_a_terminated_bench_stops_its_engine_and_sidecars_and_exits_143(tmp_path):
    """SIGTERM (``kill``, a CI job's timeout) stops the bench's children with it,
    not just Ctrl-C: a timed-out bench once left six sidecars running."""
    import asyncio
    import re
    import signal
    import sys

    from bench_support import stop_group

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "binbatch_sidecar.cli", "bench", "e2e", "--quick", "--only", "chat@burst",
        cwd=tmp_path, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    ports: list[int] = []
    try:
        async with asyncio.timeout(BENCH_TIMEOUT):
            assert proc.stderr is not None
            while len(ports) < 2:  # the engine, then the first sidecar
                line = (await proc.stderr.readline()).decode()
                assert line, "the bench ended before it started its children"
                if m := re.search(r"(?:embedded engine \(kv\)|sidecar kv-hint): .*?127\.0\.0\.1:(\d+)$|"
                                  r"sidecar kv-hint on 127\.0\.0\.1:(\d+)$", line.strip()):  # fmt: skip
                    ports.append(int(m.group(1) or m.group(2)))
            proc.send_signal(signal.SIGTERM)  # the bench alone, not its group
            await proc.stderr.read()
            assert await proc.wait() == 143
        for port in ports:
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection("127.0.0.1", port)
    finally:
        await stop_group(proc)
