"""Which namespaces the sidecar webhook sees, and how to opt one in (pure).

The install's MutatingWebhookConfiguration sends the webhook only the pods of
the namespaces its ``namespaceSelector`` matches: by default those labelled
``binbatch.io/inject=enabled``, never ``kube-system`` and its kin nor the
operator's own (by their ``kubernetes.io/metadata.name``).  A policy elsewhere
selects pods that never get a sidecar, however often they are recreated;
``not_reached`` says so, with the ``kubectl label`` command that opts the
namespace in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

NAME_LABEL = "kubernetes.io/metadata.name"  # the API server sets it to the namespace's name; it cannot be changed


def requirements(selector: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """A LabelSelector as its requirements: ``matchLabels`` k: v is ``k In [v]``."""
    selector = selector or {}
    pairs = [{"key": k, "operator": "In", "values": [v]} for k, v in (selector.get("matchLabels") or {}).items()]
    return pairs + [dict(r) for r in selector.get("matchExpressions") or []]


def met(requirement: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """One requirement against a set of labels, as Kubernetes evaluates it."""
    key, values = requirement["key"], requirement.get("values") or []
    return {
        "In": key in labels and labels.get(key) in values,
        "NotIn": labels.get(key) not in values,
        "Exists": key in labels,
        "DoesNotExist": key not in labels,
    }.get(requirement["operator"], False)  # the API server refuses any other operator


def _describe(requirement: Mapping[str, Any]) -> str:
    """A requirement in kubectl's selector syntax: ``k=v``, ``k in (a,b)``, ``k notin (a,b)``, ``k``, ``!k``."""
    key, op, values = requirement["key"], requirement["operator"], requirement.get("values") or []
    if op == "In":
        return f"{key}={values[0]}" if len(values) == 1 else f"{key} in ({','.join(values)})"
    return {"NotIn": f"{key} notin ({','.join(values)})", "Exists": key}.get(op, f"!{key}")


def _label_argument(requirement: Mapping[str, Any]) -> str:
    """The ``kubectl label`` argument that meets an unmet requirement: set the label, or remove it."""
    key, op = requirement["key"], requirement["operator"]
    if op == "In":
        return f"{key}={requirement['values'][0]}"
    return f"{key}=" if op == "Exists" else f"{key}-"


def not_reached(namespace: str, labels: Mapping[str, str], selector: Mapping[str, Any] | None) -> str:
    """Why the webhook never sees the pods of ``namespace``, and what changes that; "" when it does."""
    unmet = [r for r in requirements(selector) if not met(r, labels)]
    if not unmet:
        return ""
    wanted = ", ".join(_describe(r) for r in unmet)
    if any(r["key"] == NAME_LABEL for r in unmet):
        return (f"namespace {namespace} is never injected: the webhook's namespaceSelector excludes it by name "
                f"({wanted}); run the model server in another namespace")  # fmt: skip
    arguments = [_label_argument(r) for r in unmet]
    overwrite = any(r["operator"] == "In" and r["key"] in labels for r in unmet)  # a label with another value
    command = f"kubectl label namespace {namespace} {' '.join(arguments)}{' --overwrite' if overwrite else ''}"
    return (f"namespace {namespace} is not opted in to sidecar injection (the webhook only sees pods of namespaces "
            f"with {wanted}), so recreating its pods alone never adds the sidecar; opt it in with `{command}`, "
            "then recreate them (e.g. kubectl rollout restart)")  # fmt: skip
