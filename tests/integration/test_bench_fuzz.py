"""``binbatch bench fuzz``, small, end to end: the engine and the sidecar as child
processes on 127.0.0.1, the config parsers in the bench.  The test holds the bench to
its counts (inputs per target, answers adding up to them, no 5xx, no crash, no ERROR
record, the memory figures) -- the 100,000-input run is the bench's, not CI's."""

from __future__ import annotations

import json

from bench_support import run_binbatch

BENCH_TIMEOUT = 240


async def test_fuzz_bench_counts_every_input_and_finds_no_5xx_crash_or_error_log(tmp_path):
    code, out, err = await run_binbatch(tmp_path, "bench", "fuzz", "--inputs", "301", "--seed", "5", "--json",
                                        timeout=BENCH_TIMEOUT)  # fmt: skip
    assert code == 0, err.decode()[-3000:]
    assert b"[bench fuzz]" in err, "progress goes to stderr"
    doc = json.loads(out)
    assert doc["seed"] == 5 and doc["inputs"] == 301
    assert [t["inputs"] for t in doc["targets"].values()] == [101, 100, 100]  # http, grpc, config
    for name, t in doc["targets"].items():
        assert sum(t["answers"].values()) == t["inputs"] == sum(t["by_kind"].values()), name
        assert t["failures"] == 0 and t["examples"] == [], name
    assert (doc["failures"], doc["http_5xx"], doc["grpc_internal_or_unknown"], doc["config_other_exceptions"]) == (0, 0, 0, 0)
    assert "4xx" in doc["targets"]["http"]["answers"] and "INVALID_ARGUMENT" in doc["targets"]["grpc"]["answers"]
    assert "unsendable" not in doc["targets"]["grpc"]["answers"]  # every generated call left the client
    side = doc["sidecar"]
    assert side["crashed"] is False and side["exit_code"] == 0 and side["error_logs"] == 0
    assert 0 < side["rss_start_mib"] <= side["rss_max_mib"] and side["rss_end_mib"] <= side["rss_max_mib"]


async def test_fuzz_bench_refuses_an_unknown_target_naming_the_flag(tmp_path):
    code, _, err = await run_binbatch(tmp_path, "bench", "fuzz", "--targets", "http,ftp", timeout=60)
    assert code == 2 and b"--targets" in err and b"ftp" in err
