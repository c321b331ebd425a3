"""``binbatch sidecar``: run the batching sidecar in front of a vLLM server."""

from __future__ import annotations

import argparse
import os
import sys

from ..emulator.cli import port_number
from .arguments import EXIT_CANNOT_START, env_port


def _sidecar(args: argparse.Namespace) -> int:
    import asyncio

    from ..config import ConfigError, LoadedConfig, load_config, parse_config
    from ..server import logs
    from ..server.app import serve

    path = args.config or os.environ.get("BINBATCH_CONFIG") or None
    try:
        loaded = load_config(path) if path else LoadedConfig(parse_config(None), sha256="", source="<defaults>")
    except ConfigError as exc:
        print(f"binbatch sidecar: invalid config {path}:\n{exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    except OSError as exc:
        print(f"binbatch sidecar: cannot read config {path}: {(exc.strerror or str(exc)).lower()}", file=sys.stderr)
        return EXIT_CANNOT_START
    logs.setup(str(loaded.config.logging.level))
    try:
        return asyncio.run(serve(loaded, path, args.host, args.grpc_port, args.metrics_port, args.http_port,
                                 args.take_over_port))
    except ConfigError as exc:  # valid YAML the sidecar cannot apply: a predictor.warmStart that is no model
        print(f"binbatch sidecar: invalid config {path or '<defaults>'}:\n{exc}", file=sys.stderr)
        return EXIT_CANNOT_START



def register(sub: argparse._SubParsersAction) -> None:
    """Add ``sidecar`` to the top-level subparsers."""
    sc = sub.add_parser(
        "sidecar", help="run the batching sidecar in front of a vLLM server",
        description="Run the batching sidecar in front of a vLLM server: a gRPC door and an OpenAI-compatible HTTP "
                    "door, Prometheus metrics, and the config file reloaded on change.",
    )
    sc.add_argument("--config", metavar="FILE", help="config YAML (default: $BINBATCH_CONFIG, else built-in defaults; "
                    "an existing empty file is an error); reloaded on change, every key live except the ports")
    sc.add_argument("--host", default=os.environ.get("BINBATCH_HOST", "0.0.0.0"),
                    help="address to bind (default $BINBATCH_HOST or 0.0.0.0)")
    sc.add_argument("--grpc-port", type=port_number, default=env_port("BINBATCH_GRPC_PORT"),
                    help="gRPC port (default $BINBATCH_GRPC_PORT, else server.grpcPort; fixed until restart)")
    sc.add_argument("--http-port", type=port_number, default=env_port("BINBATCH_HTTP_PORT"),
                    help="OpenAI-compatible HTTP port (default $BINBATCH_HTTP_PORT, else server.httpPort; "
                    "fixed until restart)")
    sc.add_argument("--take-over-port", type=port_number, metavar="PORT",
                    help="also serve the HTTP door on PORT: vLLM's own serving port, which the operator's port "
                    "take-over gives the sidecar (the policy's Service keeps reaching --http-port)")
    sc.add_argument("--metrics-port", type=port_number, default=env_port("BINBATCH_METRICS_PORT"),
                    help="Prometheus metrics port (default $BINBATCH_METRICS_PORT, else server.metricsPort; "
                    "fixed until restart)")
    sc.set_defaults(func=_sidecar)
