"""``binbatch bench operator`` without its optional dependencies (the
``operator-bench`` extra: kmock, psutil) exits 2 naming the extra to install,
instead of a traceback.  (The demo's closing line is tested in test_demo_plan.)
"""

from __future__ import annotations

import sys
import types

import pytest

from binbatch_sidecar import cli


@pytest.mark.parametrize("absent", ["kmock", "psutil"])
def test_bench_operator_without_its_extra_names_the_extra_and_exits_2(monkeypatch, capsys, absent):
    other = {"kmock": "psutil", "psutil": "kmock"}[absent]
    monkeypatch.setitem(sys.modules, other, sys.modules.get(other) or types.ModuleType(other))  # present
    monkeypatch.setitem(sys.modules, absent, None)  # import of it raises ModuleNotFoundError
    code = cli.main(["bench", "operator", "--quick"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_CANNOT_START
    assert f"({absent} is not installed)" in err
    assert "pip install 'binbatch[operator-bench]'" in err
    assert "Traceback" not in err


def test_bench_operator_on_a_real_api_server_does_not_need_kmock(monkeypatch):
    monkeypatch.setitem(sys.modules, "kmock", None)
    monkeypatch.setitem(sys.modules, "psutil", sys.modules.get("psutil") or types.ModuleType("psutil"))
    assert cli._missing_operator_bench_module(needs_kmock=False) is None
    assert cli._missing_operator_bench_module(needs_kmock=True) == "kmock"
