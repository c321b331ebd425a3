"""Upgrade and uninstall as the README's "Operate and uninstall" section tells them, on a real API server.

The BatchingPolicy CRD is cluster-wide and other tests (and other people) use it on the same
server, so this test never swaps its schema under them: it installs the previous release's CRD
(``fixtures/batchingpolicies-7244d3b.yaml``) and this release's under an API group and kind of its
own (``<namespace>.binbatch.io``, ``BbtUpgrade``).  The schema, its defaults and its rules are the
real ones; only the names differ.  The chart is a copy of charts/binbatch whose ``crds/`` holds that
CRD, so Helm's handling of ``crds/`` is the one users get.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import CHART
from kube_support import Cluster, temporary_namespace, wait_for

pytestmark = pytest.mark.apiserver

OLD_CRD = Path(__file__).parent / "fixtures" / "batchingpolicies-7244d3b.yaml"
NEW_CRD = CHART / "crds" / "batchingpolicies.binbatch.io.yaml"
VERSION = "v1alpha1"
PLURAL, KIND = "bbtupgrades", "BbtUpgrade"
SELECTOR = {"matchLabels": {"app": "vllm"}}
MODEL = {"configMapKeyRef": {"name": "predictor-model", "key": "model.json"}}


def renamed(path: Path, group: str) -> dict[str, Any]:
    """The CRD at ``path`` under ``group`` and the kind ``BbtUpgrade``: same schema, names of this test's own."""
    crd = copy.deepcopy(yaml.safe_load(path.read_text()))
    assert crd["spec"]["group"] == "binbatch.io" and len(crd["spec"]["versions"]) == 1, path
    crd["metadata"] = {"name": f"{PLURAL}.{group}"}
    crd["spec"]["group"] = group
    crd["spec"]["names"] = {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": "bbtupgrade"}
    return crd


def chart_with_crd(folder: Path, crd: dict[str, Any]) -> Path:
    """A copy of the chart whose ``crds/`` holds ``crd`` only."""
    chart = folder / "binbatch"
    shutil.copytree(CHART, chart)
    shutil.rmtree(chart / "crds")
    (chart / "crds").mkdir()
    (chart / "crds" / f"{crd['metadata']['name']}.yaml").write_text(yaml.safe_dump(crd, sort_keys=False))
    return chart


def schema_has(cluster: Cluster, name: str, *path: str) -> bool:
    crd = cluster.api.sanitize_for_serialization(
        _extensions(cluster).read_custom_resource_definition(name))  # fmt: skip
    node = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for key in path:
        node = (node.get("properties") or {}).get(key)
        if node is None:
            return False
    return True


def _extensions(cluster: Cluster) -> Any:
    from kubernetes import client

    return client.ApiextensionsV1Api(cluster.api)


def test_upgrade_applies_the_crd_first_then_helm_upgrade_and_uninstall_leaves_nothing(
    cluster: Cluster, crds: None, tmp_path: Path
) -> None:
    import helm_python as helm
    from kubernetes.client.exceptions import ApiException

    with temporary_namespace(cluster, {"pod-security.kubernetes.io/enforce": "restricted"}) as ns:
        group, release = f"{ns}.binbatch.io", ns
        crd_name = f"{PLURAL}.{group}"
        old_chart = chart_with_crd(tmp_path / "old", renamed(OLD_CRD, group))
        new_chart = chart_with_crd(tmp_path / "new", renamed(NEW_CRD, group))

        def get(name: str) -> dict[str, Any]:
            return cluster.custom.get_namespaced_custom_object(group, VERSION, ns, PLURAL, name)

        def create(name: str, spec: dict[str, Any]) -> dict[str, Any]:
            body = {"apiVersion": f"{group}/{VERSION}", "kind": KIND, "metadata": {"name": name}, "spec": spec}
            return cluster.custom.create_namespaced_custom_object(group, VERSION, ns, PLURAL, body,
                                                                  field_validation="Strict")  # fmt: skip

        installed = False
        try:
            with helm.Config(kubeconfig_path=cluster.kubeconfig, namespace=ns) as config:
                # The previous release: helm install creates the CRD from crds/.
                with helm.Chart.load(old_chart) as chart:
                    config.install(chart, release, namespace=ns, timeout=120)
                installed = True
                cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd_name}")
                stored = create("stored", {"selector": SELECTOR})
                # The old CRD's defaults are written into the object when it is created.
                assert stored["spec"]["memory"]["admission"] == "BatchSize", stored["spec"]["memory"]
                assert "maxQueuedBytes" not in stored["spec"]["batch"]
                with pytest.raises(ApiException) as refused:  # no spec.predictor.model before the upgrade
                    create("too-early", {"selector": SELECTOR, "predictor": {"model": MODEL}})
                assert refused.value.status in (400, 422), refused.value.body
                assert "spec.predictor.model" in refused.value.body, refused.value.body

                # helm upgrade alone: Helm leaves the CRD in crds/ as it was.
                with helm.Chart.load(new_chart) as chart:
                    config.upgrade(chart, release, namespace=ns, timeout=120)
                assert not schema_has(cluster, crd_name, "spec", "predictor", "model"), "helm upgrade changed the CRD"

                # The documented order: apply the CRD server-side, then helm upgrade.
                cluster.apply(new_chart / "crds", "--force-conflicts")
                with helm.Chart.load(new_chart) as chart:
                    config.upgrade(chart, release, namespace=ns, timeout=120)
                assert schema_has(cluster, crd_name, "spec", "predictor", "model")

                # The stored policy is served under the new schema: fields new since then come defaulted on
                # read; what the old CRD defaulted at creation stays as stored (memory.admission BatchSize).
                def served_new() -> dict[str, Any] | None:
                    policy = get("stored")
                    return policy if "maxQueuedBytes" in policy["spec"]["batch"] else None

                served = wait_for("the stored policy served with the new CRD's defaults", served_new,
                                  timeout=60, every=0.2, diagnose=cluster.diagnostics)  # fmt: skip
                assert served["spec"]["batch"]["maxQueuedBytes"] == 268435456
                assert served["spec"]["sidecar"]["maxConnections"] == 1024
                assert served["spec"]["memory"]["admission"] == "BatchSize"
                assert served["spec"]["selector"] == SELECTOR

                # Removing the field lets the new default in (defaulting runs on every write).
                cluster.kubectl("--namespace", ns, "patch", f"{PLURAL}.{group}", "stored", "--type=json",
                                "-p", '[{"op": "remove", "path": "/spec/memory/admission"}]')  # fmt: skip
                assert get("stored")["spec"]["memory"]["admission"] == "Auto"

                # A policy created now gets the new defaults and may use the new fields.
                fresh = create("fresh", {"selector": SELECTOR, "predictor": {"model": MODEL}})
                assert fresh["spec"]["memory"]["admission"] == "Auto"
                assert fresh["spec"]["predictor"]["model"] == MODEL
                assert get("fresh")["spec"]["predictor"]["model"] == MODEL

                # Uninstall: the release, then the CRD (which takes its objects with it).
                made = leftovers(cluster, ns, release)
                assert f"mutatingwebhookconfiguration.admissionregistration.k8s.io/{release}-binbatch" in made, made
                config.uninstall(release, timeout=120)
                installed = False
            assert schema_has(cluster, crd_name, "spec"), "helm uninstall deleted the CRD from crds/"
            cluster.kubectl("delete", "crd", crd_name, "--wait=true", "--timeout=60s")
            assert cluster.gone(_extensions(cluster).read_custom_resource_definition, crd_name)
            crd_name = ""
            left = leftovers(cluster, ns, release)
            assert left == [], f"left behind by helm uninstall and the CRD's deletion: {left}"
        finally:
            if installed:  # the test failed midway: leave nothing of it on the shared server
                with helm.Config(kubeconfig_path=cluster.kubeconfig, namespace=ns) as config:
                    config.uninstall(release, timeout=120)
            if crd_name:
                cluster.kubectl("delete", "crd", crd_name, "--ignore-not-found", "--wait=false")


# Everything the chart can make, cluster-scoped and in the release's namespace.
CLUSTER_KINDS = ("clusterroles", "clusterrolebindings", "mutatingwebhookconfigurations", "flowschemas",
                 "customresourcedefinitions", "clusterkopfpeerings")  # fmt: skip
NAMESPACED_KINDS = ("deployments", "services", "serviceaccounts", "roles", "rolebindings", "secrets", "configmaps",
                    "poddisruptionbudgets", "horizontalpodautoscalers", "leases", "kopfpeerings")  # fmt: skip


def leftovers(cluster: Cluster, namespace: str, release: str) -> list[str]:
    """Objects of the release (its instance label, or its name) still on the server."""
    kinds = ",".join(CLUSTER_KINDS)
    found = cluster.kubectl("get", kinds, "-o", "name", "-l", f"app.kubernetes.io/instance={release}")
    # The operator's peering object carries no label: it is named after the chart's full name.
    found += cluster.kubectl("get", kinds, "-o", "name", "--field-selector", f"metadata.name={release}-binbatch")
    found += cluster.kubectl("--namespace", namespace, "get", ",".join(NAMESPACED_KINDS), "-o", "name",
                             "-l", f"app.kubernetes.io/instance={release}")  # fmt: skip
    return sorted(line for line in found.splitlines() if line)
