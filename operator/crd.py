"""The ``BatchingPolicy`` CRD, generated from the sidecar's config models.

The spec's batching sections (engine, bins, batch, memory, latency, predictor,
metrics, logging) ARE the sidecar's config file (``binbatch_sidecar.config``), so
their schema is derived from those pydantic models: one definition of every
field, description and bound, and no drift between what the API server accepts
and what the sidecar loads.  The policy's own parts (pod selector, sidecar
container) and the status are written here.  Cross-field rules that pydantic
checks in Python are repeated as CEL ``x-kubernetes-validations`` so the API
server refuses a bad policy before the operator sees it.

``python -m binbatch_operator.crd`` rewrites the one source file,
``manifests/crd/batchingpolicies.binbatch.io.yaml``; a test fails if it drifts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from binbatch_sidecar.config import (
    GRPC_MAX_CONCURRENT_STREAMS_DEFAULT,
    AuthConfig,
    GRPC_MAX_CONNECTION_AGE_SECONDS_DEFAULT,
    HTTP_REQUEST_READ_TIMEOUT_MILLISECONDS_DEFAULT,
    MAX_CONNECTIONS_DEFAULT,
    MAX_REQUEST_BYTES_DEFAULT,
    ServerConfig,
    SidecarConfig,
)

from . import k8s_rules

GROUP = "binbatch.io"
VERSION = "v1alpha1"
KIND = "BatchingPolicy"
PLURAL = "batchingpolicies"
CRD_PATH = Path("manifests/crd/batchingpolicies.binbatch.io.yaml")

# Sections of the sidecar config a policy sets; ``server`` is the operator's to
# render (ports come from spec.sidecar).
CONFIG_SECTIONS = ("engine", "bins", "batch", "memory", "latency", "predictor", "metrics", "logging", "classes",
                   "tenants")

# Fields of a config section that only the operator reads (the sidecar's config has no such key).
CRD_ONLY = {"predictor": ("model", "fleet"), "engine": ("apiKeySecretRef",)}
MODEL_REFS = ("configMapKeyRef", "secretKeyRef")

# spec.sidecar's defaults: the CRD's, and the builders' for a spec the API server did not default.
SIDECAR_DEFAULTS: dict[str, Any] = {"grpcPort": 50051, "httpPort": 8080, "metricsPort": 9090, "drainGraceSeconds": 30,
                                    "passthroughPaths": [], "maxRequestBytes": MAX_REQUEST_BYTES_DEFAULT,
                                    "httpRequestReadTimeoutMilliseconds": HTTP_REQUEST_READ_TIMEOUT_MILLISECONDS_DEFAULT,
                                    "maxConnections": MAX_CONNECTIONS_DEFAULT,
                                    "grpcMaxConcurrentStreams": GRPC_MAX_CONCURRENT_STREAMS_DEFAULT,
                                    "grpcMaxConnectionAgeSeconds": GRPC_MAX_CONNECTION_AGE_SECONDS_DEFAULT}  # fmt: skip
# spec.sidecar's keys that are the sidecar config's server keys of the same name, their schema taken from it
SERVER_KEYS = ("passthroughPaths", "maxRequestBytes", "httpRequestReadTimeoutMilliseconds", "maxConnections",
               "grpcMaxConcurrentStreams", "grpcMaxConnectionAgeSeconds")
# spec.sidecar.takeOverServingPort's defaults (see takeover.py).
TAKEOVER_DEFAULTS = {"enabled": False, "enginePort": 8001, "container": ""}
# spec.service's defaults: the extra headless Service for client-side gRPC load balancing.
SERVICE_DEFAULTS = {"headless": False}
# A URL whose host is this pod's loopback: the only engine a port take-over can move (shared with takeover.py).
# spec.engine's own field (not the sidecar config's): the Secret behind engine.apiKeyFile (see builders.py).
API_KEY_SECRET_REF = "apiKeySecretRef"
LOOPBACK_URL = r"^https?://(127\.0\.0\.1|localhost|\[::1\])(:[0-9]+)?([/?#].*)?$"

class FleetSpec(BaseModel):
    """``spec.predictor.fleet``: one learned length model for all the policy's pods, fitted by the operator."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True, strict=True, alias_generator=to_camel)

    enabled: bool = Field(False, description="Gather the hashed training records of the policy's sidecars (never prompt text), fit one length model on them and publish it in the ConfigMap <policy>-binbatch-model, which new pods mount as their model: each sidecar starts from what the whole fleet learned, and it outlives the pods. Needs kind Learned; not with model or warmStart.")  # fmt: skip
    refit_interval_seconds: int = Field(600, ge=60, le=86400, description="Gather the new records and refit this often.")  # fmt: skip
    max_records: int = Field(10000, ge=1000, le=40000, description="Records the operator keeps to fit on (a uniform sample of all gathered; a tenth more held out to score the model). Each takes a few KiB of the operator's memory.")  # fmt: skip


FLEET_DEFAULTS: dict[str, Any] = FleetSpec().model_dump(by_alias=True)


def _rule(uses: tuple[str, ...], check: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """A CEL rule that holds when any field it ``uses`` is absent.

    The API server runs every rule on its node's declared ``default`` exactly as
    written (``default: {}`` has no keys; nested defaults are not filled in
    first), and reading an absent key is an evaluation error ("no such key"),
    which refuses the CRD.  On a stored object the fields are there: defaulting
    fills them in before validation.  So each field a rule reads is guarded.
    """
    guards = [f"!has(self.{name})" for name in uses]
    rule = {"rule": " || ".join([*guards, check]), "message": message}
    if field_path:
        rule["fieldPath"] = field_path
    return rule


_FLEET_OFF = "!has(self.fleet) || !has(self.fleet.enabled) || !self.fleet.enabled"

SECTION_RULES: dict[str, list[dict[str, str]]] = {
    "engine": [
        _rule(("apiKeySecretRef", "apiKeyFile"), "self.apiKeyFile == ''",
              "apiKeyFile must be empty when apiKeySecretRef is set: the operator mounts the Secret and sets the "
              "file itself", ".apiKeySecretRef"),
    ],
    "batch": [
        _rule(("minBatchSize", "staticSize"), "self.minBatchSize <= self.staticSize",
              "minBatchSize must be <= staticSize", ".minBatchSize"),
        _rule(("staticSize", "maxBatchSize"), "self.staticSize <= self.maxBatchSize",
              "staticSize must be <= maxBatchSize", ".staticSize"),
        _rule(("dispatch", "mode"), "self.dispatch != 'Smdp' || self.mode == 'Gang'",
              "dispatch Smdp needs mode Gang", ".dispatch"),
        _rule(("drainOrder", "mode", "order", "sizing"),
              "self.drainOrder != 'LongestFitFirst' || (self.mode == 'Continuous' && self.order == 'ShortestFirst'"
              " && (self.sizing == 'Memory' || self.sizing == 'Combined'))",
              "drainOrder LongestFitFirst needs mode Continuous, order ShortestFirst and sizing Memory or Combined",
              ".drainOrder"),
        _rule(("order", "mode"), "self.order != 'EnginePriority' || self.mode == 'Continuous'",
              "order EnginePriority needs mode Continuous", ".order"),
        _rule(("order", "followEngineQueue"), "self.order != 'EnginePriority' || !self.followEngineQueue",
              "followEngineQueue must be false with order EnginePriority: the queue is to form in the engine",
              ".followEngineQueue"),
    ],
    "bins": [
        _rule(("boundaries", "mode"), "size(self.boundaries) == 0 || self.mode == 'Fixed'",
              "boundaries must be empty unless mode is Fixed", ".boundaries"),
        _rule(("boundaries", "count"), "size(self.boundaries) == 0 || size(self.boundaries) == self.count - 1",
              "boundaries needs count-1 entries", ".boundaries"),
        _rule(("boundaries",), "self.boundaries.isSorted()", "boundaries must be strictly increasing", ".boundaries"),
        _rule(("boundaries", "maxOutputTokens"), "self.boundaries.all(b, b < self.maxOutputTokens)",
              "every boundary must be below maxOutputTokens", ".boundaries"),
        _rule(("countMode", "mode"), "self.countMode != 'Auto' || self.mode != 'Adaptive'",
              "countMode must be Fixed when mode is Adaptive", ".countMode"),
        _rule(("countMode",), "self.countMode != 'Auto' || (has(self.latencyTargetMilliseconds) && self.latencyTargetMilliseconds > 0)",
              "latencyTargetMilliseconds must be > 0 when countMode is Auto", ".latencyTargetMilliseconds"),
        _rule(("countMode", "boundaries"), "self.countMode != 'Auto' || size(self.boundaries) == 0",
              "boundaries must be empty when countMode is Auto", ".boundaries"),
    ],
    "predictor.external": [
        _rule(("feedbackUrl", "url"), "self.feedbackUrl == '' || self.url != ''",
              "feedbackUrl needs url: completions are reported only for requests the service was asked about",
              ".feedbackUrl"),
    ],
    "predictor": [
        _rule(("warmStart", "kind"), "self.warmStart == '' || self.kind == 'Learned'",
              "warmStart is only read with kind Learned", ".warmStart"),
        _rule(("warmStartOptional", "warmStart"), "!self.warmStartOptional || self.warmStart != ''",
              "warmStartOptional needs warmStart: it says what to do when that file cannot be read",
              ".warmStartOptional"),
        _rule(("kind",), "!has(self.model) || self.kind == 'Learned'",
              "model is only read with kind Learned", ".model"),
        _rule(("warmStart",), "!has(self.model) || self.warmStart == ''",
              "model and warmStart exclude each other: with model the operator mounts the file and sets warmStart "
              "to it; leave warmStart empty", ".model"),
        _rule(("kind",), f"{_FLEET_OFF} || self.kind == 'Learned'", "fleet is only used with kind Learned", ".fleet"),
        _rule((), f"{_FLEET_OFF} || !has(self.model)",
              "fleet and model exclude each other: with fleet the operator fits, publishes and mounts the model", ".fleet"),
        _rule(("warmStart",), f"{_FLEET_OFF} || self.warmStart == ''",
              "fleet and warmStart exclude each other: with fleet the operator mounts its model and sets warmStart "
              "to it; leave warmStart empty", ".fleet"),
    ],
    "metrics": [
        _rule(("staleAfterMilliseconds", "intervalMilliseconds"),
              "self.staleAfterMilliseconds >= 2 * self.intervalMilliseconds",
              "staleAfterMilliseconds must be >= 2 x intervalMilliseconds", ".staleAfterMilliseconds"),
    ],
}  # fmt: skip

# memory.admission is, or resolves to, BatchSize: said so, or Auto (the default) in Gang mode or with the
# queue in the engine (SidecarConfig.kv_admission)
_ADMISSION_IS_BATCH_SIZE = (
    "((has(self.memory) && has(self.memory.admission) && self.memory.admission == 'BatchSize')"
    " || ((!has(self.memory) || !has(self.memory.admission) || self.memory.admission == 'Auto') && has(self.batch)"
    " && ((has(self.batch.order) && self.batch.order == 'EnginePriority') || (has(self.batch.mode) && self.batch.mode == 'Gang'))))"
)

SPEC_RULES = [
    {"rule": "!has(self.batch) || !has(self.batch.sizing) || self.batch.sizing != 'Sla'"
             " || (has(self.latency) && has(self.latency.tpotMilliseconds) && self.latency.tpotMilliseconds > 0)",
     "message": "latency.tpotMilliseconds must be > 0 when batch.sizing is Sla", "fieldPath": ".latency.tpotMilliseconds"},
    {"rule": "!has(self.batch) || !has(self.batch.drainOrder) || self.batch.drainOrder != 'LongestFitFirst'"
             f" || !{_ADMISSION_IS_BATCH_SIZE}",
     "message": "batch.drainOrder LongestFitFirst needs memory.admission Projected or Auto (it packs by the projected KV plan)",
     "fieldPath": ".batch.drainOrder"},
    {"rule": "!has(self.batch) || !has(self.batch.shortestBy) || self.batch.shortestBy != 'KvFootprint'"
             f" || !{_ADMISSION_IS_BATCH_SIZE}",
     "message": "batch.shortestBy KvFootprint needs memory.admission Projected or Auto (only the projected KV plan limits the KV)",
     "fieldPath": ".batch.shortestBy"},
    {"rule": "!has(self.batch) || !has(self.batch.order) || self.batch.order != 'EnginePriority'"
             " || !has(self.memory) || !has(self.memory.admission) || self.memory.admission != 'Projected'",
     "message": "memory.admission Projected holds requests in the sidecar; with batch.order EnginePriority the queue "
                "is to form in the engine: use BatchSize", "fieldPath": ".memory.admission"},
    _rule(("sidecar", "sidecar.maxRequestBytes", "batch", "batch.maxQueuedBytes"),
          "self.batch.maxQueuedBytes >= self.sidecar.maxRequestBytes",
          "batch.maxQueuedBytes must be >= sidecar.maxRequestBytes: a request of the largest size could never be queued",
          ".batch.maxQueuedBytes"),
    _rule(("sidecar", "sidecar.takeOverServingPort", "sidecar.takeOverServingPort.enabled", "engine", "engine.url"),
          f"!self.sidecar.takeOverServingPort.enabled || self.engine.url.matches(r'{LOOPBACK_URL}')",
          "engine.url must name the pod's loopback (127.0.0.1 or localhost) when sidecar.takeOverServingPort is "
          "enabled: the sidecar then reaches vLLM at 127.0.0.1:enginePort",
          ".engine.url"),
]  # fmt: skip

MAX_MATCH_LABELS = 64  # bounds for CEL's cost estimate on everything a rule iterates
MAX_RESOURCES = 16

# Label keys are checked by CEL (a schema cannot constrain map keys); values by ``pattern``.
LABEL_KEY_RULE = {
    "rule": f"self.all(k, k.matches(r'^{k8s_rules.LABEL_KEY}$') && !k.matches(r'{k8s_rules.LABEL_KEY_LONG_PREFIX}'))",
    "message": "label keys are [prefix/]name: an optional DNS subdomain prefix of at most 253 characters, "
               "and a name of at most 63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric",
}  # fmt: skip

SECTION_DESCRIPTIONS = {
    "engine": "The vLLM server next to the sidecar.",
    "bins": "How requests are binned by predicted output length.",
    "batch": "Batch formation, sizing and dispatch.",
    "memory": "The memory-aware batch size (KV-cache overflow bound).",
    "latency": "Latency SLOs for the SLA-aware batch size.",
    "predictor": "How output lengths are predicted.",
    "metrics": "Where the sidecar reads the engine's metrics.",
    "logging": "The sidecar's logs.",
    "classes": "Request classes clients name in request_class, each with a priority and what its callers may send to steer their place in the queue.",
    "tenants": "Tenants (the x-llm-d-inference-fairness-id a request sends, else one shared tenant) and their weights: each gets its weighted fair share of admission and of the queue, so one tenant's flood cannot starve another's.",
}

_DROP = {"title", "additionalProperties"}


def _openapi(node: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON-schema property as a structural OpenAPI v3 property."""
    out = {k: v for k, v in node.items() if k not in _DROP}
    if "const" in out:  # a one-value Literal
        out["enum"] = [out.pop("const")]
        out.setdefault("type", "string")
    if "items" in out:
        out["items"] = _openapi(out["items"])
    if "enum" in out and out.get("type") == "string":  # a bound for CEL's cost estimate, as on every string
        out.setdefault("maxLength", max(len(v) for v in out["enum"]))
    return out


def section_schema(name: str, model: type[BaseModel], description: str | None = None) -> dict[str, Any]:
    """The object schema of the config section (or nested section, e.g. ``predictor.external``) ``name``."""
    schema = model.model_json_schema(by_alias=True)
    props = {key: _openapi(prop) for key, prop in schema["properties"].items()}
    for key, field in model.model_fields.items():
        alias = field.alias or key
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):  # inlined: a CRD has no $ref
            props[alias] = section_schema(f"{name}.{alias}", field.annotation, field.description)
        elif "default" not in props[alias] and not field.is_required():  # a default_factory is not in pydantic's JSON schema
            props[alias]["default"] = field.get_default(call_default_factory=True)
    if name == "engine":  # the policy's own field: the operator mounts the Secret and renders apiKeyFile
        props[API_KEY_SECRET_REF] = api_key_secret_ref_schema()
    if name == "predictor":
        props["model"] = model_schema()
        props["fleet"] = section_schema("predictor.fleet", FleetSpec, "Learned: one model for the whole fleet of "
                                        "pods, fitted by the operator from their sidecars' records.")  # fmt: skip
        del props["fleet"]["default"]  # absent is off: a stored policy without it stays as it was
    if name == "bins":  # pydantic checks entries in a validator; the API server needs the bounds here
        props["boundaries"]["items"] |= {"minimum": 1, "maximum": 1_000_000}
        props["boundaries"]["x-kubernetes-list-type"] = "set"  # with isSorted(): strictly increasing
    out: dict[str, Any] = {"type": "object", "description": description or SECTION_DESCRIPTIONS[name], "default": {},
                           "properties": props}  # fmt: skip
    if name in SECTION_RULES:
        out["x-kubernetes-validations"] = SECTION_RULES[name]
    return out


def _str(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def api_key_secret_ref_schema() -> dict[str, Any]:
    """``spec.engine.apiKeySecretRef``: the Secret key holding the engine's ``--api-key``."""
    return {
        "type": "object",
        "description": "The key of a vLLM started with --api-key, in a Secret of the policy's namespace: the "
                       "operator mounts that one Secret key read-only into the sidecar (the kubelet mounts it; the "
                       "operator never reads it) and points engine.apiKeyFile at it, so the sidecar sends "
                       "'Authorization: Bearer <key>' on every engine call. Updating the Secret rotates the key "
                       "without a restart. Not together with apiKeyFile.",
        "required": ["name", "key"],
        "properties": {
            "name": _str("Name of the Secret, in the policy's namespace.", minLength=1,
                         maxLength=k8s_rules.DNS1123_SUBDOMAIN_MAX, pattern=f"^{k8s_rules.DNS1123_SUBDOMAIN}$"),
            "key": _str("Key within the Secret whose value is the API key.", minLength=1,
                        maxLength=k8s_rules.CONFIG_KEY_MAX, pattern=f"^{k8s_rules.CONFIG_KEY}$"),
        },
    }  # fmt: skip


def auth_schema() -> dict[str, Any]:
    """``spec.auth``: who may call the sidecars.  The operator mounts the Secrets and renders the sidecar
    config's ``auth`` section (paths, callers, and its own public key and audience: see builders.py)."""
    callers = _openapi(AuthConfig.model_json_schema(by_alias=True)["properties"]["callers"])
    callers["items"]["properties"] = {k: _openapi(v) for k, v in callers["items"]["properties"].items()}
    callers["default"] = []

    def name() -> dict[str, Any]:
        return _str("Name of the Secret, in the policy's namespace.", minLength=1,
                    maxLength=k8s_rules.DNS1123_SUBDOMAIN_MAX, pattern=f"^{k8s_rules.DNS1123_SUBDOMAIN}$")
    return {
        "type": "object",
        "description": "Who may call the sidecars. Caller authentication is off unless callerTokensSecretRef is "
                       "set (a gateway in front usually authenticates, and the policy's NetworkPolicy limits who "
                       "reaches the sidecars). The Admin service always answers only loopback and callers with a "
                       "credential: the operator's own signed tokens, or adminTokenSecretRef's token.",
        "default": {},
        "properties": {
            "callerTokensSecretRef": {
                "type": "object", "required": ["name"],
                "description": "Turns caller authentication on: a Secret of the policy's namespace whose every key "
                               "is a caller and whose value is that caller's bearer token. Every request to the "
                               "sidecars' HTTP door (Authorization: Bearer <token>) and gRPC Inference service "
                               "(metadata authorization: Bearer <token>) must carry one of these tokens, else 401 / "
                               "UNAUTHENTICATED; /health needs none. The operator mounts the Secret read-only into "
                               "the sidecar (it never reads it); updating the Secret rotates the tokens without a "
                               "restart.",
                "properties": {"name": name()},
            },
            "adminTokenSecretRef": {
                "type": "object", "required": ["name", "key"],
                "description": "A token that lets a caller off the pod's loopback use the sidecars' Admin service "
                               "(authorization: Bearer <token>), e.g. a dashboard; the operator itself needs none. "
                               "Mounted read-only into the sidecar; updating the Secret rotates it.",
                "properties": {
                    "name": name(),
                    "key": _str("Key within the Secret whose value is the token.", minLength=1,
                                maxLength=k8s_rules.CONFIG_KEY_MAX, pattern=f"^{k8s_rules.CONFIG_KEY}$"),
                },
            },
            "callers": callers,
        },
    }  # fmt: skip


def model_schema() -> dict[str, Any]:
    """``spec.predictor.model``: a trained length model in a ConfigMap or Secret of the policy's namespace."""

    def ref(kind: str) -> dict[str, Any]:
        return {
            "type": "object", "description": f"A key of a {kind} in the policy's namespace.",
            "required": ["name", "key"],
            "properties": {
                "name": _str(f"Name of the {kind}.", minLength=1, maxLength=k8s_rules.DNS1123_SUBDOMAIN_MAX,
                             pattern=f"^{k8s_rules.DNS1123_SUBDOMAIN}$"),
                "key": _str(f"Key of the {kind} that holds the model file (binaryData for a ConfigMap).", minLength=1,
                            maxLength=k8s_rules.CONFIG_KEY_MAX, pattern=f"^{k8s_rules.CONFIG_KEY}$"),
            },
        }  # fmt: skip

    return {
        "type": "object",
        "description": "Learned: a model written by the command binbatch predictor train, in a ConfigMap (e.g. "
                       "kubectl create configmap NAME --from-file=model=FILE) or a Secret: the operator mounts that key "
                       "read-only into every sidecar and points warmStart at it. A missing object or key does not keep "
                       "pods from starting: their sidecars start cold and learn from completions, the ModelReady "
                       "condition says why (for a ConfigMap), and a model that appears or changes later is loaded "
                       "without a restart. Exactly one of configMapKeyRef and secretKeyRef.",
        "properties": {"configMapKeyRef": ref("ConfigMap"), "secretKeyRef": ref("Secret")},
        "x-kubernetes-validations": [
            {"rule": "has(self.configMapKeyRef) != has(self.secretKeyRef)",
             "message": "model needs exactly one of configMapKeyRef and secretKeyRef"},
        ],
    }  # fmt: skip


def allow_from_schema() -> dict[str, Any]:
    """``spec.sidecar.allowFrom``: who may reach the sidecars' ports, as NetworkPolicyPeers."""
    label_selector = {
        "type": "object",
        "description": "A label selector: matchLabels and matchExpressions, as in a NetworkPolicy.",
        "properties": {
            "matchLabels": {"type": "object", "description": "Labels to match.", "maxProperties": 64,
                            "additionalProperties": {"type": "string", "maxLength": 63}},
            "matchExpressions": {"type": "array", "description": "Label requirements.", "maxItems": 64, "items": {
                "type": "object", "description": "One requirement.", "required": ["key", "operator"],
                "properties": {
                    "key": _str("Label key.", maxLength=317),
                    "operator": _str("In, NotIn, Exists or DoesNotExist.", enum=["In", "NotIn", "Exists", "DoesNotExist"]),
                    "values": {"type": "array", "description": "Values (In, NotIn).", "maxItems": 64,
                               "items": {"type": "string", "maxLength": 63}},
                },
            }},
        },
    }  # fmt: skip
    peer = {
        "type": "object",
        "description": "One peer, as a NetworkPolicyPeer: pods by podSelector (in this namespace, or in the "
                       "namespaces namespaceSelector matches), or an ipBlock.",
        "properties": {
            "namespaceSelector": {**label_selector, "description": "Namespaces whose pods may connect ({}: all)."},
            "podSelector": {**label_selector, "description": "Pods that may connect ({}: all, of the namespaces meant)."},
            "ipBlock": {"type": "object", "description": "Addresses that may connect.", "required": ["cidr"],
                        "properties": {"cidr": _str("A CIDR, e.g. 10.0.0.0/8.", maxLength=64),
                                       "except": {"type": "array", "description": "CIDRs left out.", "maxItems": 64,
                                                  "items": {"type": "string", "maxLength": 64}}}},
        },
        "x-kubernetes-validations": [
            {"rule": "has(self.ipBlock) ? !has(self.podSelector) && !has(self.namespaceSelector) "
                     ": has(self.podSelector) || has(self.namespaceSelector)",
             "message": "a peer is an ipBlock, or a podSelector and/or namespaceSelector"},
        ],
    }  # fmt: skip
    return {
        "type": "array", "minItems": 1, "maxItems": 32, "items": peer,
        "description": "Who may reach the sidecars' ports (gRPC, HTTP, metrics and, with takeOverServingPort, the "
                       "serving port) when the install makes a NetworkPolicy per policy (networkPolicy.enabled). "
                       "Unset: the pods of the policy's own namespace. Add the namespace of your gateway or "
                       "Prometheus here if it is elsewhere.",
    }  # fmt: skip


def resources_schema() -> dict[str, Any]:
    """``spec.sidecar.resources``: requests and limits as a Pod's container has them.

    A quantity is a string (``"500m"``, ``"1Gi"``) or a whole number (``cpu: 1``),
    as in a Pod: ``x-kubernetes-int-or-string`` (``minimum`` bounds the numbers,
    ``pattern`` and ``maxLength`` the strings).  CEL sees such a value as
    ``dyn``, so each rule asks ``type(v) == int`` before treating it as a
    string, and turns a number into text with ``string(v)`` for ``quantity()``.
    The rules' cost is estimated from the values' size: ``maxLength`` bounds it
    from Kubernetes 1.34 (kubernetes/kubernetes#132837); older API servers size
    an int-or-string as the whole request and refuse the comparison of requests
    with limits as over budget.  A fractional number (``cpu: 1.5``) is not an
    int-or-string: write ``"1.5"`` or ``1500m``.
    """

    quantity = {
        "x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
        "description": 'A quantity: a whole number (1) or a string ("500m", "1.5", "1Gi").',
        "minimum": 0, "maxLength": 64, "pattern": f"^{k8s_rules.QUANTITY}$",
        "x-kubernetes-validations": [
            {"rule": "type(self) == int || !isQuantity(self) || sign(quantity(self)) >= 0",
             "message": "quantities must not be negative"},
        ],
    }  # fmt: skip

    def amounts(what: str) -> dict[str, Any]:
        return {
            "type": "object", "maxProperties": MAX_RESOURCES,
            "description": f"{what} per resource name (cpu, memory, ephemeral-storage, hugepages-<size>, domain/name).",
            "additionalProperties": quantity,
            "x-kubernetes-validations": [
                {"rule": f"self.all(k, k in {list(k8s_rules.STANDARD_CONTAINER_RESOURCES)} "
                         f"|| k.startsWith('{k8s_rules.HUGEPAGES_PREFIX}') || (k.matches(r'^{k8s_rules.LABEL_KEY}$') "
                         "&& k.contains('/') && !k.contains('kubernetes.io/')))",
                 "message": "resource names are cpu, memory, ephemeral-storage, hugepages-<size> or an extended "
                            "resource (domain/name)"},
            ],
        }  # fmt: skip

    request, limit = "string(self.requests[k])", "string(self.limits[k])"
    return {
        "type": "object",
        "description": "The sidecar container's resources (requests and limits), as in a Pod spec. Unset: requests "
                       "cpu 250m and memory 384Mi, limits cpu 1 and memory 768Mi (the memory bounds a full queue). "
                       "In a pod whose every container has requests equal to limits (Guaranteed QoS), the sidecar's "
                       "cpu and memory requests are raised to its limits, so the pod stays Guaranteed.",
        "properties": {"requests": amounts("Requested amount"), "limits": amounts("Upper limit")},
        "x-kubernetes-validations": [
            _rule(("requests", "limits"),
                  f"self.requests.all(k, !(k in self.limits) || !isQuantity({request}) || !isQuantity({limit}) "
                  f"|| quantity({request}).compareTo(quantity({limit})) <= 0)",
                  "every request must be <= its limit", ".requests"),
        ],
    }  # fmt: skip


def takeover_schema(port: dict[str, Any]) -> dict[str, Any]:
    """``spec.sidecar.takeOverServingPort``: the sidecar's HTTP door on vLLM's own port (see takeover.py)."""
    return {
        "type": "object",
        "description": "Opt-in: the sidecar's HTTP API takes over the vLLM container's serving port (its --port, "
                       "vLLM's default 8000) and vLLM is moved to 127.0.0.1:enginePort, so existing Services, "
                       "gateways and InferencePools that target the pod reach the sidecar with no change. Pods the "
                       "webhook cannot rewrite safely get no sidecar; the policy's SidecarsInjected condition and "
                       "an Event say why.",
        "default": {},
        "properties": {
            "enabled": {"type": "boolean", "default": TAKEOVER_DEFAULTS["enabled"],
                        "description": "Take over the serving port of the selected pods' vLLM container."},
            "enginePort": {**port, "default": TAKEOVER_DEFAULTS["enginePort"],
                           "description": "Port vLLM is moved to, bound to 127.0.0.1 only (--host 127.0.0.1 "
                                          "--port <enginePort>); the sidecar's engine.url and a scraped metrics.url "
                                          "on the loopback get this port."},
            "container": _str("Name of the vLLM container; empty: the pod's only container, else the one whose image, "
                              "command or args name vllm.", maxLength=63, default=TAKEOVER_DEFAULTS["container"]),
        },
    }  # fmt: skip


def server_keys_schema() -> dict[str, Any]:
    """``spec.sidecar``'s keys that are the sidecar config's ``server`` keys (``SERVER_KEYS``), from its model."""
    props = section_schema("server", ServerConfig, "The sidecar's server settings.")["properties"]
    out = {key: props[key] for key in SERVER_KEYS}
    out["passthroughPaths"]["x-kubernetes-list-type"] = "set"  # the sidecar refuses a path listed twice
    return out


def spec_schema() -> dict[str, Any]:
    fields = SidecarConfig.model_fields
    sections = {name: section_schema(name, fields[name].annotation) for name in CONFIG_SECTIONS}  # type: ignore[arg-type]
    selector = {
        "type": "object",
        "description": "Pods of this namespace that get the sidecar: every label here must match.",
        "properties": {
            "matchLabels": {
                "type": "object", "description": "Label key/value pairs a pod must carry.",
                "minProperties": 1, "maxProperties": MAX_MATCH_LABELS,
                "additionalProperties": _str("Label value: empty, or at most 63 alphanumerics, '-', '_' or '.', "
                                             "starting and ending alphanumeric.",
                                             maxLength=k8s_rules.LABEL_VALUE_MAX, pattern=f"^{k8s_rules.LABEL_VALUE}$"),
                "x-kubernetes-validations": [LABEL_KEY_RULE],
            },
        },
        "required": ["matchLabels"],
    }  # fmt: skip
    port = {"type": "integer", "minimum": 1, "maximum": 65535}
    sidecar = {
        "type": "object",
        "description": "The injected sidecar container.",
        "default": {},
        "properties": {
            "image": _str("Sidecar image; empty uses the operator's own image.", maxLength=512, default=""),
            "grpcPort": {**port, "default": SIDECAR_DEFAULTS["grpcPort"], "description": "Port of the gRPC API (binbatch.v1.Inference)."},
            "httpPort": {**port, "default": SIDECAR_DEFAULTS["httpPort"],
                         "description": "Port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                                        "/v1/models; other paths pass through to the engine). With takeOverServingPort "
                                        "the sidecar listens on the pod's serving port instead, and this is only the "
                                        "port of the policy's Service."},
            "metricsPort": {**port, "default": SIDECAR_DEFAULTS["metricsPort"], "description": "Port of the sidecar's Prometheus /metrics."},
            "drainGraceSeconds": {"type": "integer", "minimum": 0, "maximum": 3600, "default": SIDECAR_DEFAULTS["drainGraceSeconds"],
                                  "description": "On termination, time to drain queued and in-flight requests."},
            **server_keys_schema(),
            "resources": resources_schema(),
            "takeOverServingPort": takeover_schema(port),
            "allowFrom": allow_from_schema(),
        },
        "x-kubernetes-validations": [
            _rule(("grpcPort", "metricsPort"), "self.grpcPort != self.metricsPort", "grpcPort and metricsPort must differ",
                  ".metricsPort"),
            _rule(("httpPort", "grpcPort"), "self.httpPort != self.grpcPort", "httpPort and grpcPort must differ",
                  ".httpPort"),
            _rule(("httpPort", "metricsPort"), "self.httpPort != self.metricsPort", "httpPort and metricsPort must differ",
                  ".httpPort"),
            *(_rule(("takeOverServingPort", "takeOverServingPort.enabled", "takeOverServingPort.enginePort", other),
                    f"!self.takeOverServingPort.enabled || self.takeOverServingPort.enginePort != self.{other}",
                    f"takeOverServingPort.enginePort must differ from {other}", ".takeOverServingPort.enginePort")
              for other in ("grpcPort", "httpPort", "metricsPort")),
        ],
    }  # fmt: skip
    service = {
        "type": "object",
        "description": "The policy's Services (a ClusterIP Service <policy>-binbatch always exists).",
        "default": {},
        "properties": {
            "headless": {"type": "boolean", "default": SERVICE_DEFAULTS["headless"],
                         "description": "Also create a headless Service <policy>-binbatch-headless (clusterIP None) whose "
                                        "DNS name resolves to every ready sidecar, for gRPC clients that balance across "
                                        "pods themselves (dns:/// target with the round_robin policy)."},
        },
    }  # fmt: skip
    return {
        "type": "object",
        "description": "How to batch for the selected vLLM pods; the batching sections are the sidecar's config.",
        "required": ["selector"],
        "properties": {"selector": selector, "sidecar": sidecar, "service": service, **sections, "auth": auth_schema()},
        "x-kubernetes-validations": SPEC_RULES,
    }


def status_schema() -> dict[str, Any]:
    integer = {"type": "integer", "minimum": 0, "maximum": 1_000_000_000}
    condition = {
        "type": "object",
        "description": "One condition: Ready, Valid, SidecarsInjected, MetricsAvailable, "
                       "EnginePriorityEnabled (batch.order EnginePriority) or ModelReady (spec.predictor.model or "
                       "spec.predictor.fleet).",
        "required": ["type", "status"],
        "properties": {
            "type": _str("Condition type.", maxLength=64),
            "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
            "reason": _str("CamelCase reason.", maxLength=128),
            "message": _str("Human-readable detail.", maxLength=4096),
            "observedGeneration": {**integer, "description": "Generation the condition was computed for."},
            "lastTransitionTime": _str("When the status last changed.", format="date-time"),
        },
    }
    adjustment = {
        "type": "object",
        "description": "A change the sidecars made, with its reason.",
        "properties": {
            "time": _str("When.", format="date-time"),
            "pod": _str("Pod whose sidecar changed.", maxLength=253),
            "field": _str("What changed (batchSize, binBoundaries).", maxLength=64),
            "from": _str("Old value.", maxLength=256),
            "to": _str("New value.", maxLength=256),
            "reason": _str("Why.", maxLength=1024),
        },
    }
    return {
        "type": "object",
        "description": "What the operator observed.",
        "properties": {
            "observedGeneration": {**integer, "description": "Last spec generation the operator acted on."},
            "conditions": {"type": "array", "description": "Current conditions.", "items": condition,
                           "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"], "maxItems": 16},
            "pods": {**integer, "description": "Pods governed by this policy."},
            "batchSize": {**integer, "description": "Current target batch size (largest across pods)."},
            "bins": _str("Current bin boundaries, in output tokens.", maxLength=1024),
            "throughputRequestsPerSecond": _str("Aggregated recent throughput.", maxLength=32),
            "networkPolicy": _str("The NetworkPolicy that limits who reaches the sidecars' ports (empty: the install "
                                  "makes none).", maxLength=63),
            "adjustments": {"type": "array", "description": "The last adjustments (at most 20).",
                            "items": adjustment, "maxItems": 20},
            "model": {
                "type": "object",
                "description": "spec.predictor.fleet: the fleet model the operator published last.",
                "properties": {
                    "version": {**integer, "description": "Its version: one more at each publish."},
                    "records": {**integer, "description": "Training records it was fitted on."},
                    "kendallTau": _str("Kendall's rank correlation of its predicted against the actual output lengths of "
                                       "held-out records (never fitted on): how well it orders requests, -1 to 1.",
                                       maxLength=16),
                    "publishedAt": _str("When it was published.", format="date-time"),
                },
            },
        },
    }  # fmt: skip


def build_crd() -> dict[str, Any]:
    condition = '.status.conditions[?(@.type=="Ready")].status'
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": "batchingpolicy", "shortNames": ["bp"],
                      "listKind": f"{KIND}List"},  # fmt: skip
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Ready", "type": "string", "jsonPath": condition},
                    {"name": "Pods", "type": "integer", "jsonPath": ".status.pods"},
                    {"name": "Batch size", "type": "integer", "jsonPath": ".status.batchSize"},
                    {"name": "Bins", "type": "string", "jsonPath": ".status.bins"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "BatchingPolicy: multi-bin batching for the vLLM pods it selects.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": _str("API version."), "kind": _str("Kind."),
                        "metadata": {"type": "object"},
                        "spec": spec_schema(), "status": status_schema(),
                    },
                }},
            }],  # fmt: skip
        },
    }


def render() -> str:
    header = "# Generated by `python -m binbatch_operator.crd` from binbatch_sidecar.config; do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the BatchingPolicy CRD.")
    parser.add_argument("--out", type=Path, default=CRD_PATH, help=f"file to write (default {CRD_PATH})")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render())
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
