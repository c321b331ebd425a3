"""The unit suite's guard (tests/unit/conftest.py) refuses the network and
nothing else: unit tests stay free of sockets because they cannot open one."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from aiohttp import ClientSession

REFUSED = "opens no sockets"  # the guard's message (an AssertionError)


def test_a_tcp_connect_is_refused():
    with socket.socket() as s, pytest.raises(AssertionError, match=REFUSED):
        s.connect(("127.0.0.1", 9))


def test_a_listening_socket_is_refused():
    with socket.socket() as s, pytest.raises(AssertionError, match=REFUSED):
        s.bind(("127.0.0.1", 0))


async def test_an_http_client_call_is_refused():
    async with ClientSession() as http:
        with pytest.raises(AssertionError, match=REFUSED):
            await http.get("http://127.0.0.1:9/")


def test_grpc_servers_and_channels_are_refused():
    for make in (grpc.aio.server, grpc.server, lambda: grpc.aio.insecure_channel("127.0.0.1:9")):
        with pytest.raises(AssertionError, match=REFUSED):
            make()


async def test_the_event_loop_still_runs():
    """asyncio wakes its loop through a socket pair, made without bind or connect."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    loop.call_soon_threadsafe(done.set)  # writes to the self-pipe
    await asyncio.wait_for(done.wait(), timeout=5)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"x")
        assert b.recv(1) == b"x"
