"""What two commands print at their end or on failure, in a user's words.

``binbatch demo`` ends with the count of targets met, saying what a target is
without project shorthand; ``binbatch bench operator`` without its optional
dependencies exits 2 naming the extra to install instead of a traceback.
"""

from __future__ import annotations

import re
import sys

import pytest

from binbatch_sidecar import cli
from binbatch_sidecar.bench import demo, e2e

from .test_demo_plan import _doc


def test_the_demo_ends_with_the_targets_met_in_plain_words(capsys):
    cfg = demo.config()
    ratios = dict.fromkeys(e2e.RATIO_KEYS, 1.0) | {"e2e_mean_at_95pct_load": 1.05,
                                                   "sharegpt": {"e2e_mean": 0.95, "e2e_p99": 1.1, "throughput": 0.99,
                                                                "preemptions": 0.1}}  # fmt: skip
    doc = _doc(cfg, ratios)
    doc["wins"] = demo.judge(doc, cfg)
    doc["setup"] = {"engine": "embedded", "slo": "TTFT <= 500 ms", "repeats": 1, "seed": 1, "failures": 0,
                    "capacity_requests_per_s": 10.0}  # fmt: skip
    demo.print_report(doc)
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    met = sum(c["met"] is True for w in doc["wins"] for c in w["checks"])
    total = sum(len(w["checks"]) for w in doc["wins"])
    assert last.startswith(f"targets met: {met} of {total} (each a goal the sidecar sets itself against calling "
                           "the embedded engine directly;")  # fmt: skip
    assert not re.search(r"\bissues?\b|\bsession", last), last


@pytest.mark.parametrize("absent", ["kmock", "psutil"])
def test_bench_operator_without_its_extra_names_the_extra_and_exits_2(monkeypatch, capsys, absent):
    monkeypatch.setitem(sys.modules, absent, None)  # import of it raises ModuleNotFoundError
    code = cli.main(["bench", "operator", "--quick"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_CANNOT_START
    assert f"({absent} is not installed)" in err
    assert "pip install 'binbatch[operator-bench]'" in err
    assert "Traceback" not in err


def test_bench_operator_on_a_real_api_server_does_not_need_kmock(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "kmock", None)
    monkeypatch.setitem(sys.modules, "psutil", sys.modules.get("psutil") or object())
    assert cli._missing_operator_bench_module(needs_kmock=False) is None
    assert cli._missing_operator_bench_module(needs_kmock=True) == "kmock"
