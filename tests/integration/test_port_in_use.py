"""A port already in use: one line naming the setting and the address, exit 2.

``binbatch sidecar`` (gRPC and metrics ports) and the engine emulator (``binbatch
emulate-engine`` and ``python -m binbatch_sidecar.emulator``) run as real
processes against a port this test holds on 127.0.0.1.  What a person reads is
the whole of stderr: one line, no traceback, no grpc log lines.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from binbatch_sidecar.config import LoadedConfig, parse_config
from binbatch_sidecar.server.app import Sidecar
from binbatch_sidecar.server.ports import EXIT_CANNOT_LISTEN, ListenError, PortInUse, listen_error

BIN = Path(sys.executable).parent
TIMEOUT = 60  # a process that started serving instead of failing is killed here, and the test fails


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port some other program listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def run(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, cwd=cwd, stdin=subprocess.DEVNULL)


def assert_one_line(out: subprocess.CompletedProcess[str], expected: str) -> None:
    assert out.returncode == EXIT_CANNOT_LISTEN == 2, out.stderr
    assert out.stderr.splitlines() == [expected], out.stderr
    assert out.stdout == ""


def test_sidecar_grpc_port_in_use_is_one_line_and_exit_2(held_port, tmp_path):
    out = run(str(BIN / "binbatch"), "sidecar", "--host", "127.0.0.1", "--grpc-port", str(held_port),
              "--metrics-port", "0", cwd=tmp_path)  # fmt: skip
    assert_one_line(out, f"binbatch sidecar: cannot listen on 127.0.0.1:{held_port} "
                         "(--grpc-port or $BINBATCH_GRPC_PORT): address already in use")  # fmt: skip


def test_sidecar_metrics_port_from_the_config_file_names_its_key(held_port, tmp_path):
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump({"server": {"grpcPort": 0, "metricsPort": held_port}}))
    out = run(str(BIN / "binbatch"), "sidecar", "--config", str(path), "--host", "127.0.0.1", cwd=tmp_path)
    assert_one_line(out, f"binbatch sidecar: cannot listen on 127.0.0.1:{held_port} (server.metricsPort): "
                         "address already in use")  # fmt: skip


async def test_a_second_sidecar_on_a_grpc_servers_port_is_refused(tmp_path):
    """Linux gRPC binds with SO_REUSEPORT by default: a second sidecar on the port of
    a running gRPC server used to start, and the kernel split the connections
    between the two processes."""
    other = grpc.aio.server()
    port = other.add_insecure_port("127.0.0.1:0")
    await other.start()
    try:
        out = run(str(BIN / "binbatch"), "sidecar", "--host", "127.0.0.1", "--grpc-port", str(port),
                  "--metrics-port", "0", cwd=tmp_path)  # fmt: skip
    finally:
        await other.stop(None)
    assert_one_line(out, f"binbatch sidecar: cannot listen on 127.0.0.1:{port} "
                         "(--grpc-port or $BINBATCH_GRPC_PORT): address already in use")  # fmt: skip


@pytest.mark.parametrize("command", [("binbatch", "emulate-engine"), ("python", "-m", "binbatch_sidecar.emulator")],
                         ids=["binbatch emulate-engine", "python -m"])  # fmt: skip
def test_emulator_port_in_use_is_one_line_and_exit_2(held_port, tmp_path, command):
    argv = [sys.executable, *command[1:]] if command[0] == "python" else [str(BIN / command[0]), *command[1:]]
    out = run(*argv, "--host", "127.0.0.1", "--port", str(held_port), cwd=tmp_path)
    assert_one_line(out, f"binbatch emulate-engine: cannot listen on 127.0.0.1:{held_port} (--port): "
                         "address already in use")  # fmt: skip


async def test_a_failed_start_releases_the_ports_it_had_bound(held_port):
    """The metrics port is taken after the gRPC port was bound: the start raises
    ``PortInUse`` and the gRPC port is free again (nothing is left serving)."""
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        grpc_port = spare.getsockname()[1]
    sidecar = Sidecar(LoadedConfig(parse_config(None), sha256="", source="<test>"), host="127.0.0.1",
                      grpc_port=grpc_port, metrics_port=held_port)  # fmt: skip
    with pytest.raises(PortInUse) as err:
        await sidecar.start()
    assert (err.value.setting, err.value.host, err.value.port) == ("--metrics-port or $BINBATCH_METRICS_PORT",
                                                                   "127.0.0.1", held_port)  # fmt: skip
    with socket.socket() as again:  # a listener left behind would refuse this bind
        again.bind(("127.0.0.1", grpc_port))
        again.listen()


def test_an_unknown_host_names_the_host_setting():
    """getaddrinfo's error has no errno: the reason is its message, the setting the host's."""
    unknown = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    err = listen_error("server.grpcPort", "no-such-host", 50051, unknown)
    assert str(err) == "cannot listen on no-such-host:50051 (--host or $BINBATCH_HOST): name or service not known"


def test_listen_error_text_brackets_an_ipv6_host():
    assert str(ListenError("server.grpcPort", "::1", 50051, "address already in use")) == (
        "cannot listen on [::1]:50051 (server.grpcPort): address already in use"
    )
