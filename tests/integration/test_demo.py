"""``binbatch demo --quick``, end to end on the embedded engine.

Holds the demo to its contract, not to its figures (timing belongs in
benchmarks): direct to the engine first, the sidecar's best configuration for
each win of issue 11, every ratio present and computed from the same run's
rows, each judged against its target, and the PNG written.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from binbatch_sidecar.bench import demo

DEMO_TIMEOUT = 300  # seconds; the quick demo takes well under a minute on 2 busy cores


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One quick demo for the module's tests: (its JSON document, its PNG path)."""
    tmp = tmp_path_factory.mktemp("demo")
    png = tmp / "demo.png"

    proc = subprocess.run(
        [sys.executable, "-m", "binbatch_sidecar.cli", "demo", "--quick", "--json", "--plot", str(png)],
        cwd=tmp, capture_output=True, timeout=DEMO_TIMEOUT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert b"[demo] " in proc.stderr, "progress goes to stderr"
    out = proc.stdout
    return json.loads(out), png


def test_demo_document_runs_direct_first_in_every_scenario(demo_run):
    doc, _ = demo_run
    assert list(doc) == ["setup", "runs", "ratios", "wins"]
    runs = doc["runs"]
    assert runs[0]["mode"] == "direct"
    scenarios = [r["name"].split(" | ")[0] for r in runs]
    for i, row in enumerate(runs):
        if i == 0 or scenarios[i] != scenarios[i - 1]:
            assert row["mode"] == "direct", row["name"]
        assert row["requests_per_s"] > 0, row["name"]
    # the best configuration per win only: hinted sidecars, gang k = 1 and 4, no online predictor, no k = 8
    assert {(r["mode"], r["k"]) for r in runs} == {("direct", 1), ("continuous", 4), ("gang", 1), ("gang", 4),
                                                   ("ideal-gang", 1), ("ideal-gang", 4)}  # fmt: skip
    assert not [r for r in runs if "online" in r["name"]]
    assert doc["setup"]["failures"] == 0


def test_demo_judges_each_win_with_ratios_from_its_own_rows(demo_run):
    doc, _ = demo_run
    runs = {r["name"]: r for r in doc["runs"]}
    wins = {w["key"]: w for w in doc["wins"]}
    assert list(wins) == [w.key for w in demo.WINS]
    for win in doc["wins"]:
        assert win["rows"] and runs[win["rows"][0]]["mode"] == "direct", win["key"]
        assert win["measured"], win["key"]
        for check in win["checks"]:
            value = check["value"]
            first, *rest = check["ratio"].split(".")  # a ratio, or a path into the ratios or the notes
            found = doc["ratios"] if first in doc["ratios"] else doc["setup"]
            for key in (first, *rest):
                found = found[key]
            assert value == found
            if value is None:  # only where the run gives nothing to divide by (no direct preemptions)
                assert "preemptions" in check["ratio"] and check["met"] is None, check
                continue
            assert type(value) is float and math.isfinite(value), check
            assert check["met"] is (value <= check["target"] if check["op"] == "<=" else value >= check["target"])

    # the burst's ratios are the packing sidecar's; the default drain order's row is shown beside it
    direct, default_drain, sidecar = (runs[n] for n in wins["kv"]["rows"])
    assert "LongestFitFirst" in sidecar["name"] and "LongestFitFirst" not in default_drain["name"]
    assert doc["ratios"]["throughput_under_kv_pressure"] == pytest.approx(
        sidecar["requests_per_s"] / direct["requests_per_s"]
    )
    assert direct["preemptions"] is not None and sidecar["preemptions"] is not None  # read from the engine
    preempted = doc["ratios"]["preemptions_under_kv_pressure"]
    assert preempted == (pytest.approx(sidecar["preemptions"] / direct["preemptions"]) if direct["preemptions"] else None)
    direct, sidecar, in_engine = (runs[n] for n in wins["latency"]["rows"])
    assert doc["ratios"]["e2e_p99_at_95pct_load"] == pytest.approx(sidecar["e2e_p99_s"] / direct["e2e_p99_s"])
    # the sidecar handing its order to the engine's priority twin: reported beside, from its own row
    assert "order in engine" in in_engine["name"] and "order in engine" not in sidecar["name"]
    assert doc["setup"]["engine_order_at_95pct_load"]["e2e_p99"] == pytest.approx(in_engine["e2e_p99_s"] / direct["e2e_p99_s"])
    gang = {runs[n]["mode"] + str(runs[n]["k"]): runs[n]["requests_per_s"] for n in wins["gang"]["rows"]}
    assert doc["ratios"]["gang_k4_gain_vs_ideal"] == pytest.approx(
        (gang["gang4"] / gang["gang1"]) / (gang["ideal-gang4"] / gang["ideal-gang1"])
    )


def test_demo_writes_the_latency_and_goodput_plot(demo_run):
    _, png = demo_run
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_report_prints_direct_before_the_sidecar_and_every_verdict(demo_run, capsys):
    doc, _ = demo_run
    demo.print_report(doc)
    text = capsys.readouterr().out
    for win in doc["wins"]:
        section = text.split(win["label"], 1)[1].split("\n\n", 1)[0]
        lines = [ln for ln in section.splitlines() if ln.startswith("   ")]
        assert lines[1].split()[0] == "direct", lines
        for check in win["checks"]:
            verdict = {True: "met", False: "MISSED", None: "not measured"}[check["met"]]
            assert any(ln.split()[:1] == check["label"].split()[:1] and ln.endswith(verdict) for ln in lines), lines
    met = sum(c["met"] is True for w in doc["wins"] for c in w["checks"])
    assert f"targets met: {met} of {sum(len(w['checks']) for w in doc['wins'])}" in text
