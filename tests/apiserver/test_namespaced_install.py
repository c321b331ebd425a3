"""A namespaced install (the chart's ``watchNamespaces``) against a real API server, under its own RBAC.

The chart is installed by Helm with ``watchNamespaces`` naming one namespace and two
replicas (so kopf peers through a namespaced KopfPeering); the operator runs as its
Deployment says (``--namespace=...``), with a token of the install's ServiceAccount,
whose only write permissions there are Roles in the watched namespace (and the patch
of its own webhook configuration's CA).  A policy there is served; one in another
namespace is not touched, and the operator never runs into RBAC refusals.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kube_support import Cluster, temporary_namespace, wait_for
from test_operator_against_apiserver import (
    INJECT,
    POLICY,
    SELECTOR,
    Operator,
    ServiceProxy,
    containers,
    create_pod,
    create_policy,
    reconciled,
    service_account_kubeconfig,
)

from binbatch_operator import crd
from binbatch_operator.builders import SIDECAR_CONTAINER, child_name

pytestmark = pytest.mark.apiserver
CHART = Path(__file__).resolve().parents[2] / "charts" / "binbatch"


@pytest.fixture(scope="module")
def namespaced(cluster: Cluster, crds: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Operator]]:
    """(the watched namespace, the running operator of a release that watches only it)."""
    import helm_python as helm

    with temporary_namespace(cluster, INJECT) as served, \
            temporary_namespace(cluster, {"pod-security.kubernetes.io/enforce": "restricted"}) as release, \
            helm.Config(kubeconfig_path=cluster.kubeconfig, namespace=release) as config, \
            helm.Chart.load(CHART) as chart:  # fmt: skip
        config.install(chart, release, {"watchNamespaces": [served], "operator": {"replicas": 2}},
                       namespace=release, timeout=120)  # fmt: skip
        try:
            (deployment,) = cluster.apps.list_namespaced_deployment(release).items
            deployment = cluster.api.sanitize_for_serialization(deployment)
            (webhook,) = cluster.admission.list_mutating_webhook_configuration(
                label_selector=f"app.kubernetes.io/instance={release}").items  # fmt: skip
            service_ref = webhook.webhooks[0].client_config.service
            service = cluster.core.read_namespaced_service(service_ref.name, service_ref.namespace)
            folder = tmp_path_factory.mktemp("namespaced-operator")
            account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
            kubeconfig = service_account_kubeconfig(cluster, release, account, folder / "kubeconfig")
            process = Operator(cluster, deployment, kubeconfig, webhook.metadata.name, folder / "operator.log")
            with ServiceProxy(service.spec.cluster_ip, service_ref.port, process.webhook_port):
                process.start()
                try:
                    yield served, process
                finally:
                    # The policies go while the operator runs (its finalizer would hold the namespace).
                    cluster.custom.delete_collection_namespaced_custom_object(crd.GROUP, crd.VERSION, served, crd.PLURAL)
                    wait_for("the policies to go", lambda: not cluster.custom.list_namespaced_custom_object(
                        crd.GROUP, crd.VERSION, served, crd.PLURAL)["items"], timeout=60, every=0.2, diagnose=process.tail)  # fmt: skip
                    process.stop()
        finally:
            config.uninstall(release, timeout=120)


def test_a_namespaced_install_serves_its_namespace_only_and_never_meets_a_refusal(
    cluster: Cluster, namespaced: tuple[str, Operator]
) -> None:
    served, operator = namespaced
    create_policy(cluster, served, {"selector": SELECTOR})
    reconciled(cluster, served, operator)
    peering = cluster.custom.get_namespaced_custom_object("kopf.dev", "v1", served, "kopfpeerings",
                                                          operator.env["BINBATCH_WEBHOOK_CONFIG"])  # fmt: skip
    assert peering["status"], peering  # the replicas peer here, through the namespaced object
    assert containers(create_pod(cluster, served, "served", {"app": "vllm"})) == ["vllm", SIDECAR_CONTAINER]

    with temporary_namespace(cluster, INJECT) as other:
        create_policy(cluster, other, {"selector": SELECTOR})
        assert containers(create_pod(cluster, other, "not-served", {"app": "vllm"})) == ["vllm"]
        # A change to the served policy made after this one existed is acted on; this one is never seen.
        cluster.custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, served, crd.PLURAL, POLICY,
                                                      {"spec": {"batch": {"staticSize": 16}}})  # fmt: skip
        assert reconciled(cluster, served, operator)["batch"]["staticSize"] == 16
        policy: dict[str, Any] = cluster.custom.get_namespaced_custom_object(crd.GROUP, crd.VERSION, other, crd.PLURAL, POLICY)
        assert "status" not in policy and not policy["metadata"].get("finalizers"), policy
        assert cluster.gone(cluster.core.read_namespaced_config_map, child_name(POLICY), other)
        cluster.custom.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, other, crd.PLURAL, POLICY)
    log = operator.log.read_text(errors="replace")
    assert "Forbidden" not in log and " 403" not in log, operator.tail()
