"""Ask one sidecar for its stats over gRPC (``binbatch.v1.Admin/GetStats``)."""

from __future__ import annotations

import grpc

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc

TIMEOUT_SECONDS = 3.0


async def get_stats(address: str, timeout: float = TIMEOUT_SECONDS) -> pb.Stats:
    """``address`` is ``host:port``; raises grpc.aio.AioRpcError on failure or timeout."""
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.AdminStub(channel).GetStats(pb.GetStatsRequest(), timeout=timeout)


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
