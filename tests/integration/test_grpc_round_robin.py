"""Client-side gRPC load balancing across sidecars: what the headless Service is for.

A headless Service's DNS name answers with every ready pod's address; a gRPC
channel on ``dns:///<svc>.<ns>.svc.cluster.local:50051`` with the ``round_robin``
policy connects to each and spreads its calls.  The test stands in for the DNS
answer with a multi-address ``ipv4:`` target (the same resolver result, without
a cluster), three real sidecars on 127.0.0.1 in front of one emulator, and real
gRPC.  The default policy, ``pick_first``, is also shown: one connection, one
sidecar, which is what a client behind a ClusterIP Service gets too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
from sidecar_harness import prompt_request, running_sidecar, sidecar_config

from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc
from binbatch_sidecar.emulator import EmulatorConfig, running_emulator

FAST = EmulatorConfig(step_a=0.001, step_c=0.0001, num_gpu_blocks=512, block_size=16)
SIDECARS = 3
CALLS = 30  # sequential: round_robin rotates over the ready subchannels call by call
BOUND_SECONDS = 60  # the whole run: three sidecars, one emulator, thirty calls
ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})  # what the docs tell clients to set


async def _served_by_each(tmp_path, options: list[tuple[str, str]]) -> list[int]:
    """Run ``CALLS`` Generate calls through one channel on all sidecars; requests each one accepted."""
    async with asyncio.timeout(BOUND_SECONDS), running_emulator(FAST) as url, contextlib.AsyncExitStack() as stack:
        sidecars = []
        for i in range(SIDECARS):
            folder = tmp_path / f"sidecar-{i}"
            folder.mkdir()
            doc = sidecar_config(url, server={"httpPort": 0})
            sidecars.append(await stack.enter_async_context(running_sidecar(doc, folder)))
        target = "ipv4:" + ",".join(f"127.0.0.1:{sc.sidecar.grpc_port}" for sc in sidecars)
        async with grpc.aio.insecure_channel(target, options=options) as channel:
            stub = pb_grpc.InferenceStub(channel)
            for i in range(CALLS):
                resp = await stub.Generate(prompt_request(i, 2), timeout=30)
                assert resp.completion_tokens == 2
        return [(await sc.stats()).totals.accepted for sc in sidecars]


async def test_round_robin_over_a_multi_address_target_reaches_every_sidecar(tmp_path):
    served = await _served_by_each(tmp_path, [("grpc.service_config", ROUND_ROBIN)])
    assert sum(served) == CALLS
    assert all(n > 0 for n in served), served
    print(f"round_robin: calls per sidecar {served}")  # for the report


async def test_the_default_pick_first_channel_pins_one_sidecar(tmp_path):
    """Why the docs ask for round_robin: without it one HTTP/2 connection carries every call."""
    served = await _served_by_each(tmp_path, [("grpc.lb_policy_name", "pick_first")])
    assert sorted(served) == [0] * (SIDECARS - 1) + [CALLS], served
