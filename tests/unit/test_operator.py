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
from binbatch_operator.kube import ChildConflict
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
from binbatch_sidecar.config import GRPC_MAX_CONCURRENT_STREAMS_DEFAULT, ConfigError, parse_config

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
                                     "maxConnections": 1024, "grpcMaxConcurrentStreams": GRPC_MAX_CONCURRENT_STREAMS_DEFAULT,
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


MODEL_CM = {**SPEC, "predictor": {"kind": "Learned", "model": {"configMapKeyRef": {"name": "lengths", "key": "model"}}}}


@pytest.mark.parametrize(
    ("model", "source"),
    [({"configMapKeyRef": {"name": "lengths", "key": "model"}}, {"configMap": {"name": "lengths"}}),
     ({"secretKeyRef": {"name": "lengths", "key": "model"}}, {"secret": {"secretName": "lengths"}})],
    ids=["configmap", "secret"],
)  # fmt: skip
def test_a_model_key_is_mounted_read_only_and_optional_and_becomes_the_warm_start(model, source):
    spec = {**SPEC, "predictor": {"model": model}}
    cfg = parse_config(yaml.safe_load(builders.build_configmap("fast", "llm", spec)["data"][builders.CONFIG_KEY]))
    assert (cfg.predictor.warm_start, cfg.predictor.warm_start_optional) == (builders.MODEL_PATH, True)
    patch = builders.build_pod_patch(vllm_pod(), "fast", 3, spec, IMAGE)
    volumes = {v["name"]: v for v in patch["spec"]["volumes"]}
    [(kind, body)] = [(k, v) for k, v in volumes[builders.MODEL_VOLUME].items() if k != "name"]
    assert {kind: {k: v for k, v in body.items() if k in ("name", "secretName")}} == source
    assert body["optional"] is True  # a missing object or key does not keep the pod from starting
    assert body["items"] == [{"key": "model", "path": "model.npz"}]
    mounts = {m["name"]: m for m in patch["spec"]["containers"][-1]["volumeMounts"]}
    assert mounts[builders.MODEL_VOLUME] == {"name": builders.MODEL_VOLUME, "mountPath": builders.MODEL_DIR, "readOnly": True}
    assert "subPath" not in mounts[builders.MODEL_VOLUME]  # kubelet updates the file in place
    assert builders.MODEL_PATH == f"{builders.MODEL_DIR}/{body['items'][0]['path']}"
    plain = builders.build_pod_patch(vllm_pod(), "fast", 3, SPEC, IMAGE)
    assert builders.MODEL_VOLUME not in {v["name"] for v in plain["spec"]["volumes"]}
    assert builders.MODEL_VOLUME not in {m["name"] for m in plain["spec"]["containers"][-1]["volumeMounts"]}


def test_a_changed_model_reference_marks_running_pods_outdated_and_no_model_changes_nothing():
    other = {**MODEL_CM, "predictor": {"model": {"configMapKeyRef": {"name": "lengths-v2", "key": "model"}}}}
    hashes = {builders.sidecar_hash(s, IMAGE) for s in (SPEC, MODEL_CM, other)}
    assert len(hashes) == 3
    assert builders.sidecar_hash({**SPEC, "predictor": {"kind": "Learned"}}, IMAGE) == builders.sidecar_hash(SPEC, IMAGE)


@pytest.mark.parametrize(
    ("predictor", "field", "message"),
    [({"kind": "Online", "model": {"configMapKeyRef": {"name": "m", "key": "m"}}}, "spec.predictor.model",
      "only read with kind Learned"),
     ({"warmStart": "/m.npz", "model": {"configMapKeyRef": {"name": "m", "key": "m"}}}, "spec.predictor.model",
      "model and warmStart exclude each other"),
     ({"model": {"configMapKeyRef": {"name": "m", "key": "m"}, "secretKeyRef": {"name": "m", "key": "m"}}},
      "spec.predictor.model", "exactly one of configMapKeyRef and secretKeyRef"),
     ({"model": None}, "spec.predictor.model", "must be an object"),
     ({"model": {"secretKeyRef": {"name": "m", "key": "a/b"}}}, "spec.predictor.model.secretKeyRef.key",
      "alphanumeric"),
     ({"model": {"configMapKeyRef": {"key": "m"}}}, "spec.predictor.model.configMapKeyRef.name", "required")],
    ids=["online", "warm-start", "both", "null", "bad-key", "no-name"],
)  # fmt: skip
def test_a_bad_model_reference_is_refused_naming_the_field(predictor, field, message):
    with pytest.raises(ConfigError) as err:
        builders.sidecar_config({**SPEC, "predictor": predictor})
    assert any(path == field and message in text for path, text in err.value.problems), err.value.problems


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
        self.configmaps: dict[str, dict] = {}  # by name: what read_configmap finds (spec.predictor.model's)

    def _maybe_fail(self, key):
        self.calls.append(key)
        if key in self.errors:
            raise _api_exception(*self.errors[key])

    async def ensure(self, obj, current):
        """As ``KubeApi.ensure``: an object of that name (as watched, or found by a create's 409) that is
        not the policy's own is never written."""
        self._maybe_fail(("ensure", obj["kind"]))
        found = current if current is not None else self.children.get((obj["kind"], obj["metadata"]["name"]))
        if found is not None and not builders.owned_by(found, obj):
            raise ChildConflict(obj, found)
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

    async def read_configmap(self, name, namespace):
        self._maybe_fail(("read", "ConfigMap"))
        return self.configmaps.get(name)


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


# -- spec.predictor.model: the ModelReady condition ------------------------------------------------


async def model_ready(kube, spec=MODEL_CM, status=None, ctx=None):
    ctx = ctx or Context(kube=kube, sidecar_image=IMAGE, model_check_seconds=0)
    outcome = await reconcile(ctx, policy_body(spec=spec, status=status), Seen(), logging.getLogger("t"))
    return {c["type"]: c for c in outcome.status["conditions"]}


async def test_a_missing_model_configmap_is_model_not_found_naming_the_field_and_warned_once(caplog):
    kube = FakeKube()
    caplog.set_level(logging.WARNING, logger="t")
    conditions = await model_ready(kube)
    c = conditions["ModelReady"]
    assert (c["status"], c["reason"], c["observedGeneration"]) == ("False", "ModelNotFound", 2)
    assert c["message"].startswith("spec.predictor.model: ConfigMap lengths not found in namespace llm")
    assert "start cold" in c["message"] and "kubectl create configmap lengths --from-file=model=" in c["message"]
    assert conditions["Ready"]["status"] == "True"  # the sidecars serve without it (cold)
    warned = [r.getMessage() for r in caplog.records if "spec.predictor.model" in r.getMessage()]
    assert len(warned) == 1  # an Event
    again = await model_ready(kube, status={"conditions": list(conditions.values())})
    assert again["ModelReady"]["lastTransitionTime"] == c["lastTransitionTime"]
    assert len([r for r in caplog.records if "spec.predictor.model" in r.getMessage()]) == 1


async def test_the_model_configmap_is_found_by_its_binary_key_and_a_missing_or_text_key_is_named():
    kube = FakeKube()
    kube.configmaps["lengths"] = {"metadata": {"name": "lengths"}, "binaryData": {"other": "AAAA"}, "data": {"x": "y"}}
    c = (await model_ready(kube))["ModelReady"]
    assert (c["status"], c["reason"]) == ("False", "ModelNotFound")
    assert "ConfigMap lengths has no key model (its keys: other, x)" in c["message"]
    kube.configmaps["lengths"]["data"]["model"] = "not a model"
    c = (await model_ready(kube))["ModelReady"]
    assert (c["status"], c["reason"]) == ("False", "ModelNotBinary") and "key model is text" in c["message"]
    kube.configmaps["lengths"]["binaryData"]["model"] = "A" * 4096
    c = (await model_ready(kube))["ModelReady"]
    assert (c["status"], c["reason"]) == ("True", "ModelFound") and "holds 3 KiB" in c["message"]


async def test_a_model_secret_is_not_read_and_its_condition_points_at_the_sidecars_metric():
    kube = FakeKube()
    spec = {**SPEC, "predictor": {"model": {"secretKeyRef": {"name": "lengths", "key": "model"}}}}
    c = (await model_ready(kube, spec))["ModelReady"]
    assert (c["status"], c["reason"]) == ("Unknown", "SecretNotChecked")
    assert "binbatch_predictor_model_loaded" in c["message"] and c["message"].startswith("spec.predictor.model: ")
    assert ("read", "ConfigMap") not in kube.calls and ("read", "Secret") not in kube.calls


async def test_the_model_configmap_is_read_at_most_once_a_minute_and_a_failed_read_is_unknown():
    kube = FakeKube(errors={("read", "ConfigMap"): (403, "forbidden")})
    ctx = Context(kube=kube, sidecar_image=IMAGE)
    c = (await model_ready(kube, ctx=ctx))["ModelReady"]
    assert (c["status"], c["reason"]) == ("Unknown", "ModelUnknown") and "reading ConfigMap lengths: 403" in c["message"]
    kube.errors.clear()
    assert (await model_ready(kube, ctx=ctx))["ModelReady"]["reason"] == "ModelNotFound"  # a failure is not kept
    await model_ready(kube, ctx=ctx)
    assert kube.calls.count(("read", "ConfigMap")) == 2  # the answer is reused within model_check_seconds
    plain = await model_ready(FakeKube(), spec=SPEC)
    assert "ModelReady" not in plain


# -- no confused deputy ------------------------------------------------------------


def _desired(uid="u1"):
    cm = builders.build_configmap("fast", "llm", SPEC)
    kopf.adopt(cm, owner=policy_body() | {"metadata": {**policy_body()["metadata"], "uid": uid}})
    return cm


@pytest.mark.parametrize("meta, owned", [
    ({"ownerReferences": [{"kind": "BatchingPolicy", "name": "fast", "uid": "u1"}]}, True),
    ({"ownerReferences": [{"kind": "BatchingPolicy", "name": "fast", "uid": "an-older-fast"}]}, False),
    ({"ownerReferences": [{"kind": "Deployment", "name": "web", "uid": "d1"}],
      "labels": {**builders.MANAGED_LABELS, builders.POLICY_LABEL: "fast"}}, False),
    ({}, False),  # someone's own ConfigMap of that name
    ({"labels": {builders.POLICY_LABEL: "fast"}}, False),  # one of our labels is not enough
    ({"labels": {**builders.MANAGED_LABELS, builders.POLICY_LABEL: "slow"}}, False),
    ({"labels": {**builders.MANAGED_LABELS, builders.POLICY_LABEL: "fast"}}, True),  # orphaned from an earlier 'fast'
])  # fmt: skip
def test_only_the_policys_own_children_count_as_its_own(meta, owned):
    assert builders.owned_by({"metadata": {"name": "fast-binbatch", **meta}}, _desired()) is owned


def test_admit_injects_nothing_for_a_policy_whose_children_are_not_its_own():
    held = policy("fast") | {"childConflict": "ConfigMap llm/fast-binbatch already exists and is not made by this policy"}
    patch, warnings = admit(vllm_pod(), [held], IMAGE)
    assert patch == {} and "does not own its children" in warnings[0] and "llm/fast-binbatch" in warnings[0]
    status = {"conditions": [{"type": "Ready", "status": "False", "reason": "ChildConflict", "message": "m"}]}
    assert candidate({"metadata": {"name": "fast"}, "spec": SPEC, "status": status})["childConflict"] == "m"
    assert not candidate({"metadata": {"name": "fast"}, "spec": SPEC})["childConflict"]


async def test_a_conflicting_child_sets_ready_child_conflict_and_is_not_written():
    class Conflicting(FakeKube):
        async def ensure(self, obj, current):
            if obj["kind"] == "ConfigMap":
                raise ChildConflict(obj, {"metadata": {"ownerReferences": [{"kind": "Deployment", "name": "web"}]}})
            return await super().ensure(obj, current)

    kube = Conflicting()
    outcome = await reconcile(Context(kube=kube, sidecar_image=IMAGE), policy_body(), Seen(), logging.getLogger("t"))
    ready = next(c for c in outcome.status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ChildConflict")
    assert "ConfigMap llm/fast-binbatch already exists and is owned by Deployment/web" in ready["message"]
    assert ("Service", "fast-binbatch") in kube.children and ("ConfigMap", "fast-binbatch") not in kube.children
    assert outcome.failures == []  # not an API error to retry with backoff: the re-check looks again


async def test_a_headless_service_not_the_policys_own_is_never_deleted():
    spec = {**SPEC, "service": {"headless": False}}
    theirs = {"apiVersion": "v1", "kind": "Service",
              "metadata": {"name": "fast-binbatch-headless", "namespace": "llm",
                           "labels": {builders.POLICY_LABEL: "fast"}}}  # fmt: skip
    kube = FakeKube()
    seen = Seen(children={("Service", "fast-binbatch-headless"): theirs})
    await reconcile(Context(kube=kube, sidecar_image=IMAGE), policy_body(spec=spec), seen, logging.getLogger("t"))
    assert ("delete", "Service") not in kube.calls
    ours = {**theirs, "metadata": {**theirs["metadata"], "ownerReferences": [{"kind": "BatchingPolicy", "uid": "u1"}]}}
    kube.children[("Service", "fast-binbatch-headless")] = ours
    seen = Seen(children={("Service", "fast-binbatch-headless"): ours})
    await reconcile(Context(kube=kube, sidecar_image=IMAGE), policy_body(spec=spec), seen, logging.getLogger("t"))
    assert ("delete", "Service") in kube.calls


# -- what the install allows a policy ------------------------------------------------


@pytest.mark.parametrize("image, patterns, allowed", [
    ("ghcr.io/binbatch/binbatch:0.2.0", ("ghcr.io/binbatch/binbatch",), True),
    ("ghcr.io/binbatch/binbatch@sha256:" + "a" * 64, ("ghcr.io/binbatch/binbatch",), True),
    ("ghcr.io/binbatch/binbatch", ("ghcr.io/binbatch/binbatch",), True),
    ("ghcr.io/binbatch/binbatch-evil:1", ("ghcr.io/binbatch/binbatch",), False),  # a repository is no prefix
    ("ghcr.io/binbatch/binbatch.evil.io/x:1", ("ghcr.io/binbatch/binbatch",), False),
    ("localhost:5000/binbatch:1", ("localhost:5000/binbatch",), True),  # a registry port is not a tag
    ("registry.corp/ml/team/binbatch:3", ("registry.corp/ml/",), True),
    ("registry.corp/mlx/binbatch:3", ("registry.corp/ml/",), False),
    ("ghcr.io/binbatch/binbatch:1.4", ("ghcr.io/binbatch/binbatch:1.*",), True),
    ("ghcr.io/binbatch/binbatch:2.0", ("ghcr.io/binbatch/binbatch:1.*",), False),
    ("anything/at:all", ("*",), True),
])  # fmt: skip
def test_an_image_is_allowed_by_repository_path_or_glob(image, patterns, allowed):
    from binbatch_operator.allowlist import image_allowed

    assert image_allowed(image, patterns) is allowed


@pytest.mark.parametrize("section, field", [
    ({"engine": {"url": "http://10.0.0.5:8000"}}, "spec.engine.url"),
    ({"engine": {"url": "http://127.0.0.1@evil.example:8000"}}, "spec.engine.url"),
    ({"metrics": {"source": "PromQL", "url": "http://prometheus.monitoring:9090"}}, "spec.metrics.url"),
    ({"predictor": {"external": {"url": "https://predict.example"}}}, "spec.predictor.external.url"),
    ({"predictor": {"external": {"url": "http://localhost:7000", "feedbackUrl": "http://collect.example/x"}}},
     "spec.predictor.external.feedbackUrl"),
])  # fmt: skip
def test_urls_off_the_pods_loopback_are_refused_naming_the_field_unless_allowed(section, field):
    from binbatch_operator.allowlist import Allowlist

    spec = {**SPEC, **section}
    found = Allowlist(IMAGE).problems(spec)
    assert [p for p, _ in found] == [field] and "allowRemoteUrls" in found[0][1]
    assert Allowlist(IMAGE, remote_urls=True).problems(spec) == []
    loopback = {**SPEC, "engine": {"url": "http://[::1]:8000"}, "metrics": {"url": "https://localhost:8000/metrics"}}
    assert Allowlist(IMAGE).problems(loopback) == []


def test_the_allowlist_environment_is_read_and_a_bad_switch_named():
    from binbatch_operator.allowlist import Allowlist

    bounds = Allowlist.from_environment(IMAGE, {"BINBATCH_ALLOWED_IMAGES": " a/b , c/ ", "BINBATCH_ALLOW_REMOTE_URLS": "TRUE"})
    assert (bounds.patterns, bounds.remote_urls) == (("a/b", "c/"), True)
    assert Allowlist.from_environment(IMAGE, {}).patterns == ("registry.example/binbatch",)
    with pytest.raises(ValueError, match="BINBATCH_ALLOW_REMOTE_URLS"):
        Allowlist.from_environment(IMAGE, {"BINBATCH_ALLOW_REMOTE_URLS": "yes"})


async def test_a_policy_naming_an_image_the_install_does_not_allow_is_invalid_and_injects_nothing():
    spec = {**SPEC, "sidecar": {**SPEC["sidecar"], "image": "docker.io/someone/miner:latest"}}
    kube = FakeKube()
    outcome = await reconcile(Context(kube=kube, sidecar_image=IMAGE), policy_body(spec=spec), Seen(), logging.getLogger("t"))
    valid = next(c for c in outcome.status["conditions"] if c["type"] == "Valid")
    assert (valid["status"], valid["reason"]) == ("False", "InvalidSpec")
    assert "spec.sidecar.image: 'docker.io/someone/miner:latest' is not allowed" in valid["message"]
    assert kube.children == {}  # no ConfigMap, no Service for it
    patch, warnings = admit(vllm_pod(), [policy("fast", spec)], IMAGE)
    assert patch == {} and "spec.sidecar.image" in warnings[0]
    from binbatch_operator.allowlist import Allowlist

    allowed = Allowlist(IMAGE, images=("docker.io/someone/",))
    patch, _ = admit(vllm_pod(), [policy("fast", spec)], IMAGE, allowed)
    assert patch["spec"]["containers"][-1]["image"] == "docker.io/someone/miner:latest"


# -- hostNetwork pods ------------------------------------------------------------------


def test_a_host_network_pod_is_never_injected_and_says_why():
    patch, warnings = admit(vllm_pod(hostNetwork=True), [policy("fast")], IMAGE)
    assert patch == {} and "hostNetwork" in warnings[0] and "policy fast" in warnings[0]
    assert admit(vllm_pod(hostNetwork=False), [policy("fast")], IMAGE)[0]["spec"]["containers"][-1]["name"] == builders.SIDECAR_CONTAINER


async def test_selected_host_network_pods_are_reported_not_asked_to_restart():
    from binbatch_operator.indexes import pod_entry

    host = pod_entry({"metadata": {"name": "vllm-host", "namespace": "llm", "labels": {"app": "vllm"}},
                      "spec": {"hostNetwork": True, "containers": [{"name": "vllm"}]}})  # fmt: skip
    plain = pod_entry({"metadata": {"name": "vllm-plain", "namespace": "llm", "labels": {"app": "vllm"}},
                       "spec": {"containers": [{"name": "vllm"}]}})  # fmt: skip
    assert host["spec"]["hostNetwork"] is True and "hostNetwork" not in plain["spec"]
    kube = FakeKube()
    outcome = await reconcile(Context(kube=kube, sidecar_image=IMAGE), policy_body(), Seen(pods=[host]), logging.getLogger("t"))
    injected = next(c for c in outcome.status["conditions"] if c["type"] == "SidecarsInjected")
    assert (injected["status"], injected["reason"]) == ("False", "HostNetwork")
    assert injected["message"].startswith("1 selected pod(s) use hostNetwork") and "vllm-host" in injected["message"]
    # With a pod that only needs a restart beside it, the pod that never will is what is reported.
    outcome = await reconcile(Context(kube=kube, sidecar_image=IMAGE), policy_body(), Seen(pods=[plain, host]),
                              logging.getLogger("t"))  # fmt: skip
    injected = next(c for c in outcome.status["conditions"] if c["type"] == "SidecarsInjected")
    assert injected["reason"] == "HostNetwork" and "vllm-plain" not in injected["message"]


# -- the sidecar's resources -------------------------------------------------------------

NO_RESOURCES = {**SPEC, "sidecar": {k: v for k, v in SPEC["sidecar"].items() if k != "resources"}}


def _sidecar_of_patch(patch):
    return next(c for c in patch["spec"]["containers"] if c["name"] == builders.SIDECAR_CONTAINER)


def _pod_with(*resources, init=None):
    pod = vllm_pod()
    pod["spec"]["containers"] = [{"name": f"c{i}", "image": "x", "resources": r} for i, r in enumerate(resources)]
    if init is not None:
        pod["spec"]["initContainers"] = [{"name": "init", "image": "x", "resources": init}]
    return pod


GUARANTEED = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "2000m", "memory": "8Gi"}}


def test_an_unset_spec_sidecar_resources_gets_bounded_defaults_and_a_given_one_wins():
    sidecar = _sidecar_of_patch(builders.build_pod_patch(vllm_pod(), "fast", 1, NO_RESOURCES, IMAGE))
    assert sidecar["resources"] == builders.DEFAULT_RESOURCES
    assert sidecar["resources"]["limits"]["memory"] == "768Mi"  # a full 256 MiB queue and its copies fit
    given = _sidecar_of_patch(builders.build_pod_patch(vllm_pod(), "fast", 1, SPEC, IMAGE))
    assert given["resources"] == {"requests": {"cpu": "100m"}, "limits": {"cpu": 1}}
    builders.build_pod_patch(vllm_pod(), "fast", 1, NO_RESOURCES, IMAGE)["spec"]["containers"][-1]["resources"]["requests"]["cpu"] = "9"
    assert builders.DEFAULT_RESOURCES["requests"]["cpu"] == "250m"  # the defaults are copied, never shared


@pytest.mark.parametrize("pod_resources, init, qos", [
    ((GUARANTEED,), None, True),
    ((GUARANTEED, {"limits": {"cpu": "500m", "memory": "1Gi"}}), None, True),  # unstated requests = limits
    ((GUARANTEED, {"requests": {"cpu": "500m", "memory": "1Gi"}}), None, False),  # no limits: Burstable
    ((GUARANTEED, {"requests": {"cpu": "250m", "memory": "1Gi"}, "limits": {"cpu": "500m", "memory": "1Gi"}}), None, False),
    ((GUARANTEED,), {"requests": {"cpu": "1"}}, False),  # an init container counts too
    (({},), None, False),  # BestEffort
])  # fmt: skip
def test_a_guaranteed_pod_keeps_its_qos_class_with_the_sidecar(pod_resources, init, qos):
    pod = _pod_with(*pod_resources, init=init)
    assert builders.guaranteed(pod["spec"]) is qos
    for spec in (NO_RESOURCES, SPEC):
        patch = builders.build_pod_patch(pod, "fast", 1, spec, IMAGE)
        resources = _sidecar_of_patch(patch)["resources"]
        if qos:
            assert resources["requests"] == resources["limits"], resources
            assert builders.guaranteed({"containers": patch["spec"]["containers"]})  # the whole pod still is
        else:
            assert resources == (builders.DEFAULT_RESOURCES if spec is NO_RESOURCES else SPEC["sidecar"]["resources"])
    limits = _sidecar_of_patch(builders.build_pod_patch(pod, "fast", 1, NO_RESOURCES, IMAGE))["resources"]["limits"]
    assert limits == builders.DEFAULT_RESOURCES["limits"]  # the request rises to the limit, never the reverse


def test_a_guaranteed_pods_sidecar_takes_a_given_request_as_its_limit():
    spec = {**SPEC, "sidecar": {**SPEC["sidecar"], "resources": {"requests": {"cpu": "300m", "memory": "2Gi"}}}}
    patch = builders.build_pod_patch(_pod_with(GUARANTEED), "fast", 1, spec, IMAGE)
    assert _sidecar_of_patch(patch)["resources"] == {"requests": {"cpu": "300m", "memory": "2Gi"},
                                                     "limits": {"cpu": "300m", "memory": "2Gi"}}  # fmt: skip
    native = builders.build_pod_patch(_pod_with(GUARANTEED), "fast", 1, spec, IMAGE, native=True)
    (sidecar,) = native["spec"]["initContainers"]
    assert sidecar["resources"]["requests"] == sidecar["resources"]["limits"]


# -- the NetworkPolicy per policy --------------------------------------------------------

ALLOW = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}},
         {"podSelector": {"matchExpressions": [{"key": "role", "operator": "In", "values": ["client"]}]}},
         {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.9.0.0/16"]}}]  # fmt: skip


def test_the_network_policy_admits_only_the_named_peers_to_the_sidecars_ports():
    import kubernetes_validate

    default = builders.build_network_policy("fast", "llm", SPEC)
    kubernetes_validate.validate(default, "1.30", strict=True)
    assert default["metadata"]["name"] == "fast-binbatch" and default["metadata"]["labels"][builders.POLICY_LABEL] == "fast"
    assert default["spec"]["podSelector"] == {"matchLabels": {builders.POLICY_LABEL: "fast"}}  # the injected pods only
    assert default["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = default["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {}}]  # unset allowFrom: the pods of the policy's own namespace
    assert [p["port"] for p in rule["ports"]] == ["bb-grpc", "bb-http", "bb-metrics"]
    spec = {**SPEC, "sidecar": {**SPEC["sidecar"], "allowFrom": ALLOW}}
    named = builders.build_network_policy("fast", "llm", spec, [8000, 8000, 7000])
    kubernetes_validate.validate(named, "1.30", strict=True)
    (rule,) = named["spec"]["ingress"]
    assert rule["from"] == ALLOW and [p["port"] for p in rule["ports"]] == ["bb-grpc", "bb-http", "bb-metrics", 7000, 8000]
    # The ports it names are the ones the injected container declares.
    declared = {p["name"] for p in builders.sidecar_container(SPEC, IMAGE)["ports"]}
    assert {"bb-grpc", "bb-http", "bb-metrics"} <= declared


def test_the_serving_ports_come_from_the_sidecars_the_policy_injected():
    from binbatch_operator.indexes import pod_entry

    take_over = {**SPEC, "sidecar": {**SPEC["sidecar"], "takeOverServingPort": {"enabled": True}}}
    pod = vllm_pod()
    pod["spec"]["containers"][0] |= {"ports": [{"name": "http", "containerPort": 8000}],
                                     "args": ["--model", "m", "--port", "8000"]}  # fmt: skip
    pod["metadata"]["name"] = "vllm-1"
    patch = builders.build_pod_patch(pod, "fast", 1, take_over, IMAGE)
    injected = pod_entry({"metadata": {**pod["metadata"], **patch["metadata"], "labels": {"app": "vllm", **patch["metadata"]["labels"]}},
                          "spec": {**pod["spec"], **patch["spec"]}})  # fmt: skip
    other = pod_entry({**injected, "metadata": {**injected["metadata"], "labels": {"app": "vllm", builders.POLICY_LABEL: "slow"}}})
    assert builders.sidecar_serving_ports([injected, other], "fast") == [8000]
    assert builders.sidecar_serving_ports([other], "fast") == []


async def test_reconcile_keeps_the_network_policy_and_names_it_in_status():
    kube = FakeKube()
    ctx, log = Context(kube=kube, sidecar_image=IMAGE, network_policy=True), logging.getLogger("t")
    outcome = await reconcile(ctx, policy_body(), Seen(), log)
    made = kube.children[("NetworkPolicy", "fast-binbatch")]
    assert made["metadata"]["ownerReferences"][0]["uid"] == "u1"  # garbage-collected with the policy
    assert len(made["spec"]["ingress"]) == 1  # no metricsFrom: allowFrom only
    prometheus = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    scraped = Context(kube=FakeKube(), sidecar_image=IMAGE, network_policy=True, metrics_from=prometheus)
    await reconcile(scraped, policy_body(), Seen(), log)
    rules = scraped.kube.children[("NetworkPolicy", "fast-binbatch")]["spec"]["ingress"]
    assert rules[1] == {"from": prometheus, "ports": [{"protocol": "TCP", "port": "bb-metrics"}]}
    assert outcome.status["networkPolicy"] == "fast-binbatch"
    # The install turns them off: the one the policy owns goes, and status no longer names one.
    ctx.network_policy = False
    outcome = await reconcile(ctx, policy_body(status=outcome.status), Seen(children=dict(kube.children)), log)
    assert ("delete", "NetworkPolicy") in kube.calls and ("NetworkPolicy", "fast-binbatch") not in kube.children
    assert outcome.status["networkPolicy"] is None
    # One the policy does not own is never deleted.
    theirs = {**made, "metadata": {**made["metadata"], "ownerReferences": [{"kind": "Team", "uid": "t"}]}}
    kube.calls.clear()
    await reconcile(ctx, policy_body(), Seen(children={("NetworkPolicy", "fast-binbatch"): theirs}), log)
    assert ("delete", "NetworkPolicy") not in kube.calls
