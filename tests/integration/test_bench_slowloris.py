"""``binbatch bench slowloris``, small, end to end: the engine and the sidecar as
child processes on 127.0.0.1.  The test holds the bench to what it counts (held,
closed at once by the cap, cut by the deadline, refused normal requests), not to
its latency figures (timing belongs in benchmarks, not tests)."""

from __future__ import annotations

import json

from bench_support import run_binbatch

BENCH_TIMEOUT = 180


async def test_slowloris_bench_counts_the_held_the_capped_and_the_cut(tmp_path):
    code, out, err = await run_binbatch(
        tmp_path, "bench", "slowloris", "--connections", "20", "--max-connections", "10", "--read-timeout-ms", "1000",
        "--requests", "5", "--json", timeout=BENCH_TIMEOUT,
    )  # fmt: skip
    assert code == 0, err.decode()[-3000:]
    assert b"[bench slowloris]" in err, "progress goes to stderr"
    doc = json.loads(out)
    assert (doc["connections"], doc["max_connections"], doc["read_timeout_ms"]) == (20, 10, 1000)
    assert (doc["held"], doc["refused_at_once"], doc["not_cut"]) == (10, 10, 0)  # the cap, then the deadline
    assert 0.5 <= doc["cut_after_p50_s"] <= doc["cut_after_max_s"] < 3.0
    assert doc["during_refused"] == 5 and doc["during_answered"] == 0  # the cap is full: normal requests too
    assert doc["answered_after_cut"] == 5 and doc["baseline_p50_ms"] > 0
