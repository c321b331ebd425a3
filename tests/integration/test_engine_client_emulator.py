"""EngineClient and ScrapeSource against the engine emulator over real HTTP on
127.0.0.1 (port 0).  Step times are tiny; nothing sleeps to synchronise."""

from __future__ import annotations

import pytest

from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.engine.emulator import EmulatorConfig, running_emulator
from binbatch_sidecar.engine.engine_client import (
    EngineClient,
    EngineError,
    EngineRequest,
    EngineResult,
    SamplingParams,
    StreamDelta,
)
from binbatch_sidecar.engine.metrics_feed import MetricsFeed, MetricsUnavailable, ScrapeSource

FAST = EmulatorConfig(step_a=0.0005, step_c=0.00005, num_gpu_blocks=300, block_size=8, max_model_len=256)


def prompt(i: int, params: SamplingParams) -> EngineRequest:
    return EngineRequest(params=params, prompt=f"request number {i} says hello")


async def test_batch_with_ignore_eos_returns_max_tokens_per_request() -> None:
    async with running_emulator(FAST) as url, EngineClient(url) as client:
        requests = [prompt(i, SamplingParams(model="emulated", max_tokens=5 + i, ignore_eos=True)) for i in range(8)]
        results = await client.complete_batch(requests)
    assert all(isinstance(r, EngineResult) for r in results)
    assert [r.completion_tokens for r in results] == [5 + i for i in range(8)]  # type: ignore[union-attr]
    assert all(r.finish_reason == "length" and r.prompt_tokens == 5 for r in results)  # type: ignore[union-attr]
    assert [len(r.text.split()) for r in results] == [5 + i for i in range(8)]  # type: ignore[union-attr]


async def test_shared_params_go_as_one_list_call_with_exact_counts() -> None:
    async with running_emulator(FAST) as url, EngineClient(url) as client:
        params = SamplingParams(model="emulated", max_tokens=7, ignore_eos=True, seed=1)
        results = await client.complete_batch([prompt(i, params) for i in range(8)])
    assert [(r.completion_tokens, r.finish_reason) for r in results] == [(7, "length")] * 8  # type: ignore[union-attr]
    assert all(len(r.text.split()) == 7 for r in results)  # type: ignore[union-attr]


async def test_one_prompt_too_long_fails_only_its_caller() -> None:
    async with running_emulator(FAST) as url, EngineClient(url) as client:
        params = SamplingParams(model="emulated", max_tokens=4, ignore_eos=True)
        too_long = EngineRequest(params=params, prompt="word " * 300)
        results = await client.complete_batch([prompt(0, params), too_long, prompt(2, params)])
    assert isinstance(results[0], EngineResult) and results[0].completion_tokens == 4
    assert isinstance(results[2], EngineResult) and results[2].completion_tokens == 4
    err = results[1]
    assert isinstance(err, EngineError) and err.kind == "invalid" and err.status == 400
    assert "maximum context length" in err.message


async def test_chat_and_prompts_in_one_batch() -> None:
    async with running_emulator(FAST) as url, EngineClient(url) as client:
        params = SamplingParams(model="emulated", max_tokens=6, ignore_eos=True)
        chat = EngineRequest(params=params, messages=(("user", "hi there"),))
        results = await client.complete_batch([chat, prompt(1, params)])
    assert [r.completion_tokens for r in results] == [6, 6]  # type: ignore[union-attr]


@pytest.mark.parametrize("chat", [False, True])
async def test_stream_deltas_concatenate_to_the_final_text(chat: bool) -> None:
    async with running_emulator(FAST) as url, EngineClient(url) as client:
        params = SamplingParams(model="emulated", max_tokens=9, ignore_eos=True)
        request = (
            EngineRequest(params=params, messages=(("user", "tell me"),)) if chat else prompt(0, params)
        )
        items = [item async for item in client.stream(request)]
    *deltas, final = items
    assert all(isinstance(d, StreamDelta) for d in deltas) and len(deltas) == 9
    assert isinstance(final, EngineResult)
    assert "".join(d.text for d in deltas) == final.text  # type: ignore[union-attr]
    assert (final.finish_reason, final.completion_tokens) == ("length", 9)
    assert final.prompt_tokens > 0


async def test_health_and_models() -> None:
    async with running_emulator(FAST) as url, EngineClient(url) as client:
        assert await client.health() is True
        assert await client.models() == ["emulated"]


@pytest.mark.parametrize("legacy", [False, True])
async def test_scrape_gives_kv_capacity_and_tpot(legacy: bool) -> None:
    config = EmulatorConfig(step_a=0.0005, step_c=0.00005, num_gpu_blocks=300, block_size=8, max_model_len=256,
                            legacy_names=legacy)  # fmt: skip
    async with running_emulator(config) as url, EngineClient(url) as client:
        source = ScrapeSource(f"{url}/metrics")
        feed = MetricsFeed(source, interval=1.0, stale_after=3.0, clock=ManualClock(), on_snapshot=lambda _: None)
        first = await feed.poll_once()
        assert first is not None and first.fresh
        assert first.kv_capacity_tokens == config.num_gpu_blocks * config.block_size == 2400
        params = SamplingParams(model="emulated", max_tokens=10, ignore_eos=True)
        await client.complete_batch([prompt(i, params) for i in range(4)])
        second = await feed.poll_once()
        assert second is not None and second.tpot_seconds is not None and second.tpot_seconds > 0


async def test_scrape_of_a_non_engine_page_is_unavailable() -> None:
    async with running_emulator(FAST) as url:
        with pytest.raises(MetricsUnavailable, match="HTTP 404"):
            await ScrapeSource(f"{url}/nope").fetch()
        with pytest.raises(MetricsUnavailable, match="no vllm:"):
            await ScrapeSource(f"{url}/health").fetch()  # 200, empty body
