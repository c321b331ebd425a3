"""Several operator replicas: kopf peering pauses all but one, yet every replica's
webhook answers from the current policies.

First kopf runs in this process with ``--peering`` against kmock, with a live
peer of higher priority already in the ClusterKopfPeering (the leader).  A
paused kopf stops all its own watch streams; the operator's watches go on, so the
webhook injects the sidecar of a policy created while it was paused.  Then two
replicas run as processes, exactly as the chart's Deployment starts them: the
oldest leads, the other follows, both serve the one shared certificate and
inject, and the follower takes over within 15 s when the leader is killed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import helm_python
import jsonpatch
import kmock
import kopf
import pytest
import yaml
from kopf._cogs.structs.credentials import Vault  # no public name: kopf.operator(vault=) takes one, kopf exports none
from test_operator_kmock import (  # noqa: F401 - the cluster fixture
    DEADLINE, POLICIES, WEBHOOK_CONFIG, admission, ca_bundle, cluster, controller_pod, free_port, obj, policy_doc,
    until,
)

from binbatch_operator.builders import SIDECAR_CONTAINER
from binbatch_operator.leadership import LEASE_DURATION

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


class Replica:
    """One operator process started with the chart's command and environment."""

    def __init__(self, proc: asyncio.subprocess.Process, pod_id: str, hook_port: int) -> None:
        self.proc, self.pod_id, self.hook_port = proc, pod_id, hook_port
        self.lines: list[str] = []
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for line in self.proc.stderr:
            self.lines.append(line.decode(errors="replace"))

    def logged(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    async def stop(self) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(self.proc.wait(), DEADLINE)
        await self.reader
        return code


def chart_container() -> dict[str, Any]:
    chart = helm_python.Chart.load(Path(__file__).resolve().parents[2] / "charts" / "binbatch")
    text = chart.render({}, name="binbatch", namespace="binbatch-system", is_install=True)
    deployment = next(doc for path, body in text.items() if path.endswith("deployment.yaml")
                      for doc in yaml.safe_load_all(body) if doc)  # fmt: skip
    assert deployment["spec"]["replicas"] >= 2
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def replica_tmp(tmp_path: Path, pod_id: str) -> Path:
    """The replica's TMPDIR, where it writes the shared certificate's files for kopf's server."""
    folder = tmp_path / f"tmp-{pod_id}"
    folder.mkdir(exist_ok=True)
    return folder


async def start_replica(container: dict[str, Any], pod_id: str, tmp_path: Path) -> Replica:
    live_port, hook_port = free_port(), free_port()
    command = [f"--liveness=http://127.0.0.1:{live_port}/healthz" if a.startswith("--liveness=") else a
               for a in container["command"]]  # fmt: skip
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env |= {"POD_NAMESPACE": "binbatch-system", "POD_ID": pod_id, "BINBATCH_WEBHOOK_PORT": str(hook_port),
            "BINBATCH_WEBHOOK_ADDRESS": "127.0.0.1", "BINBATCH_WEBHOOK_CONFIG": WEBHOOK_CONFIG,
            "BINBATCH_WEBHOOK_HOSTNAMES": env["BINBATCH_WEBHOOK_HOSTNAMES"] + ",127.0.0.1",
            "BINBATCH_STATS_INTERVAL_SECONDS": "0.5", "KUBECONFIG": os.environ["KUBECONFIG"],
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": str(tmp_path),
            "TMPDIR": str(replica_tmp(tmp_path, pod_id))}  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *command, cwd=tmp_path, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    return Replica(proc, pod_id, hook_port)


async def injects(replica: Replica, ca_pem: bytes) -> bool:
    response = await admission(replica.hook_port, ca_pem, controller_pod())
    if "patch" not in response:
        return False
    patched = jsonpatch.apply_patch(controller_pod(), json.loads(base64.b64decode(response["patch"])))
    return [c["name"] for c in patched["spec"]["containers"]] == ["vllm", SIDECAR_CONTAINER]


async def test_two_chart_replicas_elect_the_oldest_both_inject_and_a_kill_hands_over_within_15_s(
    cluster: Any, tmp_path: Path
) -> None:
    """Issue 23: after the leader was killed, the follower took over only when kopf's 60 s peering
    lifetime ran out (38-61 s on a real API server); Kubernetes' own leader election needs about 15 s."""
    api, container = cluster, chart_container()
    first = await start_replica(container, "operator-a", tmp_path)
    second = None
    try:
        await until(lambda: "operator-a" in peers(api), "the first replica's keep-alive")
        second = await start_replica(container, "operator-b", tmp_path)
        await until(lambda: "operator-b" in peers(api), "the second replica's keep-alive")
        priorities = {pod: info["priority"] for pod, info in peers(api).items()}
        assert priorities["operator-a"] > priorities["operator-b"]  # the oldest leads

        await api.post(POLICIES, json=policy_doc("fast"))
        await until(lambda: obj(api, "configmaps", "fast-binbatch"), "the leader to reconcile")
        # One certificate for both (the shared Secret), and both webhooks inject the new policy.
        ca_pem = await until(lambda: ca_bundle(api), "the CA bundle")
        assert await injects(first, ca_pem) and await injects(second, ca_pem)
        assert not second.logged("Resuming operations")  # it follows: paused from its start

        first.proc.kill()  # kill -9: no goodbye in the peering object
        killed = time.monotonic()
        await until(lambda: second.logged("Resuming operations"), "the follower to take over")
        took = time.monotonic() - killed
        await api.post(POLICIES, json=policy_doc("second", grpc_port=50052, selector={"matchLabels": {"app": "web"}}))
        await until(lambda: obj(api, "configmaps", "second-binbatch"), "the new leader to reconcile")
        print(f"kill -9 of the leader: the follower took over after {took:.1f} s")
        assert took <= 15.0
        assert await injects(second, ca_pem)
    finally:
        for replica in (first, second):
            if replica is not None:
                await replica.stop()


async def test_a_leader_that_cannot_renew_its_lease_stops_before_the_follower_may_take_over(
    cluster: Any, tmp_path: Path
) -> None:
    """Issue 23: at 1,000 policies the leader's keep-alives came late, the follower resumed and the
    leader went on acting (kopf's leader never stops on its own): two replicas acted at once. Now a
    leader whose renewals fail exits within RENEW_DEADLINE, before a follower may take the Lease."""
    api, container = cluster, chart_container()
    first = await start_replica(container, "operator-a", tmp_path)
    second = None
    try:
        await api.post(POLICIES, json=policy_doc("fast"))
        await until(lambda: obj(api, "configmaps", "fast-binbatch"), "the first replica to lead")
        second = await start_replica(container, "operator-b", tmp_path)
        await until(lambda: "operator-b" in peers(api), "the second replica's keep-alive")

        api["patch", kmock.resource("coordination.k8s.io/v1/leases")] << 503  # every renewal fails from now on
        failing = time.monotonic()
        code = await asyncio.wait_for(first.proc.wait(), DEADLINE)
        stopped = time.monotonic() - failing
        print(f"renewals failing: the leader exited after {stopped:.1f} s")
        assert code == 1 and first.logged("could not renew the Lease")
        assert stopped < LEASE_DURATION  # before anyone may take the Lease
        assert not second.logged("Resuming operations")  # the follower cannot take it either
        # Neither leaves the certificate's private key behind: not the one that exited at once
        # (os._exit), nor the one stopped by SIGTERM.
        assert list(replica_tmp(tmp_path, "operator-a").iterdir()) == []
        assert list(replica_tmp(tmp_path, "operator-b").iterdir()) != []  # running: kopf's server reads them
        assert await second.stop() == 0
        assert list(replica_tmp(tmp_path, "operator-b").iterdir()) == []
    finally:
        for replica in (first, second):
            if replica is not None:
                await replica.stop()
