"""bins.countMode Auto in a running sidecar: k re-chosen from the measured arrival
rate, the change and its reason in Stats and metrics, the queue kept."""

from __future__ import annotations

import asyncio

from sidecar_harness import prompt_request, running_sidecar, sidecar_config

from binbatch_sidecar.core.autok import BinCountController
from binbatch_sidecar.emulator import EmulatorConfig, running_emulator

FAST = EmulatorConfig(step_a=0.001, step_c=0.0001, num_gpu_blocks=512, block_size=16)


async def test_auto_count_rechooses_k_from_the_arrival_rate_and_reports_why(tmp_path):
    # A 1 ms latency target no k can meet: the k with the lowest Lemma 5.1 bound
    # wins, and with batches of 64 at the few hundred requests/s of this burst
    # (0.1-2 per 1 ms token step: stable for every k) that is one bin (each more
    # bin adds (B-1)/(2λ) of fill wait, more than it saves in service time).
    doc = sidecar_config(
        "",
        bins={"count": 4, "countMode": "Auto", "latencyTargetMilliseconds": 1, "maxOutputTokens": 64},
        batch={"sizing": "Static", "staticSize": 64, "maxWaitMilliseconds": 5},
        latency={"tpotMilliseconds": 1},  # the time scale while the engine reports none
        metrics={"source": "None"},
    )
    async with running_emulator(FAST) as url:
        doc["engine"]["url"], doc["metrics"]["url"] = url, url + "/metrics"
        async with running_sidecar(doc, tmp_path) as sc:
            side = sc.sidecar
            assert side.dispatcher.core.binner.k == 4  # starts at count, the most bins
            side.bin_count = BinCountController(4, 4, 0.001, confirm=1, hold=0.0)  # decide on the next snapshot
            await side.feed.poll_once()  # starts the arrival window
            await asyncio.gather(*(sc.inference.Generate(prompt_request(i, 4), timeout=60) for i in range(24)))
            await side.feed.poll_once()
            assert side.dispatcher.core.binner.k == 1
            stats = await sc.stats()
            changes = [a for a in stats.recent_adjustments if a.field == "binCount"]
            assert [(a.from_value, a.to_value) for a in changes] == [("4", "1")]
            assert changes[0].reason.startswith("target-unreachable: arrival rate ")
            assert len(stats.bins) == 1
            fams = await sc.scrape()
            counted = {s.labels["reason"]: s.value for s in fams["binbatch_bin_count_changes"].samples
                       if s.name.endswith("_total")}  # fmt: skip
            assert counted == {"target-unreachable": 1.0}
            assert fams["binbatch_bins"].samples[0].value == 1
            # still serving after the rebuild
            resp = await sc.inference.Generate(prompt_request(99, 3), timeout=30)
            assert resp.completion_tokens == 3 and resp.bin == 0
