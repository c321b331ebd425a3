"""EngineClient and ScrapeSource against the engine emulator over real HTTP on
127.0.0.1 (port 0).  Step times are tiny; nothing sleeps to synchronise."""

from __future__ import annotations

import dataclasses

import pytest

from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.emulator import EmulatorConfig, running_emulator
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
        assert first.kv_capacity_tokens == (config.num_gpu_blocks - 1) * config.block_size == 2392  # less the null block
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


# ------------------------------------------------------------------- body size (defect 5)

BIG = 120_000  # bytes per large prompt: twelve of them are over vLLM's (aiohttp's) 1 MiB


def big_batch(params: SamplingParams) -> list[EngineRequest]:
    """Twelve 120 kB prompts and twenty small ones with the same sampling params."""
    large = [EngineRequest(params=params, prompt=chr(ord("a") + i) * BIG) for i in range(12)]
    return large + [prompt(i, params) for i in range(20)]


async def test_a_list_call_over_the_body_cap_is_split_and_every_request_completes() -> None:
    """Defect 5: one list call of 1.44 MB got HTTP 413 and failed all 32 members."""
    async with running_emulator(FAST) as url, EngineClient(url) as client:  # emulator: aiohttp's 1 MiB
        params = SamplingParams(model="emulated", max_tokens=3, ignore_eos=True)
        results = await client.complete_batch(big_batch(params))
    assert [type(r).__name__ for r in results] == ["EngineResult"] * 32
    assert all(r.completion_tokens == 3 for r in results)  # type: ignore[union-attr]


async def test_a_413_from_the_engine_splits_the_call_instead_of_failing_it() -> None:
    """The client's cap above the engine's limit: the engine's 413 splits the call."""
    cfg = dataclasses.replace(FAST, max_request_body_bytes=300_000)
    async with running_emulator(cfg) as url, EngineClient(url, max_body_bytes=8 * 1024 * 1024) as client:
        params = SamplingParams(model="emulated", max_tokens=2, ignore_eos=True)
        results = await client.complete_batch(big_batch(params))
    assert [type(r).__name__ for r in results] == ["EngineResult"] * 32


async def test_a_request_too_large_on_its_own_fails_alone() -> None:
    cfg = dataclasses.replace(FAST, max_request_body_bytes=300_000)
    params = SamplingParams(model="emulated", max_tokens=2, ignore_eos=True)
    huge = EngineRequest(params=params, prompt="z" * 400_000)
    batch = [prompt(0, params), huge, *big_batch(params)[:3], prompt(1, params)]
    async with running_emulator(cfg) as url:
        # over the client's own cap: refused before sending, with both sizes named
        async with EngineClient(url, max_body_bytes=350_000) as client:
            results = await client.complete_batch(batch)
        err = results[1]
        assert isinstance(err, EngineError) and err.kind == "invalid" and err.status == 413
        assert "over the 350000-byte limit" in err.message and "maxRequestBodyBytes" in err.message
        assert all(isinstance(r, EngineResult) for i, r in enumerate(results) if i != 1)
        # under the client's cap but over the engine's: the engine's 413 fails it alone
        async with EngineClient(url, max_body_bytes=8 * 1024 * 1024) as client:
            results = await client.complete_batch(batch)
        err = results[1]
        assert isinstance(err, EngineError) and err.kind == "invalid" and err.status == 413
        assert "Maximum request body size" in err.message
        assert all(isinstance(r, EngineResult) for i, r in enumerate(results) if i != 1)
        # alone in a stream or a chat call: the same clear refusal, nothing sent
        async with EngineClient(url, max_body_bytes=350_000) as client:
            with pytest.raises(EngineError, match="over the 350000-byte limit"):
                async for _ in client.stream(huge):
                    pass
            chat = EngineRequest(params=params, messages=(("user", "y" * 400_000),))
            (chat_err,) = await client.complete_batch([chat])
        assert isinstance(chat_err, EngineError) and chat_err.status == 413
