"""The API as a client sees it over real gRPC on 127.0.0.1 is the one binbatch.proto
documents: the stream's chunks add up to the unary answer, and server reflection
(what grpcurl and Postman read) carries the proto's comments.

Each test starts the engine emulator and a sidecar, both on port 0.
"""

from __future__ import annotations

import pytest
from sidecar_harness import prompt_request, running_sidecar, sidecar_config

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar.engine.emulator import EmulatorConfig, running_emulator

FAST = EmulatorConfig(step_a=0.001, step_c=0.0001, num_gpu_blocks=512, block_size=16)

# Gang with a batch of one dispatches at once; continuous streams token by token.
MODES = {
    "continuous": {},
    "gang": {"mode": "Gang", "sizing": "Static", "staticSize": 1, "minBatchSize": 1},
}


def _deterministic_request() -> pb.GenerateRequest:
    # Seeded: the emulator's text is a function of the request, so two calls agree.
    return prompt_request(3, 24, seed=7, temperature=1.0)


@pytest.mark.parametrize("mode", sorted(MODES))
async def test_concatenated_stream_chunks_equal_the_unary_text(tmp_path, mode):
    async with running_emulator(FAST) as url, running_sidecar(sidecar_config(url, batch=MODES[mode]), tmp_path) as sc:
        unary = await sc.inference.Generate(_deterministic_request(), timeout=30)
        chunks = [c async for c in sc.inference.GenerateStream(_deterministic_request(), timeout=30)]
    assert unary.text and unary.completion_tokens == 24
    # A client that takes every text the stream carries, trusting the proto that
    # `final.text` is empty, gets the completion once.
    received = "".join(c.text + (c.final.text if c.HasField("final") else "") for c in chunks)
    assert received == unary.text
    final = chunks[-1]
    assert final.HasField("final") and not any(c.HasField("final") for c in chunks[:-1])
    assert final.final.text == ""  # as the proto says: the deltas carried it
    assert final.final.completion_tokens == unary.completion_tokens
    assert final.final.finish_reason == unary.finish_reason
    assert [c.index for c in chunks] == list(range(len(chunks)))  # sequence numbers from 0
