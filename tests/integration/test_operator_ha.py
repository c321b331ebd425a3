"""Several operator replicas: kopf peering pauses all but one, yet every replica's
webhook answers from the current policies.

kopf runs here with ``--peering`` against kmock, with a live peer of higher
priority already in the ClusterKopfPeering (the leader).  A paused kopf stops
all its watch streams, so its ``policies`` index freezes; the webhook must still
inject the sidecar of a policy created while it was paused.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import json
from collections.abc import AsyncIterator
from typing import Any

import jsonpatch
import kopf
import pytest
from kopf._cogs.structs.credentials import Vault
from test_operator_kmock import (  # noqa: F401 - the cluster fixture
    DEADLINE, POLICIES, WEBHOOK_CONFIG, admission, ca_bundle, cluster, controller_pod, free_port, obj, policy_doc,
    until,
)

from binbatch_operator.builders import SIDECAR_CONTAINER

PEERING = "/apis/kopf.dev/v1/clusterkopfpeerings"


def leader(lifetime: int) -> dict[str, Any]:
    now = datetime.datetime.now(datetime.UTC).isoformat()
    return {"leader-pod": {"priority": 2**62, "lifetime": lifetime, "lastseen": now}}


@pytest.fixture
async def follower(cluster: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[int]:
    """An operator replica with peering, behind a live leader; yields its webhook port."""
    await cluster.post(PEERING, json={"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                                      "metadata": {"name": "binbatch"}, "status": leader(lifetime=600)})  # fmt: skip
    port = free_port()
    for name, value in {"BINBATCH_WEBHOOK_SERVICE": "binbatch-webhook", "POD_NAMESPACE": "binbatch-system",
                        "BINBATCH_WEBHOOK_CONFIG": WEBHOOK_CONFIG, "BINBATCH_WEBHOOK_PORT": str(port),
                        "BINBATCH_WEBHOOK_ADDRESS": "127.0.0.1", "BINBATCH_WEBHOOK_CERT_SECRET": "binbatch-webhook-cert",
                        "BINBATCH_SIDECAR_IMAGE": "registry.test/binbatch:1", "POD_ID": "follower-pod",
                        "BINBATCH_WEBHOOK_HOSTNAMES": "127.0.0.1"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    stop, ready, vault = asyncio.Event(), asyncio.Event(), Vault()
    task = asyncio.create_task(kopf.operator(clusterwide=True, peering_name="binbatch", stop_flag=stop,
                                             ready_flag=ready, vault=vault))  # fmt: skip
    await asyncio.wait_for(ready.wait(), DEADLINE)
    try:
        yield port
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, DEADLINE)
        await vault.close()


def peers(api: Any) -> dict[str, Any]:
    return (obj(api, "clusterkopfpeerings", "binbatch", None) or {}).get("status") or {}


async def test_a_paused_replica_still_injects_current_policies_and_takes_over_when_the_leader_goes(
    cluster: Any, follower: int
) -> None:
    api = cluster
    await until(lambda: "follower-pod" in peers(api), "the follower's keep-alive in the peering object")
    # Created while this replica is paused: its kopf index never sees it, no handler runs.
    await api.post(POLICIES, json=policy_doc("fast"))
    ca_pem = await until(lambda: ca_bundle(api), "the CA bundle")
    pod = controller_pod()
    response = await admission(follower, ca_pem, pod)
    assert response["allowed"] is True and "patch" in response, response
    patched = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(response["patch"])))
    assert [c["name"] for c in patched["spec"]["containers"]] == ["vllm", SIDECAR_CONTAINER]
    assert obj(api, "configmaps", "fast-binbatch") is None, "a paused replica must not reconcile"

    # The leader leaves (kopf removes itself from the status on exit): this replica resumes.
    await api.patch(f"{PEERING}/binbatch", json={"status": {"leader-pod": None}})
    await until(lambda: obj(api, "configmaps", "fast-binbatch"), "the follower to take over and reconcile")
    secret = obj(api, "secrets", "binbatch-webhook-cert", "binbatch-system")
    assert base64.b64decode(secret["data"]["tls.crt"]) == ca_pem
