"""The operator's fleet model round against real sidecars (gRPC on 127.0.0.1, the engine emulator):
two sidecars serve requests, one round gathers both their records with ``ExportTrainingRecords``,
fits and publishes the model in a ConfigMap, and a third sidecar that mounts that file predicts from
it.  The API seam is a small in-memory one; no cluster."""

from __future__ import annotations

import asyncio
import base64
import logging

from sidecar_harness import running_sidecar, sidecar_config

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_operator.builders import FLEET_MODEL_KEY
from binbatch_operator.crd import FleetSpec
from binbatch_operator.fleet_model import FleetModels
from binbatch_sidecar.emulator import EmulatorConfig, running_emulator

FAST = EmulatorConfig(step_a=0.0002, step_c=0.0001, num_gpu_blocks=1024, block_size=16)
CAP = 400


def _prompt(i: int) -> str:
    return f"write a long essay about thing {i}" if i % 2 else f"yes or no: is thing {i} blue?"


async def _serve(sc, first: int, n: int) -> None:
    async def one(i: int) -> None:
        await sc.inference.Generate(pb.GenerateRequest(prompt=_prompt(i), max_tokens=300 if i % 2 else 3,
                                                       ignore_eos=True), timeout=60)  # fmt: skip

    await asyncio.gather(*(one(i) for i in range(first, first + n)))


class Kube:
    def __init__(self) -> None:
        self.objects: dict[str, dict] = {}

    async def ensure(self, obj, current):
        self.objects[obj["metadata"]["name"]] = obj
        return "created"


async def test_one_round_publishes_a_model_from_every_sidecar_that_a_new_sidecar_predicts_from(tmp_path):
    body = {"metadata": {"name": "chat", "namespace": "llm", "uid": "u1"}, "apiVersion": "binbatch.io/v1alpha1",
            "kind": "BatchingPolicy", "status": {}}  # fmt: skip
    settings = FleetSpec(enabled=True, max_records=1000)
    kube, fleet = Kube(), FleetModels(seed=1)
    for name in "abc":
        (tmp_path / name).mkdir()
    async with running_emulator(FAST) as url:
        async with running_sidecar(sidecar_config(url), tmp_path / "a") as a, \
                running_sidecar(sidecar_config(url), tmp_path / "b") as b:  # fmt: skip
            await asyncio.gather(_serve(a, 0, 160), _serve(b, 1000, 160))
            pods = {"llm/a": f"127.0.0.1:{a.sidecar.grpc_port}", "llm/b": f"127.0.0.1:{b.sidecar.grpc_port}"}
            await fleet.round(kube, body, settings, pods, logging.getLogger("t"))
        state = fleet.state("llm", "chat")
        assert state.failure == "" and state.published is not None and state.published.version == 1
        assert state.train.seen + state.held.seen == 320 and state.published.kendall_tau is not None
        assert {pod: cursor[1] for pod, cursor in state.cursors.items()} == {"llm/a": 160, "llm/b": 160}
        path = tmp_path / "model" / "model.npz"
        path.parent.mkdir()
        path.write_bytes(base64.b64decode(kube.objects["chat-binbatch-model"]["binaryData"][FLEET_MODEL_KEY]))
        doc = sidecar_config(url, predictor={"kind": "Learned", "warmStart": str(path), "warmStartOptional": True})
        async with running_sidecar(doc, tmp_path / "c") as c:
            [loaded] = (await c.scrape())["binbatch_predictor_model_loaded"].samples
            assert loaded.value == 1
            long, short = [
                (await c.inference.Generate(pb.GenerateRequest(prompt=_prompt(i), max_tokens=CAP, ignore_eos=True),
                                            timeout=60)).predicted_output_tokens for i in (5001, 5002)]  # fmt: skip
            assert long > 10 * short
