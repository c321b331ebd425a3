"""batch.dispatch Smdp in a running sidecar: batch times are fitted from real gang
batches, the control limit is solved in the background, and a partial batch
leaves as soon as its bin reaches it (reason "policy"), long before maxWait."""

from __future__ import annotations

import asyncio

from sidecar_harness import prompt_request, running_sidecar, sidecar_config

from binbatch_sidecar.emulator import EmulatorConfig, running_emulator

# 10 ms per engine step plus 1 ms per sequence in it: a batch of b requests of 4
# tokens takes about 4·(10 + b) ms, so the intercept β stands well above the
# HTTP jitter of a shared test machine.
STEPPED = EmulatorConfig(step_a=0.01, step_c=0.001, num_gpu_blocks=512, block_size=16)


async def test_smdp_dispatch_sends_at_the_solved_control_limit(tmp_path):
    doc = sidecar_config(
        "",
        bins={"count": 1},
        batch={"mode": "Gang", "sizing": "Static", "staticSize": 8, "maxInflightBatches": 1,
               "maxWaitMilliseconds": 200, "dispatch": "Smdp", "smdpEngineWeight": 1},  # fmt: skip
        # Snapshots only when the test polls (the feed's own loop waits a minute),
        # so the load's bucket cannot move between the solve and the wave.
        metrics={"source": "None", "intervalMilliseconds": 60000, "staleAfterMilliseconds": 120000},
    )
    async with running_emulator(STEPPED) as url:
        doc["engine"]["url"], doc["metrics"]["url"] = url, url + "/metrics"
        async with running_sidecar(doc, tmp_path) as sc:
            side = sc.sidecar
            await side.feed.poll_once()  # starts the arrival window
            # Batches of several sizes (full ones of 8, timed-out ones of 1..7) give the fit its line.
            for size in (1, 3, 5, 8, 2, 7, 4, 6, 8, 8):
                await asyncio.gather(*(sc.inference.Generate(prompt_request(i, 4), timeout=60) for i in range(size)))
            fit = side.service_fit.fit()
            assert fit is not None and fit[1] > 0.01, fit  # β: the engine time a dispatch costs
            await side.feed.poll_once()  # the load's bucket is wanted: the background solver takes it
            assert side.smdp.key is not None and side.smdp.cache.wanted() == [side.smdp.key]
            await asyncio.wait_for(side.smdp_solved.wait(), timeout=60)
            threshold = side.smdp.threshold
            assert threshold is not None and 1 <= threshold <= 8
            fams = await sc.scrape()
            assert fams["binbatch_smdp_control_limit"].samples[0].value == threshold
            # A wave of exactly the control limit leaves as one "policy" batch.
            replies = await asyncio.gather(
                *(sc.inference.Generate(prompt_request(100 + i, 4), timeout=60) for i in range(threshold))
            )
            fams = await sc.scrape()
            by_reason = {s.labels["reason"]: s.value for s in fams["binbatch_batches"].samples if s.name.endswith("_total")}
            assert by_reason.get("policy", 0) >= 1, by_reason
            assert all(r.queue_seconds < 0.2 for r in replies)  # not held until maxWait
