"""The connection deadlines and caps built from ``server.*`` (behaviour on real
sockets: tests/integration/test_slow_connections.py)."""

from __future__ import annotations

from binbatch_sidecar.config import parse_config
from binbatch_sidecar.server.connection_limits import grpc_server_options, http_runner_options


def test_grpc_server_options_carry_the_stream_cap_keepalive_enforcement_and_connection_age():
    server = parse_config({"server": {"grpcMaxConcurrentStreams": 64, "grpcMaxConnectionAgeSeconds": 120,
                                      "maxRequestBytes": 1 << 20}}).server  # fmt: skip
    options = dict(grpc_server_options(server))
    assert len(options) == len(grpc_server_options(server))  # each channel argument once
    assert options["grpc.max_concurrent_streams"] == 64
    assert options["grpc.max_connection_age_ms"] == 120_000
    assert options["grpc.max_connection_age_grace_ms"] > 0
    assert options["grpc.max_connection_idle_ms"] > 0
    assert options["grpc.max_receive_message_length"] == 1 << 20
    assert options["grpc.http2.min_ping_interval_without_data_ms"] == 10_000
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.http2.max_ping_strikes"] == 2
    # the default sets no stream cap (a cap refuses streams opened before the client read the settings)
    assert "grpc.max_concurrent_streams" not in dict(grpc_server_options(parse_config({}).server))
    assert options["grpc.so_reuseport"] == 0  # a second sidecar on the port fails to bind


def test_the_http_header_deadline_is_the_keepalive_timer_and_lingering_never_outlasts_it():
    short = parse_config({"server": {"httpRequestReadTimeoutMilliseconds": 500}}).server
    assert http_runner_options(short) == {"keepalive_timeout": 0.5, "lingering_time": 0.5}
    default = parse_config({}).server
    assert http_runner_options(default) == {"keepalive_timeout": 30.0, "lingering_time": 10.0}
