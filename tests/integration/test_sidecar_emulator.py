"""The whole sidecar over real gRPC on 127.0.0.1 in front of the engine emulator.

Each test starts an emulator and a sidecar (both on port 0).  Nothing sleeps to
synchronise: tests await gRPC answers, or drive the sidecar's own loops one step
(``feed.poll_once()``, ``watcher.check()``).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from sidecar_harness import prompt_request, running_sidecar, sidecar_config

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar.core.kv_plan import PROMPT_SCALE_PRIOR
from binbatch_sidecar.emulator import EmulatorConfig, running_emulator
from binbatch_sidecar.server.servicer import TEMPLATE_TOKENS

FAST = EmulatorConfig(step_a=0.001, step_c=0.0001, num_gpu_blocks=512, block_size=16)


def samples(families, name: str, **labels: str) -> float:
    fam = families[name]
    return sum(
        s.value for s in fam.samples if s.name == name + "_total" and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def test_generate_round_trip_in_continuous_mode(tmp_path):
    async with running_emulator(FAST) as url, running_sidecar(sidecar_config(url), tmp_path) as sc:
        resp = await sc.inference.Generate(prompt_request(1, 7, request_id="abc"), timeout=30)
        assert resp.completion_tokens == 7
        assert resp.finish_reason == "length"
        assert resp.text
        assert resp.request_id == "abc"
        assert resp.prompt_tokens > 0
        assert resp.batch_size >= 1
        stats = await sc.stats()
        assert stats.totals.accepted == 1 and stats.totals.completed == 1


async def test_gang_batch_of_eight_goes_to_the_engine_as_one_full_batch(tmp_path):
    doc = sidecar_config(
        "",
        batch={"mode": "Gang", "sizing": "Static", "staticSize": 8, "maxWaitMilliseconds": 60000},
        bins={"count": 1},
    )
    async with running_emulator(FAST) as url:
        doc["engine"]["url"] = url
        doc["metrics"]["url"] = url + "/metrics"
        async with running_sidecar(doc, tmp_path) as sc:
            calls = [sc.inference.Generate(prompt_request(i, 5 + i), timeout=30) for i in range(8)]
            responses = await asyncio.gather(*calls)
            assert [r.completion_tokens for r in responses] == [5 + i for i in range(8)]
            assert {r.batch_size for r in responses} == {8}
            fams = await sc.scrape()
            assert samples(fams, "binbatch_batches", reason="full") == 1
            assert samples(fams, "binbatch_requests", outcome="completed") == 8


async def test_chat_request_is_served(tmp_path):
    async with running_emulator(FAST) as url, running_sidecar(sidecar_config(url), tmp_path) as sc:
        msg = pb.GenerateRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]), max_tokens=4, ignore_eos=True
        )
        resp = await sc.inference.Generate(msg, timeout=30)
        assert resp.completion_tokens == 4


async def test_stream_delivers_token_chunks_then_the_final_response(tmp_path):
    async with running_emulator(FAST) as url, running_sidecar(sidecar_config(url), tmp_path) as sc:
        chunks = [c async for c in sc.inference.GenerateStream(prompt_request(2, 6), timeout=30)]
        pieces = [c.text for c in chunks if not c.HasField("final")]
        final = chunks[-1].final
        assert chunks[-1].HasField("final")
        assert len(pieces) >= 2
        assert "".join(pieces) and final.text == ""  # the chunks carry the text, once (binbatch.proto)
        assert final.completion_tokens == 6


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        ({"max_tokens": 4}, "input"),
        ({"prompt": "x", "max_tokens": 4, "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "max_tokens": 999999}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 4, "min_tokens": 9}, "min_tokens"),
    ],
)
async def test_invalid_request_is_refused_naming_the_field(tmp_path, fields, field_name):
    async with running_emulator(FAST) as url, running_sidecar(sidecar_config(url), tmp_path) as sc:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sc.inference.Generate(pb.GenerateRequest(**fields), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field_name)


async def test_bad_slo_metadata_is_refused_naming_the_key(tmp_path):
    async with running_emulator(FAST) as url, running_sidecar(sidecar_config(url), tmp_path) as sc:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sc.inference.Generate(prompt_request(1, 3), metadata=(("x-slo-tpot-ms", "fast"),), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "x-slo-tpot-ms" in err.value.details()
        ok = await sc.inference.Generate(prompt_request(1, 3), metadata=(("x-slo-ttft-ms", "500"),), timeout=10)
        assert ok.completion_tokens == 3


def _holding_config(url: str, **batch) -> dict:
    """Gang mode with a batch that never fills and no timeout: requests stay queued."""
    return sidecar_config(
        url,
        batch={"mode": "Gang", "sizing": "Static", "staticSize": 64, "maxWaitMilliseconds": 600000, **batch},
        bins={"count": 1},
    )


async def test_ttft_slo_sends_a_bin_that_would_otherwise_hold(tmp_path):
    """A batch that never fills and a 10-minute maxWait: only the TTFT SLO sends it,
    the request's own (metadata) or, without one, the policy's."""
    async with running_emulator(FAST) as url:
        doc = _holding_config(url)
        async with running_sidecar(doc, tmp_path) as sc:
            own = await sc.inference.Generate(prompt_request(1, 3), metadata=(("x-slo-ttft-ms", "200"),), timeout=60)
            assert own.completion_tokens == 3 and own.batch_size == 1
            fams = await sc.scrape()
            assert samples(fams, "binbatch_batches", reason="slo") == 1
            doc["latency"] = {"ttftMilliseconds": 200}
            sc.write_config(doc)
            assert await sc.sidecar.watcher.check()
            policy = await sc.inference.Generate(prompt_request(2, 3), timeout=60)
            assert policy.completion_tokens == 3
            assert samples(await sc.scrape(), "binbatch_batches", reason="slo") == 2


async def test_full_queue_answers_resource_exhausted_at_once(tmp_path):
    async with running_emulator(FAST) as url, running_sidecar(_holding_config(url, maxQueuedRequests=2), tmp_path) as sc:
        held = [asyncio.ensure_future(sc.inference.Generate(prompt_request(i, 3), timeout=60)) for i in range(2)]
        while (await sc.stats()).bins[0].queue_depth < 2:
            pass  # each GetStats round trip lets the two calls arrive; no timing assumption
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sc.inference.Generate(prompt_request(9, 3), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        cut = await sc.sidecar.stop(grace=10)  # drain dispatches the two held requests
        assert cut == 0
        assert [r.completion_tokens for r in await asyncio.gather(*held)] == [3, 3]
        assert sc.sidecar.dispatcher.totals["rejected"] == 1


async def test_deadline_removes_the_request_from_its_bin(tmp_path):
    async with running_emulator(FAST) as url, running_sidecar(_holding_config(url), tmp_path) as sc:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sc.inference.Generate(prompt_request(1, 3), timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        stats = await sc.stats()
        while stats.totals.expired + stats.totals.cancelled < 1:  # the server ends it on its own loop
            stats = await sc.stats()
        assert stats.bins[0].queue_depth == 0
        assert stats.totals.completed == 0


async def test_drain_serves_queued_requests_and_refuses_new_ones(tmp_path):
    async with running_emulator(FAST) as url, running_sidecar(_holding_config(url), tmp_path) as sc:
        held = [asyncio.ensure_future(sc.inference.Generate(prompt_request(i, 4), timeout=60)) for i in range(3)]
        while (await sc.stats()).bins[0].queue_depth < 3:
            pass
        stopping = asyncio.ensure_future(sc.sidecar.stop(grace=10))
        results = await asyncio.gather(*held)
        assert [r.completion_tokens for r in results] == [4, 4, 4]
        assert {r.batch_size for r in results} == {3}
        assert await stopping == 0
        assert sc.sidecar.dispatcher.totals["completed"] == 3


async def test_submit_while_draining_is_unavailable(tmp_path):
    async with running_emulator(FAST) as url, running_sidecar(sidecar_config(url), tmp_path) as sc:
        sc.sidecar.dispatcher.accepting = False  # the state stop() enters first
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sc.inference.Generate(prompt_request(1, 3), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        sc.sidecar.dispatcher.accepting = True


async def test_health_follows_the_engine_and_reflection_lists_the_services(tmp_path):
    async with running_emulator(FAST) as url, running_sidecar(sidecar_config(url), tmp_path) as sc:
        health = health_pb2_grpc.HealthStub(sc.channel)
        for service in ("", "binbatch.v1.Inference"):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        sync_channel = grpc.insecure_channel(f"127.0.0.1:{sc.sidecar.grpc_port}")
        try:
            db = ProtoReflectionDescriptorDatabase(sync_channel)
            services = await asyncio.to_thread(lambda: set(db.get_services()))
            assert {"binbatch.v1.Inference", "binbatch.v1.Admin", "grpc.health.v1.Health"} <= services
            method = await asyncio.to_thread(db.FindFileContainingSymbol, "binbatch.v1.Inference")
            assert method.package == "binbatch.v1"
        finally:
            sync_channel.close()
    # the engine is gone: the next check reports NOT_SERVING
    async with running_emulator(FAST) as url, running_sidecar(sidecar_config(url), tmp_path) as sc:
        await sc.sidecar.client.close()
        sc.sidecar.client = type(sc.sidecar.client)("http://127.0.0.1:9", timeout_seconds=2, connect_retries=0)
        await sc.sidecar._check_engine()
        resp = await health_pb2_grpc.HealthStub(sc.channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_config_reload_applies_a_good_file_and_refuses_a_bad_one(tmp_path):
    async with running_emulator(FAST) as url:
        doc = sidecar_config(url, batch={"staticSize": 16})
        async with running_sidecar(doc, tmp_path) as sc:
            doc["batch"]["staticSize"] = 24
            doc["engine"]["maxRequestBodyBytes"] = 500_000
            sc.write_config(doc)
            assert await sc.sidecar.watcher.check()
            assert sc.sidecar.client.max_body_bytes == 500_000  # applied, not only shown
            view = await sc.admin.GetConfig(pb.GetConfigRequest())
            assert view.generation == 2 and '"staticSize": 24' in view.config_json
            doc["batch"]["minBatchSize"] = 100  # > staticSize: refused
            sc.write_config(doc)
            assert not await sc.sidecar.watcher.check()
            view = await sc.admin.GetConfig(pb.GetConfigRequest())
            assert view.generation == 2
            assert "batch.minBatchSize" in view.last_reload_error
            resp = await sc.inference.Generate(prompt_request(1, 3), timeout=30)  # still serving, old config
            assert resp.completion_tokens == 3


async def test_memory_aware_size_follows_the_engines_kv_capacity(tmp_path):
    """Same workload, two KV budgets: the smaller cache gives the smaller b_mem."""
    sizes = {}
    for blocks in (64, 1024):
        engine = EmulatorConfig(step_a=0.0005, step_c=0.00005, num_gpu_blocks=blocks, block_size=16, max_model_len=512)
        # b_mem (memory.admission BatchSize); the default, Auto, plans per request instead (kv_plan)
        doc = sidecar_config("", batch={"sizing": "Memory", "staticSize": 32, "maxBatchSize": 1024}, bins={"count": 1},
                             memory={"admission": "BatchSize"})
        async with running_emulator(engine) as url:
            doc["engine"]["url"], doc["metrics"]["url"] = url, url + "/metrics"
            async with running_sidecar(doc, tmp_path) as sc:
                await asyncio.gather(*(sc.inference.Generate(prompt_request(i, 40), timeout=60) for i in range(40)))
                await sc.sidecar.feed.poll_once()
                stats = await sc.stats()
                assert stats.sizer_reason == "memory", stats.sizer_reason
                sizes[blocks] = stats.target_batch_size
                fams = await sc.scrape()
                assert fams["binbatch_target_batch_size"].samples[0].value == stats.target_batch_size
    assert sizes[64] < sizes[1024]
    assert sizes[64] <= 64 * 16 // 40  # no more requests than the cache can hold at ~50 tokens each


async def test_unset_max_tokens_stays_within_the_engines_context(tmp_path):
    """With the default cap (2048) an engine of a 256-token context refused every call
    that named no max_tokens (prompt + 2048 > max_model_len): the cap now stops at what
    the context leaves after the prompt, as the engine reports it in /v1/models."""
    small = replace(FAST, max_model_len=256)
    doc = sidecar_config("")
    async with running_emulator(small) as url:
        doc["engine"]["url"], doc["metrics"]["url"] = url, url + "/metrics"
        async with running_sidecar(doc, tmp_path) as sc:
            prompt = "no limit given"
            msg = pb.GenerateRequest(prompt=prompt, ignore_eos=True)
            resp = await sc.inference.Generate(msg, timeout=30)
            expected = 256 - len(prompt.encode()) - TEMPLATE_TOKENS
            assert (resp.completion_tokens, resp.finish_reason) == (expected, "length")


async def test_unset_max_tokens_is_capped_at_bins_max_output_tokens(tmp_path):
    # Issue 9 defect 10: max_tokens 0 reached the engine as "unset" (506 tokens came back).
    doc = sidecar_config("", bins={"maxOutputTokens": 24})
    async with running_emulator(FAST) as url:
        doc["engine"]["url"], doc["metrics"]["url"] = url, url + "/metrics"
        async with running_sidecar(doc, tmp_path) as sc:
            msg = pb.GenerateRequest(prompt="no limit given", ignore_eos=True)
            resp = await sc.inference.Generate(msg, timeout=30)
            assert (resp.completion_tokens, resp.finish_reason) == (24, "length")


async def test_engine_priority_order_lets_the_engine_run_the_shortest_waiting_first(tmp_path):
    """batch.order EnginePriority in front of an engine started with
    --scheduling-policy priority: the sidecar holds nothing back; each request
    carries its ideal end as vLLM's priority, and the engine's own queue runs the
    short one that came last before the long one that came first."""
    from binbatch_sidecar.emulator import Emulator

    engine = replace(FAST, step_a=0.002, max_num_seqs=1, scheduling_policy="priority")
    doc = sidecar_config("", batch={"order": "EnginePriority", "followEngineQueue": False, "maxWaitMilliseconds": 0,
                                    "sizing": "Static", "staticSize": 16},
                         predictor={"kind": "Hint"})  # fmt: skip
    async with Emulator(engine) as emu:
        doc["engine"]["url"] = emu.base_url
        doc["metrics"]["url"] = emu.base_url + "/metrics"
        async with running_sidecar(doc, tmp_path) as sc:
            hold = sc.inference.GenerateStream(prompt_request(0, 500, expected_output_tokens=500), timeout=30)
            await hold.read()  # running: the engine takes one sequence at a time
            long = asyncio.ensure_future(sc.inference.Generate(prompt_request(1, 40, expected_output_tokens=40), timeout=30))
            await emu.engine.wait_for(lambda e: e.stats.submitted == 2)
            short = asyncio.ensure_future(sc.inference.Generate(prompt_request(2, 3, expected_output_tokens=3), timeout=30))
            await emu.engine.wait_for(lambda e: e.stats.submitted == 3)
            keys = [s.priority for s in emu.engine.scheduler.waiting]
            hold.cancel()
            done, _ = await asyncio.wait([long, short], return_when=asyncio.FIRST_COMPLETED)
            assert done == {short}
            assert (await long).completion_tokens == 40 and (await short).completion_tokens == 3
    assert len(keys) == 2 and keys[0] < keys[1] and keys[0] > 0  # the short one heads the engine's queue


async def test_the_kv_plan_learns_the_engines_prompt_count_at_the_first_chunk_not_the_answers_end(tmp_path):
    """A fresh sidecar counts queued prompts at the prior until the engine has counted one;
    the engine's stream carries its count in the first chunk (continuous usage stats), so the
    plan learns it while the answer still runs (a burst at a fresh sidecar waited for a whole
    answer before)."""
    slow = replace(FAST, step_a=0.02)  # 200 tokens: seconds in the engine
    async with running_emulator(slow) as url, running_sidecar(sidecar_config(url), tmp_path) as sc:
        plan = sc.sidecar.dispatcher.scheduler.core.kv_plan
        assert plan is not None and plan.prompts_seen == 0  # the default plans per request (memory.admission Auto)
        stream = sc.inference.GenerateStream(prompt_request(3, 200), timeout=60)
        async for chunk in stream:
            if chunk.text:
                break  # the first token: the answer has 199 to go
        assert plan.prompts_seen == 1 and plan.prompt_scale != PROMPT_SCALE_PRIOR
        stats = await sc.stats()
        assert stats.totals.completed == 0  # learned before the answer ended
        stream.cancel()
