"""Defect 5 through the whole sidecar: a gang batch whose one list call would be
over vLLM's 1 MiB body limit (the emulator's default, as aiohttp's) is split,
and every member completes.  gRPC and HTTP on 127.0.0.1, port 0."""

from __future__ import annotations

import asyncio

from sidecar_harness import prompt_request, running_sidecar, sidecar_config

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar.emulator import EmulatorConfig, running_emulator

FAST = EmulatorConfig(step_a=0.0005, step_c=0.00005)


async def test_twelve_large_prompts_and_twenty_small_ones_in_one_gang_batch_all_complete(tmp_path):
    doc = sidecar_config(
        "", batch={"mode": "Gang", "sizing": "Static", "staticSize": 32, "maxWaitMilliseconds": 60000},
        bins={"count": 1},
    )  # fmt: skip
    async with running_emulator(FAST) as url:
        doc["engine"]["url"], doc["metrics"]["url"] = url, url + "/metrics"
        async with running_sidecar(doc, tmp_path) as sc:
            large = [pb.GenerateRequest(prompt=chr(ord("a") + i) * 120_000, max_tokens=3, ignore_eos=True)
                     for i in range(12)]  # fmt: skip
            small = [prompt_request(i, 3) for i in range(20)]
            answers = await asyncio.gather(*(sc.inference.Generate(r, timeout=60) for r in large + small))
            assert [a.completion_tokens for a in answers] == [3] * 32
            assert {a.batch_size for a in answers} == {32}  # one gang batch, sent as several calls
