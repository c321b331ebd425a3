"""Start a real sidecar in-process (gRPC and metrics on 127.0.0.1, port 0) in front
of an engine URL, for integration tests against the emulator and a real vLLM."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml
from prometheus_client.parser import text_string_to_metric_families

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc
from binbatch_sidecar.config import load_config
from binbatch_sidecar.server.app import Sidecar


def sidecar_config(engine_url: str, **sections: dict[str, Any]) -> dict[str, Any]:
    """A config document for ``engine_url``; ``sections`` override/extend the defaults."""
    doc: dict[str, Any] = {
        "engine": {"url": engine_url},
        "metrics": {"url": f"{engine_url}/metrics", "intervalMilliseconds": 100, "staleAfterMilliseconds": 2000},
        "server": {"grpcPort": 0, "httpPort": 0, "metricsPort": 0, "drainGraceSeconds": 10},
    }
    for name, values in sections.items():
        doc.setdefault(name, {}).update(values)
    return doc


class Running:
    def __init__(self, sidecar: Sidecar, channel: grpc.aio.Channel, path: Path) -> None:
        self.sidecar = sidecar
        self.channel = channel
        self.path = path
        self.inference = pb_grpc.InferenceStub(channel)
        self.admin = pb_grpc.AdminStub(channel)

    async def stats(self) -> pb.Stats:
        return await self.admin.GetStats(pb.GetStatsRequest())

    async def scrape(self) -> dict[str, Any]:
        """The sidecar's own /metrics over real HTTP, as families by name."""
        url = f"http://127.0.0.1:{self.sidecar.metrics_port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            assert resp.status == 200
            text = await resp.text()
        return {f.name: f for f in text_string_to_metric_families(text)}

    def write_config(self, doc: dict[str, Any]) -> None:
        self.path.write_text(yaml.safe_dump(doc))


@contextlib.asynccontextmanager
async def running_sidecar(doc: dict[str, Any], tmp_path: Path, **options: Any) -> AsyncIterator[Running]:
    """``options`` go to ``Sidecar`` (e.g. ``take_over_port=0``)."""
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump(doc))
    sidecar = Sidecar(load_config(path), config_path=str(path), host="127.0.0.1", **options)
    await sidecar.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}")
    try:
        yield Running(sidecar, channel, path)
    finally:
        await channel.close()
        if sidecar.dispatcher.accepting:
            await sidecar.stop(grace=5)


def prompt_request(i: int, max_tokens: int, **fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=f"request {i}: tell me something", max_tokens=max_tokens, ignore_eos=True, **fields)
