"""spec.engine.apiKeySecretRef: the operator mounts the Secret's one key read-only
into the sidecar and renders engine.apiKeyFile pointing at it; with apiKeyFile
set by hand it is refused naming the field."""

from __future__ import annotations

import pytest

from binbatch_operator import builders, crd
from binbatch_operator.reconcile import _spec_problems, admit
from binbatch_sidecar.config import ConfigError, parse_config

IMAGE = "registry.example/binbatch:test"
REF = {"name": "vllm-api-key", "key": "token"}
SPEC = {"selector": {"matchLabels": {"app": "vllm"}}, "engine": {"url": "http://127.0.0.1:8000", "apiKeySecretRef": REF}}


def vllm_pod(**pod_spec):
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "vllm-0", "namespace": "llm", "labels": {"app": "vllm"}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}], **pod_spec},
    }  # fmt: skip


def _sidecar(patch):
    spec = patch["spec"]
    return next(c for c in [*spec.get("containers", []), *spec.get("initContainers", [])]
                if c["name"] == builders.SIDECAR_CONTAINER)  # fmt: skip


def test_the_rendered_config_points_engine_api_key_file_at_the_mounted_secret():
    doc = builders.sidecar_config(SPEC)
    assert doc["engine"] == {"url": "http://127.0.0.1:8000", "apiKeyFile": builders.ENGINE_KEY_PATH}
    assert parse_config(doc).engine.api_key_file == "/var/run/binbatch/engine-key/api-key"
    assert "apiKeySecretRef" in SPEC["engine"]  # the spec itself is left as it was


def test_the_pod_patch_mounts_the_one_secret_key_read_only_into_the_sidecar_only():
    patch = builders.build_pod_patch(vllm_pod(), "fast", 2, SPEC, IMAGE)
    volumes = {v["name"]: v for v in patch["spec"]["volumes"]}
    secret = volumes[builders.ENGINE_KEY_VOLUME]["secret"]
    assert secret == {"secretName": "vllm-api-key", "items": [{"key": "token", "path": "api-key"}],
                      "defaultMode": 0o444}  # fmt: skip
    side = _sidecar(patch)
    [mount] = [m for m in side["volumeMounts"] if m["name"] == builders.ENGINE_KEY_VOLUME]
    assert mount == {"name": builders.ENGINE_KEY_VOLUME, "mountPath": builders.ENGINE_KEY_DIR, "readOnly": True}
    assert "subPath" not in mount  # a directory mount: the kubelet swaps a rotated Secret in place
    # the mounted file is the one the config names
    assert f"{mount['mountPath']}/{secret['items'][0]['path']}" == builders.sidecar_config(SPEC)["engine"]["apiKeyFile"]
    vllm = patch["spec"]["containers"][0]
    assert vllm["name"] == "vllm" and "volumeMounts" not in vllm
    assert side["securityContext"]["runAsUser"] == builders.SIDECAR_UID


def test_with_an_fs_group_the_key_file_is_group_readable_only():
    """The kubelet gives the file the pod's fsGroup and the sidecar that group: 0440 suffices."""
    patch = builders.build_pod_patch(vllm_pod(securityContext={"fsGroup": 2000}), "fast", 2, SPEC, IMAGE)
    volumes = {v["name"]: v for v in patch["spec"]["volumes"]}
    assert volumes[builders.ENGINE_KEY_VOLUME]["secret"]["defaultMode"] == 0o440


def test_without_a_secret_ref_nothing_is_mounted():
    spec = {"selector": SPEC["selector"], "engine": {"url": "http://127.0.0.1:8000"}}
    patch = builders.build_pod_patch(vllm_pod(), "fast", 2, spec, IMAGE)
    assert builders.ENGINE_KEY_VOLUME not in {v["name"] for v in patch["spec"]["volumes"]}
    assert builders.ENGINE_KEY_VOLUME not in {m["name"] for m in _sidecar(patch)["volumeMounts"]}
    assert "apiKeyFile" not in builders.sidecar_config(spec)["engine"]


def test_a_native_sidecar_keeps_the_mount():
    patch = builders.build_pod_patch(vllm_pod(), "fast", 2, SPEC, IMAGE, native=True)
    assert builders.ENGINE_KEY_VOLUME in {m["name"] for m in patch["spec"]["initContainers"][0]["volumeMounts"]}


def test_the_injected_pod_passes_the_kubernetes_schema():
    import kubernetes_validate

    pod = vllm_pod()
    patch = builders.build_pod_patch(pod, "fast", 2, SPEC, IMAGE)
    injected = {**pod, "metadata": {**pod["metadata"], **patch["metadata"]}, "spec": {**pod["spec"], **patch["spec"]}}
    kubernetes_validate.validate(injected, "1.30", strict=True)


def test_a_changed_secret_ref_marks_running_sidecars_outdated():
    base = builders.sidecar_hash(SPEC, IMAGE)
    other = {**SPEC, "engine": {**SPEC["engine"], "apiKeySecretRef": {"name": "other", "key": "token"}}}
    plain = {**SPEC, "engine": {"url": "http://127.0.0.1:8000"}}
    assert len({base, builders.sidecar_hash(other, IMAGE), builders.sidecar_hash(plain, IMAGE)}) == 3


def test_a_secret_ref_with_a_hand_set_api_key_file_is_refused_naming_the_field():
    spec = {**SPEC, "engine": {**SPEC["engine"], "apiKeyFile": "/keys/mine"}}
    with pytest.raises(ConfigError) as err:
        builders.sidecar_config(spec)
    [(field, message)] = err.value.problems
    assert field == "spec.engine.apiKeySecretRef" and "apiKeyFile" in message
    assert [p[0] for p in _spec_problems(spec)] == ["spec.engine.apiKeySecretRef"]
    patch, warnings = admit(vllm_pod(), [{"name": "fast", "spec": spec, "generation": 2}], IMAGE)
    assert patch == {} and "spec.engine.apiKeySecretRef" in warnings[0]


@pytest.mark.parametrize(
    ("ref", "field"),
    [
        ({"name": "Not_A_Name", "key": "token"}, "spec.engine.apiKeySecretRef.name"),
        ({"name": "vllm-api-key", "key": "a/b"}, "spec.engine.apiKeySecretRef.key"),
        ({"name": "vllm-api-key", "key": ".."}, "spec.engine.apiKeySecretRef.key"),
        ({"name": "vllm-api-key"}, "spec.engine.apiKeySecretRef.key"),
        ({"name": "vllm-api-key", "key": "token", "namespace": "x"}, "spec.engine.apiKeySecretRef.namespace"),
        ("vllm-api-key", "spec.engine.apiKeySecretRef"),
    ],
)
def test_a_malformed_secret_ref_is_refused_naming_the_field(ref, field):
    with pytest.raises(ConfigError) as err:
        builders.sidecar_config({**SPEC, "engine": {"apiKeySecretRef": ref}})
    assert field in [p[0] for p in err.value.problems]


def test_the_crd_declares_the_secret_ref_with_both_parts_required():
    engine = crd.spec_schema()["properties"]["engine"]
    ref = engine["properties"]["apiKeySecretRef"]
    assert ref["required"] == ["name", "key"] and set(ref["properties"]) == {"name", "key"}
    assert all(p["maxLength"] and p["pattern"] and p["description"] for p in ref["properties"].values())
    assert any("apiKeySecretRef" in r["rule"] and r["fieldPath"] == ".apiKeySecretRef"
               for r in engine["x-kubernetes-validations"])  # fmt: skip
