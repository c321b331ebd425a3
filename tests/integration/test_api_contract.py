"""The API as a client sees it over real gRPC on 127.0.0.1 is the one binbatch.proto
documents: the stream's chunks add up to the unary answer, and server reflection
(what grpcurl and Postman read) carries the proto's comments.

Each test starts the engine emulator and a sidecar, both on port 0.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from sidecar_harness import prompt_request, running_sidecar, sidecar_config

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar.emulator import EmulatorConfig, running_emulator

FAST = EmulatorConfig(step_a=0.001, step_c=0.0001, num_gpu_blocks=512, block_size=16)
PROTO_NAME = "binbatch_api/v1/binbatch.proto"

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


def _comment_of(file_proto: descriptor_pb2.FileDescriptorProto, path: tuple[int, ...]) -> str:
    for loc in file_proto.source_code_info.location:
        if tuple(loc.path) == path:
            return loc.leading_comments
    return ""


async def test_reflection_serves_the_protos_comments_and_lists_every_service(tmp_path):
    async with running_emulator(FAST) as url, running_sidecar(sidecar_config(url), tmp_path) as sc:
        channel = grpc.insecure_channel(f"127.0.0.1:{sc.sidecar.grpc_port}")  # the client is synchronous
        try:
            db = ProtoReflectionDescriptorDatabase(channel)
            services = await asyncio.to_thread(lambda: set(db.get_services()))
            by_symbol = await asyncio.to_thread(db.FindFileContainingSymbol, "binbatch.v1.Inference")
            by_name = await asyncio.to_thread(db.FindFileByName, PROTO_NAME)
            health = await asyncio.to_thread(db.FindFileContainingSymbol, "grpc.health.v1.Health")
        finally:
            channel.close()
    assert services == {
        "binbatch.v1.Inference",
        "binbatch.v1.Admin",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    assert health.package == "grpc.health.v1"
    for file_proto in (by_symbol, by_name):
        assert file_proto.name == PROTO_NAME
        service = [s.name for s in file_proto.service].index("Inference")
        generate = [m.name for m in file_proto.service[service].method].index("Generate")
        path = (
            descriptor_pb2.FileDescriptorProto.SERVICE_FIELD_NUMBER, service,
            descriptor_pb2.ServiceDescriptorProto.METHOD_FIELD_NUMBER, generate,
        )  # fmt: skip
        assert "Generates a completion and returns it when it is finished." in _comment_of(file_proto, path)
        final = [m.name for m in file_proto.message_type].index("GenerateChunk")
        assert "Set on the last chunk only" in "".join(
            loc.leading_comments
            for loc in file_proto.source_code_info.location
            if tuple(loc.path[:2]) == (descriptor_pb2.FileDescriptorProto.MESSAGE_TYPE_FIELD_NUMBER, final)
        )
