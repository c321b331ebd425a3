"""Unit-test settings.

Hypothesis's per-example deadline (200 ms) is a wall-clock bound: on a loaded
2-core runner it fails correct code. Properties are checked without it; how
fast things run is the benchmarks' business.

Unit tests open no network sockets (CONVENTIONS "Tests"): every test here runs
with Python sockets unable to bind or connect, and gRPC unable to make a server
or a channel (its C core does not use Python sockets). The socket pair asyncio
wakes its loop with is made without either, so it still works. A test that
needs the network belongs in ``tests/integration``.
"""

from __future__ import annotations

import socket

import grpc
import pytest
from hypothesis import settings

settings.register_profile("binbatch", deadline=None)
settings.load_profile("binbatch")


class NetworkInUnitTest(AssertionError):
    """A unit test tried to use the network; move it to tests/integration."""


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise NetworkInUnitTest(f"{what} in a unit test: tests/unit opens no sockets (move it to tests/integration)")

    return refuse


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    for method in ("bind", "connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, method, _refuse(f"socket.{method}"))
    for name in ("server", "insecure_channel", "secure_channel"):
        monkeypatch.setattr(grpc, name, _refuse(f"grpc.{name}"))
        monkeypatch.setattr(grpc.aio, name, _refuse(f"grpc.aio.{name}"))
