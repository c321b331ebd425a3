"""The vLLM engine emulator over real HTTP on 127.0.0.1 (port 0).

Every test awaits responses; nothing sleeps to synchronise. Step times are tiny so
the whole file runs in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from binbatch_sidecar.emulator import (
    INTER_TOKEN_LATENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    Emulator,
    EmulatorConfig,
    add_cli,
    config_from_args,
    running_emulator,
)
from binbatch_sidecar.emulator.answers import AnswerLengthsError, load_answer_lengths, prompt_key

FAST = EmulatorConfig(step_a=0.0005, step_c=0.00005)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def emulator() -> AsyncIterator[Emulator]:
    async with Emulator(FAST) as emu:
        yield emu


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def complete(http: aiohttp.ClientSession, base: str, **body: Any) -> dict[str, Any]:
    status, data = await post(http, f"{base}/v1/completions", body)
    assert status == 200, data
    return data


async def sse_payloads(http: aiohttp.ClientSession, url: str, body: Any) -> list[str]:
    """The ``data:`` payloads of one server-sent-event stream, in order."""
    async with http.post(url, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        text = await resp.text()
    return [line[len("data: ") :] for line in text.split("\n") if line.startswith("data: ")]


async def scrape(http: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    async with http.get(f"{base}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict[str, Any], family: str, sample: str | None = None) -> float:
    """Sum of a family's samples named ``sample`` (default: the family name)."""
    wanted = sample or family
    return sum(s.value for s in families[family].samples if s.name == wanted)


# ------------------------------------------------------------------ the OpenAI API


async def test_list_of_prompts_returns_one_choice_per_prompt_with_exact_max_tokens(emulator, http):
    prompts = ["one two three", "four five", "six", "seven eight nine ten"]
    data = await complete(http, emulator.base_url, model="emulated", prompt=prompts, max_tokens=7, ignore_eos=True)

    assert data["object"] == "text_completion"
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    for choice in data["choices"]:
        assert len(choice["text"].split()) == 7
        assert choice["finish_reason"] == "length"
    assert data["usage"] == {"prompt_tokens": 10, "completion_tokens": 28, "total_tokens": 38}


async def test_prompt_given_as_token_ids_counts_its_ids(emulator, http):
    data = await complete(http, emulator.base_url, prompt=[[1, 2, 3, 4, 5], [6, 7]], max_tokens=2, ignore_eos=True)

    assert len(data["choices"]) == 2
    assert data["usage"]["prompt_tokens"] == 7


async def test_chat_completion_answers_as_the_assistant_with_usage(emulator, http):
    body = {
        "model": "emulated",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
        "max_completion_tokens": 9,
        "ignore_eos": True,
    }
    status, data = await post(http, f"{emulator.base_url}/v1/chat/completions", body)

    assert status == 200
    assert data["object"] == "chat.completion"
    (choice,) = data["choices"]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 9
    assert choice["finish_reason"] == "length"
    # template: one tag per message, the words, one assistant tag
    assert data["usage"] == {"prompt_tokens": 2 + 2 + 2 + 1, "completion_tokens": 9, "total_tokens": 16}


async def test_streaming_completion_yields_one_chunk_per_token_then_done(emulator, http):
    body = {"prompt": "stream me", "max_tokens": 12, "ignore_eos": True, "stream": True}
    payloads = await sse_payloads(http, f"{emulator.base_url}/v1/completions", body)

    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len(chunks) == 12
    assert all(len(c["choices"][0]["text"].split()) == 1 for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 11 + ["length"]


async def test_streamed_text_equals_the_whole_answer_for_the_same_seed(emulator, http):
    body = {"prompt": "same seed", "max_tokens": 10, "seed": 42}
    whole = await complete(http, emulator.base_url, **body)
    payloads = await sse_payloads(http, f"{emulator.base_url}/v1/completions", {**body, "stream": True})

    streamed = "".join(json.loads(p)["choices"][0]["text"] for p in payloads[:-1])
    assert streamed == whole["choices"][0]["text"]


async def test_streaming_chat_opens_with_the_role_and_ends_with_usage(emulator, http):
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    payloads = await sse_payloads(http, f"{emulator.base_url}/v1/chat/completions", body)

    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = chunks[1:-1]
    assert len(tokens) == 5
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}


async def test_continuous_usage_stats_put_the_running_counts_in_every_token_chunk(emulator, http):
    body = {"prompt": "count along", "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    payloads = await sse_payloads(http, f"{emulator.base_url}/v1/completions", body)

    chunks = [json.loads(p) for p in payloads[:-1]]
    assert [c["usage"]["completion_tokens"] for c in chunks[:-1]] == [1, 2, 3, 4]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {chunks[-1]["usage"]["prompt_tokens"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    # as in vLLM, only with include_usage
    body["stream_options"] = {"continuous_usage_stats": True}
    payloads = await sse_payloads(http, f"{emulator.base_url}/v1/completions", body)
    assert not any("usage" in json.loads(p) for p in payloads[:-1])


async def test_output_length_is_seeded_and_stays_within_min_and_max_tokens(emulator, http):
    prompts = [f"prompt number {i}" for i in range(40)]
    first = await complete(http, emulator.base_url, prompt=prompts, max_tokens=30, min_tokens=5, seed=7)
    again = await complete(http, emulator.base_url, prompt=prompts, max_tokens=30, min_tokens=5, seed=7)

    assert [c["text"] for c in first["choices"]] == [c["text"] for c in again["choices"]]
    lengths = [len(c["text"].split()) for c in first["choices"]]
    assert all(5 <= n <= 30 for n in lengths)
    assert len(set(lengths)) > 5  # a spread, not one fixed length
    for choice, n in zip(first["choices"], lengths):
        assert choice["finish_reason"] in ("stop", "length")
        assert choice["finish_reason"] == "stop" or n == 30
    assert first["usage"]["completion_tokens"] == sum(lengths)


async def test_stop_string_ends_the_text_before_it(emulator, http):
    base = {"prompt": "tell me", "max_tokens": 20, "ignore_eos": True, "seed": 3}
    full = (await complete(http, emulator.base_url, **base))["choices"][0]["text"]
    words = full.split()
    stop_word = words[4]
    cut = full.index(" " + stop_word)  # the first occurrence, possibly before word 5

    stopped = (await complete(http, emulator.base_url, **base, stop=[" " + stop_word]))["choices"][0]

    assert stopped["text"] == full[:cut]
    assert stopped["finish_reason"] == "stop"
    assert stopped["stop_reason"] == " " + stop_word


async def test_health_and_models_describe_the_served_model(emulator, http):
    async with http.get(f"{emulator.base_url}/health") as resp:
        assert resp.status == 200
    async with http.get(f"{emulator.base_url}/v1/models") as resp:
        models = await resp.json()
    assert [m["id"] for m in models["data"]] == ["emulated"]
    assert models["data"][0]["max_model_len"] == FAST.max_model_len


# --------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ("completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ("completions", {"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
        ("completions", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
        ("completions", {"prompt": "hi", "n": 2}, "n"),
        ("completions", {"prompt": "hi", "stop": 7}, "stop"),
        ("completions", {"prompt": "hi", "seed": 1.5}, "seed"),
        ("completions", {"prompt": "hi", "ignore_eos": "yes"}, "ignore_eos"),
        ("completions", {"prompt": "hi", "stream": "true"}, "stream"),
        ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ("completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ("completions", {"prompt": "hi", "logprobs": 2}, "logprobs"),
        ("completions", {"prompt": ""}, "prompt"),
        ("completions", {"max_tokens": 3}, "prompt"),
        ("completions", {"prompt": ["fine", 3]}, "prompt[1]"),
        ("chat/completions", {"messages": []}, "messages"),
        ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -3},
         "max_completion_tokens"),
        ("completions", {"prompt": "x", "priority": "high"}, "priority"),
    ],
)  # fmt: skip
async def test_bad_field_answers_400_naming_the_field(emulator, http, path, body, field):
    status, data = await post(http, f"{emulator.base_url}/v1/{path}", body)

    assert status == 400
    assert data["error"]["param"] == field
    assert data["error"]["type"] == "BadRequestError"
    assert field in data["error"]["message"]


async def test_body_that_is_not_json_answers_400(emulator, http):
    async with http.post(f"{emulator.base_url}/v1/completions", data=b"{nope") as resp:
        assert resp.status == 400
        assert "JSON" in (await resp.json())["error"]["message"]


async def test_unknown_model_answers_404_with_an_openai_error(emulator, http):
    status, data = await post(http, f"{emulator.base_url}/v1/completions", {"model": "gpt-9", "prompt": "hi"})

    assert status == 404
    assert data["error"]["type"] == "NotFoundError"
    assert data["error"]["param"] == "model"
    assert "gpt-9" in data["error"]["message"]


# ------------------------------------------------------------------------ metrics

NEW_NAMES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:cache_config_info": "gauge",
}
HISTOGRAMS = [name for name, kind in NEW_NAMES.items() if kind == "histogram"]


def buckets(families: dict[str, Any], name: str) -> list[float]:
    return [float(s.labels["le"]) for s in families[name].samples if s.name == f"{name}_bucket"]


async def test_metrics_carry_vllm_names_labels_and_buckets(emulator, http):
    families = await scrape(http, emulator.base_url)

    for name, kind in NEW_NAMES.items():
        assert families[name].type == kind, name
    assert "vllm:gpu_cache_usage_perc" not in families
    assert "vllm:time_per_output_token_seconds" not in families
    samples = {s.name for f in families.values() for s in f.samples}
    assert "vllm:num_preemptions_total" in samples
    for name in NEW_NAMES:
        if name != "vllm:cache_config_info":
            assert all(s.labels["model_name"] == "emulated" for s in families[name].samples), name
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1
    assert (info.labels["num_gpu_blocks"], info.labels["block_size"]) == ("512", "16")
    assert buckets(families, "vllm:inter_token_latency_seconds") == [*INTER_TOKEN_LATENCY_BUCKETS, math.inf]
    assert buckets(families, "vllm:time_to_first_token_seconds") == [*TIME_TO_FIRST_TOKEN_BUCKETS, math.inf]
    for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
        assert buckets(families, name) == [*REQUEST_LATENCY_BUCKETS, math.inf]
    # vLLM's published boundaries, spelled out once more independently of the module
    assert INTER_TOKEN_LATENCY_BUCKETS[:4] == (0.01, 0.025, 0.05, 0.075)
    assert INTER_TOKEN_LATENCY_BUCKETS[-1] == 80.0
    assert TIME_TO_FIRST_TOKEN_BUCKETS[:3] == (0.001, 0.005, 0.01) and TIME_TO_FIRST_TOKEN_BUCKETS[-1] == 2560.0
    assert REQUEST_LATENCY_BUCKETS[:3] == (0.3, 0.5, 0.8) and REQUEST_LATENCY_BUCKETS[-1] == 7680.0


async def test_histograms_and_token_counters_move_after_requests(emulator, http):
    before = await scrape(http, emulator.base_url)
    data = await complete(http, emulator.base_url, prompt=["a b c", "d e f g"], max_tokens=6, ignore_eos=True)
    after = await scrape(http, emulator.base_url)

    for name in HISTOGRAMS:
        moved = value(after, name, f"{name}_count") - value(before, name, f"{name}_count")
        assert moved > 0, name
    itl = "vllm:inter_token_latency_seconds"
    assert value(after, itl, f"{itl}_count") - value(before, itl, f"{itl}_count") == 2 * 5
    assert value(after, "vllm:generation_tokens", "vllm:generation_tokens_total") - value(
        before, "vllm:generation_tokens", "vllm:generation_tokens_total"
    ) == data["usage"]["completion_tokens"]
    assert value(after, "vllm:prompt_tokens", "vllm:prompt_tokens_total") - value(
        before, "vllm:prompt_tokens", "vllm:prompt_tokens_total"
    ) == data["usage"]["prompt_tokens"]
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0


async def test_legacy_names_replace_the_renamed_metrics(http):
    async with running_emulator(replace(FAST, legacy_names=True)) as base:
        await complete(http, base, prompt="old names", max_tokens=3, ignore_eos=True)
        families = await scrape(http, base)

    assert families["vllm:gpu_cache_usage_perc"].type == "gauge"
    tpot = "vllm:time_per_output_token_seconds"
    assert families[tpot].type == "histogram"
    assert value(families, tpot, f"{tpot}_count") == 2
    assert "vllm:kv_cache_usage_perc" not in families
    assert "vllm:inter_token_latency_seconds" not in families


async def test_sidecar_metrics_reader_understands_both_generations(http):
    vllm_metrics = pytest.importorskip("binbatch_sidecar.engine.vllm_metrics")
    for legacy in (False, True):
        async with running_emulator(replace(FAST, legacy_names=legacy)) as base:
            await complete(http, base, prompt="x y", max_tokens=4, ignore_eos=True)
            async with http.get(f"{base}/metrics") as resp:
                parsed = vllm_metrics.parse(await resp.text())
        assert parsed.kv_capacity_tokens == (FAST.num_gpu_blocks - 1) * FAST.block_size  # less vLLM's null block
        assert parsed.kv_usage == 0 and parsed.running == 0 and parsed.preemptions == 0
        assert parsed.itl is not None and parsed.itl.count == 3


# --------------------------------------------------------- batching and the KV budget

TINY = replace(FAST, num_gpu_blocks=13, block_size=4, max_num_seqs=6, max_model_len=48)  # 12 usable blocks


async def test_tiny_kv_budget_preempts_yet_every_request_completes_with_its_tokens(http):
    async with Emulator(TINY) as emu:
        base = emu.base_url
        load_done = asyncio.Event()
        scraped: list[tuple[float, float]] = []

        async def watch_metrics() -> None:
            while not load_done.is_set():
                families = await scrape(http, base)
                scraped.append((value(families, "vllm:num_requests_running"),
                                value(families, "vllm:kv_cache_usage_perc")))  # fmt: skip

        async def one(i: int) -> tuple[int, dict[str, Any]]:
            max_tokens = 8 + i % 20
            prompt = f"request {i} is here"
            data = await complete(http, base, prompt=prompt, max_tokens=max_tokens, ignore_eos=True)
            return max_tokens, data

        watcher = asyncio.create_task(watch_metrics())
        try:
            results = await asyncio.gather(*(one(i) for i in range(30)))
        finally:
            load_done.set()
            await watcher
        families = await scrape(http, base)

    for max_tokens, data in results:
        (choice,) = data["choices"]
        assert data["usage"]["completion_tokens"] == max_tokens
        assert len(choice["text"].split()) == max_tokens
        assert choice["finish_reason"] == "length"
    preemptions = value(families, "vllm:num_preemptions", "vllm:num_preemptions_total")
    assert preemptions > 0
    assert preemptions == emu.engine.stats.preemptions
    assert emu.engine.stats.peak_running == TINY.max_num_seqs  # admission fills the cap...
    assert emu.engine.stats.peak_kv_usage <= 1.0  # ...and never overdraws the cache
    assert scraped, "the watcher scraped at least once"
    assert all(running <= TINY.max_num_seqs and 0 <= usage <= 1 for running, usage in scraped)


async def test_requests_beyond_max_num_seqs_wait_in_fifo_order(http):
    config = replace(FAST, max_num_seqs=2)
    async with Emulator(config) as emu:
        body = {"prompt": "queue", "max_tokens": 5, "ignore_eos": True}
        results = await asyncio.gather(*(post(http, f"{emu.base_url}/v1/completions", body) for _ in range(6)))
        families = await scrape(http, emu.base_url)

    assert all(status == 200 for status, _ in results)
    assert emu.engine.stats.peak_running == 2
    queue = "vllm:request_queue_time_seconds"
    assert value(families, queue, f"{queue}_count") == 6
    assert value(families, "vllm:num_preemptions", "vllm:num_preemptions_total") == 0


async def test_inter_token_latency_follows_step_time_a_plus_c_b(http):
    """τ(b) = a + c·b: with a = 4 ms, c = 1 ms, one sequence steps in ~5 ms, 16 in ~20 ms."""
    config = replace(FAST, step_a=0.004, step_c=0.001)
    itl = "vllm:inter_token_latency_seconds"

    async def mean_itl(concurrency: int) -> float:
        async with running_emulator(config) as base:
            await complete(http, base, prompt=["p"] * concurrency, max_tokens=25, ignore_eos=True)
            families = await scrape(http, base)
        return value(families, itl, f"{itl}_sum") / value(families, itl, f"{itl}_count")

    alone, crowded = await mean_itl(1), await mean_itl(16)
    assert 0.004 <= alone <= 0.005 * 1.6
    assert 0.016 <= crowded <= 0.020 * 1.6
    assert crowded > 2.5 * alone


# ---------------------------------------------------------------- lifecycle and CLI


async def test_shutdown_answers_pending_requests_with_503_and_stops_the_loop(http):
    async with Emulator(replace(FAST, step_a=0.01, step_c=0.0)) as emu:
        url = f"{emu.base_url}/v1/completions"
        body = {"prompt": "long job", "max_tokens": 1000, "ignore_eos": True}
        whole = asyncio.create_task(post(http, url, body))
        async with http.post(url, json={**body, "stream": True}) as stream:
            first = await stream.content.readline()
            await emu.engine.wait_for(lambda engine: engine.stats.submitted == 2)
            await emu.stop()
            rest = (await stream.text()).split("\n")
        status, error = await whole

    assert first.startswith(b"data: {")
    assert status == 503
    assert error["error"]["type"] == "ServiceUnavailableError"
    payloads = [line for line in rest if line.startswith("data: ")]
    assert payloads[-1] == "data: [DONE]"
    assert json.loads(payloads[-2][len("data: ") :])["error"]["code"] == 503
    assert emu.engine.loop_task is not None and emu.engine.loop_task.done()
    assert not emu.engine.accepting


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
async def test_under_the_priority_policy_the_lowest_priority_waiting_goes_first(http, policy):
    """vLLM's --scheduling-policy priority: one sequence at a time; while a long one
    runs, "late" (priority 1) arrives after "early" (priority 5) and runs first.
    Under fcfs the field is accepted and ignored (vLLM 0.32): arrival order."""
    async with Emulator(replace(FAST, step_a=0.002, max_num_seqs=1, scheduling_policy=policy)) as emu:
        url = f"{emu.base_url}/v1/completions"
        body = {"max_tokens": 2, "ignore_eos": True}
        async with http.post(url, json={"prompt": "hold", "max_tokens": 1000, "ignore_eos": True,
                                        "stream": True}) as hold:  # fmt: skip
            await hold.content.readline()
            early = asyncio.create_task(post(http, url, {**body, "prompt": "early", "priority": 5}))
            await emu.engine.wait_for(lambda engine: engine.stats.submitted == 2)
            late = asyncio.create_task(post(http, url, {**body, "prompt": "late", "priority": 1}))
            await emu.engine.wait_for(lambda engine: engine.stats.submitted == 3)
            hold.close()
            done, _ = await asyncio.wait([early, late], return_when=asyncio.FIRST_COMPLETED)
        assert done == ({late} if policy == "priority" else {early})
        assert (await early)[0] == 200 and (await late)[0] == 200


async def test_client_that_disconnects_frees_its_kv_blocks(http):
    async with Emulator(replace(FAST, step_a=0.005)) as emu:
        body = {"prompt": "walk away", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        async with http.post(f"{emu.base_url}/v1/completions", json=body) as stream:
            await stream.content.readline()
            assert emu.engine.scheduler.used_blocks > 0
            stream.close()
        await asyncio.wait_for(emu.engine.wait_for(lambda engine: engine.idle), timeout=5)

        assert emu.engine.scheduler.used_blocks == 0
        assert emu.engine.stats.finished == 0  # aborted, not completed
        families = await scrape(http, emu.base_url)
    assert value(families, "vllm:num_requests_running") == 0
    assert value(families, "vllm:kv_cache_usage_perc") == 0


def test_config_refuses_a_context_longer_than_the_kv_cache():
    assert EmulatorConfig(num_gpu_blocks=4, block_size=16, max_model_len=48).kv_capacity_tokens == 48  # 3 usable
    with pytest.raises(ValueError, match="max_model_len"):
        EmulatorConfig(num_gpu_blocks=4, block_size=16, max_model_len=49)
    with pytest.raises(ValueError, match="num_gpu_blocks: must be >= 2"):
        EmulatorConfig(num_gpu_blocks=1, block_size=16, max_model_len=8)


def test_cli_flags_map_onto_the_config():
    parser = argparse.ArgumentParser(prog="binbatch")
    add_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["emulate-engine", "--port", "0", "--model", "m", "--step-a", "0.001", "--step-c", "0.0001",
         "--num-gpu-blocks", "64", "--block-size", "8", "--max-num-seqs", "4", "--max-model-len", "256",
         "--legacy-names", "--seed", "9", "--max-request-body-bytes", "4096"]
    )  # fmt: skip

    assert (args.host, args.port) == ("127.0.0.1", 0)
    assert callable(args.func)
    assert config_from_args(args) == EmulatorConfig(
        model="m", step_a=0.001, step_c=0.0001, num_gpu_blocks=64, block_size=8, max_num_seqs=4,
        max_model_len=256, legacy_names=True, seed=9, max_request_body_bytes=4096,
    )  # fmt: skip


async def test_a_body_over_max_request_body_bytes_gets_413_like_vllm():
    """aiohttp's client_max_size in front of vLLM: the fault behind defect 5."""
    async with running_emulator(EmulatorConfig(max_request_body_bytes=2048)) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/completions", json={"prompt": "x" * 4096, "max_tokens": 1}) as resp:
            assert resp.status == 413
            assert "Maximum request body size 2048 exceeded" in await resp.text()
        async with http.post(f"{url}/v1/completions", json={"prompt": "small", "max_tokens": 1}) as resp:
            assert resp.status == 200


# ---------------------------------------------------------- recorded answer lengths


def answers_file(tmp_path, lengths: dict[str, int]):
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps({"prompt_sha256": prompt_key(p), "output_tokens": n}) + "\n"
                            for p, n in lengths.items()))  # fmt: skip
    return str(path)


async def test_a_prompt_with_a_recorded_answer_ends_at_its_length_within_max_tokens(http, tmp_path):
    path = answers_file(tmp_path, {"how do tides work?": 37, "write a poem": 500})
    async with running_emulator(replace(FAST, answer_lengths=path)) as base:
        tides = await complete(http, base, prompt="how do tides work?", max_tokens=1024)
        capped = await complete(http, base, prompt="write a poem", max_tokens=64)
        floored = await complete(http, base, prompt="how do tides work?", max_tokens=1024, min_tokens=50)
        forced = await complete(http, base, prompt="how do tides work?", max_tokens=60, ignore_eos=True)
        status, chat = await post(http, f"{base}/v1/chat/completions", {
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "how do tides work?"}],
            "max_tokens": 1024})  # fmt: skip
        unlisted = await complete(http, base, prompt="how do tides work", max_tokens=1024, seed=1)

    assert (tides["usage"]["completion_tokens"], tides["choices"][0]["finish_reason"]) == (37, "stop")
    assert (capped["usage"]["completion_tokens"], capped["choices"][0]["finish_reason"]) == (64, "length")
    assert floored["usage"]["completion_tokens"] == 50  # min_tokens still holds EOS back
    assert forced["usage"]["completion_tokens"] == 60  # ignore_eos still ignores it
    assert status == 200 and chat["usage"]["completion_tokens"] == 37  # keyed by the user's message, not the template
    assert unlisted["usage"]["completion_tokens"] != 37  # a prompt not in the file draws its length as before


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("not json", "line 2: not JSON"),
        ('["a"]', "line 2: expected an object"),
        ('{"prompt_sha256": "ABC", "output_tokens": 3}', "line 2: prompt_sha256 must be 64 lowercase hex digits"),
        ('{"prompt_sha256": "' + "0" * 64 + '", "output_tokens": 0}', "line 2: output_tokens must be a whole number"),
    ],
)
def test_a_malformed_answer_lengths_file_is_refused_naming_the_line_and_field(tmp_path, line, problem):
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps({"prompt_sha256": prompt_key("x"), "output_tokens": 3}) + "\n" + line + "\n")
    with pytest.raises(AnswerLengthsError, match=f"{path} {problem}"):
        load_answer_lengths(str(path))
