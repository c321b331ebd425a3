"""The chart's ValidatingAdmissionPolicies against a real API server, with the operator's own token.

The chart (``helm_release``, default values: ``admissionPolicy.enabled``) fences its ServiceAccount:
RBAC lets it patch any ConfigMap, Service, NetworkPolicy and Deployment in the namespaces it serves;
the policies let it write only its children (by their labels) and a Deployment's restart annotation.
Each request here is sent with a token of that ServiceAccount, so a refusal is the fence's, not RBAC's.
What is never ours (kube-system) is only ever written with ``dryRun``: admission still runs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kube_support import Cluster, wait_for
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from test_operator_against_apiserver import service_account_kubeconfig

from binbatch_operator.builders import MANAGED_LABELS, POLICY_LABEL
from binbatch_operator.kube import RESTART_ANNOTATION, KubeApi

pytestmark = pytest.mark.apiserver

CHILD_LABELS = {**MANAGED_LABELS, POLICY_LABEL: "llm"}


@pytest.fixture(scope="module")
def operator_client(cluster: Cluster, helm_release: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[client.ApiClient]:
    """An API client with a token of the release's ServiceAccount (what the operator runs as)."""
    (deployment,) = cluster.apps.list_namespaced_deployment(helm_release).items
    account = deployment.spec.template.spec.service_account_name
    path = service_account_kubeconfig(cluster, helm_release, account, tmp_path_factory.mktemp("sa") / "kubeconfig")
    api = config.new_client_from_config(config_file=str(path))

    def fenced() -> bool:
        """The API server applies a new policy once its informers have it and its binding: a moment later."""
        probe = {"metadata": {"name": "fence-probe"}}  # unlabelled; dry run: never stored
        try:
            client.CoreV1Api(api).create_namespaced_config_map(helm_release, probe, dry_run="All")
        except ApiException as exc:
            return exc.status == 403 and "ValidatingAdmissionPolicy" in (exc.body or "")
        return False

    wait_for("the fence to apply", fenced, timeout=60, every=0.2, diagnose=cluster.diagnostics)
    yield api
    api.close()


def refused(call: Callable[[], Any]) -> str:
    """The message of the 403 the fence answers ``call`` with (fails if the call went through)."""
    with pytest.raises(ApiException) as info:
        call()
    assert info.value.status == 403, info.value.body
    message = json.loads(info.value.body)["message"]
    assert "ValidatingAdmissionPolicy" in message, message  # the fence's refusal, not RBAC's
    return message


def test_the_policies_are_installed_bound_and_type_check_cleanly(cluster: Cluster, helm_release: str) -> None:
    selector = f"app.kubernetes.io/instance={helm_release}"
    policies = cluster.admission.list_validating_admission_policy(label_selector=selector).items
    bindings = cluster.admission.list_validating_admission_policy_binding(label_selector=selector).items
    names = sorted(p.metadata.name for p in policies)
    assert names == [f"{helm_release}-binbatch-{k}" for k in ("children", "deployments", "statefulsets")]
    assert sorted((b.spec.policy_name, tuple(b.spec.validation_actions)) for b in bindings) == [
        (n, ("Deny",)) for n in names]  # fmt: skip

    def checked() -> list[Any] | None:
        found = [cluster.admission.read_validating_admission_policy(n) for n in names]
        done = all(p.status and p.status.observed_generation == p.metadata.generation for p in found)
        return found if done else None

    # The API server type-checks each expression against the kinds it matches; a warning means a
    # field name it does not know (a rule that would silently never hold).
    found = wait_for("the policies' type checking", checked, timeout=60, every=0.2, diagnose=cluster.diagnostics)
    for policy in found:
        warnings = (policy.status.type_checking.expression_warnings or []) if policy.status.type_checking else []
        assert warnings == [], (policy.metadata.name, warnings)


def test_a_configmap_in_kube_system_is_refused(cluster: Cluster, operator_client: client.ApiClient) -> None:
    core = client.CoreV1Api(operator_client)
    body = {"metadata": {"labels": {"binbatch.io/probe": "x"}}}
    message = refused(lambda: core.patch_namespaced_config_map("kube-root-ca.crt", "kube-system", body, dry_run="All"))
    assert "binbatch.io/policy" in message and "kube-system/kube-root-ca.crt" in message
    # Even one carrying our labels: the object it changes must already be ours.
    ours = {"metadata": {"labels": CHILD_LABELS}}
    refused(lambda: core.patch_namespaced_config_map("kube-root-ca.crt", "kube-system", ours, dry_run="All"))


def test_unlabelled_objects_in_a_served_namespace_are_refused_labelled_ones_allowed(
    cluster: Cluster, operator_client: client.ApiClient, namespace: Callable[..., str]
) -> None:
    ns = namespace({"binbatch.io/inject": "enabled"})
    core, networking = client.CoreV1Api(operator_client), client.NetworkingV1Api(operator_client)
    cluster.core.create_namespaced_config_map(ns, {"metadata": {"name": "theirs"}, "data": {"k": "v"}})
    change = {"data": {"k": "changed"}}
    assert "binbatch.io/policy" in refused(lambda: core.patch_namespaced_config_map("theirs", ns, change))
    refused(lambda: core.patch_namespaced_config_map("theirs", ns, {"metadata": {"labels": CHILD_LABELS}}))
    refused(lambda: core.create_namespaced_config_map(ns, {"metadata": {"name": "plain"}, "data": {}}))
    half = {"metadata": {"name": "half", "labels": MANAGED_LABELS}, "data": {}}  # no binbatch.io/policy
    refused(lambda: core.create_namespaced_config_map(ns, half))
    service = {"metadata": {"name": "svc"}, "spec": {"ports": [{"port": 80}]}}
    refused(lambda: core.create_namespaced_service(ns, service))
    cluster.core.create_namespaced_service(ns, {**service, "metadata": {"name": "their-svc"}})
    refused(lambda: core.delete_namespaced_service("their-svc", ns))  # RBAC grants deleting Services
    netpol = {"metadata": {"name": "np"}, "spec": {"podSelector": {}}}
    refused(lambda: networking.create_namespaced_network_policy(ns, netpol))
    assert cluster.core.read_namespaced_config_map("theirs", ns).data == {"k": "v"}
    cluster.core.read_namespaced_service("their-svc", ns)
    # The fence is the operator's only: the admin still changes the unlabelled one.
    cluster.core.patch_namespaced_config_map("theirs", ns, change)

    # What the operator writes (its children, labelled) goes through: create, patch, delete.
    core.create_namespaced_config_map(ns, {"metadata": {"name": "child", "labels": CHILD_LABELS}, "data": {}})
    core.patch_namespaced_config_map("child", ns, {"data": {"config.yaml": "x"}})
    refused(lambda: core.patch_namespaced_config_map("child", ns, {"metadata": {"labels": {POLICY_LABEL: None}}}))
    core.create_namespaced_service(ns, {**service, "metadata": {"name": "svc", "labels": CHILD_LABELS}})
    core.delete_namespaced_service("svc", ns)
    networking.create_namespaced_network_policy(ns, {**netpol, "metadata": {"name": "np", "labels": CHILD_LABELS}})
    networking.delete_namespaced_network_policy("np", ns)
    assert cluster.core.read_namespaced_config_map("child", ns).data == {"config.yaml": "x"}


def deployment(name: str) -> dict[str, Any]:
    labels = {"app": name}
    return {"metadata": {"name": name, "labels": labels}, "spec": {
        "replicas": 0, "selector": {"matchLabels": labels},
        "template": {"metadata": {"labels": labels, "annotations": {"keep": "me"}},
                     "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}}}}  # fmt: skip


def test_a_deployment_changes_only_in_the_restart_annotation(
    cluster: Cluster, operator_client: client.ApiClient, namespace: Callable[..., str]
) -> None:
    ns = namespace()
    cluster.apps.create_namespaced_deployment(ns, deployment("vllm"))
    apps = client.AppsV1Api(operator_client)
    image = {"spec": {"template": {"spec": {"containers": [{"name": "vllm", "image": "evil/image"}]}}}}

    def fenced() -> bool:
        """Each policy applies a moment after the API server's informers have it (the children's may be first)."""
        try:
            apps.patch_namespaced_deployment("vllm", ns, image, dry_run="All")
        except ApiException as exc:
            return exc.status == 403 and "ValidatingAdmissionPolicy" in (exc.body or "")
        return False

    wait_for("the Deployments' fence to apply", fenced, timeout=60, every=0.2, diagnose=cluster.diagnostics)

    # The operator's own rolling restart (KubeApi.restart_owner, as reconcile calls it) goes through.
    pod = {"metadata": {"name": "p", "namespace": ns, "ownerReferences": [
        {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vllm", "uid": "u", "controller": True}]}}  # fmt: skip
    kube = KubeApi(operator_client)
    assert asyncio.run(kube.restart_owner(pod)) == "Deployment/vllm"
    annotations = cluster.apps.read_namespaced_deployment("vllm", ns).spec.template.metadata.annotations
    assert set(annotations) == {"keep", RESTART_ANNOTATION}
    assert asyncio.run(kube.restart_owner(pod)) == "Deployment/vllm"  # a second restart: the annotation changes

    assert RESTART_ANNOTATION in refused(lambda: apps.patch_namespaced_deployment("vllm", ns, image))
    both = {"spec": {"replicas": 3, "template": {"metadata": {"annotations": {RESTART_ANNOTATION: "now"}}}}}
    refused(lambda: apps.patch_namespaced_deployment("vllm", ns, both))
    other = {"spec": {"template": {"metadata": {"annotations": {"keep": "changed"}}}}}
    refused(lambda: apps.patch_namespaced_deployment("vllm", ns, other))
    gone = {"spec": {"template": {"metadata": {"annotations": {"keep": None}}}}}
    refused(lambda: apps.patch_namespaced_deployment("vllm", ns, gone))
    refused(lambda: apps.patch_namespaced_deployment("vllm", ns, {"metadata": {"labels": {"app": "x"}}}))
    stored = cluster.apps.read_namespaced_deployment("vllm", ns)
    assert stored.spec.replicas == 0 and stored.spec.template.spec.containers[0].image == "vllm/vllm-openai"
    assert stored.spec.template.metadata.annotations["keep"] == "me"
