"""free_port: a port for a server told it before it binds (the operator's webhook,
a process restarted on the same port)."""

from __future__ import annotations

import socket

from binbatch_sidecar.bench.chaos_processes import PORT_FLOOR, ephemeral_start, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_are_not_handed_out_twice():
    """No outgoing connection and no bind to port 0 can take one before its server
    binds it: the kernel hands those out from the ephemeral range only."""
    start = ephemeral_start()
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    assert all(PORT_FLOOR <= p < max(start, PORT_FLOOR + 1000) for p in ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free, as promised
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] not in ports
