"""The bench's reads of the engine (``bench_processes``): the preemption count survives a
connection the engine closed while it sat in the pool, and the bench's session keeps its
connections for less than vLLM's 5 s keep-alive."""

from __future__ import annotations

import asyncio

from binbatch_sidecar.bench.bench_processes import bench_session, preemptions
from binbatch_sidecar.engine.engine_client import KEEPALIVE_SECONDS

METRICS = b"# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{model_name=\"m\"} 7.0\n"


async def _engine(drop_first: int, status: bytes = b"") -> tuple[asyncio.Server, list[int]]:
    """An engine's /metrics on 127.0.0.1 whose first ``drop_first`` connections close unanswered
    (or, given ``status``, are answered with it and an empty body)."""
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(len(seen))
        await reader.readuntil(b"\r\n\r\n")
        if len(seen) <= drop_first:
            if status:
                writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
            writer.close()  # unanswered: as uvicorn closes an idle keep-alive connection the client just picked
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (len(METRICS), METRICS))  # fmt: skip
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, seen


async def test_a_connection_closed_unanswered_is_read_again():
    server, seen = await _engine(drop_first=1)
    port = server.sockets[0].getsockname()[1]
    async with server, bench_session(10) as session:
        assert await preemptions(session, f"http://127.0.0.1:{port}") == 7.0
    assert len(seen) >= 2


async def test_an_engine_that_never_answers_reads_as_none_after_the_attempts():
    server, seen = await _engine(drop_first=99)
    port = server.sockets[0].getsockname()[1]
    async with server, bench_session(10) as session:
        assert await preemptions(session, f"http://127.0.0.1:{port}", attempts=3) is None
    assert len(seen) >= 3  # each try (aiohttp may retry a broken GET once more itself)


async def test_an_error_status_is_read_again():
    server, seen = await _engine(drop_first=1, status=b"500 Internal Server Error")
    port = server.sockets[0].getsockname()[1]
    async with server, bench_session(10) as session:
        assert await preemptions(session, f"http://127.0.0.1:{port}") == 7.0
    assert len(seen) == 2


async def test_the_bench_session_pools_connections_for_less_than_the_engines_keep_alive():
    async with bench_session(10) as session:
        assert session.connector is not None
        assert session.connector._keepalive_timeout == KEEPALIVE_SECONDS < 5
