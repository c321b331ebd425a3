"""``binbatch bench sim``: direct first, then the sidecar's scheduler in each setup, as ratios."""

from __future__ import annotations

import io
import json

from binbatch_sidecar.bench import sim
from binbatch_sidecar.cli import main


def small() -> sim.SimBenchConfig:
    return sim.SimBenchConfig(rates=(1.0, 3.0), requests=150, kv_tokens=8192)


def test_every_load_starts_with_direct_and_compares_each_setup_to_it():
    doc = sim.run(small())
    rows = doc["rows"]
    per_load = len(sim.SETUPS) + 1
    assert len(rows) == 2 * per_load
    for start in (0, per_load):
        block = rows[start : start + per_load]
        assert [r["setup"] for r in block] == ["direct", *(s.name for s in sim.SETUPS)]
        assert block[0]["throughput_x"] == 1.0
        assert all(r["completed"] == 150 for r in block)  # nothing lost in any setup


def test_the_memory_sizer_preempts_less_than_direct_under_kv_pressure():
    rows = sim.run(small())["rows"]
    loaded = {r["setup"]: r for r in rows if r["rate"] == 3.0}
    assert loaded["direct"]["preemptions"] > 0
    assert loaded["continuous memory"]["preemptions"] < loaded["direct"]["preemptions"]


def test_table_and_json_output(capsys):
    out = io.StringIO()
    sim.print_table(sim.run(sim.SimBenchConfig(rates=(1.0,), requests=40)), out)
    assert "continuous memory" in out.getvalue() and "throughput_x" in out.getvalue()
    assert main(["bench", "sim", "--json", "--requests", "40"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["rows"][0]["setup"] == "direct" and doc["setting"]["requests"] == 40
