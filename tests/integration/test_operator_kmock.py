"""The whole operator, run by kopf, against a fake Kubernetes API server (kmock).

kopf itself logs in (kubeconfig), discovers the resources, watches the
BatchingPolicies, runs our handlers and serves the admission webhook over HTTPS
on 127.0.0.1; the API seam talks to kmock over real HTTP.  Sidecar stats come
from a real sidecar in front of the engine emulator, over gRPC on 127.0.0.1.

What only a real API server proves (and these cannot): CRD schema and CEL
enforcement, strategic-merge semantics, owner-reference garbage collection,
the API server calling the webhook through the Service, kubelet mounting the
ConfigMap.  Those are the kind e2e suite's (tests/e2e).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import logging
import os
import re
import signal
import ssl
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import helm_python
import jsonpatch
import kmock
import kubernetes
import pytest
import yaml
from sidecar_harness import running_sidecar, sidecar_config

from binbatch_operator.builders import (
    CONFLICT_ANNOTATION,
    INJECTED_ANNOTATION,
    POLICY_LABEL,
    SIDECAR_CONTAINER,
    SIDECAR_HASH_ANNOTATION,
    build_network_policy,
)
from binbatch_operator.crd import GROUP, KIND, PLURAL, VERSION
from binbatch_operator.kube import RESTART_ANNOTATION
from binbatch_sidecar.bench.chaos_processes import free_port
from binbatch_sidecar.bench.fleet import kmock_emulator
from binbatch_sidecar.emulator import running_emulator

os.environ.setdefault("BINBATCH_STATS_INTERVAL_SECONDS", "0.5")  # read when main is imported
import binbatch_operator.indexes  # noqa: E402
import binbatch_operator.kube  # noqa: E402
import binbatch_operator.main  # noqa: E402,F401 - registers the handlers with kopf
import kopf  # noqa: E402
from kopf._cogs.structs.credentials import Vault  # noqa: E402 - no public name: kopf.operator(vault=) takes one, kopf exports none

NS = "llm"
WEBHOOK_CONFIG = "binbatch-test"
POLICIES = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}"
DEADLINE = 90.0  # an upper bound only (slow, shared runners): each wait ends as soon as its condition holds


async def until(check: Callable[[], Any], what: str) -> Any:
    """Poll ``check`` until it returns something truthy (the operator works asynchronously)."""
    deadline = time.monotonic() + DEADLINE
    while True:
        result = check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)  # ok-sleep: polling an eventually-consistent fake cluster, bounded


def obj(api: kmock.KubernetesEmulator, resource: str, name: str, namespace: str | None = NS) -> dict | None:
    for (res, ns, nm), found in api.objects.items():
        if str(res.plural) == resource and ns == namespace and nm == name and not found.deleted:
            return found.raw
    return None


@pytest.fixture
async def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    api = kmock_emulator()
    async with api, kmock.Server(api):
        kubeconfig = {
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": str(api.url).rstrip("/")}}],
            "users": [{"name": "kmock", "user": {"token": "test"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": NS}}],
        }  # fmt: skip
        path = tmp_path / "kubeconfig"
        path.write_text(yaml.safe_dump(kubeconfig))
        monkeypatch.setenv("KUBECONFIG", str(path))
        # The client library reads KUBECONFIG when imported; kopf's login uses it.
        monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
        await api.post(
            "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
            json={"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
                  "metadata": {"name": WEBHOOK_CONFIG},
                  "webhooks": [{"name": "inject-sidecar.binbatch.io", "sideEffects": "None",
                                "admissionReviewVersions": ["v1"], "clientConfig": {
                      "service": {"name": "binbatch-webhook", "namespace": "binbatch-system", "path": "/inject-sidecar"}}}]},
        )  # fmt: skip
        yield api


@pytest.fixture
async def operator(cluster: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[int]:
    """The operator running in this event loop; yields the webhook's port."""
    port = free_port()
    monkeypatch.setenv("BINBATCH_WEBHOOK_SERVICE", "binbatch-webhook")
    monkeypatch.setenv("POD_NAMESPACE", "binbatch-system")
    monkeypatch.setenv("BINBATCH_WEBHOOK_CONFIG", WEBHOOK_CONFIG)
    monkeypatch.setenv("BINBATCH_WEBHOOK_PORT", str(port))
    monkeypatch.setenv("BINBATCH_WEBHOOK_ADDRESS", "127.0.0.1")
    monkeypatch.setenv("BINBATCH_SIDECAR_IMAGE", "registry.test/binbatch:1")
    stop, ready = asyncio.Event(), asyncio.Event()
    vault = Vault()
    task = asyncio.create_task(
        kopf.operator(clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready, vault=vault)
    )
    await asyncio.wait_for(ready.wait(), DEADLINE)
    try:
        yield port
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, DEADLINE)
        # A timer that fires while kopf stops can open an API session after kopf
        # closed its credentials vault; in a process that exits it would not
        # matter, in a test session it would leak into the next test.
        await vault.close()


def policy_doc(name: str, grpc_port: int = 50051, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
        "metadata": {"name": name, "namespace": NS, "generation": 1, "uid": f"uid-{name}", "resourceVersion": "1"},
        "spec": {"selector": {"matchLabels": {"app": "vllm"}},
                 "sidecar": {"grpcPort": grpc_port, "metricsPort": 9090}, **spec},
    }  # fmt: skip


def condition(api: Any, name: str, kind: str) -> dict | None:
    found = obj(api, PLURAL, name) or {}
    return next((c for c in (found.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


async def admission(port: int, ca_pem: bytes, pod: dict[str, Any]) -> dict[str, Any]:
    """POST an AdmissionReview for a pod CREATE to the operator's webhook, as the API server would."""
    review = {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "req-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "resource": {"group": "", "version": "v1", "resource": "pods"},
                    "namespace": NS, "operation": "CREATE", "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
                    "object": pod, "dryRun": False},
    }  # fmt: skip
    tls = ssl.create_default_context(cadata=ca_pem.decode())
    url = f"https://127.0.0.1:{port}/inject-sidecar"
    async with aiohttp.ClientSession() as http, http.post(url, json=review, ssl=tls) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["response"]


def ca_bundle(api: Any) -> bytes | None:
    hook = obj(api, "mutatingwebhookconfigurations", WEBHOOK_CONFIG, None) or {}
    bundle = ((hook.get("webhooks") or [{}])[0].get("clientConfig") or {}).get("caBundle")
    return base64.b64decode(bundle) if bundle else None


def controller_pod(name: str = "vllm-7d4f-abcde") -> dict[str, Any]:
    """A pod as a ReplicaSet creates it: no namespace in the object (it is in the request)."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "vllm-7d4f-", "labels": {"app": "vllm"},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "vllm-7d4f",
                                          "uid": "rs-uid", "controller": True}]},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
    }  # fmt: skip


async def test_policy_gets_configmap_service_status_and_pods_get_the_sidecar(cluster: Any, operator: int) -> None:
    api = cluster
    await api.post(POLICIES, json=policy_doc("fast", bins={"mode": "Fixed", "count": 2, "boundaries": [128]}))

    cm = await until(lambda: obj(api, "configmaps", "fast-binbatch"), "the ConfigMap")
    config = yaml.safe_load(cm["data"]["sidecar.yaml"])
    assert config["bins"]["boundaries"] == [128]
    owner = cm["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (KIND, "fast", "uid-fast", True)
    svc = await until(lambda: obj(api, "services", "fast-binbatch"), "the Service")
    assert svc["spec"]["selector"] == {POLICY_LABEL: "fast"}
    assert svc["metadata"]["ownerReferences"][0]["uid"] == "uid-fast"
    ready = await until(lambda: condition(api, "fast", "Ready"), "a Ready condition")
    assert ready["status"] == "True", ready
    assert condition(api, "fast", "Valid")["status"] == "True"

    # The webhook: our CA was published into the configuration; a pod created
    # by a ReplicaSet (namespace only in the request) gets the sidecar.
    ca_pem = await until(lambda: ca_bundle(api), "the CA bundle in the webhook configuration")
    pod = controller_pod()
    response = await admission(operator, ca_pem, pod)
    assert response["allowed"] is True and response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    patched = jsonpatch.apply_patch(pod, ops)
    names = [c["name"] for c in patched["spec"]["containers"]]
    assert names == ["vllm", SIDECAR_CONTAINER]
    assert patched["spec"]["containers"][1]["image"] == "registry.test/binbatch:1"
    assert patched["metadata"]["labels"][POLICY_LABEL] == "fast"

    # A pod of another app is left alone.
    other = controller_pod() | {"metadata": {"labels": {"app": "web"}}}
    assert "patch" not in await admission(operator, ca_pem, other)

    # A spec change rewrites the ConfigMap (the sidecars reload the mounted file).
    change = {"spec": {"bins": {"boundaries": [64]}}, "metadata": {"generation": 2}}
    await api.patch(f"{POLICIES}/fast", json=change)

    def rewritten() -> dict | None:
        data = (obj(api, "configmaps", "fast-binbatch") or {}).get("data") or {}
        doc = yaml.safe_load(data.get("sidecar.yaml", "{}"))
        return doc if doc["bins"]["boundaries"] == [64] else None

    await until(rewritten, "the ConfigMap to follow the spec")


async def test_status_aggregates_a_real_sidecars_stats(cluster: Any, operator: int, tmp_path: Path) -> None:
    api = cluster
    async with running_emulator() as engine, running_sidecar(sidecar_config(engine), tmp_path) as sc:
        port = sc.sidecar.grpc_port
        await api.post(POLICIES, json=policy_doc("fast", grpc_port=port))
        await until(lambda: obj(api, "services", "fast-binbatch"), "the Service")
        pod = controller_pod("vllm-7d4f-abcde") | {}
        pod["metadata"] = {**pod["metadata"], "name": "vllm-7d4f-abcde", "namespace": NS,
                           "labels": {"app": "vllm", POLICY_LABEL: "fast"}}  # fmt: skip
        pod["status"] = {"phase": "Running", "podIP": "127.0.0.1"}
        await api.post(f"/api/v1/namespaces/{NS}/pods", json=pod)

        def reported() -> dict | None:
            status = (obj(api, PLURAL, "fast") or {}).get("status") or {}
            return status if status.get("pods") == 1 and status.get("batchSize") is not None else None

        status = await until(reported, "the sidecar's stats in status")
        stats = await sc.stats()
        assert status["batchSize"] == stats.target_batch_size
        metrics = next(c for c in status["conditions"] if c["type"] == "MetricsAvailable")
        assert metrics["status"] == "True", metrics

        # The pod's sidecar container predates a change of spec.sidecar: reported.
        await api.patch(f"/api/v1/namespaces/{NS}/pods/vllm-7d4f-abcde",
                        json={"metadata": {"annotations": {SIDECAR_HASH_ANNOTATION: "0123456789abcdef"}}})

        def outdated() -> dict | None:
            injected = condition(api, "fast", "SidecarsInjected")
            return injected if injected and injected["reason"] == "SidecarOutdated" else None

        assert "vllm-7d4f-abcde" in (await until(outdated, "SidecarOutdated"))["message"]


async def test_invalid_spec_is_reported_by_field_and_the_old_config_kept(cluster: Any, operator: int) -> None:
    api = cluster
    await api.post(POLICIES, json=policy_doc("fast"))
    good = await until(lambda: obj(api, "configmaps", "fast-binbatch"), "the ConfigMap")
    # kmock has no schema: this stands for what gets past the CRD (pydantic-only rules).
    bad = {"spec": {"batch": {"minBatchSize": 64, "staticSize": 8}}, "metadata": {"generation": 2}}
    await api.patch(f"{POLICIES}/fast", json=bad)

    def invalid() -> dict | None:
        valid = condition(api, "fast", "Valid")
        return valid if valid and valid["status"] == "False" else None

    valid = await until(invalid, "Valid=False")
    assert valid["reason"] == "InvalidSpec" and "spec.batch" in valid["message"], valid
    assert valid["observedGeneration"] == 2
    assert condition(api, "fast", "Ready")["status"] == "False"
    assert obj(api, "configmaps", "fast-binbatch")["data"] == good["data"]


async def test_two_policies_on_one_pod_are_reported_and_deletion_rolls_the_workload(
    cluster: Any, operator: int
) -> None:
    api = cluster
    await api.post(POLICIES, json=policy_doc("fast"))
    await api.post(POLICIES, json=policy_doc("slow"))
    ca_pem = await until(lambda: ca_bundle(api), "the CA bundle")

    def indexed() -> bool:
        return bool(obj(api, "services", "slow-binbatch") and obj(api, "services", "fast-binbatch"))

    await until(indexed, "both policies reconciled")
    response = await admission(operator, ca_pem, controller_pod())
    ops = json.loads(base64.b64decode(response["patch"]))
    patched = jsonpatch.apply_patch(controller_pod(), ops)
    assert patched["metadata"]["annotations"][CONFLICT_ANNOTATION] == "fast,slow"
    assert len(patched["spec"]["containers"]) == 1
    assert "fast, slow" in response["warnings"][0]

    # A pod 'fast' injected earlier, owned by ReplicaSet → Deployment.
    await deployment_with_replicaset(api)
    await api.post(f"/api/v1/namespaces/{NS}/pods", json=injected_pod("fast"))

    def conflict_seen() -> dict | None:
        injected = condition(api, "slow", "SidecarsInjected")
        return injected if injected and injected["reason"] == "SelectorConflict" else None

    injected = await until(conflict_seen, "the conflict in slow's status")
    assert "vllm-7d4f-abcde (also fast; runs the sidecar of fast)" in injected["message"]

    await api.delete(f"{POLICIES}/fast")
    await until(lambda: restarted(api), "the Deployment's rollout restart")
    await until(lambda: obj(api, PLURAL, "fast") is None, "the policy to go (finalizer released)")


def restarted(api: Any) -> str | None:
    deployment = obj(api, "deployments", "vllm") or {}
    annotations = deployment.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations") or {}
    return annotations.get(RESTART_ANNOTATION)


def injected_pod(policy: str) -> dict[str, Any]:
    """A pod of the 'vllm' Deployment into which ``policy``'s sidecar was injected."""
    pod = controller_pod()
    pod["metadata"] = {**pod["metadata"], "name": "vllm-7d4f-abcde", "namespace": NS,
                       "labels": {"app": "vllm", POLICY_LABEL: policy},
                       "annotations": {INJECTED_ANNOTATION: f"{policy}@1"}}  # fmt: skip
    pod["spec"]["containers"].append({"name": SIDECAR_CONTAINER, "image": "registry.test/binbatch:1"})
    return pod


async def deployment_with_replicaset(api: Any) -> None:
    await api.post("/apis/apps/v1/namespaces/llm/deployments",
                   json={"metadata": {"name": "vllm", "namespace": NS, "uid": "dep-uid"},
                         "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "template": {"metadata": {}}}})
    await api.post("/apis/apps/v1/namespaces/llm/replicasets",
                   json={"metadata": {"name": "vllm-7d4f", "namespace": NS, "ownerReferences": [
                       {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vllm", "uid": "dep-uid", "controller": True}]},
                         "spec": {"selector": {"matchLabels": {"app": "vllm"}}}})  # fmt: skip


async def test_the_pods_a_deletion_restarts_come_back_without_the_sidecar(cluster: Any, operator: int) -> None:
    """Defect 2: the rollout restart ran while the policy was still indexed, so the new pod got its sidecar again."""
    api = cluster
    doc = policy_doc("fast")
    # Another controller's finalizer keeps the policy (deletionTimestamp set) after ours is released.
    doc["metadata"]["finalizers"] = ["test.example/hold"]
    await api.post(POLICIES, json=doc)
    ca_pem = await until(lambda: ca_bundle(api), "the CA bundle")
    await until(lambda: obj(api, "services", "fast-binbatch"), "the policy reconciled")
    assert "patch" in await admission(operator, ca_pem, controller_pod())  # injected while the policy lives
    await deployment_with_replicaset(api)
    await api.post(f"/api/v1/namespaces/{NS}/pods", json=injected_pod("fast"))

    await api.delete(f"{POLICIES}/fast")
    await until(lambda: restarted(api), "the Deployment's rollout restart")
    assert obj(api, PLURAL, "fast")["metadata"]["deletionTimestamp"]  # still there, being deleted
    response = await admission(operator, ca_pem, controller_pod())  # the restart's new pod
    assert response["allowed"] is True and "patch" not in response, response


async def test_a_policy_with_a_dotted_or_longest_name_gets_valid_children_and_is_ready(
    cluster: Any, operator: int
) -> None:
    """Defect 5: '<name>-binbatch' is no Service name when the policy's name has dots or is long."""
    api = cluster
    dotted, longest = "llama-3.1.8b", ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])
    for name in (dotted, longest):
        await api.post(POLICIES, json=policy_doc(name))
    for name in (dotted, longest):
        ready = await until(lambda n=name: condition(api, n, "Ready"), f"{name[:20]}'s Ready condition")
        assert ready["status"] == "True", ready
    services = [o.raw for (res, _, _), o in api.objects.items() if str(res.plural) == "services" and not o.deleted]
    names = sorted(s["metadata"]["name"] for s in services)
    assert len(names) == 2 and all(len(n) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", n) for n in names), names
    for svc in services:
        cm = obj(api, "configmaps", svc["metadata"]["name"])
        assert cm is not None and cm["metadata"]["ownerReferences"] == svc["metadata"]["ownerReferences"]
        assert len(svc["spec"]["selector"][POLICY_LABEL]) <= 63


async def test_a_child_the_api_server_refuses_is_reported_in_status_and_retried(cluster: Any, operator: int) -> None:
    """Defect 5 (status side) and 4: a 422 on the Service left the policy without any status."""
    api = cluster
    message = 'Service "fast-binbatch" is invalid: spec.ports[0].port: Invalid value'
    # The kmock emulator drops a create a reaction refuses (as a real API server stores nothing),
    # so the operator's watch never shows the Service and each retry creates it again.
    refusal = {"kind": "Status", "code": 422, "message": message}
    api["post", kmock.resource("v1/services")] << 422 << refusal
    await api.post(POLICIES, json=policy_doc("fast"))

    def rejected() -> dict | None:
        valid = condition(api, "fast", "Valid")
        return valid if valid and valid["reason"] == "RejectedByApiServer" else None

    valid = await until(rejected, "the refusal in status")
    assert valid["status"] == "False" and f"Service fast-binbatch: 422 {message}" in valid["message"]
    assert condition(api, "fast", "Ready")["status"] == "False"
    assert obj(api, "configmaps", "fast-binbatch") is not None  # the other child is made all the same
    # Retried (with backoff), not given up on.
    await until(lambda: len(api["post", kmock.resource("v1/services")]) >= 3, "the Service create retried")


async def test_an_invalid_policy_posts_a_warning_event(cluster: Any, operator: int) -> None:
    """Defect 6: warnings never became Kubernetes Events, so `kubectl describe bp` showed nothing."""
    api = cluster
    await api.post(POLICIES, json=policy_doc("bad", batch={"minBatchSize": 64, "staticSize": 8}))

    def warning_event() -> Any:
        posts = api["post", kmock.resource("v1/events")]
        return next((r.data for r in posts if "invalid spec" in (r.data or {}).get("message", "")), None)

    event = await until(warning_event, "an Event POST for the invalid spec")
    assert event["type"] == "Warning" and "spec.batch" in event["message"]
    assert (event["involvedObject"]["kind"], event["involvedObject"]["name"]) == (KIND, "bad")


def is_watch(request: Any) -> bool:
    return request.params.get("watch") in ("true", "1", "True")


async def test_an_idle_policy_costs_no_api_request_and_logs_nothing(
    cluster: Any, operator: int, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23: each 15 s tick read the ConfigMap and the Service and listed the pods (12 requests a
    minute per idle policy), and kopf logged "Timer 'reconcile_policy' succeeded." on every tick.
    Now the policy's re-checks read the watches' indexes and say nothing unless something changes."""
    api = cluster
    checks = 0

    async def counted(*args: Any) -> Any:
        nonlocal checks
        checks += 1
        return await reconcile(*args)

    reconcile = binbatch_operator.main.reconcile
    monkeypatch.setattr(binbatch_operator.main, "reconcile", counted)
    await api.post(POLICIES, json=policy_doc("fast"))
    await until(lambda: (condition(api, "fast", "Ready") or {}).get("status") == "True", "Ready")
    def settled() -> bool:  # three re-checks in a row sent nothing: the first status writes are done
        nonlocal mark, since
        if len(list(api)) != mark:
            mark, since = len(list(api)), checks
        return checks - since >= 3

    mark, since = len(list(api)), checks
    await until(settled, "the status to settle")
    first, checks = len(list(api)), 0
    caplog.clear()
    with caplog.at_level(logging.INFO):
        await asyncio.sleep(6 * binbatch_operator.main.STATS_INTERVAL)  # ok-sleep: the idle window being measured
    window = [r for r in list(api)[first:] if not is_watch(r)]
    said = [r.getMessage() for r in caplog.records if r.name.startswith(("kopf", "binbatch"))]
    print(f"idle policy: {checks} re-checks, {len(window)} requests, {len(said)} log lines")
    assert checks >= 4, "the policy was not re-checked in the window"
    assert window == [], [(str(r.method), r.url.path) for r in window]
    assert said == []


async def test_a_namespace_being_deleted_is_left_quietly(cluster: Any, operator: int, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 23: in a namespace being deleted the timer kept trying to recreate the children
    (403 "because it is being terminated"), logging errors and retrying Events that the
    namespace refused as well.  Now the refusal is recognised: nothing is retried or logged."""
    api = cluster
    message = "unable to create new content in namespace llm because it is being terminated"
    refusal = {"kind": "Status", "code": 403, "reason": "Forbidden", "message": message,
               "details": {"causes": [{"reason": "NamespaceTerminating", "message": "namespace llm is being terminated",
                                       "field": "metadata.namespace"}]}}  # fmt: skip
    for plural in ("v1/configmaps", "v1/services", "v1/events"):
        api["post", kmock.resource(plural)] << 403 << refusal
    with caplog.at_level(logging.WARNING):
        await api.post(POLICIES, json=policy_doc("fast"))
        await until(lambda: len(api["post", kmock.resource("v1/configmaps")]) >= 1, "the ConfigMap's create")
        await asyncio.sleep(6 * binbatch_operator.main.STATS_INTERVAL)  # ok-sleep: the window in which retries would come
        await api.delete(f"{POLICIES}/fast")
        await until(lambda: obj(api, PLURAL, "fast") is None, "the policy to go (finalizer released)")
    creates = len(api["post", kmock.resource("v1/configmaps")]) + len(api["post", kmock.resource("v1/services")])
    assert creates == 1, f"{creates} creates: the refused children were retried"
    assert len(api["post", kmock.resource("v1/events")]) == 0
    assert [r.getMessage() for r in caplog.records if r.name.startswith(("kopf", "binbatch"))] == []


async def test_the_charts_operator_command_runs_as_a_process(cluster: Any, tmp_path: Path) -> None:
    """`kopf run -m binbatch_operator.main ...` exactly as the chart's Deployment says,
    from a directory without the source tree (where `operator/` cannot shadow the
    standard library), with the chart's env: liveness answers, a policy is served,
    and SIGTERM ends it cleanly."""
    chart = helm_python.Chart.load(Path(__file__).resolve().parents[2] / "charts" / "binbatch")
    text = chart.render({}, name="binbatch", namespace="binbatch-system", is_install=True)
    deployment = next(doc for path, body in text.items() if path.endswith("deployment.yaml")
                      for doc in yaml.safe_load_all(body) if doc)  # fmt: skip
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    live_port, hook_port = free_port(), free_port()
    command = [f"--liveness=http://127.0.0.1:{live_port}/healthz" if a.startswith("--liveness=") else a
               for a in container["command"]]  # fmt: skip
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env |= {"POD_NAMESPACE": "binbatch-system", "BINBATCH_WEBHOOK_PORT": str(hook_port),
            "BINBATCH_WEBHOOK_ADDRESS": "127.0.0.1", "BINBATCH_WEBHOOK_CONFIG": WEBHOOK_CONFIG, "KUBECONFIG": os.environ["KUBECONFIG"],
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "HOME": str(tmp_path)}  # fmt: skip
    # The chart's default is two replicas with kopf peering: the operator makes its peering object.
    peering = next(a.split("=", 1)[1] for a in command if a.startswith("--peering="))
    proc = await asyncio.create_subprocess_exec(
        *command, cwd=tmp_path, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    try:
        await cluster.post(POLICIES, json=policy_doc("fast"))
        await until(lambda: obj(cluster, "configmaps", "fast-binbatch"), "the ConfigMap from the process")
        await until(lambda: ca_bundle(cluster), "the CA bundle from the process")
        # The built-in certificate is the one kept in the shared Secret.
        secret = await until(lambda: obj(cluster, "secrets", env["BINBATCH_WEBHOOK_CERT_SECRET"], "binbatch-system"),
                             "the shared certificate Secret")  # fmt: skip
        assert base64.b64decode(secret["data"]["tls.crt"]) == ca_bundle(cluster)
        # It leads: its keep-alive is in the peering object it created.
        await until(lambda: (obj(cluster, "clusterkopfpeerings", peering, None) or {}).get("status"), "a keep-alive")
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{live_port}/healthz") as resp:
            assert resp.status == 200
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(proc.communicate(), DEADLINE)
    assert proc.returncode == 0, stderr.decode()[-2000:]


async def test_injection_fails_open() -> None:
    """An error inside the webhook handler admits the pod unchanged, with a warning."""
    patch, warnings = kopf.Patch(), []
    broken_memo = kopf.Memo()  # no ctx: as if start-up had not finished
    await binbatch_operator.main.inject_sidecar(
        body=kopf.Body(controller_pod()), patch=patch, warnings=warnings, memo=broken_memo,
        logger=logging.getLogger("test"),
    )  # fmt: skip
    assert dict(patch) == {}
    assert "pod admitted without it" in warnings[0]


async def test_a_policys_missing_model_configmap_is_reported_and_its_pods_mount_the_key(cluster: Any, operator: int) -> None:
    """spec.predictor.model: the ConfigMap is not there, so ModelReady says so naming the field;
    a pod created meanwhile still gets the sidecar, with the key mounted (optional) as its warm start."""
    api = cluster
    model = {"configMapKeyRef": {"name": "lengths", "key": "model"}}
    await api.post(POLICIES, json=policy_doc("learned", predictor={"kind": "Learned", "model": model}))
    missing = await until(lambda: condition(api, "learned", "ModelReady"), "a ModelReady condition")
    assert (missing["status"], missing["reason"]) == ("False", "ModelNotFound"), missing
    assert missing["message"].startswith("spec.predictor.model: ConfigMap lengths not found in namespace")
    cm = await until(lambda: obj(api, "configmaps", "learned-binbatch"), "the ConfigMap")
    config = yaml.safe_load(cm["data"]["sidecar.yaml"])
    assert config["predictor"] == {"kind": "Learned", "warmStart": "/etc/binbatch-model/model.npz", "warmStartOptional": True}
    ca_pem = await until(lambda: ca_bundle(api), "the CA bundle in the webhook configuration")
    pod = controller_pod()
    response = await admission(operator, ca_pem, pod)
    patched = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(response["patch"])))
    volume = next(v for v in patched["spec"]["volumes"] if v["name"] == "binbatch-model")
    assert volume["configMap"] == {"name": "lengths", "items": [{"key": "model", "path": "model.npz"}], "optional": True}
    mount = next(m for m in patched["spec"]["containers"][1]["volumeMounts"] if m["name"] == "binbatch-model")
    assert mount == {"name": "binbatch-model", "mountPath": "/etc/binbatch-model", "readOnly": True}


async def test_a_foreign_object_under_a_childs_name_is_never_patched_adopted_or_deleted(
    cluster: Any, operator: int
) -> None:
    """No confused deputy: a create that meets someone else's `x-binbatch` ConfigMap (409) used to
    patch it and add the policy's owner reference, so deleting the policy garbage-collected it.
    Now it is left as it was, the policy says ChildConflict naming it, and no pod mounts it."""
    api = cluster
    foreign = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x-binbatch", "namespace": NS},
               "data": {"sidecar.yaml": "someone else's"}}  # fmt: skip
    await api.post(f"/api/v1/namespaces/{NS}/configmaps", json=foreign)
    await api.post(POLICIES, json=policy_doc("x"))
    ca_pem = await until(lambda: ca_bundle(api), "the CA bundle")

    def conflict() -> dict | None:
        ready = condition(api, "x", "Ready")
        return ready if ready and ready["reason"] == "ChildConflict" else None

    ready = await until(conflict, "Ready=False ChildConflict")
    assert ready["status"] == "False" and f"ConfigMap {NS}/x-binbatch already exists" in ready["message"], ready
    await until(lambda: obj(api, "services", "x-binbatch"), "the policy's own Service")  # made all the same
    left = obj(api, "configmaps", "x-binbatch")
    assert left["data"] == foreign["data"] and not left["metadata"].get("ownerReferences"), left
    assert left["metadata"].get("labels") in (None, {}), left
    assert len(api["patch", kmock.resource("v1/configmaps")]) == 0
    # The webhook does not mount a ConfigMap the policy does not own.
    response = await until_admitted_without_patch(operator, ca_pem)
    assert "does not own its children" in response["warnings"][0], response

    await api.delete(f"{POLICIES}/x")
    await until(lambda: obj(api, PLURAL, "x") is None, "the policy to go (finalizer released)")
    after = obj(api, "configmaps", "x-binbatch")
    assert after is not None and after["data"] == foreign["data"] and not after["metadata"].get("ownerReferences")
    assert len(api["delete", kmock.resource("v1/configmaps")]) == 0
    assert len(api["patch", kmock.resource("v1/configmaps")]) == 0


async def until_admitted_without_patch(port: int, ca_pem: bytes) -> dict[str, Any]:
    """The webhook's answer once its watch has the policy's status (it may lag the status write)."""
    deadline = time.monotonic() + DEADLINE
    while True:
        response = await admission(port, ca_pem, controller_pod())
        if "patch" not in response and response.get("warnings"):
            return response
        assert time.monotonic() < deadline, f"the webhook kept injecting: {response}"
        await asyncio.sleep(0.05)  # ok-sleep: polling the webhook's eventually-consistent view, bounded


async def test_a_policy_asking_for_an_image_or_url_the_install_does_not_allow_is_refused(
    cluster: Any, operator: int
) -> None:
    """The operator as started (BINBATCH_ALLOWED_IMAGES unset: its sidecar image's repository only,
    URLs on the pod's loopback): a policy naming another image or a remote engine is Valid=False
    naming the field, gets no children, and the webhook injects nothing with it."""
    api = cluster
    await api.post(POLICIES, json=policy_doc("evil", sidecar={"grpcPort": 50051, "image": "docker.io/x/miner:1"},
                                             engine={"url": "http://collector.example:8000"}))  # fmt: skip
    ca_pem = await until(lambda: ca_bundle(api), "the CA bundle")

    def invalid() -> dict | None:
        valid = condition(api, "evil", "Valid")
        return valid if valid and valid["status"] == "False" else None

    message = (await until(invalid, "Valid=False"))["message"]
    assert "spec.sidecar.image: 'docker.io/x/miner:1' is not allowed" in message, message
    assert "spec.engine.url: must name the pod's loopback" in message, message
    assert obj(api, "configmaps", "evil-binbatch") is None and obj(api, "services", "evil-binbatch") is None
    response = await until_admitted_without_patch(operator, ca_pem)
    assert "policy evil is invalid (spec.sidecar.image" in response["warnings"][0], response


async def test_what_the_operator_writes_is_in_its_store_before_any_watch_brings_it(cluster: Any) -> None:
    """A re-check that runs before the watch's event for a write compares with what was written: no second write.

    No informer runs here, so only the write itself can have put the object into the store."""
    api = cluster
    kube = binbatch_operator.kube.KubeApi.for_host(str(api.url).rstrip("/"))
    watched = binbatch_operator.indexes.Watched(candidate=dict)
    kube.wrote = watched.written
    key = ("NetworkPolicy", "fast-binbatch")

    def stored() -> dict[str, Any] | None:
        return watched.children(NS, [key]).get(key)

    first = build_network_policy("fast", NS, {"sidecar": {"allowFrom": [{"podSelector": {}}]}})
    first["metadata"]["ownerReferences"] = [{"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": "fast",
                                             "uid": "uid-fast", "controller": True}]  # fmt: skip
    changed = copy.deepcopy(first)
    changed["spec"]["ingress"][0]["from"] = [{"namespaceSelector": {"matchLabels": {"team": "gateway"}}}]
    try:
        assert await kube.ensure(first, stored()) == "created"
        assert await kube.ensure(first, stored()) == "unchanged"
        assert await kube.ensure(changed, stored()) == "updated"
        assert stored()["spec"]["ingress"][0]["from"] == changed["spec"]["ingress"][0]["from"]
        assert await kube.ensure(changed, stored()) == "unchanged"
    finally:
        kube.close()
    resource = kmock.resource("networking.k8s.io/v1/networkpolicies")
    assert (len(api["post", resource]), len(api["patch", resource]), len(api["get", resource])) == (1, 1, 0)


async def test_each_policy_gets_its_own_network_policy_named_in_its_status(
    cluster: Any, operator: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """networkPolicy.enabled (the default): only spec.sidecar.allowFrom reaches the injected pods' sidecars."""
    api = cluster
    allow = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}]
    await api.post(POLICIES, json=policy_doc("fast", sidecar={"grpcPort": 50051, "allowFrom": allow}))

    def named() -> str | None:
        return ((obj(api, PLURAL, "fast") or {}).get("status") or {}).get("networkPolicy")

    assert await until(named, "status.networkPolicy") == "fast-binbatch"
    policy = obj(api, "networkpolicies", "fast-binbatch")
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-fast"
    assert policy["spec"]["podSelector"] == {"matchLabels": {POLICY_LABEL: "fast"}}
    assert policy["spec"]["ingress"][0]["from"] == allow
    # A change of allowFrom follows; written once, not again on every re-check.
    await api.patch(f"{POLICIES}/fast", json={"spec": {"sidecar": {"allowFrom": [{"podSelector": {}}]}},
                                              "metadata": {"generation": 2}})  # fmt: skip

    def followed() -> bool:
        current = obj(api, "networkpolicies", "fast-binbatch") or {}
        return current.get("spec", {}).get("ingress", [{}])[0].get("from") == [{"podSelector": {}}]

    await until(followed, "the NetworkPolicy to follow allowFrom")
    patches = len(api["patch", kmock.resource("networking.k8s.io/v1/networkpolicies")])
    checks = binbatch_operator.main.reconcile_once
    seen_checks = 0

    async def counted(*args: Any) -> Any:
        nonlocal seen_checks
        seen_checks += 1
        return await checks(*args)

    monkeypatch.setattr(binbatch_operator.main, "reconcile_once", counted)
    await until(lambda: seen_checks >= 3, "three more re-checks")
    assert len(api["patch", kmock.resource("networking.k8s.io/v1/networkpolicies")]) == patches


@pytest.fixture
def admin_signing_secret(monkeypatch: pytest.MonkeyPatch) -> str:
    """The chart's BINBATCH_ADMIN_SIGNING_SECRET (requested before ``operator``, which reads it at start)."""
    monkeypatch.setenv("BINBATCH_ADMIN_SIGNING_SECRET", "binbatch-admin-signing")
    return "binbatch-admin-signing"


def operator_public_key(api: Any, secret: str) -> str | None:
    from binbatch_sidecar.engine.admin_token import load_private_pem, public_pem

    stored = obj(api, "secrets", secret, "binbatch-system")
    if not stored:
        return None
    return public_pem(load_private_pem(base64.b64decode(stored["data"]["ed25519.pem"])))


async def test_spec_auth_mounts_its_secrets_and_every_configmap_names_the_operators_key(
    admin_signing_secret: str, cluster: Any, operator: int
) -> None:
    api = cluster
    public = await until(lambda: operator_public_key(api, admin_signing_secret), "the operator's signing Secret")
    auth = {"callerTokensSecretRef": {"name": "callers"}, "adminTokenSecretRef": {"name": "dash", "key": "token"},
            "callers": [{"name": "team-a", "allowHints": False}]}  # fmt: skip
    await api.post(POLICIES, json=policy_doc("locked", auth=auth))
    cm = await until(lambda: obj(api, "configmaps", "locked-binbatch"), "the ConfigMap")
    assert yaml.safe_load(cm["data"]["sidecar.yaml"])["auth"] == {
        "callerTokensDir": "/var/run/binbatch/caller-tokens", "adminTokenFile": "/var/run/binbatch/admin-token/admin-token",
        "callers": [{"name": "team-a", "allowHints": False}], "operatorPublicKeys": [public], "audience": f"{NS}/locked",
    }  # fmt: skip
    ca_pem = await until(lambda: ca_bundle(api), "the CA bundle in the webhook configuration")
    pod = controller_pod()
    response = await admission(operator, ca_pem, pod)
    patched = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(response["patch"])))
    volumes = {v["name"]: v for v in patched["spec"]["volumes"]}
    assert volumes["binbatch-caller-tokens"]["secret"]["secretName"] == "callers"
    assert volumes["binbatch-admin-token"]["secret"]["items"] == [{"key": "token", "path": "admin-token"}]
    mounts = {m["name"]: m for m in patched["spec"]["containers"][1]["volumeMounts"]}
    assert mounts["binbatch-caller-tokens"]["readOnly"] and mounts["binbatch-admin-token"]["readOnly"]


async def test_the_operator_reaches_a_sidecars_admin_off_loopback_with_its_signed_token(
    admin_signing_secret: str, cluster: Any, operator: int, tmp_path: Path
) -> None:
    """The sidecar trusts the operator's key (from its signing Secret) for the policy's audience, as the
    ConfigMap the operator renders says, and its Admin gate is told no peer is on loopback: the status
    still gets its stats, through the operator's signed token."""
    api = cluster
    public = await until(lambda: operator_public_key(api, admin_signing_secret), "the operator's signing Secret")
    auth = {"operatorPublicKeys": [public], "audience": f"{NS}/signed"}
    async with running_emulator() as engine, running_sidecar(sidecar_config(engine, auth=auth), tmp_path) as sc:
        sc.sidecar.admin_gate.is_loopback = lambda peer: False
        refused = sc.sidecar.metrics.registry.get_sample_value
        await api.post(POLICIES, json=policy_doc("signed", grpc_port=sc.sidecar.grpc_port))
        pod = controller_pod() | {}
        pod["metadata"] = {**pod["metadata"], "name": "vllm-signed", "namespace": NS,
                           "labels": {"app": "vllm", POLICY_LABEL: "signed"}}  # fmt: skip
        pod["status"] = {"phase": "Running", "podIP": "127.0.0.1"}
        await api.post(f"/api/v1/namespaces/{NS}/pods", json=pod)

        def reported() -> dict | None:
            status = (obj(api, PLURAL, "signed") or {}).get("status") or {}
            return status if status.get("pods") == 1 and status.get("batchSize") is not None else None

        status = await until(reported, "the sidecar's stats in status, asked with a signed token")
        assert refused("binbatch_unauthenticated_total", {"door": "admin"}) == 0
        cm = obj(api, "configmaps", "signed-binbatch")
        assert yaml.safe_load(cm["data"]["sidecar.yaml"])["auth"] == auth  # what the sidecar was given
        sc.sidecar.admin_gate.is_loopback = lambda peer: True
        assert status["batchSize"] == (await sc.stats()).target_batch_size
