"""Fetch a sidecar's training records (``Admin/ExportTrainingRecords``), page by page, as ``Record``s.

What ``binbatch predictor export`` writes to a file and the operator gathers for
a policy's fleet model (``spec.predictor.fleet``): hashed features and output
lengths, never prompt text.  ``since`` and ``epoch`` are a cursor: the answer
says where to go on from (``Exported.next``, ``Exported.epoch``), so a reader
that keeps them fetches only what is new.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc

from .training_records import Record, hashed_record

TIMEOUT_SECONDS = 10.0  # one page (up to about 2 MiB)
PAGE_RECORDS = 2000  # the sidecar's own bound on one answer


@dataclass
class Exported:
    records: list[Record] = field(default_factory=list)
    next: int = 0  # the cursor to ask from next time
    epoch: str = ""  # the sidecar's numbering the cursor counts in
    remaining: int = 0  # records newer than ``next`` the sidecar still holds (``limit`` was reached)
    dropped: int = 0  # records that left the sidecar's buffer before they were asked for


def as_record(msg: pb.TrainingRecord) -> Record:
    return hashed_record(list(msg.indices), list(msg.values), msg.output_tokens)


async def export_records(
    address: str, *, since: int = 0, epoch: str = "", limit: int = 100_000, timeout: float = TIMEOUT_SECONDS,
    token: str | Callable[[], str] = "",
) -> Exported:
    """At most ``limit`` records of the sidecar at ``host:port`` after the cursor (``since`` in ``epoch``);
    raises ``grpc.aio.AioRpcError`` when a page fails (FAILED_PRECONDITION: its predictor is not Learned,
    UNAUTHENTICATED: off the sidecar's loopback without a credential).  ``token``: sent as
    ``authorization: Bearer`` (the admin token, or a callable giving a fresh operator-signed one per page)."""
    out = Exported(next=since, epoch=epoch)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.AdminStub(channel)
        while True:
            ask = min(PAGE_RECORDS, limit - len(out.records))
            bearer = token() if callable(token) else token
            reply = await stub.ExportTrainingRecords(
                pb.ExportTrainingRecordsRequest(since=out.next, epoch=out.epoch, max_records=ask), timeout=timeout,
                metadata=(("authorization", f"Bearer {bearer}"),) if bearer else None,
            )
            if reply.epoch != out.epoch:  # a new sidecar process (or the first ask): it answered from its start
                out.next = 0
            if reply.oldest > out.next + 1:
                out.dropped += reply.oldest - out.next - 1
            out.epoch, out.next, out.remaining = reply.epoch, reply.next, reply.remaining
            out.records.extend(as_record(r) for r in reply.records)
            if not reply.remaining or not reply.records or len(out.records) >= limit:
                return out
