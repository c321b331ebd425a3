"""The CRD as a Kubernetes API server (1.36) judges it, checked offline.

No API server runs in CI, so ``crd_admission`` (tests/crd_admission.py; its
docstring lists each check and the API-server code it mirrors) plays one:
defaults validated as written, objects defaulted as stored, every CEL rule run
(an absent key is an error), also on sparse objects, with bounds on everything a
rule reads, and the quantity library called as Kubernetes declares it.  The same
``CASES`` go to a real API server in ``tests/apiserver`` when one is there.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cel
import kubernetes_validate
import pytest
import yaml

from binbatch_operator import crd
from binbatch_operator.reconcile import _spec_problems
from binbatch_sidecar.config import dump_config, parse_config
from crd_admission import (
    CASES, K8S_FUNCTIONS, SAMPLES, SCHEMA, SELECTOR, SPEC, admission, at, call_style_errors, default_findings,
    evaluate_rules, policy_spec, rule_nodes, sparse_variants, validate,
)  # fmt: skip

DEFAULTS = dump_config(parse_config({}))


@pytest.mark.parametrize("case", list(CASES))
def test_the_api_server_and_the_operator_agree(case: str) -> None:
    overrides, field = CASES[case]
    stored, found = admission(policy_spec(overrides))
    errors = [f for f in found if f.kind == "error"]
    assert not errors, errors  # a rule that fails to evaluate refuses the object with a useless message
    assert {f.path for f in found} == ({field} if field else set()), (case, found)
    assert bool(_spec_problems(stored)) is (field is not None), (case, _spec_problems(stored))


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


@pytest.mark.parametrize("case", [name for name, (_, field) in CASES.items() if field is None])
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
        if schema.get("x-kubernetes-int-or-string") and "maxLength" not in schema:
            yield f"{where}: int-or-string without maxLength"
        if schema.get("x-kubernetes-preserve-unknown-fields"):
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
    assert [f.kind for f in default_findings({"type": "string", "enum": ["A"], "default": "B"}, "x")] == ["blocking"]
    assert [f.kind for f in default_findings({"type": "integer", "default": "1"}, "x")] == ["blocking"]
    unknown = {"type": "object", "properties": {"a": {"type": "integer"}}, "default": {"b": 1}}
    assert [f.text for f in default_findings(unknown, "x")] == ["unknown field"]


def test_harness_runs_rules_after_a_pattern_error_but_not_after_a_blocking_one() -> None:
    # hasBlockingErr: after a pattern or a minimum the rules still run (so they must guard), after a
    # type or a bound they do not.  An int-or-string reaches its rule as an int or a str.
    node = {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}],
            "minimum": 0, "maxLength": 4, "pattern": "^[0-9]+$",
            "x-kubernetes-validations": [{"rule": "type(self) == int || int(self) < 50", "message": "small"}]}  # fmt: skip
    kinds = {"7": [], "70": ["false"], 70: [], -1: ["schema"], "x": ["error", "schema"],
             "12345": ["blocking"], 1.5: ["blocking"]}  # fmt: skip
    for value, expected in kinds.items():
        assert sorted(f.kind for f in validate(node, value, "q")) == expected, value


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
