"""Every install path on a real API server: the CRD, the plain manifest, the Helm chart; and
``kubectl explain``, which reads the CRD's schema back from the server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_support import FIELD_MANAGER, Cluster, wait_for

from binbatch_operator import crd

pytestmark = pytest.mark.apiserver

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "binbatch"
INSTALL = ROOT / "manifests" / "install" / "binbatch.yaml"


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def operator_pods_admitted(cluster: Cluster, namespace: str) -> None:
    """The Deployment's ReplicaSet made its pods: Pod Security admitted them (no kubelet runs them)."""

    def pods() -> list[Any]:
        return cluster.core.list_namespaced_pod(namespace, label_selector="app.kubernetes.io/component=operator").items

    wait_for(f"the operator's pods in {namespace} (created by its ReplicaSet, admitted by Pod Security)",
             pods, timeout=60, diagnose=cluster.diagnostics)  # fmt: skip


def test_the_crd_applies_server_side(cluster: Cluster, crds: None) -> None:
    assert "serverside-applied (server dry run)" in cluster.apply(ROOT / crd.CRD_PATH, "--dry-run=server")
    stored = json.loads(cluster.kubectl("get", "crd", f"{crd.PLURAL}.{crd.GROUP}", "-o", "json"))
    conditions = {c["type"]: c["status"] for c in stored["status"]["conditions"]}
    assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True"
    assert stored["spec"]["versions"][0]["schema"] == crd.build_crd()["spec"]["versions"][0]["schema"]


def test_the_install_manifest_applies_server_side(cluster: Cluster, crds: None) -> None:
    text = INSTALL.read_text()
    (namespace,) = [d["metadata"]["name"] for d in documents(text) if d["kind"] == "Namespace"]

    def existing() -> dict[str, Any] | None:  # kubectl leaves managedFields out unless asked
        items = json.loads(cluster.kubectl("get", "namespaces", "--show-managed-fields", "-o", "json"))["items"]
        return next((ns for ns in items if ns["metadata"]["name"] == namespace), None)

    found = existing()
    owners = {m["manager"] for m in (found or {"metadata": {}})["metadata"].get("managedFields", [])
              if not m.get("subresource")}  # not the namespace controller's status while it deletes one  # fmt: skip
    if owners - {FIELD_MANAGER}:
        pytest.fail(f"namespace {namespace} already holds an install ({', '.join(sorted(owners))}): this test "
                    f"applies manifests/install/binbatch.yaml and deletes it again; use a server without one")  # fmt: skip
    if found and found["metadata"].get("deletionTimestamp"):  # this test's last run, still being deleted
        wait_for(f"namespace {namespace} deleted by this test's last run", lambda: existing() is None, timeout=120,
                 diagnose=cluster.diagnostics)  # fmt: skip
    # Everything but the CRDs goes at the end: deleting a CRD would delete every policy on the server.
    removable = yaml.safe_dump_all([d for d in documents(text) if d["kind"] != "CustomResourceDefinition"])
    try:
        cluster.apply(text)
        operator_pods_admitted(cluster, namespace)
        assert "(server dry run)" in cluster.apply(text, "--dry-run=server")  # and again, as a dry run
    finally:
        cluster.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-", stdin=removable)


def test_the_chart_installs_with_helm(cluster: Cluster, helm_release: str) -> None:
    import helm_python as helm

    operator_pods_admitted(cluster, helm_release)

    def leader_election_schema() -> dict[str, str] | None:  # its priority level exists: not Dangling
        (schema,) = json.loads(cluster.kubectl("get", "flowschemas", "-l", f"app.kubernetes.io/instance={helm_release}",
                                               "-o", "json"))["items"]  # fmt: skip
        conditions = {c["type"]: c["status"] for c in (schema.get("status") or {}).get("conditions") or []}
        return conditions if "Dangling" in conditions else None

    conditions = wait_for("the chart's FlowSchema's conditions", leader_election_schema, timeout=60,
                          diagnose=cluster.diagnostics)  # fmt: skip
    assert conditions["Dangling"] == "False"
    # The chart as Helm renders it for a second release, sent to the server as a dry run.
    with helm.Config(kubeconfig_path=cluster.kubeconfig, namespace=helm_release) as config, \
            helm.Chart.load(CHART) as chart:  # fmt: skip
        rendered = config.install(chart, f"{helm_release}-dry", namespace=helm_release, dry_run="server")
    kinds = {d["kind"] for d in documents(rendered["manifest"])}
    assert {"ClusterRole", "Deployment", "MutatingWebhookConfiguration", "Service"} <= kinds
    assert "(server dry run)" in cluster.apply(rendered["manifest"], "--dry-run=server")


@pytest.mark.parametrize(("field", "says"), [
    ("batchingpolicy.spec", "How to batch for the selected vLLM pods"),
    ("batchingpolicy.spec.sidecar.resources.limits", "Upper limit per resource name"),
])  # fmt: skip
def test_kubectl_explain_teaches_the_api(cluster: Cluster, crds: None, field: str, says: str) -> None:
    assert says in " ".join(cluster.kubectl("explain", field).split())
