"""Scheduling inputs are earned, end to end on the emulator: through the HTTP door with the
official ``openai`` client and through gRPC, a hint the request contradicts is refused naming the
header or field, inputs a class may not send are ignored and counted, and a class whose hints run
long loses them until honest completions bring them back."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc
import openai
import pytest
from sidecar_harness import Running, prompt_request, running_sidecar, sidecar_config

from binbatch_sidecar.core.hint_trust import MIN_SAMPLES
from binbatch_sidecar.emulator import Emulator, EmulatorConfig

FAST = EmulatorConfig(step_a=0.0005, step_c=0.0001, num_gpu_blocks=512, block_size=16)
WAIT = 20.0
CLASSES = {"classes": [
    {"name": "batch"},  # the defaults: hints only
    {"name": "liar"},
    {"name": "trusted", "allowPriority": True, "allowSloHeaders": True},
]}  # fmt: skip
NEVER = "<never-said>"  # a stop sequence the emulator's text never holds: the answer runs to max_tokens


@contextlib.asynccontextmanager
async def sidecar(tmp_path) -> AsyncIterator[Running]:
    async with Emulator(FAST) as emulator:
        doc = sidecar_config(emulator.base_url, classes=CLASSES, predictor={"kind": "Online"})
        async with running_sidecar(doc, tmp_path) as sc:
            yield sc


def value(families, name: str, sample: str, **labels: str) -> float | None:
    found = [s.value for s in families[name].samples
             if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]  # fmt: skip
    return found[0] if found else None


async def ignored(sc: Running, what: str) -> float | None:
    return value(await sc.scrape(), "binbatch_ignored_inputs", "binbatch_ignored_inputs_total", input=what)


async def distrusted(sc: Running, request_class: str) -> float | None:
    families = await sc.scrape()
    return value(families, "binbatch_hints_distrusted", "binbatch_hints_distrusted", request_class=request_class)


async def test_the_http_door_earns_hints_priorities_and_slo_headers(tmp_path):
    async with sidecar(tmp_path) as sc:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{sc.sidecar.http_port}/v1", api_key="unused",
                                    max_retries=0, timeout=WAIT)  # fmt: skip
        try:
            # 1. A hint the request contradicts: 400 naming the header, the engine never asked.
            for extra_body in ({"min_tokens": 40}, {"ignore_eos": True}):
                with pytest.raises(openai.BadRequestError) as err:
                    await client.completions.create(model="", prompt="x", max_tokens=64, extra_body=extra_body,
                                                    extra_headers={"x-expected-output-tokens": "1"})  # fmt: skip
                assert err.value.param == "x-expected-output-tokens"
                assert "x-expected-output-tokens: 1 is below" in err.value.message
            assert (await sc.stats()).totals.accepted == 0

            # 2. What the class may not send is ignored and counted; the request is served.
            raw = await client.completions.with_raw_response.create(
                model="", prompt="x", max_tokens=6, extra_body={"ignore_eos": True},
                extra_headers={"x-request-class": "batch", "x-request-priority": "1000", "x-slo-ttft-ms": "5",
                               "x-expected-output-tokens": "6"},
            )  # fmt: skip
            assert raw.parse().usage.completion_tokens == 6
            assert raw.headers["x-binbatch-predicted-tokens"] == "6"  # hints it may send
            assert (await ignored(sc, "priority"), await ignored(sc, "slo"), await ignored(sc, "hint")) == (1, 1, 0)
            await client.completions.create(model="", prompt="x", max_tokens=3, extra_body={"ignore_eos": True},
                                            extra_headers={"x-request-class": "trusted", "x-request-priority": "9",
                                                           "x-slo-ttft-ms": "5000"})  # fmt: skip
            assert (await ignored(sc, "priority"), await ignored(sc, "slo")) == (1, 1)

            # 3. A class whose answers run long loses its hints (ignore_eos with a stop sequence that never
            # comes is no contradiction the request states: only the answers tell), then earns them back.
            async def served(hint: int, max_tokens: int, stop: list[str] | None = None) -> str:
                raw = await client.completions.with_raw_response.create(
                    model="", prompt="lie", max_tokens=max_tokens, stop=stop, extra_body={"ignore_eos": True},
                    extra_headers={"x-request-class": "liar", "x-expected-output-tokens": str(hint)},
                )  # fmt: skip
                assert raw.parse().usage.completion_tokens == max_tokens
                return raw.headers["x-binbatch-predicted-tokens"]

            for _ in range(MIN_SAMPLES):
                assert await served(1, 24, [NEVER]) == "1"  # believed until the evidence is in
            assert await distrusted(sc, "liar") == 1 and await distrusted(sc, "batch") is None
            assert await served(1, 24, [NEVER]) != "1"  # the predictor places it now
            assert await ignored(sc, "hint") == 1
            honest = 0
            while await distrusted(sc, "liar") == 1:
                await served(12, 12)
                honest += 1
                assert honest <= 32
            assert honest == MIN_SAMPLES + 2  # nine lies in the window: ten honest answers move the median
            assert await served(12, 12) == "12"
        finally:
            await client.close()


async def test_the_grpc_door_earns_them_alike(tmp_path):
    async with sidecar(tmp_path) as sc:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sc.inference.Generate(prompt_request(0, 64, expected_output_tokens=1), timeout=WAIT)  # ignore_eos
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("expected_output_tokens: 1 is below max_tokens 64")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            msg = prompt_request(0, 64, expected_output_tokens=2, min_tokens=30, stop=[NEVER])
            await sc.inference.Generate(msg, timeout=WAIT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("expected_output_tokens: 2 is below min_tokens 30")

        resp = await sc.inference.Generate(
            prompt_request(1, 5, request_class="batch", priority=-1000, expected_output_tokens=5),
            metadata=(("x-slo-tpot-ms", "1"),), timeout=WAIT,
        )  # fmt: skip
        assert resp.completion_tokens == 5 and resp.predicted_output_tokens == 5
        assert (await ignored(sc, "priority"), await ignored(sc, "slo")) == (1, 1)

        for i in range(MIN_SAMPLES):
            resp = await sc.inference.Generate(
                prompt_request(i, 20, request_class="liar", expected_output_tokens=2, stop=[NEVER]), timeout=WAIT
            )  # fmt: skip
            assert resp.predicted_output_tokens == 2
        assert await distrusted(sc, "liar") == 1
        resp = await sc.inference.Generate(
            prompt_request(9, 20, request_class="liar", expected_output_tokens=2, stop=[NEVER]), timeout=WAIT
        )  # fmt: skip
        assert resp.predicted_output_tokens != 2 and await ignored(sc, "hint") == 1
        # the other classes keep theirs
        for request_class in ("", "batch"):
            msg = prompt_request(10, 4, expected_output_tokens=4, request_class=request_class)
            assert (await sc.inference.Generate(msg, timeout=WAIT)).predicted_output_tokens == 4
