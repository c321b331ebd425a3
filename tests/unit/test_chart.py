"""The Helm chart, the plain-YAML install and the samples.

The chart is linted and rendered by the real Helm library (``helm-python-sdk``,
Helm's Go SDK as ``libhelm_c.so``; no cluster, no ``helm`` binary), and every
object it renders is checked against the Kubernetes OpenAPI schemas
(``kubernetes-validate``, strict: an unknown field is an error).  Sample
policies are checked by the operator's own config builder and by the CRD's
schema, as ``kubectl apply`` (strict field validation) would.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from binbatch_operator.builders import MANAGED_LABELS, build_headless_service, build_service, sidecar_config
from binbatch_sidecar.cli import build_parser
from binbatch_sidecar.config import ConfigError
from binbatch_sidecar.emulator import config_from_args
from binbatch_sidecar.engine.sidecar_metrics import SidecarMetrics
from binbatch_sidecar.engine.vllm_metrics import ALIASES

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "binbatch"
CRD_SOURCE = ROOT / "manifests" / "crd" / "batchingpolicies.binbatch.io.yaml"
CRD_COPY = CHART / "crds" / "batchingpolicies.binbatch.io.yaml"
PEERING_CRD = CHART / "crds" / "clusterkopfpeerings.kopf.dev.yaml"
NAMESPACED_PEERING_CRD = CHART / "crds" / "kopfpeerings.kopf.dev.yaml"
INSTALL = ROOT / "manifests" / "install" / "binbatch.yaml"
SAMPLES = sorted((ROOT / "manifests" / "samples").glob("*.yaml"))
RELEASE, NAMESPACE = "binbatch", "binbatch-system"
KUBE_VERSION = "1.34"  # the oldest Kubernetes the chart targets (Chart.yaml kubeVersion); kubernetes-validate ships its schemas

MONITORING = {
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "grafanaDashboard": {"enabled": True},
}
CUSTOM_TAG = {"image": {"tag": "1.2.3-rc1"}}
SINGLE = {"operator": {"replicas": 1}}
CERT_MANAGER = {"webhook": {"certificate": {"source": "CertManager"}}}
CERT_MANAGER_ISSUER = {"webhook": {"certificate": {"source": "CertManager", "certManager": {
    "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}}}}  # fmt: skip
SCOPED = {"webhook": {"namespaceSelector": {"matchLabels": None, "matchExpressions": [{"key": "team", "operator": "In", "values": ["ml"]}]},
                      "objectSelector": {"matchLabels": {"binbatch.io/inject": "enabled"}},
                      "listenAddress": "::", "port": 10443, "extraHostnames": ["hook.example.org", "10.0.0.9"]},
          "sidecar": {"native": True}}  # fmt: skip
EVERY_NAMESPACE = {"webhook": {"namespaceSelector": {"matchLabels": None}}}  # Helm: null drops a default key
KEDA = {"autoscaling": {"target": {"name": "vllm"}, "minReplicas": 2, "maxReplicas": 6, "waitingPerPod": 12,
                        "keda": {"enabled": True, "serverAddress": "http://prometheus.monitoring:9090"}},
        "serviceMonitor": {"enabled": True, "engineMetrics": True}}  # fmt: skip
HPA = {"autoscaling": {"target": {"name": "vllm", "kind": "StatefulSet"}, "hpa": {"enabled": True}}}
VALUE_SETS = {
    "defaults": None, "monitoring": MONITORING, "custom-tag": CUSTOM_TAG, "single": SINGLE,
    "cert-manager": CERT_MANAGER, "cert-manager-issuer": CERT_MANAGER_ISSUER, "scoped": SCOPED,
    "keda": KEDA, "hpa": HPA, "namespaced": {"watchNamespaces": ["llm", "team-b"]},
}  # fmt: skip

NAMESPACED = {"ServiceAccount", "Service", "Deployment", "ConfigMap", "ServiceMonitor", "Role", "RoleBinding",
              "PodDisruptionBudget", "Issuer", "Certificate", "ScaledObject", "HorizontalPodAutoscaler"}  # fmt: skip

# A Prometheus duration, as prometheus-operator checks it.
DURATION = "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"

# The part of prometheus-operator's ServiceMonitor (monitoring.coreos.com/v1) the chart
# uses, closed like the strict Kubernetes schemas; kubernetes-validate has no CRD schemas.
SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "additionalProperties": False, "properties": {
                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "matchExpressions": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False, "required": ["key", "operator"], "properties": {
                            "key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                            "values": {"type": "array", "items": {"type": "string"}}}}}}},
                "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "properties": {
                        "port": {"type": "string"}, "path": {"type": "string"},
                        "interval": {"type": "string", "pattern": DURATION}}}},
            },
        },
    },
}  # fmt: skip



def _closed(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": properties, "required": required or []}


_ISSUER_REF = _closed({"name": {"type": "string"}, "kind": {"enum": ["Issuer", "ClusterIssuer"]},
                       "group": {"type": "string"}}, ["name"])  # fmt: skip
# The parts of cert-manager's Issuer and Certificate (cert-manager.io/v1) and kopf's
# ClusterKopfPeering the chart uses, closed like the strict Kubernetes schemas.
CUSTOM_KINDS = {
    "ClusterKopfPeering": _closed({"apiVersion": {"const": "kopf.dev/v1"}, "kind": {"const": "ClusterKopfPeering"},
                                   "metadata": {"type": "object"}}, ["metadata"]),
    "Issuer": _closed({
        "apiVersion": {"const": "cert-manager.io/v1"}, "kind": {"const": "Issuer"}, "metadata": {"type": "object"},
        "spec": {"type": "object", "minProperties": 1, "maxProperties": 1, "additionalProperties": False, "properties": {
            "selfSigned": _closed({}), "ca": _closed({"secretName": {"type": "string"}}, ["secretName"])}},
    }, ["spec"]),
    "Certificate": _closed({
        "apiVersion": {"const": "cert-manager.io/v1"}, "kind": {"const": "Certificate"}, "metadata": {"type": "object"},
        "spec": _closed({
            "secretName": {"type": "string"}, "isCA": {"type": "boolean"}, "commonName": {"type": "string"},
            "duration": {"type": "string", "pattern": "^([0-9]+(h|m|s))+$"},
            "renewBefore": {"type": "string", "pattern": "^([0-9]+(h|m|s))+$"},
            "dnsNames": {"type": "array", "items": {"type": "string"}},
            "privateKey": _closed({"algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]}, "size": {"type": "integer"}}),
            "usages": {"type": "array", "items": {"enum": ["server auth", "digital signature", "key encipherment"]}},
            "issuerRef": _ISSUER_REF,
        }, ["secretName", "issuerRef"]),
    }, ["spec"]),
}  # fmt: skip


# The part of KEDA's ScaledObject (keda.sh/v1alpha1) the chart uses, closed like the strict
# Kubernetes schemas, with the types of KEDA's own CRD (kedacore/charts,
# keda/templates/crds/crd-scaledobjects.yaml, KEDA 2.x): int32 counts, a required target
# name, triggers of a type and string-to-string metadata.  The CRD itself is not vendored.
_INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
_PROMETHEUS_METADATA = _closed({
    "serverAddress": {"type": "string", "pattern": "^https?://"}, "query": {"type": "string", "minLength": 1},
    "threshold": {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?$"}, "activationThreshold": {"type": "string"},
}, ["serverAddress", "query", "threshold"])  # fmt: skip
CUSTOM_KINDS["ScaledObject"] = _closed({
    "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"}, "metadata": {"type": "object"},
    "spec": _closed({
        "scaleTargetRef": _closed({"apiVersion": {"type": "string"}, "kind": {"enum": ["Deployment", "StatefulSet"]},
                                   "name": {"type": "string", "minLength": 1}}, ["name"]),
        "minReplicaCount": {**_INT32, "minimum": 0}, "maxReplicaCount": {**_INT32, "minimum": 1},
        "pollingInterval": _INT32, "cooldownPeriod": _INT32,
        "triggers": {"type": "array", "minItems": 1, "items": _closed({
            "type": {"const": "prometheus"}, "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
            "name": {"type": "string"}, "metadata": _PROMETHEUS_METADATA}, ["type", "metadata"])},
    }, ["scaleTargetRef", "triggers"]),
}, ["spec"])  # fmt: skip


# ------------------------------------------------------------------ helpers


@functools.cache
def _chart() -> helm.Chart:
    return helm.Chart.load(CHART)


@functools.cache
def _render(values_json: str) -> dict[str, str]:
    return _chart().render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE, is_install=True)


def rendered(values: dict[str, Any] | None = None) -> dict[str, str]:
    """Template path → rendered text, from Helm."""
    return _render(json.dumps(values))


def objects(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    out = []
    for path, text in sorted(rendered(values).items()):
        if path.endswith(".yaml"):
            out += [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def operator_container(values: dict[str, Any] | None = None) -> dict[str, Any]:
    (container,) = one(objects(values), "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def validate_kubernetes(obj: dict[str, Any]) -> None:
    if obj["kind"] == "ServiceMonitor":
        jsonschema.Draft7Validator(SERVICE_MONITOR).validate(obj)
    elif obj["kind"] in CUSTOM_KINDS:
        jsonschema.Draft7Validator(CUSTOM_KINDS[obj["kind"]]).validate(obj)
    else:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def strict_schema(node: Any) -> Any:
    """A CRD schema as ``kubectl apply``'s strict field validation applies it: unknown fields are errors."""
    if isinstance(node, list):
        return [strict_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {key: strict_schema(value) for key, value in node.items()}
    if (
        out.get("type") == "object"
        and isinstance(out.get("properties"), dict)
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def policy_validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load(CRD_SOURCE.read_text())
    return jsonschema.Draft7Validator(strict_schema(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]))


def sample_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def render_manifests_module():
    spec = importlib.util.spec_from_file_location("render_manifests", ROOT / "charts" / "render_manifests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ the chart as Helm sees it


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_chart_passes_strict_helm_lint(values):
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # 2 warning, 3 error


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_every_rendered_object_is_valid_against_the_kubernetes_schemas(values):
    objs = objects(values)
    assert objs
    for obj in objs:
        validate_kubernetes(obj)
        if obj["kind"] in NAMESPACED:
            served = (NAMESPACE, *((values or {}).get("watchNamespaces") or ()))
            assert obj["metadata"]["namespace"] in served, f"{obj['kind']} must name its namespace for kubectl apply"


def test_crd_in_the_chart_is_a_byte_copy_of_the_manifests_source():
    assert CRD_COPY.read_bytes() == CRD_SOURCE.read_bytes(), "cp manifests/crd/*.yaml charts/binbatch/crds/"
    crds = {c["filename"]: c["data"] for c in _chart().crds}
    names = {Path(name).name: data for name, data in crds.items()}
    assert sorted(names) == ["batchingpolicies.binbatch.io.yaml", "clusterkopfpeerings.kopf.dev.yaml",
                             "kopfpeerings.kopf.dev.yaml"]  # fmt: skip
    assert names["batchingpolicies.binbatch.io.yaml"].encode() == CRD_SOURCE.read_bytes()


def test_crds_are_valid_kubernetes_objects():
    validate_kubernetes(yaml.safe_load(CRD_COPY.read_text()))
    peering = yaml.safe_load(PEERING_CRD.read_text())
    validate_kubernetes(peering)
    # What kopf looks for with --all-namespaces: kopf.dev/v1 clusterkopfpeerings, cluster-scoped.
    assert (peering["spec"]["group"], peering["spec"]["names"]["plural"], peering["spec"]["scope"]) == (
        "kopf.dev", "clusterkopfpeerings", "Cluster")
    assert [v["name"] for v in peering["spec"]["versions"]] == ["v1"]
    # ... and with --namespace (watchNamespaces): kopf.dev/v1 kopfpeerings, namespaced.
    namespaced = yaml.safe_load(NAMESPACED_PEERING_CRD.read_text())
    validate_kubernetes(namespaced)
    assert (namespaced["spec"]["group"], namespaced["spec"]["names"]["plural"], namespaced["spec"]["scope"]) == (
        "kopf.dev", "kopfpeerings", "Namespaced")


def test_defaults_render_the_operator_with_peering_and_nothing_optional():
    kinds = sorted(o["kind"] for o in objects())
    assert kinds == sorted([
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Service", "Deployment",
        "MutatingWebhookConfiguration", "PodDisruptionBudget", "Role", "RoleBinding", "FlowSchema",  # the Lease's
        *FENCE_KINDS,
    ])  # fmt: skip
    single = sorted(o["kind"] for o in objects(SINGLE))
    assert single == sorted([
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Service", "Deployment",
        "MutatingWebhookConfiguration", *FENCE_KINDS,
    ])  # fmt: skip


# ------------------------------------------------------------------ the fence (ValidatingAdmissionPolicy)

FENCE_KINDS = ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"] * 3
FENCES = ("children", "deployments", "statefulsets")


def fence(values: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The rendered policies by their suffix, each checked to have a Deny binding of its own name."""
    objs = objects(values)
    policies = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ValidatingAdmissionPolicy"}
    bindings = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "ValidatingAdmissionPolicyBinding"}
    assert bindings == {name: {"policyName": name, "validationActions": ["Deny"]} for name in policies}
    return {name.removeprefix(f"{RELEASE}-"): policy["spec"] for name, policy in policies.items()}


def test_the_fence_matches_only_the_operators_service_account():
    for values, account in ((None, RELEASE), ({"serviceAccount": {"name": "ops"}}, "ops"),
                            ({"serviceAccount": {"create": False, "name": "shared"}}, "shared")):  # fmt: skip
        policies = fence(values)
        assert sorted(policies) == sorted(FENCES)
        for spec in policies.values():
            assert spec["failurePolicy"] == "Fail"
            (condition,) = spec["matchConditions"]
            assert condition["expression"] == f"request.userInfo.username == 'system:serviceaccount:{NAMESPACE}:{account}'"
    assert fence({"admissionPolicy": {"enabled": False}}) == {}


def test_the_fence_names_the_labels_and_annotation_the_operator_writes():
    """The CEL is text in the chart: it must name what operator/builders.py and operator/kube.py really use."""
    from binbatch_operator.builders import MANAGED_LABELS, POLICY_LABEL
    from binbatch_operator.kube import RESTART_ANNOTATION

    policies = fence()
    children = policies["children"]
    kinds = {(g, r) for rule in children["matchConstraints"]["resourceRules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert kinds == {("", "configmaps"), ("", "services"), ("networking.k8s.io", "networkpolicies")}
    rules = " ".join(v["expression"] for v in children["validations"])
    assert f"'{POLICY_LABEL}' in L" in rules
    assert f"L['app.kubernetes.io/managed-by'] == '{MANAGED_LABELS['app.kubernetes.io/managed-by']}'" in rules
    for kind in ("deployments", "statefulsets"):
        (rule,) = policies[kind]["matchConstraints"]["resourceRules"]
        assert (rule["apiGroups"], rule["resources"], rule["operations"]) == (["apps"], [kind], ["CREATE", "UPDATE", "DELETE"])
        text = " ".join(v["expression"] for v in policies[kind]["validations"])
        assert text.count(f"k == '{RESTART_ANNOTATION}'") == 2
        assert "object.spec.template.spec == oldObject.spec.template.spec" in text


def test_notes_tell_the_next_commands():
    notes = rendered()["binbatch/templates/NOTES.txt"]
    assert f"kubectl --namespace {NAMESPACE} rollout status deployment/{RELEASE}" in notes
    assert "apply -f manifests/samples/cpu-emulator.yaml" in notes
    assert "get bp" in notes
    # The opt-in label before the sample, and the Pod Security label --create-namespace leaves out.
    assert notes.index("kubectl label namespace binbatch-demo binbatch.io/inject=enabled") < notes.index(
        "apply -f manifests/samples/cpu-emulator.yaml")
    assert f"kubectl label namespace {NAMESPACE} pod-security.kubernetes.io/enforce=restricted" in notes
    everywhere = rendered(EVERY_NAMESPACE)["binbatch/templates/NOTES.txt"]
    assert "binbatch.io/inject=enabled" not in everywhere


# ------------------------------------------------------------------ values and their schema


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"bogus": 1}, "bogus"),
        ({"image": {"tagg": "v1"}}, "tagg"),
        ({"serviceMonitor": {"enable": True}}, "enable"),
        ({"resources": {"limit": {"memory": "1Gi"}}}, "limit"),
    ],
)
def test_an_unknown_value_is_refused_naming_it(values, named):
    with pytest.raises(helm.HelmValuesError) as err:
        _chart().render(values, name=RELEASE, namespace=NAMESPACE)
    assert f"'{named}' not allowed" in str(err.value)


def test_a_bad_webhook_failure_policy_is_refused():
    with pytest.raises(helm.HelmValuesError, match="failurePolicy"):
        _chart().render({"webhook": {"failurePolicy": "Retry"}}, name=RELEASE, namespace=NAMESPACE)


def _schema_nodes(node: dict[str, Any], path: str = "values"):
    yield path, node
    for key, prop in node.get("properties", {}).items():
        yield from _schema_nodes(prop, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _schema_nodes(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _schema_nodes(node["additionalProperties"], f"{path}.*")


def test_values_schema_closes_every_object_it_defines():
    schema = _chart().schema
    for path, node in _schema_nodes(schema):
        if node.get("type") != "object":
            continue
        if "properties" in node:
            assert node.get("additionalProperties") is False, f"{path} accepts unknown keys"
        else:  # a map (labels, requests) or a Kubernetes type passed through to the API server
            extra = node.get("additionalProperties")
            assert isinstance(extra, dict) or (extra is True and "API server" in node["description"]), path
        assert node.get("description"), f"{path} has no description"


def _key_lines(node: yaml.Node, schema: dict[str, Any], path: str = ""):
    """(dotted key, line) of every values.yaml key the schema defines (not map entries or pass-through data)."""
    if not isinstance(node, yaml.MappingNode):
        return
    for key, value in node.value:
        prop = schema.get("properties", {}).get(key.value)
        if prop is None:
            continue
        yield f"{path}{key.value}", key.start_mark.line
        yield from _key_lines(value, prop, f"{path}{key.value}.")


def test_every_value_is_commented():
    text = (CHART / "values.yaml").read_text()
    lines = text.splitlines()
    keys = list(_key_lines(yaml.compose(text), _chart().schema))
    assert len(keys) > 40
    for key, line in keys:
        above = lines[line - 1].strip() if line else ""
        assert above.startswith("#") or "#" in lines[line], f"values.yaml: {key} has no comment"
    assert {k for k, _ in keys if "." not in k} == set(_chart().schema["properties"]), "values.yaml misses a key"


# ------------------------------------------------------------------ RBAC

EXPECTED_RULES = {
    ("binbatch.io", "batchingpolicies", ("get", "list", "patch", "watch"), ()),
    ("binbatch.io", "batchingpolicies/status", ("get", "patch"), ()),
    ("binbatch.io", "batchingpolicies/finalizers", ("update",), ()),
    ("", "configmaps", ("create", "get", "list", "patch", "watch"), ()),
    ("", "services", ("create", "delete", "get", "list", "patch", "watch"), ()),
    ("networking.k8s.io", "networkpolicies", ("create", "delete", "get", "list", "patch", "watch"), ()),
    ("", "pods", ("get", "list", "watch"), ()),
    ("", "events", ("create",), ()),
    ("events.k8s.io", "events", ("create",), ()),
    ("apiextensions.k8s.io", "customresourcedefinitions", ("get", "list", "watch"), ()),
    ("", "namespaces", ("get", "list", "watch"), ()),
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", ("get", "patch"), (RELEASE,)),
    ("kopf.dev", "clusterkopfpeerings", ("create", "list", "watch"), ()),
    ("kopf.dev", "clusterkopfpeerings", ("get", "patch"), (RELEASE,)),
    ("apps", "deployments", ("get", "patch"), ()),
    ("apps", "statefulsets", ("get", "patch"), ()),
    ("apps", "replicasets", ("get",), ()),
}


def _grants(role: dict[str, Any]) -> set[tuple[str, str, tuple[str, ...], tuple[str, ...]]]:
    return {
        (group, resource, tuple(sorted(rule["verbs"])), tuple(rule.get("resourceNames", ())))
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }


def test_rbac_rules_have_no_wildcard():
    role = one(objects(), "ClusterRole")
    assert "*" not in json.dumps(role["rules"])


PEERING_RULES = {r for r in EXPECTED_RULES if r[0] == "kopf.dev"}
CA_PATCH_RULES = {r for r in EXPECTED_RULES if r[1] == "mutatingwebhookconfigurations"}
SECRET_RULES = {("", "secrets", ("create",), ()),
                ("", "secrets", ("get", "update"), (f"{RELEASE}-admin-signing", f"{RELEASE}-webhook-cert"))}  # fmt: skip
LEASE_RULES = {("coordination.k8s.io", "leases", ("create",), ()),
               ("coordination.k8s.io", "leases", ("get", "patch"), (RELEASE,))}  # fmt: skip


def test_rbac_grants_exactly_what_the_operator_needs():
    assert _grants(one(objects(), "ClusterRole")) == EXPECTED_RULES
    assert _grants(one(objects(), "Role", RELEASE)) == SECRET_RULES  # the Admin signing key, the built-in certificate
    assert _grants(one(objects(), "Role", f"{RELEASE}-leader")) == LEASE_RULES  # the leader's Lease
    # One replica: no peering, no Lease. cert-manager: no CA patching, and only the Admin signing key's Secret.
    assert _grants(one(objects(SINGLE), "ClusterRole")) == EXPECTED_RULES - PEERING_RULES
    assert [o["metadata"]["name"] for o in objects(SINGLE) if o["kind"] == "Role"] == [RELEASE]
    cert_manager = objects(CERT_MANAGER)
    read_only = {("admissionregistration.k8s.io", "mutatingwebhookconfigurations", ("get",), (RELEASE,))}
    assert _grants(one(cert_manager, "ClusterRole")) == EXPECTED_RULES - CA_PATCH_RULES | read_only
    assert sorted(o["metadata"]["name"] for o in cert_manager if o["kind"] in ("Role", "RoleBinding")) == \
        [RELEASE, RELEASE, f"{RELEASE}-leader", f"{RELEASE}-leader"]
    assert _grants(one(cert_manager, "Role", RELEASE)) == {
        ("", "secrets", ("create",), ()), ("", "secrets", ("get", "update"), (f"{RELEASE}-admin-signing",))}
    assert env(operator_container())["BINBATCH_ADMIN_SIGNING_SECRET"] == f"{RELEASE}-admin-signing"


def test_a_namespaced_install_writes_only_through_roles_in_the_namespaces_it_watches():
    """watchNamespaces: kopf --namespace for each, a Role + RoleBinding in each with what the ClusterRole held
    for policies, and a ClusterRole with no write verb but the patch of its own webhook configuration's CA."""
    watched = ["llm", "team-b"]
    objs = objects({"watchNamespaces": watched})
    container = operator_container({"watchNamespaces": watched})
    assert "--all-namespaces" not in container["command"]
    assert [a for a in container["command"] if a.startswith("--namespace=")] == ["--namespace=llm", "--namespace=team-b"]
    assert env(container)["BINBATCH_WATCH_NAMESPACES"] == "llm,team-b"
    assert "BINBATCH_WATCH_NAMESPACES" not in env(operator_container())
    cluster_rules = _grants(one(objs, "ClusterRole"))
    writes = {"create", "update", "patch", "delete", "deletecollection"}
    assert {r for r in cluster_rules if writes & set(r[2])} == {
        ("admissionregistration.k8s.io", "mutatingwebhookconfigurations", ("get", "patch"), (RELEASE,))}
    assert {r[1] for r in cluster_rules} == {"customresourcedefinitions", "namespaces", "mutatingwebhookconfigurations"}
    per_namespace = EXPECTED_RULES - {r for r in EXPECTED_RULES if r[1] in (
        "customresourcedefinitions", "namespaces", "mutatingwebhookconfigurations", "clusterkopfpeerings")}
    peering = {("kopf.dev", "kopfpeerings", ("create", "list", "watch"), ()),
               ("kopf.dev", "kopfpeerings", ("get", "patch"), (RELEASE,))}  # fmt: skip
    for ns in watched:
        role = next(o for o in objs if o["kind"] == "Role" and o["metadata"]["namespace"] == ns)
        assert _grants(role) == per_namespace | peering, ns
        binding = next(o for o in objs if o["kind"] == "RoleBinding" and o["metadata"]["namespace"] == ns)
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}]
    single = objects({"watchNamespaces": watched, **SINGLE})
    assert all(r[1] != "kopfpeerings" for o in single if o["kind"] == "Role" for r in _grants(o))
    (hook,) = one(objs, "MutatingWebhookConfiguration")["webhooks"]
    selector = hook["namespaceSelector"]
    assert _selects(selector, _namespace("llm", **{"binbatch.io/inject": "enabled"}))
    assert not _selects(selector, _namespace("elsewhere", **{"binbatch.io/inject": "enabled"}))
    with pytest.raises(helm.HelmValuesError, match="watchNamespaces"):
        rendered({"watchNamespaces": ["Not_A_Namespace"]})


def test_network_policies_are_granted_only_as_far_as_the_install_makes_them():
    """networkPolicy.enabled false: the operator only finds and deletes the ones it made earlier."""
    no_policies = {"networkPolicy": {"enabled": False}}
    written = {r for r in EXPECTED_RULES if r[1] == "networkpolicies"}
    cleanup = {("networking.k8s.io", "networkpolicies", ("delete", "list", "watch"), ())}
    assert _grants(one(objects(no_policies), "ClusterRole")) == EXPECTED_RULES - written | cleanup
    assert env(operator_container())["BINBATCH_NETWORK_POLICY"] == "true"
    assert env(operator_container(no_policies))["BINBATCH_NETWORK_POLICY"] == "false"


def test_the_metrics_peers_reach_the_operator_as_json_it_checks():
    """networkPolicy.metricsFrom -> BINBATCH_NETWORK_POLICY_METRICS_FROM -> the NetworkPolicy's metrics rule."""
    import kopf

    from binbatch_operator.builders import build_network_policy
    from binbatch_operator.main import metrics_peers

    prometheus = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    variables = env(operator_container({"networkPolicy": {"metricsFrom": prometheus}}))
    peers = metrics_peers(variables["BINBATCH_NETWORK_POLICY_METRICS_FROM"])
    assert peers == prometheus
    rules = build_network_policy("fast", "llm", {}, metrics_from=peers)["spec"]["ingress"]
    assert rules[1] == {"from": prometheus, "ports": [{"protocol": "TCP", "port": "bb-metrics"}]}
    assert metrics_peers(env(operator_container())["BINBATCH_NETWORK_POLICY_METRICS_FROM"]) == []
    with pytest.raises(kopf.PermanentError, match=r"networkPolicy\.metricsFrom\[0\]\.ipBlock\.cidr"):
        metrics_peers('[{"ipBlock": {"cidr": "300.0.0.0/8"}}]')
    with pytest.raises(kopf.PermanentError, match="is not JSON"):
        metrics_peers("[{")
    with pytest.raises(helm.HelmValuesError, match="metricsFrom"):
        rendered({"networkPolicy": {"metricsFrom": [{"namespaceSelecter": {}}]}})


def test_the_roles_for_the_certificate_secret_and_the_lease_are_bound_in_the_release_namespace():
    objs = objects()
    for name in (RELEASE, f"{RELEASE}-leader"):
        binding, role = one(objs, "RoleBinding", name), one(objs, "Role", name)
        assert binding["roleRef"]["name"] == name and role["metadata"]["namespace"] == NAMESPACE
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": NAMESPACE}]


def test_webhook_configuration_access_is_restricted_to_the_releases_own():
    objs = objects({"fullnameOverride": "bb"})
    rules = [r for r in one(objs, "ClusterRole")["rules"] if "mutatingwebhookconfigurations" in r["resources"]]
    assert [r["resourceNames"] for r in rules] == [["bb"]]
    assert one(objs, "MutatingWebhookConfiguration")["metadata"]["name"] == "bb"
    assert env(operator_container({"fullnameOverride": "bb"}))["BINBATCH_WEBHOOK_CONFIG"] == "bb"


def test_role_is_bound_to_the_operators_service_account():
    objs = objects()
    binding, account = one(objs, "ClusterRoleBinding"), one(objs, "ServiceAccount")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": one(objs, "ClusterRole")["metadata"]["name"]}  # fmt: skip
    subject = {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    assert binding["subjects"] == [subject]
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


# ------------------------------------------------------------------ the operator Deployment


def test_one_operator_replica_is_standalone_and_recreated_never_two_at_once():
    spec = one(objects(SINGLE), "Deployment")["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    (container,) = spec["template"]["spec"]["containers"]
    assert "--standalone" in container["command"] and not [a for a in container["command"] if "peering" in a]
    assert "topologySpreadConstraints" not in spec["template"]["spec"]
    assert "POD_ID" not in env(container)


def test_several_replicas_elect_a_leader_with_kopf_peering_and_roll_without_a_gap():
    objs = objects({"operator": {"replicas": 3}})
    deployment = one(objs, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 3
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    (container,) = spec["template"]["spec"]["containers"]
    # The operator creates this ClusterKopfPeering at start-up, and may patch only it.
    (peering,) = [r["resourceNames"] for r in one(objs, "ClusterRole")["rules"] if r.get("resourceNames")
                  and r["resources"] == ["clusterkopfpeerings"]]  # fmt: skip
    assert f"--peering={peering[0]}" in container["command"] and "--standalone" not in container["command"]
    assert env(container)["POD_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    (spread,) = spec["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["whenUnsatisfiable"] == "ScheduleAnyway"
    assert spread["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
    pdb = one(objs, "PodDisruptionBudget")
    assert pdb["spec"] == {"minAvailable": 1, "selector": {"matchLabels": spec["selector"]["matchLabels"]}}
    assert not [o for o in objects({"operator": {"replicas": 3, "podDisruptionBudget": False}})
                if o["kind"] == "PodDisruptionBudget"]  # fmt: skip


def test_the_leaders_lease_requests_go_to_the_leader_election_priority_level():
    """API Priority and Fairness: the operator's own burst of writes must not queue its Lease renewals."""
    schema = one(objects(), "FlowSchema")
    assert schema["metadata"]["name"] == f"{RELEASE}-leader-election"
    spec = schema["spec"]
    assert spec["priorityLevelConfiguration"] == {"name": "leader-election"}
    assert spec["matchingPrecedence"] < 9000  # ahead of the built-in service-accounts schema (workload-low)
    (rule,) = spec["rules"]
    assert rule["subjects"] == [{"kind": "ServiceAccount", "serviceAccount": {"name": RELEASE, "namespace": NAMESPACE}}]
    assert rule["resourceRules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                                      "verbs": ["get", "create", "patch"], "namespaces": [NAMESPACE]}]  # fmt: skip
    assert not [o for o in objects(SINGLE) if o["kind"] == "FlowSchema"]  # one replica: no Lease


def test_operator_runs_non_root_on_a_read_only_root_filesystem():
    deployment = one(objects(), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = operator_container()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == 10001 and sc["runAsGroup"] == 10001
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    # The one writable place: the webhook certificate goes to /tmp.
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert [v for v in pod["volumes"] if v["name"] == "tmp"][0]["emptyDir"] is not None
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]


def test_operator_probes_kopfs_liveness_endpoint():
    container = operator_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"webhook": 9443, "health": 8080}
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["command"]
    assert {p["name"]: p["containerPort"] for p in operator_container(SCOPED)["ports"]}["webhook"] == 10443
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_operator_command_and_environment():
    objs = objects()
    container = operator_container()
    assert container["name"] == "operator"
    assert container["command"] == [
        "kopf", "run", "-m", "binbatch_operator.main", "--all-namespaces", f"--peering={RELEASE}",
        "--liveness=http://0.0.0.0:8080/healthz", "--log-format=json",
    ]  # fmt: skip
    service = one(objs, "Service")["metadata"]["name"]
    assert env(container) == {
        "POD_NAMESPACE": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        "POD_ID": {"fieldRef": {"fieldPath": "metadata.name"}},
        "BINBATCH_SIDECAR_IMAGE": f"ghcr.io/binbatch/binbatch:{_chart().metadata['appVersion']}",
        "BINBATCH_SIDECAR_NATIVE": "false",
        "BINBATCH_ALLOWED_IMAGES": "ghcr.io/binbatch/binbatch",
        "BINBATCH_ALLOW_REMOTE_URLS": "false",
        "BINBATCH_NETWORK_POLICY": "true",
        "BINBATCH_NETWORK_POLICY_METRICS_FROM": "[]",
        "BINBATCH_WEBHOOK_SERVICE": service,
        "BINBATCH_WEBHOOK_ADDRESS": "0.0.0.0",
        "BINBATCH_WEBHOOK_PORT": "9443",
        "BINBATCH_WEBHOOK_HOSTNAMES": f"{service}.{NAMESPACE}.svc,{service}.{NAMESPACE}.svc.cluster.local,"
                                      f"{service}.{NAMESPACE},{service}",
        "BINBATCH_WEBHOOK_CERT_SECRET": f"{RELEASE}-webhook-cert",
        "BINBATCH_ADMIN_SIGNING_SECRET": f"{RELEASE}-admin-signing",
        "BINBATCH_WEBHOOK_CONFIG": one(objs, "MutatingWebhookConfiguration")["metadata"]["name"],
        "BINBATCH_STATS_INTERVAL_SECONDS": "15",
    }  # fmt: skip
    slower = operator_container({"operator": {"statsIntervalSeconds": 30}})
    assert env(slower)["BINBATCH_STATS_INTERVAL_SECONDS"] == "30"


def test_image_tag_defaults_to_the_app_version_and_the_sidecar_uses_the_same_image():
    app_version = _chart().metadata["appVersion"]
    assert operator_container()["image"] == f"ghcr.io/binbatch/binbatch:{app_version}"
    custom = operator_container(CUSTOM_TAG)
    assert custom["image"] == "ghcr.io/binbatch/binbatch:1.2.3-rc1"
    assert env(custom)["BINBATCH_SIDECAR_IMAGE"] == "ghcr.io/binbatch/binbatch:1.2.3-rc1"


def test_sidecar_image_can_differ_from_the_operators():
    container = operator_container({"sidecar": {"image": "registry.example/sidecar:2"}})
    assert container["image"] == f"ghcr.io/binbatch/binbatch:{_chart().metadata['appVersion']}"
    assert env(container)["BINBATCH_SIDECAR_IMAGE"] == "registry.example/sidecar:2"


# ------------------------------------------------------------------ the admission webhook


def test_webhook_calls_inject_sidecar_on_the_operators_service_and_ignores_failures_by_default():
    objs = objects()
    (hook,) = one(objs, "MutatingWebhookConfiguration")["webhooks"]
    service = one(objs, "Service")
    assert hook["name"] == "inject-sidecar.binbatch.io"
    assert hook["clientConfig"] == {
        "service": {"namespace": NAMESPACE, "name": service["metadata"]["name"], "path": "/inject-sidecar", "port": 443}
    }  # no caBundle: the operator patches in the CA it generates
    assert hook["failurePolicy"] == "Ignore" and hook["timeoutSeconds"] == 5
    assert hook["sideEffects"] == "None" and hook["admissionReviewVersions"] == ["v1"]
    assert hook["reinvocationPolicy"] == "Never"
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"],
                              "operations": ["CREATE"], "scope": "Namespaced"}]  # fmt: skip
    (expr,) = hook["namespaceSelector"]["matchExpressions"]
    assert expr["key"] == "kubernetes.io/metadata.name" and expr["operator"] == "NotIn"
    assert set(expr["values"]) == {"kube-system", "kube-node-lease", "kube-public", NAMESPACE}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector's meaning (matchLabels and matchExpressions), as the API server applies it."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]  # fmt: skip
        if not ok:
            return False
    return True


def _namespace(name: str, **labels: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": name, **labels}


def test_webhook_is_opt_in_per_namespace_by_default_and_never_sees_system_namespaces():
    (hook,) = one(objects(), "MutatingWebhookConfiguration")["webhooks"]
    selector = hook["namespaceSelector"]
    assert selector["matchLabels"] == {"binbatch.io/inject": "enabled"}
    assert _selects(selector, _namespace("ml", **{"binbatch.io/inject": "enabled"}))
    assert not _selects(selector, _namespace("ml"))  # not labelled: its pods never reach the webhook
    assert not _selects(selector, _namespace("web", **{"binbatch.io/inject": "disabled"}))
    for system in ("kube-system", NAMESPACE):
        assert not _selects(selector, _namespace(system, **{"binbatch.io/inject": "enabled"}))
    assert "objectSelector" not in hook


def test_webhook_scope_comes_from_values_and_keeps_the_exclusions():
    (hook,) = one(objects(SCOPED), "MutatingWebhookConfiguration")["webhooks"]
    selector = hook["namespaceSelector"]
    assert "matchLabels" not in selector
    assert _selects(selector, _namespace("ml", team="ml")) and not _selects(selector, _namespace("web", team="web"))
    assert not _selects(selector, _namespace(NAMESPACE, team="ml"))
    assert hook["objectSelector"] == {"matchLabels": {"binbatch.io/inject": "enabled"}}
    (everywhere,) = one(objects(EVERY_NAMESPACE), "MutatingWebhookConfiguration")["webhooks"]
    assert _selects(everywhere["namespaceSelector"], _namespace("anything"))
    assert not _selects(everywhere["namespaceSelector"], _namespace("kube-system"))


def test_webhook_listen_address_port_and_certificate_names_come_from_values():
    container = operator_container(SCOPED)
    variables = env(container)
    assert (variables["BINBATCH_WEBHOOK_ADDRESS"], variables["BINBATCH_WEBHOOK_PORT"]) == ("::", "10443")
    hosts = variables["BINBATCH_WEBHOOK_HOSTNAMES"].split(",")
    assert hosts[0] == f"{RELEASE}-webhook.{NAMESPACE}.svc" and hosts[-2:] == ["hook.example.org", "10.0.0.9"]
    assert variables["BINBATCH_SIDECAR_NATIVE"] == "true"


def test_cert_manager_issues_the_certificate_and_injects_the_ca():
    objs = objects(CERT_MANAGER)
    config = one(objs, "MutatingWebhookConfiguration")
    certificates = {c["metadata"]["name"]: c for c in objs if c["kind"] == "Certificate"}
    serving = certificates[f"{RELEASE}-webhook"]
    assert config["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": f"{NAMESPACE}/{RELEASE}-webhook"}
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    service = one(objs, "Service")["metadata"]["name"]
    assert f"{service}.{NAMESPACE}.svc" in serving["spec"]["dnsNames"]
    # The chart's own chain: self-signed root -> CA Certificate -> CA Issuer -> serving certificate.
    issuers = {i["metadata"]["name"]: i["spec"] for i in objs if i["kind"] == "Issuer"}
    ca_issuer = issuers[serving["spec"]["issuerRef"]["name"]]
    assert ca_issuer == {"ca": {"secretName": certificates[f"{RELEASE}-ca"]["spec"]["secretName"]}}
    assert certificates[f"{RELEASE}-ca"]["spec"]["isCA"] is True
    assert issuers[certificates[f"{RELEASE}-ca"]["spec"]["issuerRef"]["name"]] == {"selfSigned": {}}
    # The operator serves the mounted Secret and patches no CA.
    container = operator_container(CERT_MANAGER)
    variables = env(container)
    assert variables["BINBATCH_WEBHOOK_CERT_DIR"] == "/etc/binbatch/webhook-tls"
    assert "BINBATCH_WEBHOOK_CERT_SECRET" not in variables
    assert variables["BINBATCH_WEBHOOK_CONFIG"] == config["metadata"]["name"]  # read for its namespaceSelector
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/etc/binbatch/webhook-tls")
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == serving["spec"]["secretName"] and mount["readOnly"] is True


def test_cert_manager_can_use_an_existing_issuer():
    objs = objects(CERT_MANAGER_ISSUER)
    assert not [o for o in objs if o["kind"] == "Issuer"]
    (serving,) = [o for o in objs if o["kind"] == "Certificate"]
    assert serving["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer"}


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"webhook": {"certificate": {"source": "Vault"}}}, "source"),
        ({"operator": {"replicas": 0}}, "replicas"),
        ({"webhook": {"namespaceSelector": {"matchExpressions": [{"key": "a", "operator": "Like"}]}}}, "operator"),
        ({"webhook": {"extraHostnames": ["bad name"]}}, "extraHostnames"),
    ],
)
def test_bad_new_values_are_refused_naming_the_field(values, named):
    with pytest.raises(helm.HelmValuesError, match=named):
        _chart().render(values, name=RELEASE, namespace=NAMESPACE)


def test_webhook_service_reaches_the_operators_webhook_port():
    objs = objects()
    service = one(objs, "Service")
    assert service["spec"]["ports"] == [{"name": "https", "port": 443, "targetPort": "webhook", "protocol": "TCP"}]
    pod_labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_webhook_failure_policy_and_timeout_come_from_values():
    objs = objects({"webhook": {"failurePolicy": "Fail", "timeoutSeconds": 10}})
    (hook,) = one(objs, "MutatingWebhookConfiguration")["webhooks"]
    assert (hook["failurePolicy"], hook["timeoutSeconds"]) == ("Fail", 10)


# ------------------------------------------------------------------ monitoring


def test_service_monitor_scrapes_the_services_the_operator_creates():
    monitor = one(objects(MONITORING), "ServiceMonitor")
    service = build_service("p", "ns", {"selector": {"matchLabels": {"app": "x"}}})
    sidecar_name = MANAGED_LABELS["app.kubernetes.io/name"]
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": sidecar_name}
    assert selects(monitor["spec"]["selector"], service["metadata"]["labels"])
    headless = build_headless_service("p", "ns", {"selector": {"matchLabels": {"app": "x"}}, "service": {"headless": True}})
    assert not selects(monitor["spec"]["selector"], headless["metadata"]["labels"])  # the same pods: scraped once
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": "15s"}
    assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["metadata"]["labels"]["release"] == "prometheus"


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector's meaning (matchLabels and the four matchExpressions operators)."""
    if not selector["matchLabels"].items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        held = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[op]  # fmt: skip
        if not held:
            return False
    return True


def test_service_monitor_can_scrape_the_engines_through_the_sidecars_http_port():
    monitor = one(objects(KEDA), "ServiceMonitor")
    assert monitor["spec"]["endpoints"][1] == {"port": "http", "path": "/metrics", "interval": "15s"}
    service = build_service("p", "ns", {"selector": {"matchLabels": {"app": "x"}}})
    assert "http" in {p["name"] for p in service["spec"]["ports"]}


# ------------------------------------------------------------------ autoscaling


def test_keda_scales_the_target_on_the_backlog_per_pod():
    (scaled,) = [o for o in objects(KEDA) if o["kind"] == "ScaledObject"]
    spec = scaled["spec"]
    assert scaled["metadata"]["namespace"] == NAMESPACE
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "vllm"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 6)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"] == {
        "serverAddress": "http://prometheus.monitoring:9090", "threshold": "12",
        "query": f'sum(binbatch_requests_waiting{{namespace="{NAMESPACE}", pod=~"vllm-.*"}})',
    }  # fmt: skip
    assert not [o for o in objects(KEDA) if o["kind"] == "HorizontalPodAutoscaler"]


def test_keda_query_and_namespace_can_be_set():
    values = {"autoscaling": {"target": {"name": "vllm", "namespace": "llm"},
                              "keda": {"enabled": True, "query": 'sum(binbatch_requests_waiting{service="fast-binbatch"})'}}}  # fmt: skip
    (scaled,) = [o for o in objects(values) if o["kind"] == "ScaledObject"]
    assert scaled["metadata"]["namespace"] == "llm"
    assert scaled["spec"]["triggers"][0]["metadata"]["query"] == 'sum(binbatch_requests_waiting{service="fast-binbatch"})'
    validate_kubernetes(scaled)


def test_notes_name_the_autoscaler_to_watch():
    assert f"kubectl --namespace {NAMESPACE} get scaledobject vllm-binbatch" in rendered(KEDA)["binbatch/templates/NOTES.txt"]
    assert f"kubectl --namespace {NAMESPACE} get hpa vllm-binbatch" in rendered(HPA)["binbatch/templates/NOTES.txt"]
    assert "binbatch_requests_waiting" not in rendered()["binbatch/templates/NOTES.txt"]


def test_hpa_scales_on_the_pods_metric_the_adapter_serves():
    hpa = one(objects(HPA), "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "vllm"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "binbatch_requests_waiting"}, "target": {"type": "AverageValue", "averageValue": "8"}}}]  # fmt: skip
    assert not [o for o in objects(HPA) if o["kind"] == "ScaledObject"]


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"autoscaling": {"keda": {"enabled": True}}}, "autoscaling.target.name"),
        ({"autoscaling": {"target": {"name": "v"}, "keda": {"enabled": True}, "hpa": {"enabled": True}}}, "not both"),
        ({"autoscaling": {"target": {"name": "v"}, "minReplicas": 5, "maxReplicas": 2, "hpa": {"enabled": True}}},
         "autoscaling.minReplicas (5) must be <= autoscaling.maxReplicas (2)"),
    ],
    ids=["no target", "both", "min above max"],
)
def test_bad_autoscaling_values_fail_the_render_naming_the_value(values, says):
    with pytest.raises(helm.HelmRenderError, match=re.escape(says)):
        _chart().render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize(
    "values",
    [{"autoscaling": {"minReplicas": 0}}, {"autoscaling": {"target": {"kind": "DaemonSet"}}},
     {"autoscaling": {"keda": {"serverAddress": "prometheus:9090"}}}, {"autoscaling": {"hpa": {"enable": True}}}],
    ids=["zero replicas", "DaemonSet", "address without scheme", "misspelt key"],
)  # fmt: skip
def test_the_values_schema_refuses_bad_autoscaling_values(values):
    with pytest.raises(helm.HelmValuesError):
        _chart().render(values, name=RELEASE, namespace=NAMESPACE)


# Issue 12's contract (CONTRACTS-12.md): the series helper i12-signals adds to
# sidecar_metrics.py on its branch.  Once merged they are exported and this set is redundant.
ISSUE_12_SERIES = {"binbatch_requests_waiting"} | {
    f"binbatch_request_{name}_seconds{suffix}" for name in ("e2e", "ttft") for suffix in ("_bucket", "_sum", "_count")
}


def _exported_series() -> set[str]:
    """Every series name the sidecar's registry can expose."""
    names = set()
    for family in SidecarMetrics().registry.collect():
        if family.type == "counter":
            names |= {family.name + "_total"}
        elif family.type == "histogram":
            names |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
        else:
            names.add(family.name)
    return names


def _dashboard() -> dict[str, Any]:
    config_map = one(objects(MONITORING), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    (text,) = config_map["data"].values()
    return json.loads(text)


def test_dashboard_queries_only_metrics_the_sidecar_exports():
    dashboard = _dashboard()
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {name for expr in exprs for name in re.findall(r"\bbinbatch_[a-z0-9_]+", expr)}
    assert used, "no binbatch_* metric in the dashboard"
    known = _exported_series() | ISSUE_12_SERIES
    assert used <= known, f"not exported by the sidecar: {sorted(used - known)}"
    engine = {name for expr in exprs for name in re.findall(r"\bvllm:[a-z0-9_:]+", expr)}
    vllm_names = {name for names in ALIASES.values() for name in names}
    assert engine <= vllm_names, f"not a vLLM metric the sidecar knows: {sorted(engine - vllm_names)}"
    for expr in exprs:
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            labels = {label.strip() for label in group.split(",")}
            assert labels <= {"bin", "outcome", "reason", "le", "pod", "namespace", "service", "model_name"}, expr
    # the headline panels the dashboard promises
    titles = {p["title"] for p in dashboard["panels"]}
    for title in ("Requests by outcome", "Queue depth per bin", "B_mem per bin", "Predictor accuracy",
                  "Requests waiting (sidecar + engine)", "End-to-end latency p50 / p99 by model",
                  "Time to first token p50 / p99 by model", "KV-cache usage"):  # fmt: skip
        assert title in titles


def test_dashboard_shows_kv_cache_usage_beside_the_target_batch_size_under_both_vllm_names():
    panels = {p["title"]: p for p in _dashboard()["panels"]}
    kv, target = panels["KV-cache usage"], panels["Target batch size B_t per bin"]
    assert kv["gridPos"]["y"] == target["gridPos"]["y"]  # the same row
    (expr,) = [t["expr"] for t in kv["targets"]]
    assert "vllm:kv_cache_usage_perc" in expr and "vllm:gpu_cache_usage_perc" in expr
    waiting = " ".join(t["expr"] for t in panels["Requests waiting (sidecar + engine)"]["targets"])
    assert "binbatch_requests_waiting" in waiting and "vllm:num_requests_waiting" in waiting
    for title in ("End-to-end latency p50 / p99 by model", "Time to first token p50 / p99 by model"):
        assert all("by (le, model_name)" in t["expr"] for t in panels[title]["targets"])


def test_dashboard_panels_fit_the_grid_with_unique_ids():
    panels = _dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]


# ------------------------------------------------------------------ manifests/install


def test_install_manifest_is_the_rendered_chart():
    assert INSTALL.read_text() == render_manifests_module().render(), "run: python charts/render_manifests.py"


def test_install_manifest_creates_the_namespace_then_the_crd_then_the_operator():
    docs = [doc for doc in yaml.safe_load_all(INSTALL.read_text()) if doc]
    kinds = [d["kind"] for d in docs]
    assert kinds[:4] == ["Namespace", "CustomResourceDefinition", "CustomResourceDefinition", "CustomResourceDefinition"]
    assert docs[0]["metadata"]["name"] == NAMESPACE
    assert docs[0]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert docs[1] == yaml.safe_load(CRD_SOURCE.read_text())
    assert docs[2] == yaml.safe_load(PEERING_CRD.read_text())
    assert docs[3] == yaml.safe_load(NAMESPACED_PEERING_CRD.read_text())
    assert sorted(kinds[4:]) == sorted(o["kind"] for o in objects())
    assert kinds.index("MutatingWebhookConfiguration") > kinds.index("Deployment")
    for doc in docs:
        validate_kubernetes(doc)
        if doc["kind"] in NAMESPACED:
            assert doc["metadata"]["namespace"] == NAMESPACE


# ------------------------------------------------------------------ manifests/samples


def _policies(path: Path) -> list[dict[str, Any]]:
    return [d for d in sample_docs(path) if d["kind"] == "BatchingPolicy"]


def _workload_pods(path: Path) -> list[dict[str, Any]]:
    return [d["spec"]["template"] for d in sample_docs(path) if d["kind"] in ("Deployment", "StatefulSet")]


def _container(template: dict[str, Any]) -> dict[str, Any]:
    (container,) = template["spec"]["containers"]
    return container


@pytest.mark.parametrize("path", SAMPLES, ids=[p.name for p in SAMPLES])
def test_sample_policy_is_valid_for_the_operator_and_the_crd(path):
    policies = _policies(path)
    assert len(policies) == 1
    for policy in policies:
        assert policy["apiVersion"] == "binbatch.io/v1alpha1"
        errors = sorted(policy_validator().iter_errors(policy), key=str)
        assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)
        sidecar_config(policy["spec"])  # raises ConfigError naming spec.<field>


@pytest.mark.parametrize("path", SAMPLES, ids=[p.name for p in SAMPLES])
def test_sample_workloads_are_valid_kubernetes_objects(path):
    for doc in sample_docs(path):
        if doc["kind"] != "BatchingPolicy":
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("path", SAMPLES, ids=[p.name for p in SAMPLES])
def test_sample_policy_selects_the_samples_engine_and_calls_its_port(path):
    (policy,) = _policies(path)
    selector = policy["spec"]["selector"]["matchLabels"]
    (pod,) = [t for t in _workload_pods(path) if selector.items() <= t["metadata"]["labels"].items()]
    engine = _container(pod)
    url = policy["spec"]["engine"]["url"]
    assert url.startswith("http://127.0.0.1:")
    assert int(url.rsplit(":", 1)[1]) in {p["containerPort"] for p in engine["ports"]}
    assert engine["readinessProbe"]["httpGet"]["path"] == policy["spec"]["engine"].get("healthPath", "/health")
    assert policy["spec"]["metrics"]["url"] == url + "/metrics"
    assert sample_docs(path)[0]["kind"] == "BatchingPolicy", "the policy comes first so new pods get the sidecar"


def test_cpu_sample_runs_the_real_emulator_cli_on_all_interfaces():
    path = ROOT / "manifests" / "samples" / "cpu-emulator.yaml"
    (policy,) = _policies(path)
    (pod,) = _workload_pods(path)
    engine = _container(pod)
    command = engine["command"]
    assert command[:2] == ["binbatch", "emulate-engine"]
    args = build_parser().parse_args(command[1:])
    emulator = config_from_args(args)  # raises ValueError on a bad flag combination
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert emulator.model == policy["spec"]["engine"]["model"]
    assert policy["spec"]["bins"]["maxOutputTokens"] <= emulator.max_model_len
    sc = engine["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert engine["image"].startswith("ghcr.io/binbatch/binbatch:")


def test_gpu_sample_serves_the_policys_model_on_one_gpu():
    path = ROOT / "manifests" / "samples" / "gpu-vllm.yaml"
    (policy,) = _policies(path)
    (pod,) = _workload_pods(path)
    engine = _container(pod)
    assert engine["image"].startswith("vllm/vllm-openai:")
    args = engine["args"]
    assert args[args.index("--model") + 1] == policy["spec"]["engine"]["model"]
    assert args[args.index("--host") + 1] == "0.0.0.0" and args[args.index("--port") + 1] == "8000"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "vllm"


def test_crd_check_refuses_a_misspelt_policy_field():
    (policy,) = _policies(ROOT / "manifests" / "samples" / "cpu-emulator.yaml")
    policy["spec"]["batch"]["maxBatchSizee"] = 64
    assert any("maxBatchSizee" in e.message for e in policy_validator().iter_errors(policy))
    with pytest.raises(ConfigError, match="spec.batch.maxBatchSizee"):
        sidecar_config(policy["spec"])


def test_every_env_var_the_chart_sets_is_read_by_the_operator():
    """A renamed variable on either side would silently fall back to a default."""
    import re

    source = (ROOT / "operator" / "main.py").read_text()
    read = set(re.findall(r'os\.environ\.get\("([A-Z_]+)"', source))
    # allowlist.py reads its two variables by the names its *_ENV constants hold.
    bounds = (ROOT / "operator" / "allowlist.py").read_text()
    read |= set(re.findall(r'^[A-Z_]+_ENV = "([A-Z_]+)"', bounds, re.M))
    read_by_kopf = {"POD_ID"}  # the replica's name in the peering object (kopf's peering.detect_own_id)
    # the built-in certificate's lifetime: a year unless set, which only the renewal tests do (not a chart value)
    not_from_the_chart = {"BINBATCH_WEBHOOK_CERT_SECONDS"}
    chart = set().union(*(env(operator_container(values)) for values in VALUE_SETS.values()))
    assert chart == (read - not_from_the_chart) | read_by_kopf


@pytest.mark.parametrize("path", SAMPLES, ids=[p.name for p in SAMPLES])
def test_sample_tells_to_opt_its_namespace_in_before_applying(path):
    """The webhook is opt-in by default: a sample applied to an unlabelled namespace gets no sidecar."""
    (selector,) = [o for o in objects() if o["kind"] == "MutatingWebhookConfiguration"]
    ((key, value),) = selector["webhooks"][0]["namespaceSelector"]["matchLabels"].items()
    text = path.read_text()
    assert re.search(rf"kubectl label namespace \S+ {re.escape(key)}={value}", text), path.name
    assert text.index(f"{key}={value}") < text.index(" apply -f manifests/samples/")


def test_allowed_images_and_remote_urls_reach_the_operators_check():
    """sidecar.allowedImages / allowRemoteUrls -> the operator's environment -> what a policy may ask for."""
    from binbatch_operator.allowlist import Allowlist

    def bounds(values: dict[str, Any] | None = None) -> Allowlist:
        variables = env(operator_container(values))
        return Allowlist.from_environment(variables["BINBATCH_SIDECAR_IMAGE"], variables)

    default = bounds()
    assert default.problems({"sidecar": {"image": "ghcr.io/binbatch/binbatch:0.2.0"}}) == []
    assert [p for p, _ in default.problems({"sidecar": {"image": "docker.io/evil/binbatch:1"}})] == ["spec.sidecar.image"]
    assert [p for p, _ in default.problems({"engine": {"url": "http://vllm.other:8000"}})] == ["spec.engine.url"]
    opened = bounds({"sidecar": {"allowedImages": ["registry.corp/ml/", "docker.io/evil/*"], "allowRemoteUrls": True}})
    assert opened.problems({"sidecar": {"image": "docker.io/evil/binbatch:1"}, "engine": {"url": "http://vllm.other:8000"}}) == []
    assert opened.problems({"sidecar": {"image": "registry.corp/ml/binbatch@sha256:" + "0" * 64}}) == []
    # The listed entries replace the default: the operator's own repository is no longer listed,
    # but its own sidecar image (the default a policy gets) stays allowed.
    assert [p for p, _ in opened.problems({"sidecar": {"image": "ghcr.io/binbatch/binbatch:9"}})] == ["spec.sidecar.image"]
    assert opened.problems({"sidecar": {"image": "ghcr.io/binbatch/binbatch:0.1.0"}}) == []
    with pytest.raises(helm.HelmValuesError, match="allowedImages"):
        rendered({"sidecar": {"allowedImages": ["a,b"]}})
