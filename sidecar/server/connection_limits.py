"""Deadlines and caps on the sidecar's connections, both doors, from ``server.*``.

A client that opens a connection and then sends nothing, half a header, or a body
one byte at a time must not hold the sidecar's memory or sockets for long, nor
keep others from being served.

HTTP door (aiohttp):

- Headers: aiohttp's own keep-alive timer is armed when a connection opens and
  again after each answer, and closes the connection if no complete request has
  arrived by then -- an idle connection and one that sent half a header alike.
  It is set to ``server.httpRequestReadTimeoutMilliseconds`` (``http_runner_options``),
  so the one setting is both the header deadline and the keep-alive idle timeout.
- Body: the door reads a body within the same time of its headers (``read_body``),
  else answers 408 and closes the connection; a body it passes on to the engine as
  it arrives (a listed passthrough path) is held to the same deadline (``StreamedBody``).
- Connections: ``cap_connections`` closes a connection past ``server.maxConnections``
  as it is made (before a byte of it is read), so the open ones keep being served.

gRPC door (grpc core channel arguments, ``grpc_server_options``): at most
``server.grpcMaxConcurrentStreams`` calls at once per connection (HTTP/2
SETTINGS_MAX_CONCURRENT_STREAMS: further calls wait in the client), keepalive
pings enforced (a client pinging more often than every ``KEEPALIVE_MIN_PING_MS``
without data gets strikes, and after ``KEEPALIVE_MAX_PING_STRIKES`` a GOAWAY),
a connection idle for ``MAX_CONNECTION_IDLE_MS`` closed, and every connection
asked to go away at ``server.grpcMaxConnectionAgeSeconds`` (its running calls get
``MAX_CONNECTION_AGE_GRACE_MS`` to finish).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import StreamReader, web

from ..config import ServerConfig
from .ports import GRPC_SERVER_OPTIONS

log = logging.getLogger("binbatch.http")

# gRPC keepalive enforcement: clients may ping an idle connection every 10 s (grpc's default
# policy, 5 minutes, strikes out the common 30-60 s client keepalive), idle pings allowed
KEEPALIVE_MIN_PING_MS = 10_000
KEEPALIVE_MAX_PING_STRIKES = 2  # grpc's default, stated
MAX_CONNECTION_IDLE_MS = 600_000  # a connection with no call for 10 minutes is closed (GOAWAY)
MAX_CONNECTION_AGE_GRACE_MS = 600_000  # an aged connection's running calls: engine.requestTimeoutSeconds' default


def grpc_server_options(server: ServerConfig) -> tuple[tuple[str, int], ...]:
    """The grpc.aio server's channel arguments (names: grpc core's ``grpc_types.h``)."""
    return (
        *GRPC_SERVER_OPTIONS,
        # server.maxRequestBytes: a larger message is RESOURCE_EXHAUSTED before it is held (the HTTP door's 413)
        ("grpc.max_receive_message_length", server.max_request_bytes),
        # 0: gRPC's own, no cap (config.py GRPC_MAX_CONCURRENT_STREAMS_DEFAULT says why)
        *((("grpc.max_concurrent_streams", server.grpc_max_concurrent_streams),) if server.grpc_max_concurrent_streams else ()),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MIN_PING_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_ping_strikes", KEEPALIVE_MAX_PING_STRIKES),
        ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_MS),
        ("grpc.max_connection_age_ms", server.grpc_max_connection_age_seconds * 1000),
        ("grpc.max_connection_age_grace_ms", MAX_CONNECTION_AGE_GRACE_MS),
    )


def http_runner_options(server: ServerConfig) -> dict[str, Any]:
    """The HTTP door's ``web.AppRunner`` options: the header deadline and keep-alive idle
    timeout (aiohttp's one keep-alive timer), and how long a refused body is still read
    and dropped so its client sees the answer (no longer than the deadline itself)."""
    seconds = server.http_request_read_timeout_milliseconds / 1000
    return {"keepalive_timeout": seconds, "lingering_time": min(seconds, 10.0)}


class BodyTooLarge(Exception):
    """A body passed the size limit while it was read (chunked, or a Content-Length that lied)."""


async def read_body(request: web.Request, seconds: float, limit: int) -> bytearray | None:
    """The request's body, or None if it did not arrive within ``seconds``; ``BodyTooLarge``
    as soon as more than ``limit`` bytes arrived.  Read into one buffer the caller owns and
    drops once it is parsed (``request.read()`` would keep a copy on the request until its
    answer: twice a queued request's bytes)."""
    body = bytearray()
    try:
        async with asyncio.timeout(seconds):
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > limit:
                    raise BodyTooLarge
    except TimeoutError:
        return None
    return body


class StreamedBody:
    """A request body passed on as it arrives (a listed passthrough path), due within
    ``seconds`` of now: past it, the chunks stop with an error (the engine call fails
    and is closed) and ``missed`` says why."""

    def __init__(self, content: StreamReader, seconds: float) -> None:
        self.content = content
        self.deadline = asyncio.get_running_loop().time() + seconds
        self.missed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            try:
                async with asyncio.timeout_at(self.deadline):
                    chunk = await self.content.readany()
            except TimeoutError:
                self.missed = True
                raise BodyTooSlow from None
            if not chunk:
                return
            yield chunk


class BodyTooSlow(Exception):
    """A streamed body missed its deadline."""


def cap_connections(server: web.Server, limit: Callable[[], int], refused: Callable[[], None]) -> None:
    """Close each connection ``server`` is given past ``limit()`` open ones, as it is made
    (``refused()`` counts it).

    aiohttp has no cap of its own.  The check sits where it registers a connection
    (``Server.connection_made``, called by each connection's protocol; wrapped on the
    instance, since the runner builds the Server), so it is exact however many are
    accepted at once -- a count at accept time would miss those accepted in the same
    loop iteration.  ``limit`` is read per connection (``server.maxConnections`` applies live).
    """
    register = server.connection_made

    def connection_made(handler: Any, transport: asyncio.Transport) -> None:
        if len(server.connections) >= limit():
            log.debug("connection refused: %d open (server.maxConnections)", len(server.connections))
            transport.close()  # never registered: its protocol's connection_lost finds nothing to remove
            refused()
            return
        register(handler, transport)

    server.connection_made = connection_made  # type: ignore[method-assign]
