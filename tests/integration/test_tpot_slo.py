"""x-slo-tpot-ms over real gRPC: a request whose TPOT SLO the engine does not meet
waits in the sidecar (up to its TTFT budget, or until its deadline), while
requests without one go at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from sidecar_harness import prompt_request, running_sidecar, sidecar_config

from binbatch_sidecar.emulator import EmulatorConfig, running_emulator

# 10 ms per engine step: the engine's TPOT is ~10 ms, far above a 1 ms SLO.
STEPPED = EmulatorConfig(step_a=0.01, step_c=0.0001, num_gpu_blocks=512, block_size=16)



async def test_a_tpot_slo_the_engine_misses_holds_the_request_until_its_ttft_budget(tmp_path):
    doc = sidecar_config(
        "",
        batch={"sizing": "Static", "staticSize": 4, "maxWaitMilliseconds": 1},
        # Snapshots only when the test polls: the observed TPOT stays what it was.
        metrics={"intervalMilliseconds": 60000, "staleAfterMilliseconds": 600000},
    )
    async with running_emulator(STEPPED) as url:
        doc["engine"]["url"], doc["metrics"]["url"] = url, url + "/metrics"
        async with running_sidecar(doc, tmp_path) as sc:
            side = sc.sidecar
            await side.feed.poll_once()
            await asyncio.gather(*(sc.inference.Generate(prompt_request(i, 6), timeout=30) for i in range(4)))
            snap = await side.feed.poll_once()
            assert snap is not None and snap.fresh and snap.tpot_seconds is not None and snap.tpot_seconds > 0.005
            gate = side.dispatcher.core.former.gate
            assert gate is not None and gate.observed == snap.tpot_seconds

            # TTFT SLO 600 ms: it may wait 300 ms (latency.queueSharePercent 50) for the engine.
            held = sc.inference.Generate(
                prompt_request(10, 3), metadata=(("x-slo-tpot-ms", "1"), ("x-slo-ttft-ms", "600")), timeout=30
            )
            loose = sc.inference.Generate(prompt_request(11, 3), metadata=(("x-slo-tpot-ms", "500"),), timeout=30)
            plain = sc.inference.Generate(prompt_request(12, 3), timeout=30)
            held_r, loose_r, plain_r = await asyncio.gather(held, loose, plain)
            assert held_r.queue_seconds >= 0.3  # held until its TTFT budget was spent
            assert loose_r.queue_seconds < 0.3 and plain_r.queue_seconds < 0.3  # a looser SLO is not held

            # An idle engine (no token since the last scrape) is the best TPOT a
            # request can get: waiting cannot help it, so a tight request goes at once.
            await side.feed.poll_once()  # the tokens of the requests above
            idle = await side.feed.poll_once()
            assert idle is not None and idle.tpot_seconds is None
            quick = await sc.inference.Generate(prompt_request(13, 3), metadata=(("x-slo-tpot-ms", "1"),), timeout=30)
            assert quick.queue_seconds < 0.3


@contextlib.asynccontextmanager
async def _static_sidecar_on_stepped_engine(tmp_path) -> AsyncIterator[Any]:
    """A static-size sidecar in front of the STEPPED engine that scrapes only when
    the test polls, polled once before any traffic."""
    doc = sidecar_config(
        "", batch={"sizing": "Static", "staticSize": 4, "maxWaitMilliseconds": 1},
        metrics={"intervalMilliseconds": 60000, "staleAfterMilliseconds": 600000},
    )  # fmt: skip
    async with running_emulator(STEPPED) as url:
        doc["engine"]["url"], doc["metrics"]["url"] = url, url + "/metrics"
        async with running_sidecar(doc, tmp_path) as sc:
            await sc.sidecar.feed.poll_once()
            yield sc


async def test_a_held_request_without_a_ttft_budget_ends_at_its_deadline(tmp_path):
    async with _static_sidecar_on_stepped_engine(tmp_path) as sc:
        await asyncio.gather(*(sc.inference.Generate(prompt_request(i, 6), timeout=30) for i in range(4)))
        await sc.sidecar.feed.poll_once()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sc.inference.Generate(prompt_request(20, 3), metadata=(("x-slo-tpot-ms", "1"),), timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        stats = await sc.stats()
        assert stats.totals.expired + stats.totals.cancelled == 1  # ended in the sidecar, never sent
        assert stats.totals.completed == 4


async def test_a_tpot_slo_the_engine_misses_even_alone_is_sent_at_once(tmp_path):
    """The same engine and request as above, but the sidecar has seen the engine's
    TPOT with one request running (~10 ms): a 1 ms SLO cannot be met by waiting, so
    the request goes at once instead of waiting out its deadline."""
    async with _static_sidecar_on_stepped_engine(tmp_path) as sc:
        for i in range(2):  # one at a time, a scrape after each: the engine's TPOT alone
            await sc.inference.Generate(prompt_request(i, 6), timeout=30)
            await sc.sidecar.feed.poll_once()
        gate = sc.sidecar.dispatcher.core.former.gate
        assert gate is not None and gate.alone is not None and gate.alone > 0.005
        assert gate.observed is not None and gate.observed > 0.001  # the gate alone would hold it
        reply = await sc.inference.Generate(prompt_request(20, 3), metadata=(("x-slo-tpot-ms", "1"),), timeout=5)
        assert reply.completion_tokens == 3 and reply.queue_seconds < 0.3


async def test_a_policy_tpot_slo_the_engine_misses_at_one_request_is_given_up(tmp_path, caplog):
    """latency.tpotMilliseconds 1 with Sla sizing in front of an engine that takes
    ~10 ms a token even alone: the sizer walks the batch down to minBatchSize, and
    after three slow scrapes there stops chasing the SLO -- b_sla goes back to
    maxBatchSize and Stats says "sla-infeasible" -- instead of serving one request
    at a time, every one of them still late."""
    doc = sidecar_config(
        "",
        batch={"mode": "Continuous", "sizing": "Sla", "staticSize": 4, "maxBatchSize": 32, "maxWaitMilliseconds": 1},
        latency={"tpotMilliseconds": 1},
        metrics={"intervalMilliseconds": 60000, "staleAfterMilliseconds": 600000},  # scrapes only when polled
    )
    async with running_emulator(STEPPED) as url:
        doc["engine"]["url"], doc["metrics"]["url"] = url, url + "/metrics"
        async with running_sidecar(doc, tmp_path) as sc:
            await sc.sidecar.feed.poll_once()
            reasons, sizes = [], []
            for round_ in range(8):  # each round decodes tokens, so each scrape has a fresh TPOT
                await asyncio.gather(*(sc.inference.Generate(prompt_request(10 * round_ + i, 8), timeout=30)
                                       for i in range(2)))  # fmt: skip
                await sc.sidecar.feed.poll_once()
                stats = await sc.stats()
                reasons.append(stats.sizer_reason.partition(":")[0])
                sizes.append(stats.b_sla)
            assert 1 in sizes  # it did try the smallest batch first
            assert reasons[-1] == "sla-infeasible" and sizes[-1] == 32, (reasons, sizes)
            warnings = [r.getMessage() for r in caplog.records
                        if r.name == "binbatch.dispatcher" and r.levelname == "WARNING"]  # fmt: skip
            assert len(warnings) == 1 and "TPOT SLO (1.0 ms) is beyond the engine" in warnings[0]  # once, a change
            # and stops shrinking for it: 8 requests at once all go in together
            replies = await asyncio.gather(*(sc.inference.Generate(prompt_request(100 + i, 8), timeout=30)
                                             for i in range(8)))  # fmt: skip
            assert max(r.queue_seconds for r in replies) < 0.3
