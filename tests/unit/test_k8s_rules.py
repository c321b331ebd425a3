"""The API server's syntax rules (``k8s_rules``), and the operator refusing a policy
that would make objects the API server refuses (issue 8, defects 3 and 4)."""

from __future__ import annotations

import re
from typing import Any

import cel
import pytest

from binbatch_operator import crd, k8s_rules
from binbatch_operator.indexes import Seen
from binbatch_operator.reconcile import Context, admit, reconcile

# -- names (the regexes and lengths of k8s.io/apimachinery pkg/util/validation) --------

DNS1123_LABEL = {"a": True, "a" * 63: True, "a" * 64: False, "web-1": True, "1web": True, "-web": False,
                 "web-": False, "Web": False, "web.x": False, "": False, "web_1": False}  # fmt: skip
DNS1123_SUBDOMAIN = {"a.b-c.d": True, "a" * 63 + "." + "b" * 189: True, "a" * 63 + "." + "b" * 190: False,
                     "a..b": False, ".a": False, "a.": False, "A.b": False, "a" * 64: True, "x\n": False}  # fmt: skip
DNS1035_LABEL = {"abc": True, "a" * 63: True, "a" * 64: False, "1abc": False, "a-1": True, "a-": False,
                 "a.b": False, "": False}  # fmt: skip


@pytest.mark.parametrize(("check", "cases"), [
    (k8s_rules.dns1123_label_problems, DNS1123_LABEL),
    (k8s_rules.dns1123_subdomain_problems, DNS1123_SUBDOMAIN),
    (k8s_rules.dns1035_label_problems, DNS1035_LABEL),
])  # fmt: skip
def test_name_syntax_follows_the_api_servers_regexes_and_lengths(check: Any, cases: dict[str, bool]) -> None:
    for value, valid in cases.items():
        assert (check(value) == []) is valid, (check.__name__, value)


def test_object_names_follow_each_kinds_rule() -> None:
    # A name with dots, or of 64 characters, is a valid ConfigMap name and an invalid Service name.
    for name in ("fast.v2-binbatch", "a" * 64):
        assert k8s_rules.object_name_problems("ConfigMap", name) == []
        assert k8s_rules.object_name_problems("Service", name) != []
    assert k8s_rules.object_name_problems("Service", "fast-binbatch") == []
    assert k8s_rules.object_name_problems("Namespace", "llm.prod") != []


def test_name_problems_say_what_is_wrong() -> None:
    assert k8s_rules.dns1035_label_problems("a" * 64) == ["must be no more than 63 characters"]
    assert "start with a letter" in k8s_rules.dns1035_label_problems("1abc")[0]


# -- labels: the module and the CRD agree on every sample ------------------------------

LONG_PREFIX = "a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 62  # 254 characters
LABEL_KEYS = {
    "app": True, "app.kubernetes.io/name": True, "example.com/a_b.c-d": True, "A9": True, "a" * 63: True,
    "a" * 64: False, "example.com/" + "a" * 64: False, LONG_PREFIX[:-1] + "/app": True, LONG_PREFIX + "/app": False,
    "a/b/c": False, "/app": False, "example.com/": False, "-app": False, "app-": False, "Example.com/app": False,
    "exa_mple.com/app": False, "app name": False, "app\n": False, "": False,
}  # fmt: skip
LABEL_VALUES = {"": True, "vllm": True, "v1.2_3-x": True, "v" * 63: True, "v" * 64: False, "-v": False,
                "v llm": False, "vllm\n": False, "v/x": False}  # fmt: skip


@pytest.mark.parametrize(("key", "valid"), list(LABEL_KEYS.items()))
def test_label_keys_are_qualified_names_in_the_module_and_the_crd(key: str, valid: bool) -> None:
    assert (k8s_rules.qualified_name_problems(key) == []) is valid
    rule = crd.LABEL_KEY_RULE["rule"]
    assert cel.evaluate(rule, cel.Context(variables={"self": {key: "x"}})) is valid


@pytest.mark.parametrize(("value", "valid"), list(LABEL_VALUES.items()))
def test_label_values_in_the_module_and_the_crd_pattern(value: str, valid: bool) -> None:
    assert (k8s_rules.label_value_problems(value) == []) is valid
    schema = crd.spec_schema()["properties"]["selector"]["properties"]["matchLabels"]["additionalProperties"]
    go_pattern = schema["pattern"].removesuffix("$") + r"\Z"  # Go's "$" is the end of the text
    assert (re.search(go_pattern, value) is not None and len(value) <= schema["maxLength"]) is valid


def test_selector_problems_name_the_label() -> None:
    problems = k8s_rules.selector_problems({"matchLabels": {"app": "ok", "bad key": "ok", "tier": "bad value"}})
    assert [path for path, _ in problems] == ["spec.selector.matchLabels[bad key]", "spec.selector.matchLabels[tier]"]
    assert problems[0][1].startswith("key name part") and problems[1][1].startswith("value ")
    assert k8s_rules.selector_problems({}) == [("spec.selector.matchLabels", "must list at least one label")]


# -- resources --------------------------------------------------------------------------


@pytest.mark.parametrize(("resources", "field", "says"), [
    ({"limits": {"cpu": "lots"}}, "spec.sidecar.resources.limits.cpu", "must be a quantity"),
    ({"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}, "spec.sidecar.resources.limits.cpu", "greater than or equal to the request"),
    ({"requests": {"memory": "1Gi"}, "limits": {"memory": "1000Mi"}}, "spec.sidecar.resources.limits.memory", "request"),
    ({"requests": {"memory": "-1"}}, "spec.sidecar.resources.requests.memory", "greater than or equal to 0"),
    ({"requests": {"cpus": "1"}}, "spec.sidecar.resources.requests.cpus", "standard resource"),
    ({"limits": {"example.com/gpu": "500m"}}, "spec.sidecar.resources.limits.example.com/gpu", "whole number"),
    ({"requests": {"example.com/gpu": "1"}}, "spec.sidecar.resources.limits.example.com/gpu", "must be set"),
    ({"requests": {"hugepages-2Mi": "1Mi"}, "limits": {"hugepages-2Mi": "2Mi"}}, "spec.sidecar.resources.requests.hugepages-2Mi", "must equal"),
    ({"requests": {"cpu": 1.5}}, "spec.sidecar.resources.requests.cpu", "a whole number or a string"),
    ({"requests": {"cpu": -1}}, "spec.sidecar.resources.requests.cpu", "greater than or equal to 0"),
    ({"requests": {"cpu": 2}, "limits": {"cpu": "1500m"}}, "spec.sidecar.resources.limits.cpu", "greater than or equal to the request"),
    ({"claims": [{"name": "gpu"}]}, "spec.sidecar.resources.claims", "unknown field"),
])  # fmt: skip
def test_bad_resources_are_named_by_field(resources: dict[str, Any], field: str, says: str) -> None:
    problems = k8s_rules.resources_problems(resources)
    assert [path for path, _ in problems] == [field], problems
    assert says in problems[0][1]


def test_valid_resources_pass_including_integers_and_extended_resources() -> None:
    resources = {"requests": {"cpu": "250m", "memory": 134217728, "example.com/gpu": "1"},
                 "limits": {"cpu": "1", "memory": "1Gi", "example.com/gpu": 1, "ephemeral-storage": "1e9"}}  # fmt: skip
    assert k8s_rules.resources_problems(resources) == []
    assert k8s_rules.resources_problems(None) == []


# -- the operator: Valid=False, never injected, no pod list with a bad selector ----------

GOOD = {"selector": {"matchLabels": {"app": "vllm"}}}
BAD_RESOURCES = {**GOOD, "sidecar": {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "lots"}}}}
BAD_SELECTOR = {"selector": {"matchLabels": {"app": "vllm", "bad key": "x"}}}


def test_a_policy_with_bad_resources_injects_nothing_and_names_the_field() -> None:
    pod = {"metadata": {"labels": {"app": "vllm"}}, "spec": {"containers": [{"name": "vllm"}]}}
    patch, warnings = admit(pod, [{"name": "fast", "spec": BAD_RESOURCES, "generation": 1}], "img")
    assert patch == {}
    assert "spec.sidecar.resources.limits.cpu" in warnings[0] and "no sidecar" in warnings[0]


class FakeKube:
    """What reconcile() asks of the API."""

    def __init__(self) -> None:
        self.applied: list[dict[str, Any]] = []

    async def ensure(self, obj: dict[str, Any], current: dict[str, Any] | None) -> str:
        self.applied.append(obj)
        return "created"


class Logger:
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, msg: str, *args: Any) -> None:
        self.warnings.append(msg % args)


@pytest.mark.parametrize(("spec", "field"), [
    (BAD_RESOURCES, "spec.sidecar.resources.limits.cpu"),
    (BAD_SELECTOR, "spec.selector.matchLabels[bad key]"),
])  # fmt: skip
async def test_reconcile_reports_valid_false_naming_the_field_and_creates_nothing(spec: dict[str, Any], field: str) -> None:
    kube = FakeKube()
    body = {"metadata": {"name": "fast", "namespace": "llm", "generation": 2, "uid": "u1"}, "spec": spec}
    outcome = await reconcile(Context(kube=kube, sidecar_image="img"), body, Seen(), Logger())  # type: ignore[arg-type]
    valid = next(c for c in outcome.status["conditions"] if c["type"] == "Valid")
    assert valid["status"] == "False" and field in valid["message"]
    assert kube.applied == []


@pytest.mark.parametrize("peers, field", [
    ([{"podSelector": {}}], None),
    ([{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}}, "podSelector": {"matchLabels": {"app": "gw"}}}], None),
    ([{"ipBlock": {"cidr": "fd00::/8", "except": ["fd00:1::/32"]}}], None),
    ([], "spec.sidecar.allowFrom"),
    ("everyone", "spec.sidecar.allowFrom"),
    ([{}], "spec.sidecar.allowFrom[0]"),
    ([{"podSelector": {}, "ipBlock": {"cidr": "10.0.0.0/8"}}], "spec.sidecar.allowFrom[0]"),
    ([{"podSelecter": {}}], ("spec.sidecar.allowFrom[0].podSelecter", "spec.sidecar.allowFrom[0]")),
    ([{"ipBlock": {"cidr": "10.0.0.0/33"}}], "spec.sidecar.allowFrom[0].ipBlock.cidr"),
    ([{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["192.168.0.0/16"]}}], "spec.sidecar.allowFrom[0].ipBlock.except[0]"),
    ([{"podSelector": {"matchLabels": {"app": "v llm"}}}], "spec.sidecar.allowFrom[0].podSelector.matchLabels[app]"),
    ([{"podSelector": {}}, {"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In"}]}}],
     "spec.sidecar.allowFrom[1].namespaceSelector.matchExpressions[0].values"),
    ([{"podSelector": {"matchExpressions": [{"key": "team", "operator": "Exists", "values": ["x"]}]}}],
     "spec.sidecar.allowFrom[0].podSelector.matchExpressions[0].values"),
    ([{"podSelector": {"matchExpressions": [{"key": "team", "operator": "Like"}]}}],
     "spec.sidecar.allowFrom[0].podSelector.matchExpressions[0].operator"),
])  # fmt: skip
def test_allow_from_peers_are_checked_as_a_network_policy_would_be(peers, field):
    from binbatch_operator.k8s_rules import allow_from_problems, policy_problems

    found = allow_from_problems(peers)
    expected = list(field) if isinstance(field, tuple) else [field] if field else []
    assert [path for path, _ in found] == expected, found
    assert policy_problems({"selector": {"matchLabels": {"app": "vllm"}}, "sidecar": {"allowFrom": peers}}) == found
