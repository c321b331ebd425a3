"""The operator's pure parts: builders, the admission decision, status, certificates."""

from __future__ import annotations

import ssl
import json
import logging
import re
from pathlib import Path

import pytest
import yaml
import kopf
from cryptography import x509
from kubernetes.client.exceptions import ApiException

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_operator import builders
from binbatch_operator.indexes import Seen, Watched
from binbatch_operator.reconcile import Context, admit, candidate, reconcile
from binbatch_operator.status import (
    ApiFailure,
    Condition,
    PodReport,
    adjustments,
    aggregate,
    changed_fields,
    merge_conditions,
)
from binbatch_operator.webhook import fill_namespace, self_signed_certificate, service_hostnames
from binbatch_sidecar.config import ConfigError, parse_config

IMAGE = "registry.example/binbatch:test"
SPEC = {
    "selector": {"matchLabels": {"app": "vllm"}},
    "sidecar": {"grpcPort": 50061, "httpPort": 8181, "metricsPort": 9191, "drainGraceSeconds": 40,
                "resources": {"requests": {"cpu": "100m"}, "limits": {"cpu": 1}}},  # cpu: 1 as a Pod takes it
    "bins": {"mode": "Fixed", "count": 3, "boundaries": [64, 256]},
    "batch": {"maxBatchSize": 64},
}  # fmt: skip


def vllm_pod(labels=None, **spec):
    return {
        "metadata": {"generateName": "vllm-", "namespace": "llm", "labels": labels or {"app": "vllm"}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}], "volumes": [{"name": "cache"}], **spec},
    }


def policy(name, spec=SPEC, generation=3):
    return {"name": name, "spec": spec, "generation": generation}


# -- builders -------------------------------------------------------------------


def test_configmap_carries_the_sidecar_config_the_sidecar_loads():
    cm = builders.build_configmap("fast", "llm", SPEC)
    assert cm["metadata"]["name"] == "fast-binbatch" and cm["metadata"]["namespace"] == "llm"
    cfg = parse_config(yaml.safe_load(cm["data"][builders.CONFIG_KEY]))
    assert cfg.server.grpc_port == 50061 and cfg.server.metrics_port == 9191 and cfg.server.http_port == 8181
    assert list(cfg.bins.boundaries) == [64, 256] and cfg.batch.max_batch_size == 64


def test_spec_sidecar_passthrough_paths_and_request_bytes_reach_the_sidecar_config():
    spec = {**SPEC, "sidecar": {**SPEC["sidecar"], "passthroughPaths": ["/tokenize"], "maxRequestBytes": 1048576}}
    cfg = parse_config(yaml.safe_load(builders.build_configmap("fast", "llm", spec)["data"][builders.CONFIG_KEY]))
    assert cfg.server.passthrough_paths == ["/tokenize"] and cfg.server.max_request_bytes == 1048576
    # at their defaults (as the API server fills them in) they are left out: the ConfigMap is the one it was
    defaulted = {**SPEC, "sidecar": {**SPEC["sidecar"], "passthroughPaths": [], "maxRequestBytes": 4194304}}
    assert builders.sidecar_config(defaulted) == builders.sidecar_config(SPEC)
    assert "passthroughPaths" not in builders.sidecar_config(SPEC)["server"]
    # a new request size is bound at the sidecar's start: the pods that run the old one are told apart
    assert builders.sidecar_hash(spec, "img") != builders.sidecar_hash(SPEC, "img")
    assert builders.sidecar_hash(defaulted, "img") == builders.sidecar_hash(SPEC, "img")


def test_spec_sidecar_connection_settings_reach_the_sidecar_config_and_those_bound_at_start_change_the_hash():
    wanted = {"httpRequestReadTimeoutMilliseconds": 5000, "maxConnections": 64, "grpcMaxConcurrentStreams": 16,
              "grpcMaxConnectionAgeSeconds": 600}  # fmt: skip
    spec = {**SPEC, "sidecar": {**SPEC["sidecar"], **wanted}}
    server = parse_config(yaml.safe_load(builders.build_configmap("fast", "llm", spec)["data"][builders.CONFIG_KEY])).server
    assert (server.http_request_read_timeout_milliseconds, server.max_connections, server.grpc_max_concurrent_streams,
            server.grpc_max_connection_age_seconds) == (5000, 64, 16, 600)  # fmt: skip
    # at their defaults they are left out: the ConfigMap and the pods' digest are the ones before these settings
    defaulted = {**SPEC, "sidecar": {**SPEC["sidecar"], "httpRequestReadTimeoutMilliseconds": 30000,
                                     "maxConnections": 1024, "grpcMaxConcurrentStreams": 1024,
                                     "grpcMaxConnectionAgeSeconds": 1800}}  # fmt: skip
    assert builders.sidecar_config(defaulted) == builders.sidecar_config(SPEC)
    assert builders.sidecar_hash(defaulted, "img") == builders.sidecar_hash(SPEC, "img")
    for key, value in wanted.items():  # a key bound at start-up needs new pods; maxConnections applies live
        changed = {**SPEC, "sidecar": {**SPEC["sidecar"], key: value}}
        assert (builders.sidecar_hash(changed, "img") != builders.sidecar_hash(SPEC, "img")) == (key != "maxConnections")


def test_a_bad_spec_sidecar_connection_setting_is_refused_naming_it():
    with pytest.raises(ConfigError) as err:
        builders.sidecar_config({**SPEC, "sidecar": {"maxConnections": 0}})
    assert [p for p, _ in err.value.problems] == ["spec.sidecar.maxConnections"]


def test_a_bad_spec_sidecar_passthrough_path_is_refused_naming_it():
    with pytest.raises(ConfigError) as err:
        builders.sidecar_config({**SPEC, "sidecar": {"passthroughPaths": ["/v1/../pause"]}})
    assert [p for p, _ in err.value.problems] == ["spec.sidecar.passthroughPaths"]


def test_the_configmap_text_is_the_one_pure_python_yaml_writes():
    """The faster emitter changes no byte: an upgraded operator rewrites no ConfigMap (no sidecar reloads)."""
    long_url = "http://prometheus.monitoring.svc.cluster.local:9090/" + "x" * 80  # past the 80-column fold
    for spec in (SPEC, {**SPEC, "engine": {"url": "http://localhost:8000/"}},
                 {**SPEC, "metrics": {"source": "PromQL", "url": long_url}}, {"batch": {"staticSize": 16}}):  # fmt: skip
        text = builders.build_configmap("fast", "llm", spec)["data"][builders.CONFIG_KEY]
        assert text == yaml.safe_dump(builders.sidecar_config(spec), sort_keys=True)


def test_a_policys_config_is_built_once_per_spec():
    """Every check rebuilds the ConfigMap to compare it: an unchanged spec costs no new YAML."""
    spec = {**SPEC, "batch": {"maxBatchSize": 63}}  # a spec no other test builds
    before = builders.config_text.cache_info()
    first = builders.build_configmap("fast", "llm", spec)
    again = builders.build_configmap("other", "ns", {**spec})  # an equal spec in another object
    after = builders.config_text.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    assert first["data"] == again["data"]
    changed = builders.build_configmap("fast", "llm", {**spec, "batch": {"maxBatchSize": 62}})
    assert "maxBatchSize: 62" in changed["data"][builders.CONFIG_KEY]


def test_service_selects_injected_pods_on_the_sidecar_ports():
    svc = builders.build_service("fast", "llm", SPEC)
    assert svc["spec"]["selector"] == {builders.POLICY_LABEL: "fast"}
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["grpc"]["port"] == 50061 and ports["grpc"]["targetPort"] == "bb-grpc"
    assert ports["metrics"]["port"] == 9191 and ports["metrics"]["targetPort"] == "bb-metrics"
    assert ports["http"]["port"] == 8181 and ports["http"]["targetPort"] == "bb-http"
    assert ports["http"]["appProtocol"] == "http"
    assert svc["metadata"]["labels"]["app.kubernetes.io/name"] == "binbatch-sidecar"


def test_pod_patch_appends_a_locked_down_sidecar_and_keeps_the_pods_own_parts():
    patch = builders.build_pod_patch(vllm_pod(), "fast", 3, SPEC, IMAGE)
    containers = patch["spec"]["containers"]
    assert [c["name"] for c in containers] == ["vllm", builders.SIDECAR_CONTAINER]
    side = containers[1]
    assert side["image"] == IMAGE
    assert side["command"][-1] == "/etc/binbatch/sidecar.yaml"
    assert {p["name"]: p["containerPort"] for p in side["ports"]} == {"bb-grpc": 50061, "bb-http": 8181, "bb-metrics": 9191}
    assert "--http-port" not in side["command"]  # the config's server.httpPort holds
    assert side["readinessProbe"]["grpc"]["port"] == 50061
    sec = side["securityContext"]
    assert sec["runAsNonRoot"] and sec["readOnlyRootFilesystem"] and not sec["allowPrivilegeEscalation"]
    assert side["resources"] == {"requests": {"cpu": "100m"}, "limits": {"cpu": 1}}
    volumes = {v["name"]: v for v in patch["spec"]["volumes"]}
    assert set(volumes) == {"cache", builders.CONFIG_VOLUME, builders.TMP_VOLUME}
    assert volumes[builders.CONFIG_VOLUME]["configMap"] == {"name": "fast-binbatch", "optional": True}
    assert patch["spec"]["terminationGracePeriodSeconds"] == 45  # drain 40 s + 5
    assert patch["metadata"]["labels"] == {builders.POLICY_LABEL: "fast"}
    assert patch["metadata"]["annotations"] == {
        builders.INJECTED_ANNOTATION: "fast@3", builders.SIDECAR_HASH_ANNOTATION: builders.sidecar_hash(SPEC, IMAGE)}


def test_pod_patch_uses_the_policy_image_and_keeps_a_longer_grace_period():
    spec = {**SPEC, "sidecar": {"image": "mine:1"}}
    patch = builders.build_pod_patch(vllm_pod(terminationGracePeriodSeconds=120), "fast", 1, spec, IMAGE)
    assert patch["spec"]["containers"][-1]["image"] == "mine:1"
    assert patch["spec"]["terminationGracePeriodSeconds"] == 120


def test_pod_that_already_has_the_sidecar_is_left_alone():
    pod = vllm_pod()
    pod["spec"]["containers"].append({"name": builders.SIDECAR_CONTAINER, "image": IMAGE})
    assert builders.build_pod_patch(pod, "fast", 1, SPEC, IMAGE) == {}


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ({"app": "vllm"}, {"app": "vllm", "tier": "gpu"}, True),
        ({"app": "vllm", "tier": "cpu"}, {"app": "vllm", "tier": "gpu"}, False),
        ({"app": "vllm"}, None, False),
        ({}, {"app": "vllm"}, False),
    ],
)
def test_selector_matches_every_label(selector, labels, matches):
    assert builders.selector_matches(selector, labels) is matches


# -- the admission decision -------------------------------------------------------


def test_admit_injects_the_one_policy_that_selects_the_pod():
    other = policy("other", {**SPEC, "selector": {"matchLabels": {"app": "tgi"}}})
    patch, warnings = admit(vllm_pod(), [other, policy("fast")], IMAGE)
    assert warnings == []
    assert patch["metadata"]["annotations"][builders.INJECTED_ANNOTATION] == "fast@3"


def test_admit_leaves_unselected_pods_untouched():
    assert admit(vllm_pod({"app": "web"}), [policy("fast")], IMAGE) == ({}, [])


def test_two_policies_on_one_pod_are_reported_not_merged():
    patch, warnings = admit(vllm_pod(), [policy("b"), policy("a")], IMAGE)
    assert patch == {"metadata": {"annotations": {builders.CONFLICT_ANNOTATION: "a,b"}}}
    assert len(warnings) == 1 and "a, b" in warnings[0]


def test_invalid_policy_injects_nothing_and_says_which_field():
    bad = {**SPEC, "batch": {"maxBatchSize": 0}}
    patch, warnings = admit(vllm_pod(), [policy("fast", bad)], IMAGE)
    assert patch == {}
    assert "spec.batch.maxBatchSize" in warnings[0]


# -- status ---------------------------------------------------------------------------


def stats(batch=32, state=pb.METRICS_STATE_FRESH, rps=2.5, bounds=(64.0, 256.0), adjustments=()):
    s = pb.Stats(target_batch_size=batch, bin_boundaries=list(bounds))
    s.metrics_source.state = state
    s.throughput.requests_per_second = rps
    for t, field, a, b, why in adjustments:
        s.recent_adjustments.add(time_unix_seconds=t, field=field, from_value=a, to_value=b, reason=why)
    return s


def by_type(conditions):
    return {c.type: c for c in conditions}


def test_all_sidecars_fresh_makes_the_policy_ready_with_aggregates():
    pods = [PodReport("p1", True, stats=stats(16, rps=1.0)), PodReport("p2", True, stats=stats(48, rps=2.0))]
    conditions, fields = aggregate(pods, [], children_ready=True)
    c = by_type(conditions)
    assert [x.type for x in conditions] == ["Ready", "Valid", "SidecarsInjected", "MetricsAvailable"]
    assert c["Ready"].status == "True" and c["MetricsAvailable"].status == "True"
    assert fields == {"pods": 2, "batchSize": 48, "bins": "64, 256", "throughputRequestsPerSecond": "3"}


def test_no_pods_yet_is_ready_once_children_exist():
    conditions, fields = aggregate([], [], children_ready=True)
    c = by_type(conditions)
    assert fields == {"pods": 0, "batchSize": None, "bins": None, "throughputRequestsPerSecond": None}
    assert c["Ready"].status == "True"
    assert (c["SidecarsInjected"].reason, c["MetricsAvailable"].status) == ("NoPods", "Unknown")
    assert by_type(aggregate([], [], children_ready=False)[0])["Ready"].status == "False"


def test_invalid_spec_names_the_field_and_blocks_ready():
    problems = [("spec.batch.maxBatchSize", "must be >= 1")]
    c = by_type(aggregate([], problems, children_ready=True)[0])
    assert c["Valid"].status == "False" and c["Valid"].reason == "InvalidSpec"
    assert "spec.batch.maxBatchSize: must be >= 1" in c["Valid"].message
    assert c["Ready"].status == "False" and c["Ready"].reason == "InvalidSpec"


def test_pods_without_sidecar_and_conflicts_are_reported():
    old = PodReport("old-pod", injected=False)
    c = by_type(aggregate([old], [], True)[0])
    assert c["SidecarsInjected"].reason == "PodsNeedRestart" and "old-pod" in c["SidecarsInjected"].message
    both = PodReport("shared", injected=False, conflict=["slow"])
    c = by_type(aggregate([both], [], True)[0])
    assert c["SidecarsInjected"].reason == "SelectorConflict"
    assert "shared (also slow; has no sidecar)" in c["SidecarsInjected"].message
    assert c["Ready"].status == "False"


def test_stale_or_silent_sidecars_make_metrics_unavailable():
    c = by_type(aggregate([PodReport("p", True, stats=stats(state=pb.METRICS_STATE_STALE))], [], True)[0])
    assert c["MetricsAvailable"].reason == "EngineMetricsStale"
    c = by_type(aggregate([PodReport("p", True, error="UNAVAILABLE: refused")], [], True)[0])
    assert c["MetricsAvailable"].reason == "SidecarUnreachable" and "UNAVAILABLE" in c["MetricsAvailable"].message


def test_transition_time_changes_only_when_status_flips():
    first = merge_conditions(None, [Condition("Ready", "False", "Reconciling", "")], 1, "2026-01-01T00:00:00Z")
    same = merge_conditions(first, [Condition("Ready", "False", "Other", "x")], 2, "2026-01-01T00:01:00Z")
    flip = merge_conditions(same, [Condition("Ready", "True", "Ready", "")], 2, "2026-01-01T00:02:00Z")
    assert same[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z" and same[0]["observedGeneration"] == 2
    assert flip[0]["lastTransitionTime"] == "2026-01-01T00:02:00Z"


def test_adjustments_are_deduplicated_and_bounded():
    changes = [(1_800_000_000 + i, "target_batch_size", str(i), str(i + 1), "kv_memory") for i in range(30)]
    pods = [PodReport("p", True, stats=stats(adjustments=changes))]
    first = adjustments(pods, None)
    assert len(first) == 20 and first[-1]["to"] == "30" and first[-1]["reason"] == "kv_memory"
    assert adjustments(pods, first) == first  # asking again adds nothing


# -- the webhook's certificate and request fix ------------------------------------------


def test_self_signed_certificate_serves_tls_for_service_names_and_ips(tmp_path: Path):
    names = [*service_hostnames("binbatch-webhook", "binbatch-system"), "127.0.0.1"]
    cert_pem, key_pem = self_signed_certificate(names)
    cert = x509.load_pem_x509_certificate(cert_pem)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "binbatch-webhook.binbatch-system.svc" in sans.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    (tmp_path / "c.pem").write_bytes(cert_pem)
    (tmp_path / "k.pem").write_bytes(key_pem)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")  # the key matches the cert
    client = ssl.create_default_context(cadata=cert_pem.decode())  # and it is its own CA
    assert client.cert_store_stats()["x509_ca"] == 1


def test_fill_namespace_copies_the_request_namespace_only_when_missing():
    review = {"request": {"namespace": "llm", "object": {"metadata": {"generateName": "vllm-"}}}}
    assert fill_namespace(review)["request"]["object"]["metadata"]["namespace"] == "llm"
    review = {"request": {"namespace": "llm", "object": {"metadata": {"namespace": "other"}}}}
    assert fill_namespace(review)["request"]["object"]["metadata"]["namespace"] == "other"


def test_built_objects_pass_the_kubernetes_schemas():
    import kubernetes_validate

    pod = vllm_pod()
    pod |= {"apiVersion": "v1", "kind": "Pod"}
    patch = builders.build_pod_patch(pod, "fast", 3, SPEC, IMAGE)
    injected = {**pod, "metadata": {**pod["metadata"], **patch["metadata"]}, "spec": {**pod["spec"], **patch["spec"]}}
    injected["spec"]["volumes"] = [v if v["name"] != "cache" else {"name": "cache", "emptyDir": {}} for v in injected["spec"]["volumes"]]
    for obj in (injected, builders.build_configmap("fast", "llm", SPEC), builders.build_service("fast", "llm", SPEC)):
        kubernetes_validate.validate(obj, "1.30", strict=True)


def test_sidecar_hash_follows_the_container_not_the_batching_settings():
    base = builders.sidecar_hash(SPEC, IMAGE)
    assert builders.build_pod_patch(vllm_pod(), "fast", 3, SPEC, IMAGE)["metadata"]["annotations"][
        builders.SIDECAR_HASH_ANNOTATION] == base  # fmt: skip
    assert builders.sidecar_hash({**SPEC, "batch": {"maxBatchSize": 8}}, IMAGE) == base  # reloads live
    assert builders.sidecar_hash(SPEC, "registry.example/binbatch:next") != base
    assert builders.sidecar_hash({**SPEC, "sidecar": {**SPEC["sidecar"], "grpcPort": 50099}}, IMAGE) != base


def test_pods_with_an_older_sidecar_container_are_reported():
    pods = [PodReport("new", True, stats=stats()), PodReport("old", True, outdated=True, stats=stats())]
    c = by_type(aggregate(pods, [], True)[0])
    assert c["SidecarsInjected"].reason == "SidecarOutdated" and c["SidecarsInjected"].message.endswith(": old")
    assert c["Ready"].status == "False"


# -- child names (defect 5) --------------------------------------------------------------

DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # Service names (k8s validation.IsDNS1035Label)
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")  # k8s IsValidLabelValue
DOTTED = "llama-3.1.8b.prod"
LONGEST = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])  # a valid DNS-1123 subdomain of 253


def valid_service_name(name: str) -> bool:
    return len(name) <= 63 and DNS1035_LABEL.fullmatch(name) is not None


@pytest.mark.parametrize("policy_name", [DOTTED, LONGEST, "x" * 60, "7b-model", "fast"])
def test_child_names_are_valid_service_names_for_any_valid_policy_name(policy_name):
    name = builders.child_name(policy_name)
    assert valid_service_name(name), name
    assert name == builders.child_name(policy_name)  # deterministic: found again on every reconcile
    label = builders.policy_label(policy_name)
    assert len(label) <= 63 and LABEL_VALUE.fullmatch(label), label
    # Every place names the children and labels the pods the same way.
    cm, svc = builders.build_configmap(policy_name, "llm", SPEC), builders.build_service(policy_name, "llm", SPEC)
    assert cm["metadata"]["name"] == svc["metadata"]["name"] == name
    patch = builders.build_pod_patch(vllm_pod(), policy_name, 1, SPEC, IMAGE)
    config_volume = next(v for v in patch["spec"]["volumes"] if v["name"] == builders.CONFIG_VOLUME)
    assert config_volume["configMap"]["name"] == name
    assert patch["metadata"]["labels"][builders.POLICY_LABEL] == svc["spec"]["selector"][builders.POLICY_LABEL] == label
    assert cm["metadata"]["labels"][builders.POLICY_LABEL] == label


def test_child_names_keep_the_plain_form_and_never_collide():
    assert builders.child_name("fast") == "fast-binbatch"  # what existing installs already have
    names = {builders.child_name(n) for n in ("a.b", "a-b", "a--b", LONGEST, LONGEST[:-1] + "e", "1a", "a1")}
    assert len(names) == 7
    assert builders.policy_label(LONGEST) != builders.policy_label(LONGEST[:-1] + "e")


# -- policies being deleted, opt-out (defects 2 and 7) -----------------------------------------


def test_admit_ignores_a_policy_being_deleted():
    going = {**policy("fast"), "deletionTimestamp": "2026-01-01T00:00:00Z"}
    assert admit(vllm_pod(), [going], IMAGE) == ({}, [])
    # Nor does it count as a conflict for the policy that stays.
    patch, warnings = admit(vllm_pod(), [going, policy("slow")], IMAGE)
    assert warnings == [] and patch["metadata"]["labels"] == {builders.POLICY_LABEL: "slow"}


def test_a_pod_that_opts_out_gets_no_sidecar_and_is_not_reported():
    pod = vllm_pod()
    pod["metadata"]["annotations"] = {builders.INJECT_ANNOTATION: "false"}
    assert admit(pod, [policy("fast")], IMAGE) == ({}, [])
    assert admit(pod, [policy("fast"), policy("slow")], IMAGE) == ({}, [])  # no conflict annotation either
    pod["metadata"]["annotations"] = {builders.INJECT_ANNOTATION: "true"}
    assert admit(pod, [policy("fast")], IMAGE)[0]["spec"]["containers"][-1]["name"] == builders.SIDECAR_CONTAINER
    c = by_type(aggregate([PodReport("quiet", injected=False, opted_out=True)], [], True)[0])
    assert c["SidecarsInjected"].status == "True" and c["Ready"].status == "True"


# -- messages say what is known (defect 8) ------------------------------------------------------


def test_pods_need_restart_message_does_not_claim_they_predate_the_policy():
    message = by_type(aggregate([PodReport("p", injected=False)], [], True)[0])["SidecarsInjected"].message
    assert "were created before the policy" not in message
    assert "while the webhook was unavailable" in message and message.endswith(": p")


def test_conflict_message_follows_whether_the_pod_runs_a_sidecar():
    pods = [PodReport("with", True, conflict=["slow"], sidecar_of="fast", stats=stats()),
            PodReport("without", False, conflict=["slow"])]  # fmt: skip
    message = by_type(aggregate(pods, [], True)[0])["SidecarsInjected"].message
    assert "with (also slow; runs the sidecar of fast)" in message
    assert "without (also slow; has no sidecar)" in message
    assert "get no sidecar" not in message


# -- API failures are reported in status (defect 4) ------------------------------------------


def test_a_request_the_api_server_rejects_makes_the_policy_invalid_with_its_message():
    failure = ApiFailure("listing pods", 400, "400 unable to parse requirement: invalid label key")
    conditions, fields = aggregate(None, [], True, [failure])
    c = by_type(conditions)
    assert (c["Valid"].status, c["Valid"].reason) == ("False", "RejectedByApiServer")
    assert "listing pods: 400 unable to parse requirement" in c["Valid"].message
    assert (c["Ready"].status, c["Ready"].reason) == ("False", "RejectedByApiServer")
    assert c["SidecarsInjected"].status == "Unknown" and fields == {}  # pod fields kept as they were
    c = by_type(aggregate([], [], False, [ApiFailure("Service x-binbatch", 503, "503 etcd unavailable")])[0])
    assert c["Valid"].status == "True"
    assert (c["Ready"].reason, c["Ready"].message) == ("ApiError", "Service x-binbatch: 503 etcd unavailable")


class FakeKube:
    """The API seam with canned answers: children by (kind, name), and errors to raise; ``pods`` are
    what the watches would show (``Seen``)."""

    def __init__(self, pods=(), errors=None):
        self.children: dict[tuple[str, str], dict] = {}
        self.pods, self.errors, self.calls = list(pods), dict(errors or {}), []
        self.namespace_labels_by_name: dict[str, dict[str, str]] = {}
        self.webhook_selector: dict | None = None  # the webhook configuration's namespaceSelector; None: gone

    def _maybe_fail(self, key):
        self.calls.append(key)
        if key in self.errors:
            raise _api_exception(*self.errors[key])

    async def ensure(self, obj, current):
        self._maybe_fail(("ensure", obj["kind"]))
        if current is not None and builders.covers(current, obj):
            return "unchanged"
        self.children[(obj["kind"], obj["metadata"]["name"])] = obj
        return "created"

    async def delete(self, kind, name, namespace):
        self._maybe_fail(("delete", kind))
        return self.children.pop((kind, name), None) is not None


    async def namespace_labels(self, name):
        self._maybe_fail(("read", "Namespace"))
        return {"kubernetes.io/metadata.name": name, **self.namespace_labels_by_name.get(name, {})}

    async def webhook_namespace_selector(self, name):
        self._maybe_fail(("read", "MutatingWebhookConfiguration"))
        return self.webhook_selector


def _api_exception(code, message, causes=()):
    exc = ApiException(status=code, reason="Err")
    exc.body = json.dumps({"kind": "Status", "code": code, "message": message, "details": {"causes": list(causes)}})
    return exc


def policy_body(name="fast", spec=SPEC, status=None):
    return {"apiVersion": "binbatch.io/v1alpha1", "kind": "BatchingPolicy",
            "metadata": {"name": name, "namespace": "llm", "uid": "u1", "generation": 2},
            "spec": spec, "status": status or {}}  # fmt: skip


async def test_reconcile_reports_a_refused_child_in_status():
    errors = {("ensure", "Service"): (422, 'Service "x" is invalid: metadata.name: Invalid value')}
    kube = FakeKube(errors=errors)
    outcome = await reconcile(Context(kube=kube, sidecar_image=IMAGE), policy_body(), Seen(), logging.getLogger("t"))
    assert [f.what for f in outcome.failures] == ["Service fast-binbatch"]
    valid = next(c for c in outcome.status["conditions"] if c["type"] == "Valid")
    assert valid["status"] == "False" and valid["reason"] == "RejectedByApiServer"
    assert "Service fast-binbatch: 422 Service \"x\" is invalid" in valid["message"]
    assert ("ConfigMap", "fast-binbatch") in kube.children  # the other child is still made


async def test_an_unchanged_status_is_not_written_again():
    kube = FakeKube()
    ctx, log = Context(kube=kube, sidecar_image=IMAGE), logging.getLogger("t")
    first = (await reconcile(ctx, policy_body(), Seen(), log)).status
    again = (await reconcile(ctx, policy_body(status=first), Seen(children=kube.children), log)).status
    assert changed_fields(first, again) == {}
    assert changed_fields({"pods": 1}, {"pods": 2, "bins": None}) == {"pods": 2}


# -- a namespace the webhook does not see (issue 23) --------------------------------------------


def install_namespace_selector():
    """The namespaceSelector of the plain install's webhook (the chart's defaults)."""
    docs = yaml.safe_load_all((Path(__file__).parents[2] / "manifests/install/binbatch.yaml").read_text())
    config = next(d for d in docs if d and d["kind"] == "MutatingWebhookConfiguration")
    return config["webhooks"][0]["namespaceSelector"]


async def sidecars_condition(kube, namespace="llm"):
    body = policy_body()
    body["metadata"]["namespace"] = namespace
    ctx = Context(kube=kube, sidecar_image=IMAGE, webhook_config="binbatch")
    outcome = await reconcile(ctx, body, Seen(pods=kube.pods), logging.getLogger("t"))
    return next(c for c in outcome.status["conditions"] if c["type"] == "SidecarsInjected")


def unlabelled_pod(name):
    return {"metadata": {"name": name, "namespace": "llm", "labels": {"app": "vllm"}}, "spec": {"containers": []}}


async def test_pods_in_a_namespace_not_opted_in_say_how_to_opt_it_in_not_to_recreate_them():
    kube = FakeKube(pods=[unlabelled_pod("vllm-0")])
    kube.webhook_selector = install_namespace_selector()
    c = await sidecars_condition(kube)
    assert (c["status"], c["reason"]) == ("False", "NamespaceNotOptedIn")
    assert "namespace llm is not opted in" in c["message"] and "recreating its pods alone never adds" in c["message"]
    assert "`kubectl label namespace llm binbatch.io/inject=enabled`" in c["message"] and c["message"].endswith(": vllm-0")
    kube.namespace_labels_by_name = {"llm": {"binbatch.io/inject": "enabled"}}  # opted in: now recreating helps
    c = await sidecars_condition(kube)
    assert c["reason"] == "PodsNeedRestart" and "kubectl rollout restart" in c["message"]


async def test_the_operators_own_namespace_is_never_injected_and_says_so():
    kube = FakeKube(pods=[unlabelled_pod("vllm-0")])
    kube.webhook_selector = install_namespace_selector()
    kube.namespace_labels_by_name = {"binbatch-system": {"binbatch.io/inject": "enabled"}}
    c = await sidecars_condition(kube, "binbatch-system")
    assert c["reason"] == "NamespaceNotOptedIn"
    assert "namespace binbatch-system is never injected" in c["message"] and "another namespace" in c["message"]
    assert "kubernetes.io/metadata.name notin (kube-system,kube-node-lease,kube-public,binbatch-system)" in c["message"]


async def test_without_the_webhook_configuration_the_advice_stays_recreate_them():
    for kube in (FakeKube(pods=[unlabelled_pod("p")]),  # the configuration is gone
                 FakeKube(pods=[unlabelled_pod("p")], errors={("read", "MutatingWebhookConfiguration"): (403, "forbidden")})):  # fmt: skip
        assert (await sidecars_condition(kube))["reason"] == "PodsNeedRestart"
    kube = FakeKube(pods=[unlabelled_pod("p")])
    kube.webhook_selector = install_namespace_selector()
    ctx = Context(kube=kube, sidecar_image=IMAGE)  # no BINBATCH_WEBHOOK_CONFIG: not even asked
    outcome = await reconcile(ctx, policy_body(), Seen(pods=kube.pods), logging.getLogger("t"))
    assert ("read", "MutatingWebhookConfiguration") not in kube.calls
    assert next(c for c in outcome.status["conditions"] if c["type"] == "SidecarsInjected")["reason"] == "PodsNeedRestart"


async def test_the_namespace_is_read_only_while_a_pod_lacks_its_sidecar():
    injected = {"metadata": {"name": "p", "namespace": "llm", "labels": {"app": "vllm", builders.POLICY_LABEL: "fast"}},
                "spec": {"containers": []}}  # fmt: skip
    kube = FakeKube(pods=[injected])
    kube.webhook_selector = install_namespace_selector()
    await sidecars_condition(kube)
    assert ("read", "Namespace") not in kube.calls and ("read", "MutatingWebhookConfiguration") not in kube.calls


@pytest.mark.parametrize(
    ("selector", "labels", "command"),
    [
        ({"matchLabels": {"binbatch.io/inject": "enabled"}}, {"binbatch.io/inject": "disabled"},
         "kubectl label namespace llm binbatch.io/inject=enabled --overwrite"),
        ({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gpu", "cpu"]}]}, {}, "kubectl label namespace llm tier=gpu"),
        ({"matchExpressions": [{"key": "llm", "operator": "Exists"}]}, {}, "kubectl label namespace llm llm="),
        ({"matchExpressions": [{"key": "frozen", "operator": "DoesNotExist"}]}, {"frozen": "yes"}, "kubectl label namespace llm frozen-"),
        ({"matchLabels": {"a": "1"}, "matchExpressions": [{"key": "b", "operator": "NotIn", "values": ["x"]}]}, {"b": "x"},
         "kubectl label namespace llm a=1 b-"),
    ],
    ids=["another value", "In", "Exists", "DoesNotExist", "labels and expressions"],
)  # fmt: skip
def test_the_opt_in_command_meets_the_webhooks_own_selector(selector, labels, command):
    from binbatch_operator import opt_in

    message = opt_in.not_reached("llm", labels, selector)
    assert f"`{command}`" in message
    argument_labels = dict(labels)
    for argument in command.split()[4:]:
        if argument.endswith("-"):
            argument_labels.pop(argument[:-1])
        elif "=" in argument:
            key, _, value = argument.partition("=")
            argument_labels[key] = value
    assert opt_in.not_reached("llm", argument_labels, selector) == ""  # the command does opt it in
    assert opt_in.not_reached("llm", labels, {}) == ""  # an empty selector sees every namespace


def test_failed_reconciles_back_off_doubling_up_to_a_cap():
    from binbatch_operator import main

    delays = [main.retry_delay(n) for n in range(4)]
    assert delays == [main.STATS_INTERVAL * 2**n for n in range(4)]
    assert main.retry_delay(1000) == main.MAX_RETRY_DELAY


async def test_every_replica_injects_from_its_watched_policies_without_an_api_request():
    """Every replica watches the policies itself (kopf pauses its own watches on followers), so
    each webhook answers from a current view; a policy being deleted injects nothing."""
    from binbatch_operator import main

    memo = kopf.Memo()
    memo.ctx = Context(kube=FakeKube(), sidecar_image=IMAGE)
    memo.watched = Watched(candidate)
    fast = {**policy_body("fast"), "metadata": {**policy_body("fast")["metadata"], "generation": 3}}
    memo.watched.replace("BatchingPolicy", [fast])

    async def inject(pod):
        patch, warnings = kopf.Patch(), []
        await main.inject_sidecar(body=kopf.Body(pod), patch=patch, warnings=warnings, memo=memo,
                                  logger=logging.getLogger("t"))  # fmt: skip
        return dict(patch), warnings

    patch, warnings = await inject(vllm_pod())
    assert warnings == [] and patch["metadata"]["labels"] == {builders.POLICY_LABEL: "fast"}
    assert memo.ctx.kube.calls == []
    going = {**fast, "metadata": {**fast["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    memo.watched.apply("BatchingPolicy", "MODIFIED", going)
    assert await inject(vllm_pod()) == ({}, [])


async def test_an_invalid_spec_is_warned_about_once_not_on_every_tick(caplog):
    """With posting.loggers on, each warning is an Event: one per change, not one per 15 s."""
    bad = {**SPEC, "batch": {"maxBatchSize": 0}}
    ctx, log = Context(kube=FakeKube(), sidecar_image=IMAGE), logging.getLogger("t")
    with caplog.at_level(logging.WARNING, logger="t"):
        first = (await reconcile(ctx, policy_body(spec=bad), Seen(), log)).status
        await reconcile(ctx, policy_body(spec=bad, status=first), Seen(), log)
    assert len(caplog.records) == 1 and "spec.batch.maxBatchSize" in caplog.records[0].getMessage()


async def test_a_policy_daemon_spawned_while_the_operator_stops_ends_with_it():
    """kopf stops every policy daemon when it exits, but an event it was still processing can
    spawn one after that, whose own stop flag nothing sets: the exit waited for it, cancelled it
    and failed (`kopf run` exited 1 with a TimeoutError).  The operator's close ends it too."""
    import asyncio

    from binbatch_operator import main

    memo = kopf.Memo()
    memo.ctx = Context(kube=FakeKube(), sidecar_image=IMAGE)
    memo.watched = Watched(candidate)
    from kopf._cogs.aiokits.aioenums import AsyncFlagWaiter, FlagSetter  # no public name: kopf makes them

    never = AsyncFlagWaiter(FlagSetter())  # the late daemon's stop flag: nothing sets it
    memo.ctx.kube.close = lambda: None  # the API client close() ends
    await main.close(memo=memo)
    daemon = asyncio.ensure_future(main.follow_policy(stopped=never, body=kopf.Body(policy_body("fast")), memo=memo,
                                                      logger=logging.getLogger("t")))  # fmt: skip
    done, _ = await asyncio.wait([daemon], timeout=main.STATS_INTERVAL * 2)  # its first re-check would come within one
    daemon.cancel()
    assert done == {daemon} and memo.ctx.kube.calls == []
