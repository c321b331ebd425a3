"""Slow and hostile connections on both doors: a client that sends half a header,
a body that never ends, more connections than ``server.maxConnections``, more
gRPC calls on one connection than ``server.grpcMaxConcurrentStreams``.

Real sockets on 127.0.0.1 (port 0) against the engine emulator.  Every wait is on
the server: a bounded read that ends when the sidecar closes the socket, or a
call with a deadline; a trickling client paces itself by those bounded reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import yaml
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sidecar_harness import Running, running_sidecar, sidecar_config

from binbatch_sidecar.emulator import Emulator, EmulatorConfig

FAST = EmulatorConfig(step_a=0.001, step_c=0.0001, num_gpu_blocks=512, block_size=16)
BOUND = 20.0  # no wait here lasts longer
DEADLINE_MS = 600  # server.httpRequestReadTimeoutMilliseconds in the deadline tests


async def echo(request: web.Request) -> web.Response:
    """An engine route that reads the whole body before it answers (as vLLM's /tokenize does)."""
    return web.Response(body=await request.read(), content_type="application/json")


@contextlib.asynccontextmanager
async def sidecar(tmp_path, **server: Any) -> AsyncIterator[tuple[Running, str, str]]:
    """A sidecar in front of the emulator (with an echoing ``POST /tokenize``); its HTTP
    base URL and the emulator's model."""
    emulator = Emulator(FAST)
    emulator.app.router.add_post("/tokenize", echo)
    async with emulator:
        doc = sidecar_config(emulator.base_url, server=server)
        doc["metrics"]["source"] = "None"
        async with running_sidecar(doc, tmp_path) as sc:
            yield sc, f"http://127.0.0.1:{sc.sidecar.http_port}", emulator.config.model


async def raw(sc: Running) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", sc.sidecar.http_port)


async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (bounded)."""
    async with asyncio.timeout(BOUND):
        return await reader.read()


async def completion(http: aiohttp.ClientSession, base: str, model: str) -> int:
    body = {"model": model, "prompt": "a normal request", "max_tokens": 3, "ignore_eos": True}
    async with http.post(f"{base}/v1/completions", json=body) as resp:
        assert (await resp.json())["usage"]["completion_tokens"] == 3
        return resp.status


async def test_half_a_header_is_disconnected_at_the_deadline_while_a_normal_request_is_answered(tmp_path):
    async with sidecar(tmp_path, httpRequestReadTimeoutMilliseconds=DEADLINE_MS) as (sc, base, model):
        opened = time.monotonic()  # before the connect: the server's clock starts later
        reader, writer = await raw(sc)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")  # and then nothing
        await writer.drain()
        async with aiohttp.ClientSession() as http:
            assert await completion(http, base, model) == 200  # another connection is served meanwhile
        assert await closed_by_server(reader) == b""  # closed unanswered: no request ever arrived
        assert time.monotonic() - opened >= DEADLINE_MS / 1000  # at the deadline, not before
        writer.close()


async def test_a_header_trickled_a_byte_at_a_time_is_still_cut_at_the_deadline(tmp_path):
    """Data arriving does not restart the clock: the headers are due by the deadline, whole."""
    async with sidecar(tmp_path, httpRequestReadTimeoutMilliseconds=DEADLINE_MS) as (sc, _, _):
        opened = time.monotonic()
        reader, writer = await raw(sc)
        header = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 10_000
        sent = 0
        async with asyncio.timeout(BOUND):
            while True:  # one byte, then wait (bounded) for the server to close before the next
                writer.write(header[sent:sent + 1])
                sent += 1
                try:
                    got = await asyncio.wait_for(reader.read(1), timeout=0.05)
                except TimeoutError:
                    continue
                break
        assert got == b""
        assert sent > 1 and DEADLINE_MS / 1000 <= time.monotonic() - opened < BOUND
        writer.close()


async def test_a_slow_body_is_answered_408_and_disconnected_while_a_normal_request_is_answered(tmp_path):
    async with sidecar(tmp_path, httpRequestReadTimeoutMilliseconds=DEADLINE_MS) as (sc, base, model):
        reader, writer = await raw(sc)
        headers_sent = time.monotonic()  # before the write: the server's clock starts later
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")  # fmt: skip
        await writer.drain()
        async with aiohttp.ClientSession() as http:
            assert await completion(http, base, model) == 200
        answer = await closed_by_server(reader)  # the 408, then the server closes
        assert time.monotonic() - headers_sent >= DEADLINE_MS / 1000
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ")
        assert b"Connection: close" in head
        assert b"server.httpRequestReadTimeoutMilliseconds" in body and b'"param":"body"' in body.replace(b" ", b"")
        assert sc.sidecar.dispatcher.totals["accepted"] == 1  # the slow one never reached the scheduler
        writer.close()


async def test_a_slow_body_to_a_listed_passthrough_path_is_cut_at_the_deadline_and_answered_408(tmp_path):
    async with sidecar(tmp_path, httpRequestReadTimeoutMilliseconds=DEADLINE_MS, passthroughPaths=["/tokenize"]) as (
        sc, base, model,
    ):  # fmt: skip
        async with aiohttp.ClientSession() as http:  # a whole body passes through as before
            async with http.post(f"{base}/tokenize", data=b'{"prompt": "hi"}') as resp:
                assert (resp.status, await resp.read()) == (200, b'{"prompt": "hi"}')
        reader, writer = await raw(sc)
        headers_sent = time.monotonic()
        writer.write(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")  # fmt: skip
        await writer.drain()
        answer = await closed_by_server(reader)
        assert time.monotonic() - headers_sent >= DEADLINE_MS / 1000
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in head
        assert b"server.httpRequestReadTimeoutMilliseconds" in body
        writer.close()


async def test_connections_past_max_connections_are_closed_at_once_while_open_ones_are_served(tmp_path):
    async with sidecar(tmp_path, maxConnections=2) as (sc, base, model):  # the default 30 s read deadline
        connector = aiohttp.TCPConnector(limit=1)  # one kept-alive connection
        async with aiohttp.ClientSession(connector=connector) as http:
            assert await completion(http, base, model) == 200  # connection 1, kept alive
            idle_reader, idle_writer = await raw(sc)  # connection 2: open, idle
            refused_reader, refused_writer = await raw(sc)  # connection 3 (accepted after 2: the backlog is FIFO)
            opened = time.monotonic()
            assert await closed_by_server(refused_reader) == b""  # connection 3: closed at once, unread
            assert time.monotonic() - opened < 10  # long before the 30 s read deadline
            assert await completion(http, base, model) == 200  # connection 1 still served
            server = sc.sidecar._http_runner.server
            assert server is not None and len(server.connections) == 2
            scraped = await sc.scrape()
            refused = scraped["binbatch_http_connections_refused"].samples[0]
            assert (refused.name, refused.value) == ("binbatch_http_connections_refused_total", 1)
            assert scraped["binbatch_http_connections"].samples[0].value == 2  # the open ones, not the refused
            idle_writer.close()  # a place frees: a new connection is served again
            assert await closed_by_server(idle_reader) == b""
            async with asyncio.timeout(BOUND):
                while len(server.connections) == 2:
                    await sc.stats()  # a round trip lets the sidecar's loop drop the closed connection
            reader, writer = await raw(sc)
            writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert (await closed_by_server(reader)).startswith(b"HTTP/1.1 200 ")
            writer.close()
            refused_writer.close()


async def test_a_reload_raising_max_connections_admits_new_connections_without_a_restart(tmp_path):
    async with sidecar(tmp_path, maxConnections=1) as (sc, _, _):
        _, held_writer = await raw(sc)  # the one place
        refused_reader, refused_writer = await raw(sc)
        assert await closed_by_server(refused_reader) == b""
        doc = yaml.safe_load(sc.path.read_text())
        doc["server"]["maxConnections"] = 2
        generation = sc.sidecar.loaded.generation
        sc.write_config(doc)
        async with asyncio.timeout(BOUND):
            while sc.sidecar.loaded.generation == generation:
                await sc.stats()  # a round trip lets the sidecar's loop poll the file
        reader, writer = await raw(sc)
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert (await closed_by_server(reader)).startswith(b"HTTP/1.1 200 ")
        for w in (writer, refused_writer, held_writer):
            w.close()


async def test_grpc_calls_past_max_concurrent_streams_wait_on_their_connection(tmp_path):
    async with sidecar(tmp_path, grpcMaxConcurrentStreams=2) as (sc, _, _):
        health = health_pb2_grpc.HealthStub(sc.channel)
        watches = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(2)]
        for watch in watches:  # both streams open on the server: each sent its first status
            async with asyncio.timeout(BOUND):
                await watch.read()
        try:
            await health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)  # a third stream on the connection
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # it waited in the client, never started
        else:
            raise AssertionError("a third call ran past grpcMaxConcurrentStreams = 2")
        own_connection = (("grpc.use_local_subchannel_pool", 1),)  # else channels to one address share a connection
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sc.sidecar.grpc_port}", options=own_connection) as other:
            reply = await health_pb2_grpc.HealthStub(other).Check(health_pb2.HealthCheckRequest(), timeout=BOUND)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING  # another connection is served at once
        watches[0].cancel()  # a stream ends: the next call on the connection runs
        reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=BOUND)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        watches[1].cancel()
