"""The PromQL metrics source against a REAL Prometheus (Debian's package, installed
by the test itself: ``prometheus_support``) scraping two engine emulators on
127.0.0.1 every second.  ``test_metrics_sources.py`` checks the queries' text
against a table-driven fake; this proves them on the real query engine.

The engines hold still while they are read, so what Prometheus scraped is what
their own /metrics say now (read by ``ScrapeSource``, the other source):

* "fast" (current vLLM names) served a few requests and is idle: its histograms
  (ITL, TTFT) hold data;
* "frozen" (pre-0.10 vLLM names) is inside a 120 s engine step with one request
  running and two waiting: its KV usage, running and waiting are not zero.

Nothing sleeps to synchronise: Prometheus is polled (bounded) until its targets
are up, or until it has scraped a target after a known moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from prometheus_support.server import PrometheusServer

from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.emulator import Emulator, EmulatorConfig
from binbatch_sidecar.engine.metrics_feed import MetricsFeed, PromQLSource, ScrapeSource
from binbatch_sidecar.engine.vllm_metrics import EngineMetrics

FAST = EmulatorConfig(model="fast-model", step_a=0.002, step_c=0.0, num_gpu_blocks=512, block_size=16)
FROZEN = EmulatorConfig(model="frozen-model", step_a=120.0, step_c=0.0, num_gpu_blocks=64, block_size=16,
                        max_model_len=512, legacy_names=True)  # fmt: skip
TEST_BUDGET_SECONDS = 60.0

StartPrometheus = Callable[[dict[str, str]], Awaitable[PrometheusServer]]


@pytest.fixture
async def start_prometheus(tmp_path: Path) -> AsyncIterator[StartPrometheus]:
    """``await start_prometheus({job: "host:port"})``: a Prometheus scraping those
    /metrics every second, up once every target was scraped; stopped after the test.
    Blocking calls run in a thread: the emulators it scrapes share this event loop."""
    servers: list[PrometheusServer] = []

    async def start(targets: dict[str, str]) -> PrometheusServer:
        prom = PrometheusServer(targets, tmp_path / f"prometheus-{len(servers)}", interval_seconds=1)
        servers.append(prom)
        await asyncio.to_thread(prom.start)
        await asyncio.to_thread(prom.wait_until_scraped, *targets)
        return prom

    try:
        yield start
    finally:
        for prom in servers:
            await asyncio.to_thread(prom.stop)


def address(emulator: Emulator) -> str:
    return f"127.0.0.1:{emulator.port}"


async def complete(http: aiohttp.ClientSession, emulator: Emulator, max_tokens: int) -> dict:
    body = {"model": emulator.config.model, "prompt": "tell me a story", "max_tokens": max_tokens, "ignore_eos": True}
    async with http.post(emulator.base_url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def own_metrics(emulator: Emulator) -> EngineMetrics:
    """What the engine exposes now, read from its own /metrics."""
    return await ScrapeSource(emulator.base_url + "/metrics").fetch()


def comparable(m: EngineMetrics) -> EngineMetrics:
    """Every quantity; ``names_seen`` differs by design (families vs query names)."""
    return dataclasses.replace(m, names_seen=frozenset())


async def test_promql_source_reads_what_the_engines_expose_through_a_real_prometheus(start_prometheus) -> None:
    async with asyncio.timeout(TEST_BUDGET_SECONDS), contextlib.AsyncExitStack() as stack:
        fast = await stack.enter_async_context(Emulator(FAST))
        frozen = await stack.enter_async_context(Emulator(FROZEN))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        await asyncio.gather(*(complete(http, fast, 8) for _ in range(4)))  # histograms with data, then idle
        held = [asyncio.ensure_future(complete(http, frozen, 8))]
        await frozen.engine.wait_for(lambda e: len(e.scheduler.running) == 1)  # its step now lasts 120 s
        held += [asyncio.ensure_future(complete(http, frozen, 8)) for _ in range(2)]
        await frozen.engine.wait_for(lambda e: len(e.scheduler.waiting) == 2)
        try:
            prom = await start_prometheus({"fast": address(fast), "frozen": address(frozen)})
            fast_now, frozen_now = await own_metrics(fast), await own_metrics(frozen)
            assert fast_now.itl is not None and fast_now.itl.count == 4 * 7  # 7 gaps between 8 tokens
            assert (frozen_now.running, frozen_now.waiting) == (1, 2) and (frozen_now.kv_usage or 0) > 0

            # one engine per selector: every quantity equals the engine's own /metrics
            for selector, expected in (('{job="fast"}', fast_now), ('{job="frozen"}', frozen_now)):
                read = await PromQLSource(prom.url, selector).fetch()
                assert comparable(read) == comparable(expected), selector

            # both engines behind one selector, of two vLLM naming generations: counts
            # add up, the fullest cache speaks for all, the smallest capacity bounds
            both = await PromQLSource(prom.url, "").fetch()
            assert (both.running, both.waiting) == (1, 2)
            assert both.waiting_by_model == {"fast-model": 0, "frozen-model": 2}
            assert both.kv_usage == frozen_now.kv_usage  # the legacy-named engine's cache is the fuller one
            assert both.itl == fast_now.itl  # frozen has observed no inter-token gap yet
            assert (both.num_gpu_blocks, both.block_size) == (64, 16)

            # TPOT through the feed: the interval's histogram delta, as the scrape gives it
            feed = MetricsFeed(PromQLSource(prom.url, '{job="fast"}'), interval=1.0, stale_after=5.0,
                               clock=ManualClock(), on_snapshot=lambda _: None)  # fmt: skip
            first = await feed.poll_once()
            assert first is not None and first.fresh and first.tpot_seconds is None
            await asyncio.gather(*(complete(http, fast, 16) for _ in range(2)))
            loaded_at = time.time()
            after = await own_metrics(fast)
            await asyncio.to_thread(prom.wait_for_scrape_after, "fast", loaded_at)
            second = await feed.poll_once()
            assert fast_now.itl is not None and after.itl is not None
            expected_tpot = (after.itl.sum - fast_now.itl.sum) / (after.itl.count - fast_now.itl.count)
            assert after.itl.count - fast_now.itl.count == 2 * 15
            assert second is not None and second.fresh
            assert second.tpot_seconds == pytest.approx(expected_tpot, rel=1e-9)
            assert (second.running, second.waiting, second.kv_usage_ratio) == (0, 0, 0.0)
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
