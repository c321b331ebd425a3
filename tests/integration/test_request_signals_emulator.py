"""The per-request signals of issue 12 on a real sidecar (gRPC and /metrics on
127.0.0.1, port 0) in front of the engine emulator, read from the sidecar's
/metrics over HTTP as Prometheus would: E2E and TTFT histograms by model_name
(a stream's TTFT is its first delta, before its end) and the honest waiting
figure (the requests the sidecar holds, bounded labels)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from sidecar_harness import prompt_request, running_sidecar, sidecar_config

from binbatch_sidecar.emulator import Emulator, EmulatorConfig, running_emulator
from binbatch_sidecar.engine.sidecar_metrics import OTHER_MODEL

STEP = 0.01  # seconds per engine step: 8 tokens take ~80 ms, the first one ~10 ms
WAIT = 20.0


def histogram(families: dict[str, Any], name: str, model: str) -> tuple[float, float]:
    """(count, sum) of one model's series of a histogram."""
    samples = {s.name: s.value for s in families[name].samples if s.labels.get("model_name") == model}
    return samples.get(f"{name}_count", 0.0), samples.get(f"{name}_sum", 0.0)


def gauge(families: dict[str, Any], name: str) -> dict[str, float]:
    return {s.labels["model_name"]: s.value for s in families[name].samples}


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT):
        while not condition():
            await asyncio.sleep(0.01)  # ok-sleep: polls the in-process sidecar's state, bounded by WAIT


async def test_a_stream_has_ttft_before_e2e_and_a_plain_request_ttft_equal_to_e2e(tmp_path):
    cfg = EmulatorConfig(step_a=STEP, step_c=0.0)
    async with running_emulator(cfg) as url, running_sidecar(sidecar_config(url), tmp_path) as sc:
        chunks = [c async for c in sc.inference.GenerateStream(prompt_request(1, 8), timeout=30)]
        assert chunks[-1].HasField("final") and chunks[-1].final.completion_tokens == 8
        fams = await sc.scrape()
        ttft_n, ttft = histogram(fams, "binbatch_request_ttft_seconds", cfg.model)
        e2e_n, e2e = histogram(fams, "binbatch_request_e2e_seconds", cfg.model)
        assert (ttft_n, e2e_n) == (1, 1)
        assert e2e >= 8 * STEP  # eight engine steps from acceptance to the last token
        assert 0 < ttft < e2e - 5 * STEP  # the first delta came steps before the end

        resp = await sc.inference.Generate(prompt_request(2, 4), timeout=30)
        assert resp.completion_tokens == 4
        fams = await sc.scrape()
        ttft_n2, ttft2 = histogram(fams, "binbatch_request_ttft_seconds", cfg.model)
        e2e_n2, e2e2 = histogram(fams, "binbatch_request_e2e_seconds", cfg.model)
        assert (ttft_n2, e2e_n2) == (2, 2)
        assert ttft2 - ttft == pytest.approx(e2e2 - e2e)  # not streamed: its first token is its answer
        assert e2e2 - e2e >= 4 * STEP
        assert gauge(fams, "binbatch_requests_waiting") == {cfg.model: 0}  # exported at 0 when idle


async def test_requests_held_in_a_bin_are_waiting_by_model_with_unknown_models_as_other(tmp_path):
    doc = sidecar_config(
        "", batch={"mode": "Gang", "sizing": "Static", "staticSize": 8, "maxWaitMilliseconds": 60000},
        bins={"count": 1},
    )  # fmt: skip
    cfg = EmulatorConfig(step_a=STEP, step_c=0.0)
    async with running_emulator(cfg) as url:
        doc["engine"]["url"], doc["metrics"]["url"] = url, url + "/metrics"
        async with running_sidecar(doc, tmp_path) as sc:
            held = [asyncio.ensure_future(sc.inference.Generate(prompt_request(i, 4), timeout=30)) for i in range(3)]
            held.append(asyncio.ensure_future(sc.inference.Generate(prompt_request(9, 4, model="made-up"), timeout=30)))
            await until(lambda: sc.sidecar.dispatcher.totals["accepted"] == 4)
            await until(lambda: sc.sidecar.feed.engine_waiting() is not None)  # the engine part is fresh
            fams = await sc.scrape()
            assert gauge(fams, "binbatch_requests_waiting") == {cfg.model: 3, OTHER_MODEL: 1}
            for call in held:
                call.cancel()
            results = await asyncio.gather(*held, return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError | grpc.aio.AioRpcError) for r in results)
            await until(lambda: not sc.sidecar.dispatcher.waiting_by_model())
            fams = await sc.scrape()
            assert gauge(fams, "binbatch_requests_waiting") == {cfg.model: 0}


async def test_the_waiting_gauge_drops_when_the_request_leaves_the_engines_queue_not_a_scrape_later(tmp_path):
    """The cause of this module's one flake: the engine's part of the gauge came from the
    last scrape, so a scrape taken while a request waited in the engine kept it counted
    after its answer, until the next scrape.  Here the next scrape is a minute away, and
    the interleaving is forced: the scrape is taken while the request waits there."""
    doc = sidecar_config(
        "", batch={"mode": "Continuous", "sizing": "Static", "staticSize": 2, "followEngineQueue": False},
        bins={"count": 1}, metrics={"intervalMilliseconds": 60_000, "staleAfterMilliseconds": 600_000},
    )  # fmt: skip
    cfg = EmulatorConfig(step_a=STEP, step_c=0.0, max_num_seqs=1)  # one runs, the next waits in the engine
    async with Emulator(cfg) as emulator:
        url = emulator.base_url
        doc["engine"]["url"], doc["metrics"]["url"] = url, url + "/metrics"
        async with running_sidecar(doc, tmp_path) as sc:
            stream = sc.inference.GenerateStream(prompt_request(1, 30), timeout=30)
            first = await anext(aiter(stream))  # the long one runs in the engine (and has said so)
            assert first.text
            short = asyncio.ensure_future(sc.inference.Generate(prompt_request(2, 2), timeout=30))
            await asyncio.wait_for(emulator.engine.wait_for(lambda e: len(e.scheduler.waiting) == 1), WAIT)
            await sc.sidecar.feed.poll_once()  # the scrape sees it waiting in the engine
            assert sc.sidecar.feed.last_metrics.waiting_by_model == {cfg.model: 1}
            assert gauge(await sc.scrape(), "binbatch_requests_waiting") == {cfg.model: 1}
            chunks = [c async for c in stream]
            assert chunks[-1].HasField("final")
            assert (await short).completion_tokens == 2
            fams = await sc.scrape()
            assert sc.sidecar.feed.last_metrics.waiting_by_model == {cfg.model: 1}  # no scrape since
            assert gauge(fams, "binbatch_requests_waiting") == {cfg.model: 0}
