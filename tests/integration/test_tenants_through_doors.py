"""Tenants end to end on the emulator: the fairness id read on both doors (the HTTP door with the
official ``openai`` client's default and extra headers, gRPC metadata), bounded and validated
naming the header, counted by tenant in the metrics, and a tenant past its share of the queue
answered 429 with Retry-After while the other tenant is still accepted."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import openai
import pytest
from sidecar_harness import Running, prompt_request, running_sidecar, sidecar_config

from binbatch_sidecar.emulator import Emulator, EmulatorConfig

FAST = EmulatorConfig(step_a=0.0005, step_c=0.0001, num_gpu_blocks=512, block_size=16)
WAIT = 20.0
NEW, OLD = "x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id"
TENANTS = {"tenants": [{"name": "team-a", "weight": 1}, {"name": "team-b", "weight": 1}]}


@contextlib.asynccontextmanager
async def sidecar(tmp_path, **sections) -> AsyncIterator[Running]:
    async with Emulator(FAST) as emulator:
        async with running_sidecar(sidecar_config(emulator.base_url, tenants=TENANTS, **sections), tmp_path) as sc:
            yield sc


def client_of(sc: Running, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{sc.sidecar.http_port}/v1", api_key="unused",
                              max_retries=0, timeout=WAIT, **kw)  # fmt: skip


async def tenant_counts(sc: Running, metric: str) -> dict[str, float]:
    families = await sc.scrape()
    return {s.labels["tenant"]: s.value for s in families[metric].samples if s.name == f"{metric}_total"}


async def test_the_http_door_reads_the_tenant_and_counts_it(tmp_path):
    async with sidecar(tmp_path) as sc:
        client, plain = client_of(sc, default_headers={NEW: "team-a"}), client_of(sc)
        try:
            await client.completions.create(model="", prompt="x", max_tokens=3)
            await client.completions.create(model="", prompt="x", max_tokens=3, extra_headers={NEW: "someone-else"})
            await plain.completions.create(model="", prompt="x", max_tokens=3, extra_headers={OLD: "team-b"})
            await plain.completions.create(model="", prompt="x", max_tokens=3)
            # the current name wins over the Gateway API Inference Extension's, as in the llm-d router
            await client.completions.create(model="", prompt="x", max_tokens=3, extra_headers={OLD: "team-b"})
            admitted = await tenant_counts(sc, "binbatch_tenant_admitted")
            assert admitted == {"team-a": 2, "team-b": 1, "_other": 1, "_shared": 1}
            for bad in ("x" * 257, "a\tb"):
                with pytest.raises(openai.BadRequestError) as err:
                    await client.completions.create(model="", prompt="x", max_tokens=3, extra_headers={NEW: bad})
                assert err.value.param == NEW and f"{NEW}: must be at most 256 printable ASCII" in err.value.message
            assert "x" * 256 not in str(err.value.message)  # the value is shown cut short
            assert (await sc.stats()).totals.accepted == 5
        finally:
            await client.close()
            await plain.close()


async def test_the_grpc_door_reads_the_same_metadata(tmp_path):
    async with sidecar(tmp_path) as sc:
        await sc.inference.Generate(prompt_request(0, 3), metadata=((OLD, "team-b"),), timeout=WAIT)
        await sc.inference.Generate(prompt_request(1, 3), metadata=((NEW, "team-a"), (OLD, "team-b")), timeout=WAIT)
        assert await tenant_counts(sc, "binbatch_tenant_admitted") == {"team-a": 1, "team-b": 1}
        for metadata, why in ((((NEW, "y" * 300),), "at most 256"), (((NEW, "a"), (NEW, "b")), "given more than once")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await sc.inference.Generate(prompt_request(2, 3), metadata=metadata, timeout=WAIT)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith(f"{NEW}: ") and why in err.value.details()


def holding(**batch) -> dict:
    """Gang batches that never fill and never time out: requests stay in their bin."""
    return {"batch": {"mode": "Gang", "sizing": "Static", "staticSize": 64, "maxWaitMilliseconds": 600000, **batch},
            "bins": {"count": 1}}  # fmt: skip


async def accepted(sc: Running, n: int) -> None:
    async with asyncio.timeout(WAIT):
        while (await sc.stats()).totals.accepted < n:
            pass


async def test_a_tenant_past_its_share_of_the_queue_gets_429_and_the_other_does_not(tmp_path):
    async with sidecar(tmp_path, **holding(maxQueuedRequests=4)) as sc:
        client = client_of(sc)
        held = []
        try:
            held.append(asyncio.ensure_future(client.completions.create(
                model="", prompt="a", max_tokens=3, extra_headers={NEW: "team-a"})))  # fmt: skip
            for i in range(2):  # team-b's share beside team-a: half of 4
                held.append(asyncio.ensure_future(client.completions.create(
                    model="", prompt=f"b{i}", max_tokens=3, extra_headers={NEW: "team-b"})))  # fmt: skip
            await accepted(sc, 3)
            with pytest.raises(openai.RateLimitError) as err:
                await client.completions.create(model="", prompt="b2", max_tokens=3, extra_headers={NEW: "team-b"})
            assert err.value.status_code == 429 and err.value.response.headers["retry-after"] == "1"
            assert "queue full for tenant 'team-b'" in err.value.message and "share is 50%" in err.value.message
            held.append(asyncio.ensure_future(client.completions.create(
                model="", prompt="a2", max_tokens=3, extra_headers={NEW: "team-a"})))  # fmt: skip
            await accepted(sc, 4)  # team-a, under its share, still gets in
            assert await tenant_counts(sc, "binbatch_tenant_rejected") == {"team-b": 1}
            families = await sc.scrape()
            queued = {s.labels["tenant"]: s.value for s in families["binbatch_tenant_queued_requests"].samples}
            assert queued == {"team-a": 2, "team-b": 2, "_shared": 0, "_other": 0}
        finally:
            for task in held:
                task.cancel()
            for task in held:
                with contextlib.suppress(asyncio.CancelledError, openai.APIError):
                    await task
            await client.close()
