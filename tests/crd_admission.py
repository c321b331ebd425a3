"""The CRD as a Kubernetes API server (1.36) judges it, offline; and the policies to judge.

CI has no API server, so this module re-creates the parts of
apiextensions-apiserver that decide whether the CRD is accepted and whether a
BatchingPolicy is, and runs the CRD's real rule text in
``common-expression-language`` (a CEL interpreter whose parser is CEL's own
grammar, so a rule the API server cannot parse, e.g. an invalid ``'\\.'``
escape, fails here too).  Sources: kubernetes/kubernetes,
``staging/src/k8s.io/apiextensions-apiserver/pkg/apiserver/schema/``.
``tests/unit/test_crd_cel.py`` runs it; ``tests/apiserver/`` sends the same
``CASES`` to a real API server and checks that both give the same verdict,
naming the same field.

What is checked, and the API-server behaviour each check mirrors:

1. Defaults as written (``defaulting/validation.go``, ``ValidateDefaults``): for
   every node with a ``default``, the default is validated VERBATIM against the
   node's schema (``ValidateCustomResource``) and, if that passes, the CEL
   validator runs on it with the node as root (its own rules and those of every
   node present in the default).  Nested defaults are not filled in first:
   ``default: {}`` is evaluated as ``{}``.  Any error refuses the CRD; this is
   what refused ``batchingpolicies.binbatch.io`` ("no such key: minBatchSize").
2. Evaluation errors are failures.  A field access on an absent key is an
   error in cel-go ("no such key"); ``cel`` raises ``KeyError`` there, and the
   harness counts every exception as an error, never as ``false`` (the API
   server refuses the CRD for an error on a default, and the object for an
   error at runtime).  A rule that returns anything but a bool is an error too.
3. Objects as stored (``defaulting/algorithm.go``, ``Default``): an absent
   property with a default gets a deep copy of it and defaulting then recurses
   into it, so on a real object nested defaults ARE filled in before the schema
   and the rules run.  ``admission()`` does exactly that, then the schema, then
   the rules, unless a schema error blocks them: a wrong type, a value outside
   an enum, a missing required field, a string, list or map over its bound
   (the strategy's ``hasBlockingErr``: TypeInvalid, NotSupported, Required,
   TooLong, TooMany).  A pattern or a minimum does not block: the rules run
   on such a value too, so they must guard against it.  Its verdict is
   compared with the operator's own (``_spec_problems``: the sidecar's
   pydantic models plus ``k8s_rules``).
4. Sparse objects: every rule-bearing node is also evaluated with all optional
   fields absent and with each optional field (and map entry) absent in turn,
   with no evaluation error allowed.  Defaulting makes most of these
   impossible on a stored object, but the same guard is what item 1 needs, and
   it keeps the next default someone adds from refusing the CRD again.
5. Rules compile against the schema: every ``self.<field>`` a rule reads is
   declared (the API server type-checks rules at CRD creation), and every
   ``fieldPath`` resolves to a declared field (also checked at CRD creation).
6. Cost: the API server estimates each rule's worst-case cost from the schema's
   bounds (``SchemaDeclType``: an unbounded string counts as the 3 MiB request
   size, an unbounded list or map as many as fit in it; an int-or-string is
   bounded by its ``maxLength`` from Kubernetes 1.34, kubernetes#132837) and
   refuses rules over budget.  Every list, map, string and int-or-string a
   rule can reach must have ``maxItems``/``maxProperties``/``maxLength`` (or an
   enum).  An int-or-string (``x-kubernetes-int-or-string``) is ``dyn`` in CEL:
   an int here, a str there, as in cel-go.
7. Kubernetes' CEL libraries are supplied with their Kubernetes meaning:
   ``isSorted`` (lists), ``isQuantity``/``quantity``/``compareTo``/``sign``
   (the quantity library, Kubernetes >= 1.29), computed with
   ``kubernetes.utils.parse_quantity`` after the quantity grammar check.
8. Structure: ``x-kubernetes-list-type: set`` refuses duplicates
   (``ValidateListSetsAndMaps``); unknown fields are refused (kubectl's default
   field validation is Strict); ``pattern`` is matched with Go's semantics
   (``$`` is the end of the text, not before a final newline).

Not proven here: the cost numbers themselves (only that every bound exists),
and CEL type-checking beyond field names.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import cel
import jsonschema

from binbatch_operator import crd, k8s_rules

SCHEMA = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC = SCHEMA["properties"]["spec"]
SELECTOR = {"matchLabels": {"app": "vllm"}}
SAMPLES = sorted((Path(__file__).resolve().parents[1] / "manifests" / "samples").glob("*.yaml"))


# -- Kubernetes' CEL libraries (item 7) ---------------------------------------------

QUANTITY_TAG = "k8s.io/quantity"


def _quantity(value: Any) -> dict[str, str]:
    if not isinstance(value, str):
        raise TypeError(f"quantity() takes a string, got {type(value).__name__}")
    return {QUANTITY_TAG: str(k8s_rules.parse(value))}  # raises ValueError, as quantity() errors on bad input


def _is_quantity(value: Any) -> bool:
    if not isinstance(value, str):
        raise TypeError(f"isQuantity() takes a string, got {type(value).__name__}")
    try:
        k8s_rules.parse(value)
    except ValueError:
        return False
    return True


def _amount(q: Any) -> Decimal:
    if not (isinstance(q, dict) and set(q) == {QUANTITY_TAG}):
        raise TypeError(f"not a Quantity: {q!r}")
    return Decimal(q[QUANTITY_TAG])


def _compare(a: Any, b: Any) -> int:
    x, y = _amount(a), _amount(b)
    return (x > y) - (x < y)


# How Kubernetes declares each library function (k8s.io/apiserver/pkg/cel/library): a
# global function is called ``f(x)``, a member overload ``x.f()``.  The python ``cel``
# package accepts either spelling for any function it is given, so the spelling is
# checked here; the API server refuses the other one at CRD creation ("found no
# matching overload for 'sign' applied to 'kubernetes.Quantity.()'").
GLOBAL_ONLY = frozenset({"quantity", "isQuantity", "sign"})  # quantity.go: cel.Overload
MEMBER_ONLY = frozenset({  # quantity.go and lists.go: cel.MemberOverload
    "isSorted", "sum", "min", "max", "indexOf", "lastIndexOf",
    "compareTo", "isLessThan", "isGreaterThan", "add", "sub", "asInteger", "asApproximateFloat", "isInteger",
})  # fmt: skip


def call_style_errors(rule: str) -> list[str]:
    """What the API server's CEL compiler would refuse: a library function called in the wrong style."""
    out = []
    for match in re.finditer(r"(\.\s*)?\b([A-Za-z_]\w*)\s*\(", rule):
        member, name = bool(match.group(1)), match.group(2)
        if member and name in GLOBAL_ONLY:
            out.append(f"found no matching overload for '{name}': a function, write {name}(x), not x.{name}()")
        elif not member and name in MEMBER_ONLY:
            out.append(f"found no matching overload for '{name}': a method, write x.{name}(...), not {name}(x)")
    return out


K8S_FUNCTIONS = {
    "isSorted": lambda xs: list(xs) == sorted(xs),
    "isQuantity": _is_quantity,
    "quantity": _quantity,
    "compareTo": _compare,
    "sign": lambda q: (_amount(q) > 0) - (_amount(q) < 0),
}


# -- the API server's steps ---------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    path: str
    # "blocking" (a schema error after which no rule runs) | "schema" | "error" (a rule failed to evaluate)
    # | "false" (a rule said no)
    kind: str
    text: str


def evaluate_rules(schema: dict[str, Any], value: Any, path: str) -> list[Finding]:
    """The CEL validator: each node's rules with ``self`` = its value, then its children (items 2, 3)."""
    out = []
    for rule in schema.get("x-kubernetes-validations", []):
        if compile_errors := call_style_errors(rule["rule"]):
            out += [Finding(path, "error", f"{text} in rule: {rule['message']}") for text in compile_errors]
            continue
        try:
            result = cel.evaluate(rule["rule"], cel.Context(variables={"self": value}, functions=K8S_FUNCTIONS))
        except Exception as exc:  # noqa: BLE001 - every evaluation error is a finding
            out.append(Finding(path, "error", f"{type(exc).__name__}: {exc} evaluating rule: {rule['message']}"))
            continue
        if not isinstance(result, bool):
            out.append(Finding(path, "error", f"rule returned {result!r}, not a bool: {rule['message']}"))
        elif not result:
            out.append(Finding(path + rule.get("fieldPath", ""), "false", rule["message"]))
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for key, child in value.items():
            if key in props:
                out += evaluate_rules(props[key], child, f"{path}.{key}")
            elif isinstance(extra, dict):
                out += evaluate_rules(extra, child, f"{path}[{key}]")
    elif isinstance(value, list) and "items" in schema:
        for i, child in enumerate(value):
            out += evaluate_rules(schema["items"], child, f"{path}[{i}]")
    return out


def _go_pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[jsonschema.ValidationError]:
    if isinstance(instance, str):
        go = pattern[:-1] + r"\Z" if pattern.endswith("$") and not pattern.endswith(r"\$") else pattern
        if not re.search(go, instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


OpenAPIValidator = jsonschema.validators.extend(jsonschema.Draft4Validator, {"pattern": _go_pattern})


def _structure(schema: dict[str, Any], value: Any, path: str) -> list[Finding]:
    """Unknown fields and list-type set duplicates (item 8)."""
    out = []
    if isinstance(value, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, child in value.items():
            if props is not None and key in props:
                out += _structure(props[key], child, f"{path}.{key}")
            elif isinstance(extra, dict):
                out += _structure(extra, child, f"{path}[{key}]")
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                out.append(Finding(f"{path}.{key}", "schema", "unknown field"))
    elif isinstance(value, list):
        if schema.get("x-kubernetes-list-type") == "set" and len(set(map(repr, value))) != len(value):
            out.append(Finding(path, "schema", "duplicate entries in a set"))
        for i, child in enumerate(value):
            out += _structure(schema.get("items", {}), child, f"{path}[{i}]")
    return out


# The keywords whose failure is a blocking error (``hasBlockingErr``, item 3): TypeInvalid,
# NotSupported, Required, TooLong, TooMany.  ``anyOf`` only appears as an int-or-string's
# ``[integer, string]``, which the API server reports as "must be of type integer,string".
BLOCKING = frozenset({"type", "anyOf", "enum", "required", "maxLength", "maxItems", "maxProperties"})


def schema_findings(schema: dict[str, Any], value: Any, path: str) -> list[Finding]:
    """``ValidateCustomResource`` (types, bounds, enums, patterns) plus the structural checks."""
    out = []
    for err in OpenAPIValidator(schema).iter_errors(value):
        where = path + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
        if err.validator == "required":  # the API server names the missing field itself ("x.key: Required value")
            where += "." + err.message.split("'")[1]
        out.append(Finding(where, "blocking" if err.validator in BLOCKING else "schema", err.message))
    return out + _structure(schema, value, path)


def default_findings(schema: dict[str, Any], path: str) -> list[Finding]:
    """``ValidateDefaults``: each declared default verbatim, schema first, then CEL (item 1)."""
    out = []
    if schema.get("default") is not None:
        value = copy.deepcopy(schema["default"])
        found = schema_findings(schema, value, f"{path}.default")
        out += found or evaluate_rules(schema, value, f"{path}.default")
    for key, sub in schema.get("properties", {}).items():  # additionalProperties may not carry defaults
        out += default_findings(sub, f"{path}.properties[{key}]")
    if "items" in schema:
        out += default_findings(schema["items"], f"{path}.items")
    return out


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """``defaulting.Default``: absent (or null) properties get their default, then recurse (item 3)."""
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for key, prop in props.items():
            if prop.get("default") is not None and value.get(key) is None:
                value[key] = copy.deepcopy(prop["default"])
        for key in value:
            if key in props:
                apply_defaults(value[key], props[key])
            elif isinstance(extra, dict):
                apply_defaults(value[key], extra)
    elif isinstance(value, list) and "items" in schema:
        for child in value:
            apply_defaults(child, schema["items"])
    return value


def validate(schema: dict[str, Any], value: Any, path: str) -> list[Finding]:
    """The schema, then the rules unless a schema error blocks them (item 3)."""
    found = schema_findings(schema, value, path)
    if not any(f.kind == "blocking" for f in found):
        found += evaluate_rules(schema, value, path)
    return found


def admission(spec: dict[str, Any]) -> tuple[dict[str, Any], list[Finding]]:
    """A policy created with ``spec``: the stored (defaulted) spec and the API server's findings."""
    stored = apply_defaults(copy.deepcopy(spec), SPEC)
    return stored, validate(SPEC, stored, "spec")


# -- sparse objects (item 4) --------------------------------------------------------


def rule_nodes(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """Every schema node with rules, by its property path below spec (``*``: a map's values)."""
    if schema.get("x-kubernetes-validations"):
        yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from rule_nodes(sub, (*path, key))
    if isinstance(schema.get("additionalProperties"), dict):
        yield from rule_nodes(schema["additionalProperties"], (*path, "*"))


def optional_paths(schema: dict[str, Any], value: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Paths of every optional field and every map entry present in ``value``."""
    if not isinstance(value, dict):
        return
    props, extra = schema.get("properties"), schema.get("additionalProperties")
    for key, child in value.items():
        if props is not None and key in props:
            if key not in schema.get("required", []):
                yield (*prefix, key)
            yield from optional_paths(props[key], child, (*prefix, key))
        elif isinstance(extra, dict):
            yield (*prefix, key)
            yield from optional_paths(extra, child, (*prefix, key))


def without(value: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    out = copy.deepcopy(value)
    node = out
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return out


def skeleton(schema: dict[str, Any], value: Any) -> Any:
    """``value`` with every optional field absent, at every depth."""
    if not isinstance(value, dict) or "properties" not in schema:
        return copy.deepcopy(value)
    required = schema.get("required", [])
    return {k: skeleton(schema["properties"][k], v) for k, v in value.items() if k in required}


def sparse_variants(schema: dict[str, Any], value: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    yield "every optional field absent", skeleton(schema, value)
    for path in optional_paths(schema, value):
        yield f"without {'.'.join(path)}", without(value, path)


def at(value: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


# -- the policies -------------------------------------------------------------------

RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi", "example.com/gpu": "1"},
             "limits": {"cpu": "1", "memory": "1Gi", "example.com/gpu": "1", "hugepages-2Mi": "0"}}  # fmt: skip

# (spec without its selector unless the case sets one, the field its refusal names, or None when
# accepted).  Specs are written as users write them: sparse; the API server defaults them.
CASES: dict[str, tuple[dict[str, Any], str | None]] = {
    "selector only": ({}, None),
    "engine key from a Secret": ({"engine": {"apiKeySecretRef": {"name": "vllm-key", "key": "api-key"}}}, None),
    "engine key from a Secret and a file": (
        {"engine": {"apiKeySecretRef": {"name": "vllm-key", "key": "api-key"}, "apiKeyFile": "/keys/k"}},
        "spec.engine.apiKeySecretRef",
    ),
    "engine key file alone": ({"engine": {"apiKeyFile": "/keys/k"}}, None),
    "bins Auto, nothing else": ({"bins": {"mode": "Auto"}}, None),
    "fixed boundaries": ({"bins": {"mode": "Fixed", "count": 3, "boundaries": [64, 256]}}, None),
    "boundaries unsorted": ({"bins": {"mode": "Fixed", "count": 3, "boundaries": [256, 64]}}, "spec.bins.boundaries"),
    "boundaries repeated": ({"bins": {"mode": "Fixed", "count": 3, "boundaries": [64, 64]}}, "spec.bins.boundaries"),
    "boundaries vs count": ({"bins": {"mode": "Fixed", "count": 4, "boundaries": [64, 256]}}, "spec.bins.boundaries"),
    "boundaries vs default count": ({"bins": {"boundaries": [64, 256]}}, "spec.bins.boundaries"),
    "boundaries with Auto": ({"bins": {"mode": "Auto", "count": 3, "boundaries": [64, 256]}}, "spec.bins.boundaries"),
    "boundary past max": ({"bins": {"mode": "Fixed", "count": 2, "boundaries": [4096], "maxOutputTokens": 2048}}, "spec.bins.boundaries"),
    "boundary past default max": ({"bins": {"count": 2, "boundaries": [4096]}}, "spec.bins.boundaries"),
    "min above static": ({"batch": {"minBatchSize": 64, "staticSize": 32}}, "spec.batch.minBatchSize"),
    "min above default static": ({"batch": {"minBatchSize": 64}}, "spec.batch.minBatchSize"),
    "static above max": ({"batch": {"staticSize": 512, "maxBatchSize": 256}}, "spec.batch.staticSize"),
    "static above default max": ({"batch": {"staticSize": 512}}, "spec.batch.staticSize"),
    "batch in order": ({"batch": {"minBatchSize": 4, "staticSize": 16, "maxBatchSize": 64}}, None),
    "stale too soon": ({"metrics": {"intervalMilliseconds": 500, "staleAfterMilliseconds": 600}}, "spec.metrics.staleAfterMilliseconds"),
    "stale too soon for default interval": ({"metrics": {"staleAfterMilliseconds": 600}}, "spec.metrics.staleAfterMilliseconds"),
    "Smdp in Gang": ({"batch": {"dispatch": "Smdp", "mode": "Gang"}}, None),
    "Smdp in default Continuous": ({"batch": {"dispatch": "Smdp"}}, "spec.batch.dispatch"),
    "LongestFitFirst with Projected": ({"batch": {"drainOrder": "LongestFitFirst"}, "memory": {"admission": "Projected"}}, None),
    "LongestFitFirst with the default Auto": ({"batch": {"drainOrder": "LongestFitFirst"}}, None),
    "LongestFitFirst with BatchSize": ({"batch": {"drainOrder": "LongestFitFirst"}, "memory": {"admission": "BatchSize"}}, "spec.batch.drainOrder"),
    "LongestFitFirst with Fifo": ({"batch": {"drainOrder": "LongestFitFirst", "order": "Fifo"}, "memory": {"admission": "Projected"}}, "spec.batch.drainOrder"),
    "LongestFitFirst with Static sizing": ({"batch": {"drainOrder": "LongestFitFirst", "sizing": "Static"}, "memory": {"admission": "Projected"}}, "spec.batch.drainOrder"),
    "KvFootprint with Projected": ({"batch": {"shortestBy": "KvFootprint"}, "memory": {"admission": "Projected"}}, None),
    "KvFootprint with the default Auto": ({"batch": {"shortestBy": "KvFootprint"}}, None),
    "KvFootprint with BatchSize": ({"batch": {"shortestBy": "KvFootprint"}, "memory": {"admission": "BatchSize"}}, "spec.batch.shortestBy"),
    "KvFootprint with Auto in Gang": ({"batch": {"shortestBy": "KvFootprint", "mode": "Gang"}}, "spec.batch.shortestBy"),
    "KvFootprint with Auto and the queue in the engine": ({"batch": {"shortestBy": "KvFootprint", "order": "EnginePriority", "followEngineQueue": False}}, "spec.batch.shortestBy"),
    "EnginePriority with the default Auto": ({"batch": {"order": "EnginePriority", "followEngineQueue": False}, "memory": {"admission": "Auto"}}, None),
    "EnginePriority without the engine-queue cap": ({"batch": {"order": "EnginePriority", "followEngineQueue": False}}, None),
    "EnginePriority with the default followEngineQueue": ({"batch": {"order": "EnginePriority"}}, "spec.batch.followEngineQueue"),
    "EnginePriority in Gang": ({"batch": {"order": "EnginePriority", "followEngineQueue": False, "mode": "Gang"}}, "spec.batch.order"),
    "EnginePriority with Projected": ({"batch": {"order": "EnginePriority", "followEngineQueue": False}, "memory": {"admission": "Projected"}}, "spec.memory.admission"),
    "countMode Auto with a target": ({"bins": {"countMode": "Auto", "latencyTargetMilliseconds": 2000}}, None),
    "countMode Auto without a target": ({"bins": {"countMode": "Auto"}}, "spec.bins.latencyTargetMilliseconds"),
    "countMode Auto with Adaptive": ({"bins": {"countMode": "Auto", "mode": "Adaptive", "latencyTargetMilliseconds": 2000}}, "spec.bins.countMode"),
    "countMode Auto with boundaries": ({"bins": {"countMode": "Auto", "latencyTargetMilliseconds": 2000, "count": 2, "boundaries": [64]}}, "spec.bins.boundaries"),
    "Sla without tpot": ({"batch": {"sizing": "Sla"}}, "spec.latency.tpotMilliseconds"),
    "Sla with tpot": ({"batch": {"sizing": "Sla"}, "latency": {"tpotMilliseconds": 50}}, None),
    "same ports": ({"sidecar": {"grpcPort": 9090, "metricsPort": 9090}}, "spec.sidecar.metricsPort"),
    "grpc port on the default metrics port": ({"sidecar": {"grpcPort": 9090}}, "spec.sidecar.metricsPort"),
    "resources": ({"sidecar": {"resources": RESOURCES}}, None),
    "requests only": ({"sidecar": {"resources": {"requests": {"cpu": "250m"}}}}, None),
    "cpu: lots": ({"sidecar": {"resources": {"limits": {"cpu": "lots"}}}}, "spec.sidecar.resources.limits.cpu"),
    "request above limit": ({"sidecar": {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}}}, "spec.sidecar.resources.requests"),
    "memory request above limit": ({"sidecar": {"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1000Mi"}}}}, "spec.sidecar.resources.requests"),
    "negative request": ({"sidecar": {"resources": {"requests": {"memory": "-1Mi"}}}}, "spec.sidecar.resources.requests[memory]"),
    "unknown resource name": ({"sidecar": {"resources": {"requests": {"cpus": "1"}}}}, "spec.sidecar.resources.requests"),
    "kubernetes.io resource name": ({"sidecar": {"resources": {"limits": {"kubernetes.io/widget": "1"}}}}, "spec.sidecar.resources.limits"),
    "unknown resources field": ({"sidecar": {"resources": {"claims": [{"name": "gpu"}]}}}, "spec.sidecar.resources.claims"),
    "cpu: 1 unquoted": ({"sidecar": {"resources": {"requests": {"cpu": 1, "memory": 134217728}, "limits": {"cpu": 2, "memory": "1Gi"}}}}, None),
    "integer request above a quoted limit": ({"sidecar": {"resources": {"requests": {"cpu": 2}, "limits": {"cpu": "1500m"}}}}, "spec.sidecar.resources.requests"),
    "quoted request above an integer limit": ({"sidecar": {"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": 1073741823}}}}, "spec.sidecar.resources.requests"),
    "negative integer": ({"sidecar": {"resources": {"requests": {"cpu": -1}}}}, "spec.sidecar.resources.requests.cpu"),
    "fractional number": ({"sidecar": {"resources": {"limits": {"cpu": 1.5}}}}, "spec.sidecar.resources.limits.cpu"),
    "unknown batch field": ({"batch": {"staticSizee": 3}}, "spec.batch.staticSizee"),
    "prefixed label key": ({"selector": {"matchLabels": {"app.kubernetes.io/name": "vllm", "tier": ""}}}, None),
    "label key with two slashes": ({"selector": {"matchLabels": {"a/b/c": "vllm"}}}, "spec.selector.matchLabels"),
    "label key starting with '-'": ({"selector": {"matchLabels": {"-app": "vllm"}}}, "spec.selector.matchLabels"),
    "label key with an upper-case prefix": ({"selector": {"matchLabels": {"Example.com/app": "vllm"}}}, "spec.selector.matchLabels"),
    "label key name of 64": ({"selector": {"matchLabels": {"a" * 64: "vllm"}}}, "spec.selector.matchLabels"),
    "label key name of 63": ({"selector": {"matchLabels": {"a" * 63: "vllm"}}}, None),
    "label key prefix of 254": ({"selector": {"matchLabels": {"a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 62 + "/app": "x"}}}, "spec.selector.matchLabels"),
    "label key prefix of 253": ({"selector": {"matchLabels": {"a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 61 + "/app": "x"}}}, None),
    "label value with a space": ({"selector": {"matchLabels": {"app": "v llm"}}}, "spec.selector.matchLabels.app"),
    "label value ending in a newline": ({"selector": {"matchLabels": {"app": "vllm\n"}}}, "spec.selector.matchLabels.app"),
    "label value of 64": ({"selector": {"matchLabels": {"app": "v" * 64}}}, "spec.selector.matchLabels.app"),
    "distinct http port": ({"sidecar": {"httpPort": 8081}}, None),
    "extra passthrough paths": ({"sidecar": {"passthroughPaths": ["/tokenize", "/v1/embeddings"]}}, None),
    "passthrough wildcard": ({"sidecar": {"passthroughPaths": ["/admin/*"]}}, "spec.sidecar.passthroughPaths[0]"),
    "passthrough without its slash": ({"sidecar": {"passthroughPaths": ["tokenize"]}}, "spec.sidecar.passthroughPaths[0]"),
    "request bytes above the queue's": ({"sidecar": {"maxRequestBytes": 8388608}, "batch": {"maxQueuedBytes": 4194304}}, "spec.batch.maxQueuedBytes"),
    "request bytes within the queue's": ({"sidecar": {"maxRequestBytes": 8388608}, "batch": {"maxQueuedBytes": 8388608}}, None),
    "connection settings": ({"sidecar": {"httpRequestReadTimeoutMilliseconds": 5000, "maxConnections": 64, "grpcMaxConcurrentStreams": 16, "grpcMaxConnectionAgeSeconds": 600}}, None),
    "no connections": ({"sidecar": {"maxConnections": 0}}, "spec.sidecar.maxConnections"),
    "read deadline of 50 ms": ({"sidecar": {"httpRequestReadTimeoutMilliseconds": 50}}, "spec.sidecar.httpRequestReadTimeoutMilliseconds"),
    "grpc connection age of 5 s": ({"sidecar": {"grpcMaxConnectionAgeSeconds": 5}}, "spec.sidecar.grpcMaxConnectionAgeSeconds"),
    "http port on the grpc port": ({"sidecar": {"httpPort": 50051}}, "spec.sidecar.httpPort"),
    "http port on the default metrics port": ({"sidecar": {"httpPort": 9090}}, "spec.sidecar.httpPort"),
    "take-over with its defaults": ({"sidecar": {"takeOverServingPort": {"enabled": True}}}, None),
    "take-over of a named container": ({"sidecar": {"takeOverServingPort": {"enabled": True, "container": "vllm", "enginePort": 18000}}}, None),
    "take-over engine port on the grpc port": ({"sidecar": {"takeOverServingPort": {"enabled": True, "enginePort": 50051}}}, "spec.sidecar.takeOverServingPort.enginePort"),
    "take-over engine port on the default http port": ({"sidecar": {"takeOverServingPort": {"enabled": True, "enginePort": 8080}}}, "spec.sidecar.takeOverServingPort.enginePort"),
    "take-over engine port on the metrics port": ({"sidecar": {"metricsPort": 8001, "takeOverServingPort": {"enabled": True}}}, "spec.sidecar.takeOverServingPort.enginePort"),
    "engine port on the grpc port, take-over off": ({"sidecar": {"takeOverServingPort": {"enginePort": 50051}}}, None),
    "take-over with a remote engine": ({"sidecar": {"takeOverServingPort": {"enabled": True}}, "engine": {"url": "http://vllm.llm.svc:8000"}}, "spec.engine.url"),
    "take-over with a localhost engine": ({"sidecar": {"takeOverServingPort": {"enabled": True}}, "engine": {"url": "http://localhost:8000/"}}, None),
    "take-over with an IPv6 loopback engine": ({"sidecar": {"takeOverServingPort": {"enabled": True}}, "engine": {"url": "http://[::1]:8000"}}, None),
    "take-over with a look-alike host": ({"sidecar": {"takeOverServingPort": {"enabled": True}}, "engine": {"url": "http://127.0.0.1.example.com:8000"}}, "spec.engine.url"),
    "remote engine, take-over off": ({"engine": {"url": "http://vllm.llm.svc:8000"}}, None),
    "headless Service": ({"service": {"headless": True}}, None),
    "allowFrom peers": ({"sidecar": {"allowFrom": [{"podSelector": {}}, {"namespaceSelector": {"matchLabels": {"team": "ml"}}, "podSelector": {"matchExpressions": [{"key": "role", "operator": "In", "values": ["gw"]}]}}, {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.9.0.0/16"]}}]}}, None),
    "allowFrom empty": ({"sidecar": {"allowFrom": []}}, "spec.sidecar.allowFrom"),
    "allowFrom peer of nothing": ({"sidecar": {"allowFrom": [{}]}}, "spec.sidecar.allowFrom[0]"),
    "allowFrom ipBlock with a podSelector": ({"sidecar": {"allowFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}}, "spec.sidecar.allowFrom[0]"),
    "external predictor with feedback": ({"predictor": {"external": {"url": "http://p:9000/predict", "feedbackUrl": "http://p:9000/completions"}}}, None),
    "external predictor feedback without its url": ({"predictor": {"external": {"feedbackUrl": "http://p:9000/completions"}}}, "spec.predictor.external.feedbackUrl"),
    "external predictor timeout of 0": ({"predictor": {"external": {"url": "http://p:9000/predict", "timeoutMilliseconds": 0}}}, "spec.predictor.external.timeoutMilliseconds"),
    "model from a ConfigMap": ({"predictor": {"model": {"configMapKeyRef": {"name": "lengths", "key": "model.npz"}}}}, None),
    "model from a Secret": ({"predictor": {"kind": "Learned", "model": {"secretKeyRef": {"name": "lengths", "key": "model"}}}}, None),
    "model from both": ({"predictor": {"model": {"configMapKeyRef": {"name": "a", "key": "m"}, "secretKeyRef": {"name": "b", "key": "m"}}}}, "spec.predictor.model"),
    "model from neither": ({"predictor": {"model": {}}}, "spec.predictor.model"),
    "model without its key": ({"predictor": {"model": {"configMapKeyRef": {"name": "lengths"}}}}, "spec.predictor.model.configMapKeyRef.key"),
    "model with a bad ConfigMap name": ({"predictor": {"model": {"configMapKeyRef": {"name": "Lengths_1", "key": "m"}}}}, "spec.predictor.model.configMapKeyRef.name"),
    "model with kind Online": ({"predictor": {"kind": "Online", "model": {"configMapKeyRef": {"name": "lengths", "key": "m"}}}}, "spec.predictor.model"),
    "model with a hand-set warmStart": ({"predictor": {"warmStart": "/m.npz", "model": {"configMapKeyRef": {"name": "lengths", "key": "m"}}}}, "spec.predictor.model"),
    "warmStartOptional without warmStart": ({"predictor": {"warmStartOptional": True}}, "spec.predictor.warmStartOptional"),
    "warmStartOptional with warmStart": ({"predictor": {"warmStart": "/m.npz", "warmStartOptional": True}}, None),
}  # fmt: skip


def policy_spec(overrides: dict[str, Any]) -> dict[str, Any]:
    return {"selector": copy.deepcopy(SELECTOR), **copy.deepcopy(overrides)}


