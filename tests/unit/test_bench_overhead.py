"""``binbatch bench overhead``'s CPU accounting: each rate window says how much CPU
the client, the sidecar and the engine spent per request, so a reader can tell
which process limited the rate (the three share this machine's cores)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from binbatch_operator import builders
from binbatch_sidecar.bench.overhead import HAND_TUNED, cpu_seconds, judged_sidecar_doc, per_token, print_table
from binbatch_sidecar.config import parse_config


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_seconds_of_a_process_grow_with_the_cpu_it_uses():
    own, by_pid = cpu_seconds(), cpu_seconds(os.getpid())
    assert own is not None and by_pid is not None
    _spin(0.3)
    assert cpu_seconds() - own >= 0.25
    assert cpu_seconds(os.getpid()) - by_pid >= 0.2  # /proc counts in clock ticks


def test_cpu_seconds_of_a_process_that_is_gone_is_none():
    assert cpu_seconds(2**22 + 12345) is None  # above Linux's pid_max limit


def test_the_table_shows_each_process_cpu_per_request(capsys):
    doc = {
        "added_p50_ms": 0.5, "added_p99_ms": 1.5, "max_requests_per_s": 900.0,
        "http_added_p50_ms": 0.3, "http_added_p99_ms": 1.0, "http_max_requests_per_s": 1000.0,
        "stream_sidecar_cpu_us_per_request": 4321.0,
        "latency_ms": {"direct": {"p50": 0.5, "p99": 1.0}, "sidecar": {"p50": 1.0, "p99": 2.5},
                       "http": {"p50": 0.8, "p99": 2.0}},
        "rates": [
            {"path": "direct", "concurrency": 16, "requests_per_s": 3000.0,
             "cpu_us_per_request": {"client": 120.0, "sidecar": 2.0, "engine": 140.0}},
            {"path": "sidecar", "concurrency": 16, "requests_per_s": 900.0, "target_batch_size": 256,
             "cpu_us_per_request": {"client": 300.0, "sidecar": 850.0, "engine": None}},
            {"path": "http", "concurrency": 16, "requests_per_s": 1000.0,
             "cpu_us_per_request": {"client": 280.0, "sidecar": 800.0, "engine": 150.0}},
        ],
    }  # fmt: skip
    print_table(doc)
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["sidecar", "16", "900", "256", "300", "850", "-"] in rows
    assert ["direct", "16", "3000", "-", "120", "2", "140"] in rows
    assert ["http", "16", "1000", "-", "280", "800", "150"] in rows
    assert rows[-1][-1] == "1000"  # the HTTP door's most requests per second closes the table
    assert rows[-2][-2:] == ["4321", "us"]  # after the sidecar's CPU a streamed request

    doc["relay"] = {"concurrency": 32, "doors": {"http": {"cpu_us_per_token": 80.0, "cpu_us_per_request": 1500.0},
                                                 "grpc": {"cpu_us_per_token": None, "cpu_us_per_request": None}}}  # fmt: skip
    print_table(doc)
    out = capsys.readouterr().out
    assert "HTTP door: 80 us a token + 1500 us a request (12,500 tokens a CPU second)" in out
    assert "gRPC door: not measured (no /proc to read the CPU from)" in out


def test_the_relays_cost_a_token_is_the_slope_between_two_answer_lengths():
    # 1,000 us at 4 tokens, 11,000 at 104: 100 us a token, 600 a request
    assert per_token((4, 1000.0), (104, 11000.0)) == (100.0, 600.0)
    assert per_token((2, 500.0), (10, 500.0)) == (0.0, 500.0)  # a relay that cost nothing a token
    with pytest.raises(ValueError, match="longer than the short one, got 8 and 8 tokens"):
        per_token((8, 1.0), (8, 2.0))


ENGINE = "http://127.0.0.1:9"


def test_the_judged_sidecar_runs_the_policy_default():
    # what the operator renders for a BatchingPolicy that sets nothing, bench environment aside
    doc = judged_sidecar_doc(ENGINE, "m")
    policy = builders.sidecar_config({"selector": {}, "predictor": {}})
    policy.pop("server")
    bench_only = {"engine", "metrics", "server", "logging"}
    assert {k: v for k, v in doc.items() if k not in bench_only} == {k: v for k, v in policy.items() if k not in bench_only}
    assert doc["engine"] == {"url": ENGINE, "model": "m"}
    assert doc["metrics"] == {"url": f"{ENGINE}/metrics"}  # the default scrape interval
    assert doc["server"]["grpcPort"] == doc["server"]["httpPort"] == doc["server"]["metricsPort"] == 0
    judged, default = parse_config(doc), parse_config({})
    for section in ("bins", "batch", "memory", "latency", "predictor", "logging", "classes"):
        assert getattr(judged, section) == getattr(default, section), section
    assert judged.metrics.interval_milliseconds == default.metrics.interval_milliseconds
    assert (judged.kv_admission, judged.rank_by) == (default.kv_admission, default.rank_by)


def test_the_hand_tuned_row_differs_from_the_default():
    tuned = parse_config(HAND_TUNED)
    assert tuned.predictor.kind == "Hint" != parse_config({}).predictor.kind
    assert tuned.batch.sizing == "Static" and tuned.batch.static_size == 1024
