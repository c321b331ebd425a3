"""The CRD's CEL rules, evaluated offline, agree with the sidecar's own validation.

The API server applies defaults and then the ``x-kubernetes-validations``
rules; here the same CEL text runs in ``common-expression-language`` (Rust CEL)
on the defaulted object.  Kubernetes adds list functions to CEL; the one our
rules use, ``isSorted()``, is supplied with its Kubernetes meaning.  Each case
must be refused (or accepted) by CEL exactly when pydantic refuses (or accepts)
it, so a bad policy meets the same verdict at ``kubectl apply`` as in the sidecar.

Not proven here (only a real API server would): CEL cost limits, and rule
compilation by the API server's own CEL environment.
"""

from __future__ import annotations

import copy
from typing import Any

import cel
import kubernetes_validate
import pytest

from binbatch_operator import crd
from binbatch_operator.builders import sidecar_config
from binbatch_sidecar.config import ConfigError, dump_config, parse_config

DEFAULTS = dump_config(parse_config({}))
SPEC = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def cel_errors(rules: list[dict[str, str]], obj: dict[str, Any]) -> list[str]:
    context = cel.Context(variables={"self": obj}, functions={"isSorted": lambda xs: list(xs) == sorted(xs)})
    return [rule["message"] for rule in rules if cel.evaluate(rule["rule"], context) is not True]


def defaulted_spec(overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A spec as the API server holds it after defaulting: every section, every field."""
    spec: dict[str, Any] = {"selector": {"matchLabels": {"app": "vllm"}}}
    for name in crd.CONFIG_SECTIONS:
        spec[name] = {**copy.deepcopy(DEFAULTS[name]), **overrides.get(name, {})}
    spec["sidecar"] = {"grpcPort": 50051, "metricsPort": 9090, "drainGraceSeconds": 30, **overrides.get("sidecar", {})}
    return spec


def all_cel_errors(spec: dict[str, Any]) -> list[str]:
    errors = cel_errors(SPEC["x-kubernetes-validations"], spec)
    for name, prop in SPEC["properties"].items():
        errors += cel_errors(prop.get("x-kubernetes-validations", []), spec[name])
    return errors


def pydantic_refuses(spec: dict[str, Any]) -> bool:
    try:
        sidecar_config(spec)
    except ConfigError:
        return True
    return False


CASES = {
    "defaults": ({}, False),
    "fixed boundaries": ({"bins": {"mode": "Fixed", "count": 3, "boundaries": [64, 256]}}, False),
    "boundaries unsorted": ({"bins": {"mode": "Fixed", "count": 3, "boundaries": [256, 64]}}, True),
    "boundaries vs count": ({"bins": {"mode": "Fixed", "count": 4, "boundaries": [64, 256]}}, True),
    "boundaries with Auto": ({"bins": {"mode": "Auto", "count": 3, "boundaries": [64, 256]}}, True),
    "boundary past max": ({"bins": {"mode": "Fixed", "count": 2, "boundaries": [4096], "maxOutputTokens": 2048}}, True),
    "min above static": ({"batch": {"minBatchSize": 64, "staticSize": 32}}, True),
    "static above max": ({"batch": {"staticSize": 512, "maxBatchSize": 256}}, True),
    "batch in order": ({"batch": {"minBatchSize": 4, "staticSize": 16, "maxBatchSize": 64}}, False),
    "stale too soon": ({"metrics": {"intervalMilliseconds": 500, "staleAfterMilliseconds": 600}}, True),
    "Sla without tpot": ({"batch": {"sizing": "Sla"}, "latency": {"tpotMilliseconds": 0}}, True),
    "Sla with tpot": ({"batch": {"sizing": "Sla"}, "latency": {"tpotMilliseconds": 50}}, False),
    "same ports": ({"sidecar": {"grpcPort": 9090, "metricsPort": 9090}}, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cel_and_pydantic_agree(case: str) -> None:
    overrides, invalid = CASES[case]
    spec = defaulted_spec(overrides)
    assert pydantic_refuses(spec) is invalid, case
    errors = all_cel_errors(spec)
    assert bool(errors) is invalid, (case, errors)


def test_cel_messages_name_what_is_wrong() -> None:
    spec = defaulted_spec({"batch": {"minBatchSize": 64, "staticSize": 32}})
    assert all_cel_errors(spec) == ["minBatchSize must be <= staticSize"]


def test_crd_is_a_valid_kubernetes_object() -> None:
    kubernetes_validate.validate(crd.build_crd(), "1.30", strict=True)
