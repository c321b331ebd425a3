"""Pure builders: BatchingPolicy spec → the objects the operator creates, as dicts.

So far: the sidecar's config file (the ConfigMap's one key).  The batching
sections of the spec are copied as they are (they share the sidecar config's
schema, see ``crd.py``); ``server`` is rendered from ``spec.sidecar``.  The
result is validated with the sidecar's own loader, so the operator refuses
exactly what the sidecar would, and names the field as ``spec.<path>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from binbatch_sidecar.config import ConfigError, parse_config

from .crd import CONFIG_SECTIONS

CONFIG_KEY = "sidecar.yaml"


def sidecar_config(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The sidecar config document for ``spec``; raises ConfigError naming ``spec.<field>``."""
    doc: dict[str, Any] = {name: dict(spec[name]) for name in CONFIG_SECTIONS if spec.get(name) is not None}
    side = spec.get("sidecar") or {}
    doc["server"] = {
        "grpcPort": side.get("grpcPort", 50051),
        "metricsPort": side.get("metricsPort", 9090),
        "drainGraceSeconds": side.get("drainGraceSeconds", 30),
    }
    try:
        parse_config(doc)
    except ConfigError as exc:
        problems = [(_spec_path(path), message) for path, message in exc.problems]
        raise ConfigError(problems) from None
    return doc


def _spec_path(path: str) -> str:
    """``server.grpcPort`` → ``spec.sidecar.grpcPort``; ``batch.x`` → ``spec.batch.x``."""
    if path.startswith("server."):
        return "spec.sidecar." + path.removeprefix("server.")
    return "spec." + path
