"""The CRD as a Kubernetes API server (1.36) judges it, checked offline.

There is no Docker in CI, so no API server runs in the suite.  Instead this
module re-creates the parts of apiextensions-apiserver that decide whether the
CRD is accepted and whether a BatchingPolicy is, and runs the CRD's real rule
text in ``common-expression-language`` (a CEL interpreter whose parser is CEL's
own grammar, so a rule the API server cannot parse, e.g. an invalid ``'\\.'``
escape, fails here too).  Sources: kubernetes/kubernetes,
``staging/src/k8s.io/apiextensions-apiserver/pkg/apiserver/schema/``.

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
   the rules (skipped after a type error, like the strategy's
   ``hasBlockingErr``).  Its verdict is compared with the operator's own
   (``_spec_problems``: the sidecar's pydantic models plus ``k8s_rules``).
4. Sparse objects: every rule-bearing node is also evaluated with all optional
   fields absent and with each optional field (and map entry) absent in turn,
   with no evaluation error allowed.  Defaulting makes most of these
   impossible on a stored object, but the same guard is what item 1 needs, and
   it keeps the next default someone adds from refusing the CRD again.
5. Rules compile against the schema: every ``self.<field>`` a rule reads is
   declared (the API server type-checks rules at CRD creation), and every
   ``fieldPath`` resolves to a declared field (also checked at CRD creation).
6. Cost: the API server estimates each rule's worst-case cost from the schema's
   bounds (``SchemaDeclType``: an unbounded string or an int-or-string counts
   as the 3 MiB request size; an unbounded list or map as many as fit in it)
   and refuses rules over budget.  Every list, map and string a rule can reach
   must have ``maxItems``/``maxProperties``/``maxLength`` (or an enum).
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
import kubernetes_validate
import pytest
import yaml

from binbatch_operator import crd, k8s_rules
from binbatch_operator.reconcile import _spec_problems
from binbatch_sidecar.config import dump_config, parse_config

SCHEMA = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC = SCHEMA["properties"]["spec"]
DEFAULTS = dump_config(parse_config({}))
SELECTOR = {"matchLabels": {"app": "vllm"}}
SAMPLES = sorted((Path(__file__).resolve().parents[2] / "manifests" / "samples").glob("*.yaml"))


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
    kind: str  # "type" | "schema" | "error" (a rule failed to evaluate) | "false" (a rule said no)
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


def schema_findings(schema: dict[str, Any], value: Any, path: str) -> list[Finding]:
    """``ValidateCustomResource`` (types, bounds, enums, patterns) plus the structural checks."""
    out = []
    for err in OpenAPIValidator(schema).iter_errors(value):
        where = path + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
        out.append(Finding(where, "type" if err.validator == "type" else "schema", err.message))
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


def admission(spec: dict[str, Any]) -> tuple[dict[str, Any], list[Finding]]:
    """A policy created with ``spec``: the stored (defaulted) spec and the API server's findings."""
    stored = apply_defaults(copy.deepcopy(spec), SPEC)
    found = schema_findings(SPEC, stored, "spec")
    if not any(f.kind == "type" for f in found):
        found += evaluate_rules(SPEC, stored, "spec")
    return stored, found


# -- sparse objects (item 4) --------------------------------------------------------


def rule_nodes(schema: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """Every schema node with rules, by its property path below spec."""
    if schema.get("x-kubernetes-validations"):
        yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from rule_nodes(sub, (*path, key))


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

# (spec without its selector unless the case sets one, refused?)  Specs are
# written as users write them: sparse; the API server defaults them.
CASES: dict[str, tuple[dict[str, Any], bool]] = {
    "selector only": ({}, False),
    "bins Auto, nothing else": ({"bins": {"mode": "Auto"}}, False),
    "fixed boundaries": ({"bins": {"mode": "Fixed", "count": 3, "boundaries": [64, 256]}}, False),
    "boundaries unsorted": ({"bins": {"mode": "Fixed", "count": 3, "boundaries": [256, 64]}}, True),
    "boundaries repeated": ({"bins": {"mode": "Fixed", "count": 3, "boundaries": [64, 64]}}, True),
    "boundaries vs count": ({"bins": {"mode": "Fixed", "count": 4, "boundaries": [64, 256]}}, True),
    "boundaries vs default count": ({"bins": {"boundaries": [64, 256]}}, True),
    "boundaries with Auto": ({"bins": {"mode": "Auto", "count": 3, "boundaries": [64, 256]}}, True),
    "boundary past max": ({"bins": {"mode": "Fixed", "count": 2, "boundaries": [4096], "maxOutputTokens": 2048}}, True),
    "boundary past default max": ({"bins": {"count": 2, "boundaries": [4096]}}, True),
    "min above static": ({"batch": {"minBatchSize": 64, "staticSize": 32}}, True),
    "min above default static": ({"batch": {"minBatchSize": 64}}, True),
    "static above max": ({"batch": {"staticSize": 512, "maxBatchSize": 256}}, True),
    "static above default max": ({"batch": {"staticSize": 512}}, True),
    "batch in order": ({"batch": {"minBatchSize": 4, "staticSize": 16, "maxBatchSize": 64}}, False),
    "stale too soon": ({"metrics": {"intervalMilliseconds": 500, "staleAfterMilliseconds": 600}}, True),
    "stale too soon for default interval": ({"metrics": {"staleAfterMilliseconds": 600}}, True),
    "Smdp in Gang": ({"batch": {"dispatch": "Smdp", "mode": "Gang"}}, False),
    "Smdp in default Continuous": ({"batch": {"dispatch": "Smdp"}}, True),
    "LongestFitFirst with Projected": ({"batch": {"drainOrder": "LongestFitFirst"}, "memory": {"admission": "Projected"}}, False),
    "LongestFitFirst with the default BatchSize": ({"batch": {"drainOrder": "LongestFitFirst"}}, True),
    "LongestFitFirst with Fifo": ({"batch": {"drainOrder": "LongestFitFirst", "order": "Fifo"}, "memory": {"admission": "Projected"}}, True),
    "LongestFitFirst with Static sizing": ({"batch": {"drainOrder": "LongestFitFirst", "sizing": "Static"}, "memory": {"admission": "Projected"}}, True),
    "EnginePriority without the engine-queue cap": ({"batch": {"order": "EnginePriority", "followEngineQueue": False}}, False),
    "EnginePriority with the default followEngineQueue": ({"batch": {"order": "EnginePriority"}}, True),
    "EnginePriority in Gang": ({"batch": {"order": "EnginePriority", "followEngineQueue": False, "mode": "Gang"}}, True),
    "EnginePriority with Projected": ({"batch": {"order": "EnginePriority", "followEngineQueue": False}, "memory": {"admission": "Projected"}}, True),
    "countMode Auto with a target": ({"bins": {"countMode": "Auto", "latencyTargetMilliseconds": 2000}}, False),
    "countMode Auto without a target": ({"bins": {"countMode": "Auto"}}, True),
    "countMode Auto with Adaptive": ({"bins": {"countMode": "Auto", "mode": "Adaptive", "latencyTargetMilliseconds": 2000}}, True),
    "countMode Auto with boundaries": ({"bins": {"countMode": "Auto", "latencyTargetMilliseconds": 2000, "count": 2, "boundaries": [64]}}, True),
    "Sla without tpot": ({"batch": {"sizing": "Sla"}}, True),
    "Sla with tpot": ({"batch": {"sizing": "Sla"}, "latency": {"tpotMilliseconds": 50}}, False),
    "same ports": ({"sidecar": {"grpcPort": 9090, "metricsPort": 9090}}, True),
    "grpc port on the default metrics port": ({"sidecar": {"grpcPort": 9090}}, True),
    "resources": ({"sidecar": {"resources": RESOURCES}}, False),
    "requests only": ({"sidecar": {"resources": {"requests": {"cpu": "250m"}}}}, False),
    "cpu: lots": ({"sidecar": {"resources": {"limits": {"cpu": "lots"}}}}, True),
    "request above limit": ({"sidecar": {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}}}, True),
    "memory request above limit": ({"sidecar": {"resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1000Mi"}}}}, True),
    "negative request": ({"sidecar": {"resources": {"requests": {"memory": "-1Mi"}}}}, True),
    "unknown resource name": ({"sidecar": {"resources": {"requests": {"cpus": "1"}}}}, True),
    "kubernetes.io resource name": ({"sidecar": {"resources": {"limits": {"kubernetes.io/widget": "1"}}}}, True),
    "unknown resources field": ({"sidecar": {"resources": {"claims": [{"name": "gpu"}]}}}, True),
    "prefixed label key": ({"selector": {"matchLabels": {"app.kubernetes.io/name": "vllm", "tier": ""}}}, False),
    "label key with two slashes": ({"selector": {"matchLabels": {"a/b/c": "vllm"}}}, True),
    "label key starting with '-'": ({"selector": {"matchLabels": {"-app": "vllm"}}}, True),
    "label key with an upper-case prefix": ({"selector": {"matchLabels": {"Example.com/app": "vllm"}}}, True),
    "label key name of 64": ({"selector": {"matchLabels": {"a" * 64: "vllm"}}}, True),
    "label key name of 63": ({"selector": {"matchLabels": {"a" * 63: "vllm"}}}, False),
    "label key prefix of 254": ({"selector": {"matchLabels": {"a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 62 + "/app": "x"}}}, True),
    "label key prefix of 253": ({"selector": {"matchLabels": {"a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 61 + "/app": "x"}}}, False),
    "label value with a space": ({"selector": {"matchLabels": {"app": "v llm"}}}, True),
    "label value ending in a newline": ({"selector": {"matchLabels": {"app": "vllm\n"}}}, True),
    "label value of 64": ({"selector": {"matchLabels": {"app": "v" * 64}}}, True),
    "distinct http port": ({"sidecar": {"httpPort": 8081}}, False),
    "http port on the grpc port": ({"sidecar": {"httpPort": 50051}}, True),
    "http port on the default metrics port": ({"sidecar": {"httpPort": 9090}}, True),
    "take-over with its defaults": ({"sidecar": {"takeOverServingPort": {"enabled": True}}}, False),
    "take-over of a named container": ({"sidecar": {"takeOverServingPort": {"enabled": True, "container": "vllm", "enginePort": 18000}}}, False),
    "take-over engine port on the grpc port": ({"sidecar": {"takeOverServingPort": {"enabled": True, "enginePort": 50051}}}, True),
    "take-over engine port on the default http port": ({"sidecar": {"takeOverServingPort": {"enabled": True, "enginePort": 8080}}}, True),
    "take-over engine port on the metrics port": ({"sidecar": {"metricsPort": 8001, "takeOverServingPort": {"enabled": True}}}, True),
    "engine port on the grpc port, take-over off": ({"sidecar": {"takeOverServingPort": {"enginePort": 50051}}}, False),
    "take-over with a remote engine": ({"sidecar": {"takeOverServingPort": {"enabled": True}}, "engine": {"url": "http://vllm.llm.svc:8000"}}, True),
    "take-over with a localhost engine": ({"sidecar": {"takeOverServingPort": {"enabled": True}}, "engine": {"url": "http://localhost:8000/"}}, False),
    "take-over with an IPv6 loopback engine": ({"sidecar": {"takeOverServingPort": {"enabled": True}}, "engine": {"url": "http://[::1]:8000"}}, False),
    "take-over with a look-alike host": ({"sidecar": {"takeOverServingPort": {"enabled": True}}, "engine": {"url": "http://127.0.0.1.example.com:8000"}}, True),
    "remote engine, take-over off": ({"engine": {"url": "http://vllm.llm.svc:8000"}}, False),
    "headless Service": ({"service": {"headless": True}}, False),
    "external predictor with feedback": ({"predictor": {"external": {"url": "http://p:9000/predict", "feedbackUrl": "http://p:9000/completions"}}}, False),
    "external predictor feedback without its url": ({"predictor": {"external": {"feedbackUrl": "http://p:9000/completions"}}}, True),
    "external predictor timeout of 0": ({"predictor": {"external": {"url": "http://p:9000/predict", "timeoutMilliseconds": 0}}}, True),
}  # fmt: skip


def policy_spec(overrides: dict[str, Any]) -> dict[str, Any]:
    return {"selector": copy.deepcopy(SELECTOR), **copy.deepcopy(overrides)}


@pytest.mark.parametrize("case", list(CASES))
def test_the_api_server_and_the_operator_agree(case: str) -> None:
    overrides, invalid = CASES[case]
    stored, found = admission(policy_spec(overrides))
    errors = [f for f in found if f.kind == "error"]
    assert not errors, errors  # a rule that fails to evaluate refuses the object with a useless message
    assert bool(found) is invalid, (case, found)
    assert bool(_spec_problems(stored)) is invalid, (case, _spec_problems(stored))


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_the_sample_policies_are_accepted(sample: Path) -> None:
    policies = [d for d in yaml.safe_load_all(sample.read_text()) if d and d.get("kind") == crd.KIND]
    assert policies, sample
    for policy in policies:
        stored, found = admission(policy["spec"])
        assert found == [] and _spec_problems(stored) == [], (policy["metadata"]["name"], found)


def test_the_crd_defaults_are_the_sidecars_defaults() -> None:
    stored, found = admission({"selector": SELECTOR})
    assert found == []
    for name in crd.CONFIG_SECTIONS:
        assert stored[name] == DEFAULTS[name], name
    assert stored["sidecar"] == {**crd.SIDECAR_DEFAULTS, "image": "", "takeOverServingPort": crd.TAKEOVER_DEFAULTS}
    assert stored["service"] == crd.SERVICE_DEFAULTS


def test_every_default_passes_its_schema_and_rules_as_written() -> None:
    assert default_findings(SCHEMA, "spec.validation.openAPIV3Schema") == []


@pytest.mark.parametrize("case", [name for name, (_, invalid) in CASES.items() if not invalid])
def test_rules_evaluate_without_error_when_optional_fields_are_absent(case: str) -> None:
    stored, _ = admission(policy_spec(CASES[case][0]))
    for path, node in rule_nodes(SPEC):
        value = stored if not path else at(stored, path)
        if value is None:
            continue
        for label, variant in sparse_variants(node, value):
            errors = [f for f in evaluate_rules(node, variant, ".".join(("spec", *path))) if f.kind == "error"]
            assert not errors, (case, label, errors)


def test_rules_only_read_declared_fields() -> None:
    for path, node in rule_nodes(SPEC):
        for rule in node["x-kubernetes-validations"]:
            for match in re.finditer(r"\bself((?:\.[A-Za-z_]\w*)+)(\()?", rule["rule"]):
                names = match.group(1).split(".")[1:]
                if match.group(2):  # the last name is a method call: self.boundaries.isSorted()
                    names = names[:-1]
                schema = node
                for name in names:
                    if "properties" not in schema:
                        break  # a map: keys are data
                    assert name in schema["properties"], (path, rule["rule"], name)
                    schema = schema["properties"][name]


def test_every_field_path_names_a_declared_field() -> None:
    # The API server refuses a CRD whose fieldPath does not resolve in the schema.
    for path, node in rule_nodes(SPEC):
        for rule in node["x-kubernetes-validations"]:
            schema = node
            for name in filter(None, rule.get("fieldPath", "").split(".")):
                assert name in schema.get("properties", {}), (path, rule)
                schema = schema["properties"][name]


def test_everything_a_rule_can_read_is_bounded() -> None:
    def unbounded(schema: dict[str, Any], where: str) -> Iterator[str]:
        kind = schema.get("type")
        if kind == "array" and "maxItems" not in schema:
            yield f"{where}: list without maxItems"
        if kind == "object" and isinstance(schema.get("additionalProperties"), dict) and "maxProperties" not in schema:
            yield f"{where}: map without maxProperties"
        if kind == "string" and "maxLength" not in schema and "enum" not in schema:
            yield f"{where}: string without maxLength"
        if schema.get("x-kubernetes-int-or-string") or schema.get("x-kubernetes-preserve-unknown-fields"):
            yield f"{where}: sized as the whole request by the cost estimator"
        for key, sub in schema.get("properties", {}).items():
            yield from unbounded(sub, f"{where}.{key}")
        for key in ("items", "additionalProperties"):
            if isinstance(schema.get(key), dict):
                yield from unbounded(schema[key], f"{where}[]")

    problems = [p for path, node in rule_nodes(SPEC) for p in unbounded(node, ".".join(("spec", *path)))]
    assert problems == []


def test_cel_messages_name_what_is_wrong() -> None:
    _, found = admission(policy_spec({"batch": {"minBatchSize": 64, "staticSize": 32}}))
    assert [(f.path, f.text) for f in found] == [("spec.batch.minBatchSize", "minBatchSize must be <= staticSize")]
    _, found = admission(policy_spec({"sidecar": {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}}}))
    assert [(f.path, f.text) for f in found] == [("spec.sidecar.resources.requests", "every request must be <= its limit")]


def test_harness_treats_an_absent_key_as_an_error_not_as_false() -> None:
    node = {"type": "object", "properties": {"a": {"type": "integer"}},
            "x-kubernetes-validations": [{"rule": "self.a > 0", "message": "a must be positive"}]}  # fmt: skip
    assert [f.kind for f in evaluate_rules(node, {}, "x")] == ["error"]
    assert [f.kind for f in evaluate_rules(node, {"a": 0}, "x")] == ["false"]
    assert default_findings({**node, "default": {}}, "x") != []


def test_harness_validates_defaults_against_their_own_schema() -> None:
    assert [f.kind for f in default_findings({"type": "integer", "minimum": 1, "default": 0}, "x")] == ["schema"]
    assert [f.kind for f in default_findings({"type": "string", "enum": ["A"], "default": "B"}, "x")] == ["schema"]
    assert [f.kind for f in default_findings({"type": "integer", "default": "1"}, "x")] == ["type"]
    unknown = {"type": "object", "properties": {"a": {"type": "integer"}}, "default": {"b": 1}}
    assert [f.text for f in default_findings(unknown, "x")] == ["unknown field"]


def test_harness_quantity_library_compares_values_not_text() -> None:
    ctx = cel.Context(functions=K8S_FUNCTIONS)
    assert cel.evaluate("quantity('1500m').compareTo(quantity('2')) < 0", ctx) is True
    assert cel.evaluate("quantity('1Gi').compareTo(quantity('1000Mi')) > 0", ctx) is True
    assert cel.evaluate("isQuantity('lots') || isQuantity('1e3x')", ctx) is False
    assert cel.evaluate("sign(quantity('-1')) < 0 && sign(quantity('0')) == 0", ctx) is True


def test_harness_refuses_what_the_api_server_cannot_compile() -> None:
    # A real kube-apiserver refused ``quantity(x).sign()``; the cel package had evaluated it.
    assert call_style_errors("self.all(k, quantity(self[k]).sign() >= 0)")
    assert call_style_errors("compareTo(quantity(self.a), quantity(self.b)) <= 0")
    assert call_style_errors("self.x.isQuantity()")
    assert not call_style_errors("sign(quantity(self[k])) >= 0 && quantity(self.a).compareTo(quantity(self.b)) < 0")
    assert not call_style_errors("self.boundaries.isSorted() && size(self.b) > 0 && self.s.matches('^a$')")
    schema = {"type": "object", "x-kubernetes-validations": [{"rule": "quantity(self.q).sign() >= 0", "message": "m"}]}
    assert [f.kind for f in evaluate_rules(schema, {"q": "1"}, "spec")] == ["error"]


def test_every_rule_calls_the_library_as_kubernetes_declares_it() -> None:
    for path, node in rule_nodes(SCHEMA):
        for rule in node["x-kubernetes-validations"]:
            assert not call_style_errors(rule["rule"]), (path, rule["rule"])


@pytest.mark.parametrize("version", ["1.30", kubernetes_validate.latest_version()])
def test_crd_is_a_valid_kubernetes_object(version: str) -> None:
    kubernetes_validate.validate(crd.build_crd(), version, strict=True)
