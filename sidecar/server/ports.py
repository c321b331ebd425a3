"""Binding a listening port, with one error a person can act on.

A port already in use is the start-up failure people meet most, and each
library reports it differently: grpc's ``add_insecure_port`` raises a bare
``RuntimeError("Failed to bind ...")`` with no reason, aiohttp's
``TCPSite.start`` an ``OSError(EADDRINUSE)`` with the address.  Every sidecar
listener (gRPC, metrics, HTTP) binds through here, so all of them fail the same
way: ``ListenError`` names the setting that chose the port, the address and the
reason, and the command line prints it as one line and exits
``EXIT_CANNOT_LISTEN`` (no traceback).  The engine emulator, which imports no
sidecar code, words its ``CannotListen`` the same way.
"""

from __future__ import annotations

import errno
import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line imports this module for ListenError alone: keep it light
    import grpc
    from aiohttp import web

EXIT_CANNOT_LISTEN = 2  # documented in docs/api.md (exit codes)

HOST_SETTING = "--host or $BINBATCH_HOST"  # every listener binds the one host

# Linux gRPC sets SO_REUSEPORT by default: a second sidecar on the same port would
# bind "successfully" and the kernel would split connections between the two.
GRPC_SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


class ListenError(Exception):
    """A listener could not bind ``host:port``; ``setting`` is what chose the port
    (a config key such as ``server.grpcPort``, or a flag)."""

    def __init__(self, setting: str, host: str, port: int, reason: str) -> None:
        super().__init__(setting, host, port, reason)
        self.setting, self.host, self.port, self.reason = setting, host, port, reason

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"cannot listen on {host}:{self.port} ({self.setting}): {self.reason}"


class PortInUse(ListenError):
    """The port is taken by another process (EADDRINUSE)."""

    def __init__(self, setting: str, host: str, port: int) -> None:
        super().__init__(setting, host, port, os.strerror(errno.EADDRINUSE).lower())


def setting_name(config_key: str, flag: str, env: str, overridden: bool) -> str:
    """What chose a port: the config key, or the flag / environment variable that
    overrides it."""
    return f"{flag} or ${env}" if overridden else config_key


def listen_error(setting: str, host: str, port: int, exc: OSError) -> ListenError:
    """The ``ListenError`` for an ``OSError`` raised while binding."""
    if exc.errno == errno.EADDRINUSE:
        return PortInUse(setting, host, port)
    if isinstance(exc, socket.gaierror) or not exc.errno or exc.errno < 0:  # unknown host: no errno
        return ListenError(HOST_SETTING, host, port, str(exc.strerror or exc).lower())
    return ListenError(setting, host, port, os.strerror(exc.errno).lower())


def probe(setting: str, host: str, port: int) -> ListenError | None:
    """Why ``host:port`` cannot be bound, or None if it can: a bind of our own,
    closed at once.  With SO_REUSEADDR, as the servers bind, so a restart's
    TIME_WAIT connections do not count as "in use" while a listener does."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
    except OSError as exc:
        return listen_error(setting, host, port, exc)
    return None


def bind_grpc(server: grpc.aio.Server, host: str, port: int, setting: str) -> int:
    """``server.add_insecure_port`` for ``host:port``; the bound port (port 0 picks
    one).  Raises ``ListenError``.

    The address is probed first: grpc reports a failed bind by logging its own
    multi-line error to stderr and raising a bare RuntimeError, which is not the
    one line a person should read.
    """
    refused = probe(setting, host, port)
    if refused is not None:
        raise refused
    try:
        bound = server.add_insecure_port(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    except RuntimeError:  # taken between the probe and the bind
        bound = 0
    if bound == 0:  # older grpc returned 0 instead of raising
        raise probe(setting, host, port) or ListenError(setting, host, port, "the address could not be bound")
    return bound


async def start_site(runner: web.AppRunner, host: str, port: int, setting: str) -> int:
    """Start an aiohttp ``TCPSite`` for ``runner`` on ``host:port``; the bound
    port.  Raises ``ListenError``."""
    from aiohttp import web

    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        raise listen_error(setting, host, port, exc) from None
    sockets = site._server.sockets if site._server is not None else ()  # type: ignore[union-attr]
    return int(sockets[0].getsockname()[1])
