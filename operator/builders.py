"""Pure builders: BatchingPolicy → the objects the operator creates, as dicts.

Nothing here talks to Kubernetes: every function takes plain dicts and returns
plain dicts, so the handlers in ``main.py`` stay thin and these are tested alone.

- ``sidecar_config(spec)``: the sidecar's config file.  The batching sections of
  the spec are copied as they are (they share the sidecar config's schema, see
  ``crd.py``); ``server`` is rendered from ``spec.sidecar``.  The result is
  validated with the sidecar's own loader, so the operator refuses exactly what
  the sidecar would, and names the field as ``spec.<path>``.
- ``build_configmap`` / ``build_service``: the policy's two children.
- ``build_pod_patch``: what the admission webhook adds to a selected pod.

``spec.engine.apiKeySecretRef`` is the policy's, not the sidecar config's: the
pod patch mounts that one Secret key read-only into the sidecar (the kubelet
reads the Secret; the operator never does) and the config gets
``engine.apiKeyFile`` pointing at the mounted file.  ``spec.auth``'s Secrets likewise
(``auth_refs``): the callers' tokens as a directory (``auth.callerTokensDir``), the
admin token as a file (``auth.adminTokenFile``); ``spec.auth.callers`` is copied, and
the operator's own public key and the policy's audience are added (``sidecar_config``'s
``operator_key``), so the sidecars answer the operator's signed Admin calls.
- ``model_ref`` / ``model_volume``: ``spec.predictor.model``, the trained length model the
  sidecar reads from a ConfigMap or Secret key mounted read-only at ``MODEL_PATH``; with
  ``spec.predictor.fleet`` (``fleet_settings``) the ConfigMap the operator publishes its
  fleet's model in (``fleet_model_name``) is mounted there instead.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

import yaml
from kubernetes.utils import parse_quantity
from pydantic.alias_generators import to_snake

from binbatch_sidecar.config import RESTART_KEYS, ConfigError, parse_config

from . import k8s_rules, takeover
from pydantic import ValidationError

from .crd import (
    API_KEY_SECRET_REF,
    CONFIG_SECTIONS,
    GROUP,
    MODEL_REFS,
    SERVER_KEYS,
    SERVICE_DEFAULTS,
    SIDECAR_DEFAULTS,
    FleetSpec,
)
from .takeover import SIDECAR_PORT_NAMES, TakeOverPlan

CONFIG_KEY = "sidecar.yaml"
# spec.sidecar's server keys the sidecar binds at start-up (its RESTART_KEYS): part of the sidecar hash
BOUND_AT_START = tuple(key for key in SERVER_KEYS if ("server", to_snake(key)) in RESTART_KEYS)
# libyaml's emitter where PyYAML has it: the same text as yaml.safe_dump, about 4x faster.
CONFIG_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
CONFIG_DIR = "/etc/binbatch"
SIDECAR_CONTAINER = "binbatch-sidecar"
CONFIG_VOLUME = "binbatch-config"
TMP_VOLUME = "binbatch-tmp"  # the one writable place of a read-only root filesystem
ENGINE_KEY_VOLUME = "binbatch-engine-key"  # spec.engine.apiKeySecretRef's one key
# A directory mount (not subPath), so the kubelet swaps a rotated Secret in place and the sidecar re-reads it.
ENGINE_KEY_DIR = "/var/run/binbatch/engine-key"
ENGINE_KEY_PATH = f"{ENGINE_KEY_DIR}/api-key"
# The key file's mode: owner root, group the pod's fsGroup when it has one (the kubelet then gives the sidecar
# that group), else root. 0440 is readable by the sidecar's UID 10001 only with an fsGroup; without one the file
# must be world-readable -- and only the sidecar container mounts the volume (the pod-level fsGroup is not ours
# to set: it would re-own the model server's volumes).
ENGINE_KEY_MODE_FSGROUP = 0o440
ENGINE_KEY_MODE_NO_FSGROUP = 0o444
# spec.auth's Secrets (the same mode rules as the engine key): the callers' tokens, a key a file, and the admin token
CALLER_TOKENS_VOLUME = "binbatch-caller-tokens"
CALLER_TOKENS_DIR = "/var/run/binbatch/caller-tokens"  # the config's auth.callerTokensDir
ADMIN_TOKEN_VOLUME = "binbatch-admin-token"
ADMIN_TOKEN_DIR = "/var/run/binbatch/admin-token"
ADMIN_TOKEN_PATH = f"{ADMIN_TOKEN_DIR}/admin-token"  # the config's auth.adminTokenFile
AUTH_FIELD = "spec.auth"
MODEL_VOLUME = "binbatch-model"  # spec.predictor.model's ConfigMap or Secret key
MODEL_DIR = "/etc/binbatch-model"
MODEL_PATH = f"{MODEL_DIR}/model.npz"  # the key's file in that volume: the config's predictor.warmStart
POLICY_LABEL = f"{GROUP}/policy"  # on injected pods; the Service selects it
INJECTED_ANNOTATION = f"{GROUP}/injected"  # "<policy>@<generation>" of the config at injection
SIDECAR_HASH_ANNOTATION = f"{GROUP}/sidecar-hash"  # of the injected container: tells outdated pods
CONFLICT_ANNOTATION = f"{GROUP}/conflict"  # on pods two policies select: who they were
INJECT_ANNOTATION = f"{GROUP}/inject"  # "false" on a pod: never inject it (per-pod opt-out)
REFUSED_ANNOTATION = f"{GROUP}/take-over-refused"  # on a pod the port take-over could not rewrite: why
HEADLESS_LABEL = f"{GROUP}/headless"  # on the headless Service: the chart's ServiceMonitor skips it (same pods)
SIDECAR_UID = 10001
MANAGED_LABELS = {"app.kubernetes.io/name": "binbatch-sidecar", "app.kubernetes.io/managed-by": "binbatch-operator"}


# The injected sidecar's resources unless spec.sidecar.resources says otherwise (docs/operator-security.md):
# about 150 MiB is the process with its libraries loaded; the request bodies being read and those queued
# hold at most batch.maxQueuedBytes together (256 MiB by default), the predictor's training buffer about
# 20 MiB: 768Mi bounds a full queue with room for the copies parsing makes and the requests at the engine
# (bench memory: 200 clients posting ~4 MiB at once peaked at 523 MiB); 384Mi is what an ordinary queue uses.  One CPU serves the request path at the rates vLLM
# on one pod reaches; 250m is its share when idle.
DEFAULT_RESOURCES = {"requests": {"cpu": "250m", "memory": "384Mi"}, "limits": {"cpu": "1", "memory": "768Mi"}}
QOS_RESOURCES = ("cpu", "memory")  # what decides a pod's QoS class

CHILD_SUFFIX = "-binbatch"
HEADLESS_SUFFIX = "-binbatch-headless"
GRPC_PORT_NAME, HTTP_PORT_NAME, METRICS_PORT_NAME = SIDECAR_PORT_NAMES
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_MAX_LABEL = 63  # DNS-1035 labels and label values alike


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def child_name(policy: str, suffix: str = CHILD_SUFFIX) -> str:
    """The ConfigMap's and the Service's name for a policy: deterministic, and always valid.

    A policy's name is a DNS-1123 subdomain (dots, up to 253 characters); a
    Service's must be a DNS-1035 label (no dots, at most 63, starts with a
    letter).  ``<policy>-binbatch`` is kept whenever it is such a label (the
    common case, and the names existing installs already have); otherwise the
    name is sanitised, truncated and given a digest of the whole policy name, so
    two policies never share children (``a.b`` and ``a-b`` differ).  The
    headless Service is named the same way with its own ``suffix``.
    """
    plain = f"{policy}{suffix}"
    if len(plain) <= _MAX_LABEL and _DNS1035_LABEL.fullmatch(plain):
        return plain
    stem = re.sub(r"[^a-z0-9]+", "-", policy.lower()).strip("-")
    if not stem[:1].isalpha():
        stem = f"bb-{stem}"
    room = _MAX_LABEL - len(suffix) - 11  # "-" + 10 hex digits
    return f"{stem[:room].rstrip('-')}-{_digest(policy)}{suffix}"


def headless_name(policy: str) -> str:
    """The headless Service's name: ``<policy>-binbatch-headless`` (or its shortened, digested form)."""
    return child_name(policy, HEADLESS_SUFFIX)


def policy_label(policy: str) -> str:
    """The value of ``binbatch.io/policy`` for a policy (label values hold at most 63 characters).

    A policy name fits as it is when short enough (its characters are all valid
    in a label value); a longer one is truncated and given a digest of the whole.
    """
    if len(policy) <= _MAX_LABEL:
        return policy
    return f"{policy[:_MAX_LABEL - 11].rstrip('-.')}-{_digest(policy)}"


def opted_out(pod_meta: Mapping[str, Any] | None) -> bool:
    """The pod says ``binbatch.io/inject: "false"``: it never gets a sidecar."""
    annotations = (pod_meta or {}).get("annotations") or {}
    return str(annotations.get(INJECT_ANNOTATION, "")).strip().lower() == "false"


def sidecar_settings(spec: Mapping[str, Any]) -> dict[str, Any]:
    """``spec.sidecar``'s server settings (ports, drain grace, passthrough paths,
    request size), defaults filled in: the sidecar config's ``server`` section."""
    side = spec.get("sidecar") or {}
    out = {key: side.get(key, default) for key, default in SIDECAR_DEFAULTS.items()}
    if isinstance(out["passthroughPaths"], list | tuple):  # else the sidecar config's check names it
        out["passthroughPaths"] = list(out["passthroughPaths"])  # a copy: the default list is shared
    return out


def headless_enabled(spec: Mapping[str, Any]) -> bool:
    return bool(((spec.get("service") or {}).get("headless", SERVICE_DEFAULTS["headless"])))


# the objects of a spec the builders read into: (path from spec, field name for errors)
SPEC_OBJECTS = (*((name,) for name in CONFIG_SECTIONS), ("sidecar",), ("service",), ("sidecar", "takeOverServingPort"))


def shape_problems(spec: Any) -> list[tuple[str, str]]:
    """``spec`` and the objects in it that the builders read into, where they are not objects.
    The API server's schema refuses these; a spec it did not check gets a ConfigError naming
    the field (bench fuzz found ``spec.engine: 5`` escaping as an AttributeError)."""
    if not isinstance(spec, Mapping):
        return [("spec", f"must be an object, got {type(spec).__name__}")]
    problems = []
    for path in SPEC_OBJECTS:
        value: Any = spec
        for part in path:
            value = value.get(part) if isinstance(value, Mapping) else None
        if value is not None and not isinstance(value, Mapping):
            problems.append((".".join(("spec", *path)), f"must be an object, got {type(value).__name__}"))
    return problems


def sidecar_config(spec: Mapping[str, Any], *, audience: str = "", operator_key: str = "") -> dict[str, Any]:
    """The sidecar config document for ``spec``; raises ConfigError naming ``spec.<field>``.

    With the port take-over on, the engine (and a scrape of the loopback) is
    vLLM at its new port, ``127.0.0.1:<enginePort>``.  ``operator_key`` (PEM) and
    ``audience`` (``<namespace>/<policy>``): the operator's Admin credential the sidecars accept.
    """
    if problems := shape_problems(spec):
        raise ConfigError(problems)
    doc: dict[str, Any] = {name: dict(spec[name]) for name in CONFIG_SECTIONS if spec.get(name) is not None}
    auth = auth_config(spec, audience, operator_key)
    if auth:
        doc["auth"] = auth
    if api_key_secret_ref(spec) is not None:
        doc["engine"].pop(API_KEY_SECRET_REF)
        doc["engine"]["apiKeyFile"] = ENGINE_KEY_PATH
    # the newer server keys only when they differ from the default: a ConfigMap an older sidecar
    # (which refuses keys it does not know) loads stays as it was, and an upgrade rewrites none
    doc["server"] = {key: value for key, value in sidecar_settings(spec).items()
                     if key not in SERVER_KEYS or value != SIDECAR_DEFAULTS[key]}  # fmt: skip
    takeover.config_urls(spec, doc)
    if "fleet" in doc.get("predictor", {}):  # CRD-only: the operator's; enabled, its model is the warm start
        doc["predictor"] = {k: v for k, v in doc["predictor"].items() if k != "fleet"}
        fleet = fleet_settings(spec)
        if fleet is not None:
            predictor = doc["predictor"]
            problems = [(f"{FLEET_FIELD}.enabled", f"is only used with kind Learned (kind is {predictor.get('kind')})")
                        ] if predictor.get("kind", "Learned") != "Learned" else []  # fmt: skip
            if predictor.get("warmStart"):
                problems.append((FLEET_FIELD, "fleet and warmStart exclude each other: with fleet the operator mounts "
                                              "its model and sets warmStart to it; leave spec.predictor.warmStart empty"))  # fmt: skip
            if predictor.get("model") is not None:
                problems.append((FLEET_FIELD, "fleet and model exclude each other: with fleet the operator fits, "
                                              "publishes and mounts the model; remove spec.predictor.model"))  # fmt: skip
            if problems:
                raise ConfigError(problems)
            predictor["warmStart"], predictor["warmStartOptional"] = MODEL_PATH, True
    if "model" in doc.get("predictor", {}):  # CRD-only: the mounted file becomes the warm start
        predictor = doc["predictor"]
        if predictor.pop("model") is None or model_ref(spec) is None:
            raise ConfigError([(MODEL_FIELD, "must be an object: {configMapKeyRef: {name, key}} or {secretKeyRef: {name, key}}")])
        kind = predictor.get("kind", "Learned")
        if kind != "Learned":
            raise ConfigError([(MODEL_FIELD, f"is only read with kind Learned (kind is {kind})")])
        if predictor.get("warmStart"):
            raise ConfigError([(MODEL_FIELD, "model and warmStart exclude each other: with model the operator mounts "
                                             "the file and sets warmStart to it; leave spec.predictor.warmStart empty")])  # fmt: skip
        predictor["warmStart"], predictor["warmStartOptional"] = MODEL_PATH, True
    try:
        parse_config(doc)
    except ConfigError as exc:
        problems = [(_spec_path(path), message) for path, message in exc.problems if not path.startswith("auth.")]
        problems += [(_auth_path(path), message) for path, message in exc.problems if path.startswith("auth.")]
        raise ConfigError(problems) from None
    return doc


def api_key_secret_ref(spec: Mapping[str, Any]) -> dict[str, str] | None:
    """``spec.engine.apiKeySecretRef`` as ``{"name", "key"}`` (None when not set); raises
    ``ConfigError`` naming the field when it is malformed or set with ``apiKeyFile``."""
    engine = spec.get("engine") or {}
    ref = engine.get(API_KEY_SECRET_REF)
    if ref is None:
        return None
    where = f"spec.engine.{API_KEY_SECRET_REF}"
    if not isinstance(ref, Mapping):
        raise ConfigError([(where, "must be an object {name, key}")])
    problems = [(f"{where}.{extra}", "unknown field (allowed: name, key)") for extra in sorted(set(ref) - {"name", "key"})]
    for field, check in (("name", k8s_rules.dns1123_subdomain_problems), ("key", k8s_rules.config_key_problems)):
        value = ref.get(field)
        if not isinstance(value, str) or not value:
            problems.append((f"{where}.{field}", "is required (a non-empty string)"))
        else:
            problems += [(f"{where}.{field}", p) for p in check(value)]
    if engine.get("apiKeyFile"):
        problems.append((where, "must not be set together with spec.engine.apiKeyFile: the operator mounts the "
                                "Secret and sets the file itself; leave apiKeyFile empty"))  # fmt: skip
    if problems:
        raise ConfigError(problems)
    return {"name": ref["name"], "key": ref["key"]}


MODEL_FIELD = "spec.predictor.model"
FLEET_FIELD = "spec.predictor.fleet"
FLEET_MODEL_SUFFIX = "-binbatch-model"
FLEET_MODEL_KEY = "model.npz"  # the key of the fleet's model in its ConfigMap's binaryData


def fleet_settings(spec: Mapping[str, Any]) -> FleetSpec | None:
    """``spec.predictor.fleet`` when enabled (None: off or absent); ``ConfigError`` naming the field
    when it is malformed."""
    fleet = (spec.get("predictor") or {}).get("fleet")
    if fleet is None:
        return None
    try:
        settings = FleetSpec.model_validate(dict(fleet) if isinstance(fleet, Mapping) else fleet)
    except ValidationError as exc:
        problems = [(".".join([FLEET_FIELD, *(str(p) for p in e["loc"])]), e["msg"]) for e in exc.errors()]
        raise ConfigError(problems) from None
    return settings if settings.enabled else None


def fleet_model_name(policy: str) -> str:
    """The ConfigMap the operator publishes a policy's fleet model in: ``<policy>-binbatch-model``."""
    return child_name(policy, FLEET_MODEL_SUFFIX)


def model_ref(spec: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """``spec.predictor.model`` as (``"ConfigMap"`` or ``"Secret"``, name, key); None without one.
    ``ConfigError`` naming the field when it is not exactly one well-formed key reference."""
    model = (spec.get("predictor") or {}).get("model")
    if model is None:
        return None
    if not isinstance(model, Mapping):
        raise ConfigError([(MODEL_FIELD, "must be an object: {configMapKeyRef: {name, key}} or {secretKeyRef: {name, key}}")])
    unknown = sorted(set(model) - set(MODEL_REFS))
    if unknown:
        raise ConfigError([(f"{MODEL_FIELD}.{unknown[0]}", "unknown field: model takes configMapKeyRef or secretKeyRef")])
    refs = [k for k in MODEL_REFS if model.get(k) is not None]
    if len(refs) != 1:
        raise ConfigError([(MODEL_FIELD, "model needs exactly one of configMapKeyRef and secretKeyRef")])
    where, ref = f"{MODEL_FIELD}.{refs[0]}", model[refs[0]]
    if not isinstance(ref, Mapping):
        raise ConfigError([(where, "must be an object {name, key}")])
    problems: list[tuple[str, str]] = []
    for field, check in (("name", k8s_rules.dns1123_subdomain_problems), ("key", k8s_rules.config_key_problems)):
        value = ref.get(field)
        if not isinstance(value, str) or not value:
            problems.append((f"{where}.{field}", "required: a non-empty string"))
        else:
            problems += [(f"{where}.{field}", message) for message in check(value)]
    extra = sorted(set(ref) - {"name", "key"})
    problems += [(f"{where}.{k}", "unknown field: a key reference has name and key") for k in extra]
    if problems:
        raise ConfigError(problems)
    return ("ConfigMap" if refs[0] == "configMapKeyRef" else "Secret"), ref["name"], ref["key"]


def model_volume(spec: Mapping[str, Any], policy: str | None = None) -> dict[str, Any] | None:
    """The volume holding ``spec.predictor.model``'s key as ``model.npz`` (None without a valid one);
    with ``spec.predictor.fleet`` enabled, the fleet model's ConfigMap of ``policy``.

    ``optional``: a ConfigMap, Secret or key that does not exist leaves the volume
    empty instead of keeping the pod from starting (the sidecar then starts cold).
    Not ``subPath``: kubelet updates the volume in place and the sidecar reloads it.
    """
    try:
        ref = model_ref(spec)
        if ref is None and policy is not None and fleet_settings(spec) is not None:
            ref = ("ConfigMap", fleet_model_name(policy), FLEET_MODEL_KEY)
    except ConfigError:
        return None
    if ref is None:
        return None
    kind, name, key = ref
    items = [{"key": key, "path": MODEL_PATH.rpartition("/")[2]}]
    if kind == "ConfigMap":
        return {"name": MODEL_VOLUME, "configMap": {"name": name, "items": items, "optional": True}}
    return {"name": MODEL_VOLUME, "secret": {"secretName": name, "items": items, "optional": True}}


def _auth_path(path: str) -> str:
    """``auth.callers[0].name`` → ``spec.auth.callers[0].name``; the keys the operator renders name its fields."""
    for key, field in (("auth.callerTokensDir", "callerTokensSecretRef"), ("auth.adminTokenFile", "adminTokenSecretRef")):
        if path.startswith(key):
            return f"{AUTH_FIELD}.{field}"
    return "spec." + path


def auth_refs(spec: Mapping[str, Any]) -> tuple[str | None, dict[str, str] | None]:
    """``spec.auth``'s Secrets: the callers' Secret name and the admin token's ``{name, key}`` (None when not
    set); ``ConfigError`` naming the field when one is malformed."""
    auth = spec.get("auth") or {}
    if not isinstance(auth, Mapping):
        raise ConfigError([(AUTH_FIELD, "must be an object {callerTokensSecretRef, adminTokenSecretRef, callers}")])
    problems = [(f"{AUTH_FIELD}.{k}", "unknown field (allowed: callerTokensSecretRef, adminTokenSecretRef, callers)")
                for k in sorted(set(auth) - {"callerTokensSecretRef", "adminTokenSecretRef", "callers"})]  # fmt: skip
    found: dict[str, dict[str, str] | None] = {}
    for field, keys in (("callerTokensSecretRef", ("name",)), ("adminTokenSecretRef", ("name", "key"))):
        ref, where = auth.get(field), f"{AUTH_FIELD}.{field}"
        found[field] = None
        if ref is None:
            continue
        if not isinstance(ref, Mapping):
            problems.append((where, f"must be an object {{{', '.join(keys)}}}"))
            continue
        problems += [(f"{where}.{extra}", f"unknown field (allowed: {', '.join(keys)})") for extra in sorted(set(ref) - set(keys))]
        checks = {"name": k8s_rules.dns1123_subdomain_problems, "key": k8s_rules.config_key_problems}
        for key in keys:
            value = ref.get(key)
            if not isinstance(value, str) or not value:
                problems.append((f"{where}.{key}", "is required (a non-empty string)"))
            else:
                problems += [(f"{where}.{key}", p) for p in checks[key](value)]
        found[field] = {key: ref.get(key) for key in keys}
    if problems:
        raise ConfigError(problems)
    callers = found["callerTokensSecretRef"]
    return (callers["name"] if callers else None), found["adminTokenSecretRef"]


def auth_config(spec: Mapping[str, Any], audience: str = "", operator_key: str = "") -> dict[str, Any]:
    """The sidecar config's ``auth`` section for ``spec`` ({} when there is nothing to say)."""
    callers_secret, admin_ref = auth_refs(spec)
    out: dict[str, Any] = {}
    if callers_secret is not None:
        out["callerTokensDir"] = CALLER_TOKENS_DIR
    callers = (spec.get("auth") or {}).get("callers")
    if callers:
        out["callers"] = [dict(c) if isinstance(c, Mapping) else c for c in callers]
    if admin_ref is not None:
        out["adminTokenFile"] = ADMIN_TOKEN_PATH
    if operator_key and audience:
        out["operatorPublicKeys"], out["audience"] = [operator_key], audience
    return out


def _spec_path(path: str) -> str:
    """``server.grpcPort`` → ``spec.sidecar.grpcPort``; ``batch.x`` → ``spec.batch.x``."""
    if path.startswith("server."):
        return "spec.sidecar." + path.removeprefix("server.")
    return "spec." + path


def _labels(policy: str) -> dict[str, str]:
    return {**MANAGED_LABELS, POLICY_LABEL: policy_label(policy)}


def build_configmap(name: str, namespace: str, spec: Mapping[str, Any], operator_key: str = "") -> dict[str, Any]:
    """The owned ConfigMap the sidecars mount; its one key is the config file.  ``operator_key``: the
    operator's Admin public key (PEM), with the audience ``<namespace>/<name>`` (``admin_audience``)."""
    audience = admin_audience(namespace, name) if operator_key else ""
    text = config_text(json.dumps(spec, sort_keys=True, default=dict), audience, operator_key)  # default: kopf's view
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": child_name(name), "namespace": namespace, "labels": _labels(name)},
        "data": {CONFIG_KEY: text},
    }


def admin_audience(namespace: str, policy: str) -> str:
    """The ``aud`` of the operator's Admin tokens for a policy's sidecars (their ``auth.audience``)."""
    return f"{namespace}/{policy}"


@functools.lru_cache(maxsize=4096)
def config_text(spec_json: str, audience: str = "", operator_key: str = "") -> str:
    """The config file for a spec given as JSON.  Cached: every policy's check (1,000 at once when a
    replica takes over, then each every 15 s) rebuilds it, and a spec seldom changes."""
    doc = sidecar_config(json.loads(spec_json), audience=audience, operator_key=operator_key)
    return yaml.dump(doc, Dumper=CONFIG_DUMPER, sort_keys=True)


def _service_ports(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    ports = sidecar_settings(spec)
    return [
        {"name": "grpc", "port": ports["grpcPort"], "targetPort": GRPC_PORT_NAME, "protocol": "TCP", "appProtocol": "grpc"},
        {"name": "http", "port": ports["httpPort"], "targetPort": HTTP_PORT_NAME, "protocol": "TCP", "appProtocol": "http"},
        {"name": "metrics", "port": ports["metricsPort"], "targetPort": METRICS_PORT_NAME, "protocol": "TCP"},
    ]  # fmt: skip


def build_service(name: str, namespace: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The Service clients call: the sidecars' gRPC and HTTP ports (and metrics for scraping).

    It selects the pods the webhook injected for this policy, not the policy's
    selector, so a pod without the sidecar never receives traffic.  The ports
    target the sidecar's named container ports, so with the port take-over
    (where the HTTP door listens on each pod's own serving port) ``http`` still
    reaches it.
    """
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": child_name(name), "namespace": namespace, "labels": _labels(name)},
        "spec": {"type": "ClusterIP", "selector": {POLICY_LABEL: policy_label(name)}, "ports": _service_ports(spec)},
    }


def build_headless_service(name: str, namespace: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    """``spec.service.headless``: a second, headless Service over the same pods and ports.

    A ClusterIP Service is one virtual IP: kube-proxy balances connections, and
    a gRPC channel is one long-lived HTTP/2 connection, so each client pins one
    pod.  The headless Service's DNS name answers with every ready pod's IP, and
    a client channel on ``dns:///<name>.<ns>.svc.cluster.local:<grpcPort>`` with
    the ``round_robin`` policy connects to each and spreads its calls.  It is a
    second Service, not a switch on the first: a Service's clusterIP cannot be
    changed in place, and HTTP clients and gateways keep the virtual IP.
    """
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": headless_name(name), "namespace": namespace, "labels": {**_labels(name), HEADLESS_LABEL: "true"}},
        "spec": {
            # Only ready pods are published (publishNotReadyAddresses' default; left out, because the
            # API server omits a false value and the object would never look unchanged).
            "type": "ClusterIP", "clusterIP": "None",
            "selector": {POLICY_LABEL: policy_label(name)}, "ports": _service_ports(spec),
        },
    }  # fmt: skip


def allow_from(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``spec.sidecar.allowFrom``; unset: every pod of the policy's own namespace."""
    given = (spec.get("sidecar") or {}).get("allowFrom")
    return [dict(peer) for peer in given] if given else [{"podSelector": {}}]


def sidecar_serving_ports(pods: Iterable[Mapping[str, Any]], policy: str) -> list[int]:
    """The ports the policy's injected sidecars listen on besides their own three: with the port take-over,
    the pods' serving ports (each pod's own, from its sidecar container), sorted."""
    found: set[int] = set()
    label = policy_label(policy)
    for pod in pods:
        if ((pod.get("metadata") or {}).get("labels") or {}).get(POLICY_LABEL) != label:
            continue
        spec = pod.get("spec") or {}
        for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
            if container.get("name") == SIDECAR_CONTAINER:
                found |= {int(p["containerPort"]) for p in container.get("ports") or []
                          if p.get("name") not in SIDECAR_PORT_NAMES and p.get("containerPort")}  # fmt: skip
    return sorted(found)


def build_network_policy(
    name: str, namespace: str, spec: Mapping[str, Any], serving_ports: Iterable[int] = (),
    metrics_from: Iterable[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The NetworkPolicy over the policy's injected pods: only ``allow_from(spec)`` reaches the sidecar's ports.

    It selects the pods the webhook injected for this policy (the Service's selector) and makes them
    isolated for ingress: what it allows is the sidecar's gRPC, HTTP and metrics ports (by their
    container port names, which every injected pod has) and, with the port take-over, the pods'
    serving ports (``serving_ports``), from the peers ``allow_from`` gives.  vLLM itself listens on the
    pod's loopback under the take-over, which no peer reaches.  ``metrics_from`` (the install's
    ``networkPolicy.metricsFrom``: its Prometheus) reaches the metrics port only.  Other NetworkPolicies that select
    the same pods still add what they allow (NetworkPolicies are a union); traffic from the node
    (kubelet's probes) is always allowed.
    """
    ports = [{"protocol": "TCP", "port": port_name} for port_name in SIDECAR_PORT_NAMES]
    ports += [{"protocol": "TCP", "port": int(port)} for port in sorted(set(serving_ports))]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": child_name(name), "namespace": namespace, "labels": _labels(name)},
        "spec": {
            "podSelector": {"matchLabels": {POLICY_LABEL: policy_label(name)}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": allow_from(spec), "ports": ports}] + ([{
                "from": [dict(peer) for peer in metrics_from],
                "ports": [{"protocol": "TCP", "port": METRICS_PORT_NAME}],
            }] if metrics_from else []),
        },
    }  # fmt: skip


def covers(current: Any, desired: Any) -> bool:
    """Whether ``current`` already holds every field ``desired`` sets, with the same value.

    Fields the API server adds (a Service's clusterIP, metadata bookkeeping) and
    labels others put on the object do not count as a difference; lists must
    match item by item.  So an unchanged child is never written again.
    """
    if isinstance(desired, Mapping):
        return isinstance(current, Mapping) and all(covers(current.get(k), v) for k, v in desired.items())
    if isinstance(desired, list):
        return (
            isinstance(current, list) and len(current) == len(desired)
            and all(covers(c, d) for c, d in zip(current, desired, strict=True))
        )  # fmt: skip
    return bool(current == desired)


def owned_by(current: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Whether the existing object ``current`` is the policy's own, so the operator may patch or delete it.

    ``desired`` is what the builder made, owner reference included (``kopf.adopt``).  Its own: an
    owner reference to the policy's uid; or, with no owner reference at all, both of our labels
    (managed-by binbatch-operator and this policy's ``binbatch.io/policy``), as a child orphaned by
    an earlier policy of the same name keeps them.  Anything else, a ConfigMap or Service someone
    made under that name, is not ours: the operator never writes it (no confused deputy).
    """
    meta, want = current.get("metadata") or {}, desired.get("metadata") or {}
    uids = {o.get("uid") for o in want.get("ownerReferences") or [] if o.get("uid")}
    owners = meta.get("ownerReferences") or []
    if owners:
        return any(o.get("uid") in uids for o in owners)
    labels, wanted = meta.get("labels") or {}, want.get("labels") or {}
    keys = ("app.kubernetes.io/managed-by", POLICY_LABEL)
    return all(k in wanted and labels.get(k) == wanted[k] for k in keys)


def selector_matches(match_labels: Mapping[str, str], labels: Mapping[str, str] | None) -> bool:
    """``matchLabels`` semantics: every pair present (an empty selector matches nothing here).

    A subset test of the items (in C for dicts): each policy check matches its pods against the
    namespace's other policies, 500 selectors a policy at 100 policies a namespace."""
    return bool(match_labels) and match_labels.items() <= (labels or {}).items()


def matching_policies(policies: Iterable[Mapping[str, Any]], pod_labels: Mapping[str, str] | None) -> list[str]:
    """Names of the policies (``{"name", "spec"}`` dicts) whose selector matches the labels, sorted."""
    names = [
        p["name"] for p in policies if selector_matches(((p.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}, pod_labels)
    ]
    return sorted(names)


def sidecar_container(spec: Mapping[str, Any], default_image: str, take_over: TakeOverPlan | None = None) -> dict[str, Any]:
    """The injected container: non-root, read-only root filesystem, gRPC health probes.

    With a port take-over its HTTP door also listens on the pod's serving port
    (``--take-over-port``), declared by the entries the plan moved from vLLM;
    ``bb-http`` stays the config's httpPort, so no port is declared twice.
    """
    side = spec.get("sidecar") or {}
    settings = sidecar_settings(spec)
    grpc_port, http_port, metrics_port = settings["grpcPort"], settings["httpPort"], settings["metricsPort"]
    command = ["binbatch", "sidecar", "--config", f"{CONFIG_DIR}/{CONFIG_KEY}"]
    if take_over:
        command += ["--take-over-port", str(take_over.serving_port)]
    container: dict[str, Any] = {
        "name": SIDECAR_CONTAINER,
        "image": side.get("image") or default_image,
        "command": command,
        "ports": [
            {"name": GRPC_PORT_NAME, "containerPort": grpc_port, "protocol": "TCP"},
            {"name": HTTP_PORT_NAME, "containerPort": http_port, "protocol": "TCP"},
            {"name": METRICS_PORT_NAME, "containerPort": metrics_port, "protocol": "TCP"},
            *(take_over.serving_ports if take_over else ()),
        ],
        # The sidecar's grpc.health.v1 follows the engine's /health: not ready
        # until vLLM answers, so the Service only routes to pods that can serve.
        "readinessProbe": {"grpc": {"port": grpc_port}, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/metrics", "port": METRICS_PORT_NAME}, "periodSeconds": 20, "failureThreshold": 3},
        "volumeMounts": [
            {"name": CONFIG_VOLUME, "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": TMP_VOLUME, "mountPath": "/tmp"},
            *([{"name": ENGINE_KEY_VOLUME, "mountPath": ENGINE_KEY_DIR, "readOnly": True}]
              if api_key_secret_ref(spec) is not None else []),
            *([{"name": MODEL_VOLUME, "mountPath": MODEL_DIR, "readOnly": True}]
              if model_volume(spec, policy="") else []),
            *_auth_mounts(spec),
        ],
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": SIDECAR_UID, "runAsGroup": SIDECAR_UID,
            "readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
        },
    }  # fmt: skip
    given = side.get("resources")
    source = given if given else DEFAULT_RESOURCES
    container["resources"] = {key: dict(value) for key, value in source.items() if value is not None}
    return container


def _auth_mounts(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    try:
        callers, admin = auth_refs(spec)
    except ConfigError:
        return []
    return [
        *([{"name": CALLER_TOKENS_VOLUME, "mountPath": CALLER_TOKENS_DIR, "readOnly": True}] if callers else []),
        *([{"name": ADMIN_TOKEN_VOLUME, "mountPath": ADMIN_TOKEN_DIR, "readOnly": True}] if admin else []),
    ]


def auth_volumes(spec: Mapping[str, Any], pod_spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The volumes of ``spec.auth``'s Secrets.  Not ``optional``, like the engine key's: a pod whose Secret is
    missing waits with an Event naming it, rather than starting a sidecar that refuses its config.  Directory
    mounts (no ``subPath``), so the kubelet swaps a rotated Secret in and the sidecar re-reads it."""
    try:
        callers, admin = auth_refs(spec)
    except ConfigError:
        return []
    fs_group = (pod_spec.get("securityContext") or {}).get("fsGroup")
    mode = ENGINE_KEY_MODE_FSGROUP if fs_group is not None else ENGINE_KEY_MODE_NO_FSGROUP
    out = []
    if callers:  # every key of the Secret: each a caller
        out.append({"name": CALLER_TOKENS_VOLUME, "secret": {"secretName": callers, "defaultMode": mode}})
    if admin:
        out.append({"name": ADMIN_TOKEN_VOLUME, "secret": {
            "secretName": admin["name"], "items": [{"key": admin["key"], "path": ADMIN_TOKEN_PATH.rsplit("/", 1)[1]}],
            "defaultMode": mode}})  # fmt: skip
    return out


def _quantity(value: Any) -> Any:
    try:
        return parse_quantity(value)
    except (ValueError, TypeError):
        return None


def guaranteed(pod_spec: Mapping[str, Any]) -> bool:
    """Whether the pod is in the Guaranteed QoS class: every container (init ones too) has cpu and memory
    limits, and requests equal to them where it states requests (an unstated request defaults to the limit)."""
    containers = [*(pod_spec.get("initContainers") or []), *(pod_spec.get("containers") or [])]
    if not containers:
        return False
    for container in containers:
        resources = container.get("resources") or {}
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        for name in QOS_RESOURCES:
            limit = _quantity(limits.get(name))
            if limit is None or (name in requests and _quantity(requests[name]) != limit):
                return False
    return True


def as_guaranteed(resources: Mapping[str, Any]) -> dict[str, Any]:
    """``resources`` with cpu and memory requests equal to limits, so a Guaranteed pod stays Guaranteed.

    The limit is what counts (the request rises to it); a resource with a request and no limit gets
    the request as its limit; one with neither gets the default limit."""
    requests, limits = dict(resources.get("requests") or {}), dict(resources.get("limits") or {})
    for name in QOS_RESOURCES:
        value = limits.get(name) or requests.get(name) or DEFAULT_RESOURCES["limits"][name]
        requests[name] = limits[name] = value
    return {**resources, "requests": requests, "limits": limits}


def sidecar_hash(spec: Mapping[str, Any], default_image: str) -> str:
    """A short digest of the container the webhook would inject now.

    Batching settings reach running sidecars through the ConfigMap; the
    container itself (image, ports, resources, grace) only through a new pod.
    Comparing digests finds the pods that still run an older container.
    """
    described: Any = sidecar_container(spec, default_image)
    ref = api_key_secret_ref(spec)
    if ref is not None:  # which Secret is mounted is the pod's volume, not the container's
        described = [described, ref]
    if takeover.enabled(spec):  # the per-pod port comes from the pod itself; the choice to take over from here
        described = [described, takeover.settings(spec)]
    # server keys bound at the sidecar's start-up: a running sidecar keeps its own, so a new value needs a new pod
    # (only those off their default, so a default newly added changes no running pod's digest)
    settings = sidecar_settings(spec)
    bound = {key: settings[key] for key in BOUND_AT_START if settings[key] != SIDECAR_DEFAULTS[key]}
    if bound:
        described = [described, bound]
    try:
        auth = auth_refs(spec)
    except ConfigError:
        auth = (None, None)
    if auth != (None, None):  # which Secrets are mounted reaches running pods only through a new pod
        described = [described, {"auth": auth}]
    model = model_volume(spec, policy="")  # the fleet's ConfigMap is named for the policy, which never changes
    if model is not None:  # which ConfigMap or Secret is mounted reaches running pods only through a new pod
        described = [described, {"model": model}]
    text = json.dumps(described, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def take_over_plan(pod: Mapping[str, Any], spec: Mapping[str, Any]) -> TakeOverPlan | None:
    """The pod's port take-over (None when the policy does not ask); raises ``TakeOverRefused``."""
    if not takeover.enabled(spec):
        return None
    settings = sidecar_settings(spec)
    return takeover.plan(pod, spec, {name: settings[name] for name in ("grpcPort", "httpPort", "metricsPort")})


def build_pod_patch(
    pod: Mapping[str, Any], policy: str, generation: int, spec: Mapping[str, Any], default_image: str,
    *, native: bool = False,
) -> dict[str, Any]:
    """A merge patch that adds the sidecar to ``pod``; ``{}`` if it already has one.

    With ``spec.sidecar.takeOverServingPort`` the vLLM container is rewritten as
    well (see takeover.py); a pod that cannot be raises ``TakeOverRefused``
    before anything is built.  Lists are replaced whole by a merge patch, so the
    patch carries the pod's own containers and volumes followed by ours.  The
    ConfigMap volume is mounted as a directory (not ``subPath``) so kubelet
    updates it in place and the sidecar reloads the new config without a
    restart; it is ``optional`` so a pod restarted after its policy was deleted
    still starts.  ``spec.predictor.model`` (or ``spec.predictor.fleet``) adds its own volume (``model_volume``).
    ``native`` makes it a native sidecar (see ``as_native_sidecar``).
    """
    pod_spec = pod.get("spec") or {}
    containers = list(pod_spec.get("containers") or [])
    if any(c.get("name") == SIDECAR_CONTAINER for c in [*containers, *(pod_spec.get("initContainers") or [])]):
        return {}
    plan = take_over_plan(pod, spec)
    if plan is not None:
        containers[plan.index] = plan.container
    ours = (CONFIG_VOLUME, TMP_VOLUME, ENGINE_KEY_VOLUME, MODEL_VOLUME, CALLER_TOKENS_VOLUME, ADMIN_TOKEN_VOLUME)
    volumes = [v for v in pod_spec.get("volumes") or [] if v.get("name") not in ours]
    volumes.append({"name": CONFIG_VOLUME, "configMap": {"name": child_name(policy), "optional": True}})
    volumes.append({"name": TMP_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}})
    ref = api_key_secret_ref(spec)
    if ref is not None:
        volumes.append(engine_key_volume(ref, pod_spec))
    model = model_volume(spec, policy)
    if model is not None:
        volumes.append(model)
    volumes += auth_volumes(spec, pod_spec)
    drain = sidecar_settings(spec)["drainGraceSeconds"]
    grace = max(int(pod_spec.get("terminationGracePeriodSeconds") or 30), drain + 5)
    sidecar = sidecar_container(spec, default_image, plan)
    if guaranteed(pod_spec):  # the sidecar must not demote a Guaranteed pod to Burstable
        sidecar["resources"] = as_guaranteed(sidecar["resources"])
    patch: dict[str, Any] = {
        "metadata": {
            "labels": {POLICY_LABEL: policy_label(policy)},
            "annotations": {
                INJECTED_ANNOTATION: f"{policy}@{generation}",
                SIDECAR_HASH_ANNOTATION: sidecar_hash(spec, default_image),
            },
        },
        "spec": {
            "containers": [*containers, sidecar],
            "volumes": volumes,
            "terminationGracePeriodSeconds": grace,
        },
    }
    return as_native_sidecar(patch, pod) if native else patch


def engine_key_volume(ref: Mapping[str, str], pod_spec: Mapping[str, Any]) -> dict[str, Any]:
    """The volume of ``spec.engine.apiKeySecretRef``'s one key, as the file ``api-key``.

    Not ``optional``: a pod whose Secret is missing waits in ContainerCreating
    with an Event naming it, rather than starting a sidecar every call of which
    the engine refuses.  Read-only and readable by the sidecar's UID (see
    ``ENGINE_KEY_MODE_FSGROUP``)."""
    fs_group = (pod_spec.get("securityContext") or {}).get("fsGroup")
    mode = ENGINE_KEY_MODE_FSGROUP if fs_group is not None else ENGINE_KEY_MODE_NO_FSGROUP
    return {
        "name": ENGINE_KEY_VOLUME,
        "secret": {"secretName": ref["name"], "items": [{"key": ref["key"], "path": ENGINE_KEY_PATH.rsplit("/", 1)[1]}],
                   "defaultMode": mode},
    }  # fmt: skip


def as_native_sidecar(patch: dict[str, Any], pod: Mapping[str, Any]) -> dict[str, Any]:
    """``patch`` with the sidecar moved into ``initContainers`` with ``restartPolicy: Always``.

    A native sidecar (GA in Kubernetes 1.33; the CRD needs 1.34) starts before the pod's containers, is
    ready (its gRPC probe) before they start, and is stopped only after they
    exit, so the model server never runs without its front door and the sidecar
    drains while vLLM still answers.  It goes after the pod's own init containers
    (a model download finishes first).  The container itself is unchanged, so its
    ``sidecar-hash`` still compares with the operator's.
    """
    spec = patch.get("spec") or {}
    containers = spec.get("containers") or []
    ours = [c for c in containers if c.get("name") == SIDECAR_CONTAINER]
    if not ours:
        return patch
    inits = list(((pod.get("spec") or {}).get("initContainers")) or [])
    spec = {**spec, "containers": [c for c in containers if c.get("name") != SIDECAR_CONTAINER]}
    spec["initContainers"] = [*inits, *({**c, "restartPolicy": "Always"} for c in ours)]
    return {**patch, "spec": spec}
