"""``binbatch demo`` end to end on the embedded engine (small workload)."""

from __future__ import annotations

from binbatch_sidecar.bench import demo


async def test_demo_serves_every_scenario_with_exact_lengths():
    doc = await demo.run_async(demo.DemoConfig(requests=64), progress=lambda _: None)
    names = [row["scenario"] for row in doc["rows"]]
    assert names == [name for name, _ in demo.scenarios(demo.DemoConfig())]
    assert doc["rows"][0]["ratio_to_1_bin"] == 1.0
    for row in doc["rows"]:
        assert row["requests_per_second"] > 0
        assert 1 <= row["mean_batch"] <= 32
