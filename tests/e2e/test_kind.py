"""End to end on kind: the image, the chart, a policy, a Generate call through it.

A kind cluster ``binbatch-e2e`` (its own kubeconfig, the user's is never touched)
gets the image built from this repository, the Helm chart installed with the real
Helm library (helm-python-sdk), and ``manifests/samples/cpu-emulator.yaml``.  Then:
the policy turns Ready and the emulator pod carries the ``binbatch-sidecar``
container; a ``Generate`` through ``kubectl port-forward`` to the policy's Service
(port ``grpc``) is answered; deleting the policy removes its ConfigMap and Service.
The cluster is deleted at the end, whatever happened.

Every wait polls the API server until a deadline; nothing sleeps to synchronise.
Skipped, with the reason, where docker (with a reachable daemon), kind or kubectl
is missing.  Run with ``make e2e``.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc
from kube_support import Cluster, run, wait_for

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "binbatch"
SAMPLE = ROOT / "manifests" / "samples" / "cpu-emulator.yaml"
CLUSTER = "binbatch-e2e"
IMAGE_REPOSITORY, IMAGE_TAG = "ghcr.io/binbatch/binbatch", "e2e"
IMAGE = f"{IMAGE_REPOSITORY}:{IMAGE_TAG}"
RELEASE, OPERATOR_NAMESPACE = "binbatch", "binbatch-system"
DEMO_NAMESPACE = "binbatch-e2e"
GROUP, VERSION, PLURAL = "binbatch.io", "v1alpha1", "batchingpolicies"
SIDECAR = "binbatch-sidecar"


def _missing_tools() -> str:
    """Why this machine cannot run the test ("" if it can)."""
    reasons = [f"{tool} is not on PATH" for tool in ("docker", "kind", "kubectl") if shutil.which(tool) is None]
    if shutil.which("docker"):
        try:
            probe = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=20)
        except subprocess.TimeoutExpired:
            reasons.append("`docker info` timed out (no reachable Docker daemon)")
        else:
            if probe.returncode != 0:
                detail = (probe.stderr.strip().splitlines() or ["no output"])[-1]
                reasons.append(f"`docker info` fails, no reachable Docker daemon ({detail})")
    return "kind e2e needs docker with a daemon, kind and kubectl: " + "; ".join(reasons) if reasons else ""


MISSING = _missing_tools()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(bool(MISSING), reason=MISSING)]


# ------------------------------------------------------------------ helpers


# What to print when a wait fails.
DIAGNOSE = (
    ("get", "pods", "--all-namespaces", "-o", "wide"),
    ("--namespace", DEMO_NAMESPACE, "get", "batchingpolicies,configmaps,services,events", "-o", "wide"),
    ("--namespace", DEMO_NAMESPACE, "get", "batchingpolicies", "-o", "yaml"),
    ("--namespace", DEMO_NAMESPACE, "describe", "pods"),
    ("--namespace", OPERATOR_NAMESPACE, "logs", f"deployment/{RELEASE}", "--tail", "150"),
)


@contextlib.contextmanager
def port_forward(cluster: Cluster, namespace: str, target: str, port: str, *, timeout: float = 60) -> Iterator[int]:
    """``kubectl port-forward`` to ``target``'s ``port`` (a name or number) on a free local port."""
    proc = subprocess.Popen(
        ["kubectl", "--kubeconfig", str(cluster.kubeconfig), "--namespace", namespace, "port-forward",
         "--address", "127.0.0.1", target, f":{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        seen = ""
        while not (match := re.search(r"Forwarding from 127\.0\.0\.1:(\d+)", seen)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"kubectl port-forward {target} :{port} printed no local port in {timeout}s: {seen}")
            if selector.select(timeout=remaining):
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:  # kubectl exited
                    pytest.fail(f"kubectl port-forward {target} :{port} exited {proc.wait()}: {seen}")
                seen += chunk.decode(errors="replace")
        yield int(match.group(1))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def sample_for_kind() -> tuple[str, list[dict[str, Any]]]:
    """The CPU sample with the engine on the image built here; the policy's name and the documents."""
    docs = [doc for doc in yaml.safe_load_all(SAMPLE.read_text()) if doc]
    for doc in docs:
        if doc["kind"] == "Deployment":
            for container in doc["spec"]["template"]["spec"]["containers"]:
                container["image"], container["imagePullPolicy"] = IMAGE, "Never"
    (policy,) = [d for d in docs if d["kind"] == "BatchingPolicy"]
    return policy["metadata"]["name"], docs


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    """A fresh kind cluster with the image built from this repository loaded into it."""
    kubeconfig = tmp_path_factory.mktemp("kind") / "kubeconfig"
    run("kind", "delete", "cluster", "--name", CLUSTER, timeout=300)  # a leftover from an aborted run
    try:
        run("kind", "create", "cluster", "--name", CLUSTER, "--kubeconfig", str(kubeconfig), "--wait", "180s",
            timeout=600)  # fmt: skip
        run("docker", "build", "--tag", IMAGE, str(ROOT), timeout=1800)
        run("kind", "load", "docker-image", IMAGE, "--name", CLUSTER, timeout=600)
        yield Cluster(kubeconfig, DIAGNOSE)
    finally:
        subprocess.run(["kind", "delete", "cluster", "--name", CLUSTER], capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def operator(cluster: Cluster) -> None:
    """The chart installed by the Helm library, with the operator Available."""
    import helm_python as helm

    values = {"image": {"tag": IMAGE_TAG, "pullPolicy": "Never"}}
    with helm.Config(kubeconfig_path=cluster.kubeconfig, namespace=OPERATOR_NAMESPACE) as config, \
            helm.Chart.load(CHART) as chart:  # fmt: skip
        try:
            config.install(chart, RELEASE, values, namespace=OPERATOR_NAMESPACE, create_namespace=True,
                           wait="watcher", timeout=300)  # fmt: skip
        except helm.HelmError as exc:
            pytest.fail(f"helm install failed: {exc}\n{cluster.diagnostics()}")

    def available():
        status = cluster.apps.read_namespaced_deployment(RELEASE, OPERATOR_NAMESPACE).status
        return (status.available_replicas or 0) >= 1

    wait_for("the operator Deployment to be Available", available, timeout=180, diagnose=cluster.diagnostics)


@pytest.fixture(scope="module")
def ready_policy(cluster: Cluster, operator: None) -> dict[str, Any]:
    """The CPU sample applied; returns once its policy is Ready and its pod runs the sidecar, ready."""
    from kubernetes import client

    name, docs = sample_for_kind()
    # The chart's webhook is opt-in per namespace (values webhook.namespaceSelector).
    labels = {"binbatch.io/inject": "enabled"}
    cluster.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=DEMO_NAMESPACE, labels=labels)))
    cluster.kubectl("--namespace", DEMO_NAMESPACE, "apply", "-f", "-", stdin=yaml.safe_dump_all(docs))

    def ready_condition():
        policy = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, DEMO_NAMESPACE, PLURAL, name)
        conditions = (policy.get("status") or {}).get("conditions") or []
        ready = [c for c in conditions if c["type"] == "Ready" and c["status"] == "True"]
        return policy if ready else None

    def injected_pod_ready():
        pods = cluster.core.list_namespaced_pod(DEMO_NAMESPACE, label_selector="app.kubernetes.io/name=vllm-emulator")
        for pod in pods.items:
            names = [c.name for c in pod.spec.containers]
            statuses = pod.status.container_statuses or []
            ready = bool(statuses) and all(s.ready for s in statuses)
            if pod.metadata.deletion_timestamp is None and SIDECAR in names and ready:
                return pod
        return None

    pod = wait_for(f"pod of policy {name} with a ready {SIDECAR}", injected_pod_ready, timeout=300,
                   diagnose=cluster.diagnostics)  # fmt: skip
    policy = wait_for(f"policy {name} to be Ready", ready_condition, timeout=180, diagnose=cluster.diagnostics)
    return {"name": name, "policy": policy, "pod": pod}


# ------------------------------------------------------------------ tests (in this order: the last deletes)


def test_policy_becomes_ready_and_its_pod_gets_the_sidecar(cluster, ready_policy):
    policy, pod = ready_policy["policy"], ready_policy["pod"]
    ready = [c for c in policy["status"]["conditions"] if c["type"] == "Ready"][0]
    assert ready["observedGeneration"] == policy["metadata"]["generation"]
    assert [c.name for c in pod.spec.containers] == ["engine", SIDECAR]
    config_map = cluster.core.read_namespaced_config_map(f"{ready_policy['name']}-binbatch", DEMO_NAMESPACE)
    assert "sidecar.yaml" in config_map.data


def test_generate_through_the_policys_service(cluster, ready_policy):
    service = f"{ready_policy['name']}-binbatch"
    with port_forward(cluster, DEMO_NAMESPACE, f"service/{service}", "grpc") as port:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            inference = pb_grpc.InferenceStub(channel)
            request = pb.GenerateRequest(prompt="request 1: tell me something", max_tokens=7, ignore_eos=True)
            response = inference.Generate(request, timeout=60)
    assert response.completion_tokens == 7
    assert response.finish_reason == "length"
    assert response.text and response.batch_size >= 1


def test_deleting_the_policy_removes_its_configmap_and_service(cluster, ready_policy):
    name = ready_policy["name"]
    child = f"{name}-binbatch"
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, DEMO_NAMESPACE, PLURAL, name)

    def children_gone():
        return (
            cluster.gone(cluster.custom.get_namespaced_custom_object, GROUP, VERSION, DEMO_NAMESPACE, PLURAL, name)
            and cluster.gone(cluster.core.read_namespaced_config_map, child, DEMO_NAMESPACE)
            and cluster.gone(cluster.core.read_namespaced_service, child, DEMO_NAMESPACE)
        )

    wait_for(f"policy {name}, ConfigMap and Service {child} to be deleted", children_gone, timeout=120,
             diagnose=cluster.diagnostics)  # fmt: skip
