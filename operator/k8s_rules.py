"""The API server's syntax rules for names, labels and resource quantities.

A policy is turned into other objects (a pod list's label selector, the
injected container's resources, child ConfigMap and Service names).  If one of
those breaks a rule the API server enforces, the failure only shows up later
and elsewhere: a pod list answered with 400 forever, a pod refused at creation
by every matching Deployment.  These pure functions apply the same rules to the
policy itself, so the operator reports ``Valid=False`` naming the field and never
injects what the API server would refuse.

The regular expressions and lengths are those of k8s.io/apimachinery
``pkg/util/validation`` (``IsQualifiedName``, ``IsValidLabelValue``,
``IsDNS1123Label``, ``IsDNS1123Subdomain``, ``IsDNS1035Label``) and of
``pkg/api/resource`` (the quantity grammar, as the core types publish it in
their OpenAPI).  The CRD's schema carries the same patterns (``crd.py``), so
``kubectl apply`` refuses what this module refuses.  Every function returns a
list of problems, empty when the value is valid.
"""

from __future__ import annotations

import ipaddress

import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from kubernetes.utils import parse_quantity

DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN_MAX = 253
DNS1035_LABEL_MAX = 63
QUALIFIED_NAME_MAX = 63
LABEL_VALUE_MAX = 63

DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN = DNS1123_LABEL + r"(\." + DNS1123_LABEL + r")*"
DNS1035_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"
QUALIFIED_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
LABEL_VALUE = r"(" + QUALIFIED_NAME + r")?"
CONFIG_KEY = r"[-._a-zA-Z0-9]+"  # a ConfigMap's or Secret's data key (IsConfigMapKey)
CONFIG_KEY_MAX = 253
# resource.Quantity's OpenAPI pattern (the one CRD generators copy from the core types).
QUANTITY = r"(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?"

# A label key in one regular expression with the lengths built in (for the CRD's
# CEL rule, where splitting strings is not available everywhere): an optional
# DNS-1123 subdomain and '/', then a name of at most 63 characters.  The
# prefix's own length limit is a second check (``LABEL_KEY_LONG_PREFIX``).
LABEL_KEY = r"(" + DNS1123_SUBDOMAIN + r"/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
LABEL_KEY_LONG_PREFIX = r"^[^/]{254,}/"

# Resource names a container may request (k8s.io/kubernetes pkg/apis/core/helper:
# IsStandardContainerResourceName); hugepages-<size> is standard too.
STANDARD_CONTAINER_RESOURCES = ("cpu", "memory", "ephemeral-storage")
HUGEPAGES_PREFIX = "hugepages-"


def _full(pattern: str, value: str) -> bool:
    # fullmatch: Go's "^...$" matches the whole text; Python's "$" would also match before a final "\n".
    return re.fullmatch(pattern, value) is not None


def _name_problems(value: str, pattern: str, limit: int, shape: str) -> list[str]:
    """The API server's two checks of a name: its length and its shape (both reported)."""
    problems = []
    if len(value) > limit:
        problems.append(f"must be no more than {limit} characters")
    if not _full(pattern, value):
        problems.append(shape)
    return problems


def dns1123_label_problems(value: str) -> list[str]:
    """RFC 1123 label: Service names, namespace names (at most 63, lower-case alphanumerics and '-')."""
    return _name_problems(value, DNS1123_LABEL, DNS1123_LABEL_MAX, "must consist of lower case alphanumeric characters or '-', and start and end with an alphanumeric character")  # fmt: skip


def dns1123_subdomain_problems(value: str) -> list[str]:
    """RFC 1123 subdomain: ConfigMap names, most object names (at most 253, labels joined by '.')."""
    return _name_problems(value, DNS1123_SUBDOMAIN, DNS1123_SUBDOMAIN_MAX, "must consist of lower case alphanumeric characters, '-' or '.', and start and end with an alphanumeric character")  # fmt: skip


def config_key_problems(value: str) -> list[str]:
    """A ConfigMap's or Secret's data key: at most 253 alphanumerics, '-', '_' or '.', and not '.' or '..'."""
    problems = _name_problems(value, CONFIG_KEY, CONFIG_KEY_MAX, "must consist of alphanumeric characters, '-', '_' or '.'")
    if value in (".", ".."):
        problems.append("must not be '.' or '..'")
    return problems


def dns1035_label_problems(value: str) -> list[str]:
    """RFC 1035 label: what a Service name must be (at most 63, starts with a letter)."""
    return _name_problems(value, DNS1035_LABEL, DNS1035_LABEL_MAX, "must consist of lower case alphanumeric characters or '-', start with a letter, and end with an alphanumeric character")  # fmt: skip


# The name rule the API server applies per kind (ValidateServiceName, ValidateConfigMapName...).
NAME_RULES = {"Service": dns1035_label_problems, "ConfigMap": dns1123_subdomain_problems,
              "Pod": dns1123_subdomain_problems, "Namespace": dns1123_label_problems}  # fmt: skip


def object_name_problems(kind: str, name: str) -> list[str]:
    """Why the API server would refuse ``name`` for an object of ``kind`` (a Service's is the strictest)."""
    return NAME_RULES[kind](name)



def qualified_name_problems(value: str) -> list[str]:
    """A label key (``IsQualifiedName``): ``[prefix/]name``, prefix a DNS-1123 subdomain, name at most 63."""
    parts = value.split("/")
    if len(parts) > 2:
        return ["must be a name with an optional DNS subdomain prefix and '/' (e.g. 'example.com/name')"]
    problems = []
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            problems.append("prefix part must be non-empty")
        else:
            problems += [f"prefix part {p}" for p in dns1123_subdomain_problems(prefix)]
    name = parts[-1]
    if not name:
        problems.append("name part must be non-empty")
        return problems
    if len(name) > QUALIFIED_NAME_MAX:
        problems.append(f"name part must be no more than {QUALIFIED_NAME_MAX} characters")
    if not _full(QUALIFIED_NAME, name):
        problems.append("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character")  # fmt: skip
    return problems


def label_value_problems(value: Any) -> list[str]:
    """A label value (``IsValidLabelValue``): empty, or at most 63 characters of a qualified name."""
    if not isinstance(value, str):
        return [f"must be a string, got {type(value).__name__}"]
    problems = []
    if len(value) > LABEL_VALUE_MAX:
        problems.append(f"must be no more than {LABEL_VALUE_MAX} characters")
    if not _full(LABEL_VALUE, value):
        problems.append("must be empty or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character")  # fmt: skip
    return problems


def parse(value: Any) -> Decimal:
    """A quantity's value: a string or a whole number, as the CRD's int-or-string takes it; raises
    ValueError for what the API server would refuse."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"must be a quantity, a whole number or a string such as '500m', '1.5' or '1Gi', got {value!r}")
    if isinstance(value, str) and not _full(QUANTITY, value):
        raise ValueError(f"must be a quantity such as '500m' or '1Gi' (pattern ^{QUANTITY}$), got {value!r}")
    return Decimal(parse_quantity(value))


def selector_problems(selector: Any) -> list[tuple[str, str]]:
    """``spec.selector.matchLabels``: every key a qualified name, every value a label value."""
    match_labels = (selector or {}).get("matchLabels") if isinstance(selector, Mapping) else None
    if not isinstance(match_labels, Mapping) or not match_labels:
        return [("spec.selector.matchLabels", "must list at least one label")]
    problems = []
    for key, value in match_labels.items():
        where = f"spec.selector.matchLabels[{key}]"
        problems += [(where, f"key {msg}") for msg in qualified_name_problems(str(key))]
        problems += [(where, f"value {msg}") for msg in label_value_problems(value)]
    return problems


def resource_name_problems(name: str) -> list[str]:
    """A container resource name (``validateContainerResourceName``): standard, hugepages-*, or domain/name."""
    if "/" not in name:
        if name in STANDARD_CONTAINER_RESOURCES or name.startswith(HUGEPAGES_PREFIX):
            return []
        return [f"must be a standard resource for containers ({', '.join(STANDARD_CONTAINER_RESOURCES)}, hugepages-<size>) or an extended resource (domain/name)"]  # fmt: skip
    problems = qualified_name_problems(name)
    if not problems and "kubernetes.io/" in name:
        problems.append("kubernetes.io/ names are reserved for native resources")
    return problems


def overcommit_allowed(name: str) -> bool:
    """Only cpu, memory and ephemeral-storage may request less than their limit (``IsOvercommitAllowed``)."""
    return name in STANDARD_CONTAINER_RESOURCES


def resources_problems(resources: Any, where: str = "spec.sidecar.resources") -> list[tuple[str, str]]:
    """Container ``resources``: names, quantity syntax, no negatives, requests <= limits.

    Hugepages and extended resources (``example.com/gpu``) cannot be
    overcommitted: a request needs the same limit; extended resources are also
    whole numbers.  The same rules the API server applies to a pod's container.
    """
    if resources is None:
        return []
    if not isinstance(resources, Mapping):
        return [(where, "must be a mapping with requests and/or limits")]
    problems: list[tuple[str, str]] = []
    values: dict[str, dict[str, Decimal]] = {}
    for key, section in resources.items():
        if key not in ("requests", "limits"):
            problems.append((f"{where}.{key}", "unknown field: only requests and limits are supported"))
            continue
        if not isinstance(section, Mapping):
            problems.append((f"{where}.{key}", "must be a mapping of resource name to quantity"))
            continue
        values[key] = {}
        for name, raw in section.items():
            field = f"{where}.{key}.{name}"
            bad_name = [(field, f"resource name {msg}") for msg in resource_name_problems(str(name))]
            problems += bad_name
            try:
                amount = parse(raw)
            except ValueError as exc:
                problems.append((field, str(exc)))
                continue
            if amount < 0:
                problems.append((field, f"must be greater than or equal to 0, got {raw!r}"))
            elif "/" in str(name) and amount != amount.to_integral_value():
                problems.append((field, f"an extended resource must be a whole number, got {raw!r}"))
            if not bad_name:
                values[key][str(name)] = amount
    requests, limits = values.get("requests", {}), values.get("limits", {})
    for name, request in requests.items():
        if name not in limits:
            if not overcommit_allowed(name):
                problems.append((f"{where}.limits.{name}", f"must be set: {name} cannot be overcommitted"))
        elif request > limits[name]:
            problems.append((f"{where}.limits.{name}", f"must be greater than or equal to the request ({resources['requests'][name]!r}), got {resources['limits'][name]!r}"))  # fmt: skip
        elif not overcommit_allowed(name) and request != limits[name]:
            problems.append((f"{where}.requests.{name}", f"must equal the limit: {name} cannot be overcommitted"))
    return problems


PEER_KEYS = ("podSelector", "namespaceSelector", "ipBlock")
SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def label_selector_problems(selector: Any, where: str) -> list[tuple[str, str]]:
    """A LabelSelector of a NetworkPolicyPeer (``ValidateLabelSelector``); ``{}`` selects everything."""
    if not isinstance(selector, Mapping):
        return [(where, "must be a label selector (matchLabels, matchExpressions)")]
    problems = [(f"{where}.{key}", "unknown field") for key in selector if key not in ("matchLabels", "matchExpressions")]
    for key, value in (selector.get("matchLabels") or {}).items():
        at = f"{where}.matchLabels[{key}]"
        problems += [(at, f"key {msg}") for msg in qualified_name_problems(str(key))]
        problems += [(at, f"value {msg}") for msg in label_value_problems(value)]
    for i, expression in enumerate(selector.get("matchExpressions") or []):
        at = f"{where}.matchExpressions[{i}]"
        if not isinstance(expression, Mapping):
            problems.append((at, "must be a requirement (key, operator, values)"))
            continue
        problems += [(f"{at}.key", msg) for msg in qualified_name_problems(str(expression.get("key", "")))]
        operator, values = expression.get("operator"), expression.get("values") or []
        if operator not in SELECTOR_OPERATORS:
            problems.append((f"{at}.operator", f"must be one of {', '.join(SELECTOR_OPERATORS)}, got {operator!r}"))
        elif operator in ("In", "NotIn") and not values:
            problems.append((f"{at}.values", f"must be given for {operator}"))
        elif operator in ("Exists", "DoesNotExist") and values:
            problems.append((f"{at}.values", f"must be empty for {operator}"))
    return problems


def allow_from_problems(peers: Any, where: str = "spec.sidecar.allowFrom") -> list[tuple[str, str]]:
    """``spec.sidecar.allowFrom``: NetworkPolicyPeers, as the NetworkPolicy made from them must be."""
    if peers is None:
        return []
    if not isinstance(peers, list) or not peers:
        return [(where, "must list at least one peer (leave it out for the policy's own namespace)")]
    problems: list[tuple[str, str]] = []
    for i, peer in enumerate(peers):
        at = f"{where}[{i}]"
        if not isinstance(peer, Mapping):
            problems.append((at, "must be a peer: podSelector, namespaceSelector or ipBlock"))
            continue
        problems += [(f"{at}.{key}", "unknown field") for key in peer if key not in PEER_KEYS]
        if "ipBlock" in peer:
            if "podSelector" in peer or "namespaceSelector" in peer:
                problems.append((at, "a peer is an ipBlock, or a podSelector and/or namespaceSelector"))
            block = peer["ipBlock"] if isinstance(peer["ipBlock"], Mapping) else {}
            try:
                network = ipaddress.ip_network(str(block.get("cidr", "")), strict=False)
            except ValueError:
                problems.append((f"{at}.ipBlock.cidr", f"must be a CIDR, e.g. 10.0.0.0/8, got {block.get('cidr')!r}"))
                continue
            for j, cut in enumerate(block.get("except") or []):
                try:
                    inside = ipaddress.ip_network(str(cut), strict=False)
                except ValueError:
                    problems.append((f"{at}.ipBlock.except[{j}]", f"must be a CIDR, got {cut!r}"))
                    continue
                if inside.version != network.version or not inside.subnet_of(network):  # type: ignore[arg-type]
                    problems.append((f"{at}.ipBlock.except[{j}]", f"must be inside the cidr {network}"))
        elif not any(key in peer for key in ("podSelector", "namespaceSelector")):
            problems.append((at, "a peer is an ipBlock, or a podSelector and/or namespaceSelector"))
        for key in ("podSelector", "namespaceSelector"):
            if key in peer:
                problems += label_selector_problems(peer[key], f"{at}.{key}")
    return problems


def policy_problems(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What in a policy spec the API server would refuse once it became a selector, a container or a NetworkPolicy."""
    sidecar = spec.get("sidecar") or {}
    return (selector_problems(spec.get("selector")) + resources_problems(sidecar.get("resources"))
            + allow_from_problems(sidecar.get("allowFrom")))  # fmt: skip
