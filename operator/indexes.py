"""What the operator keeps of the cluster from its watches, and the look-ups a reconcile makes.

kopf feeds every pod, and every ConfigMap and Service the operator made, into
in-memory indexes (``main.py`` declares them; the functions here are their
bodies), so a policy's reconcile reads its children and its pods without one
API request: idle policies cost nothing, and the API is asked only to write
what differs.  Each entry is a trimmed copy (what the reconcile reads), so a
large cluster's pods do not sit in memory whole.

Pods are indexed once per label, under ``(namespace, key, value)``: a policy
finds its candidates under the first pair of its selector, not by scanning its
namespace.  Children are indexed under ``(namespace, name)``, one index per kind.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .builders import SIDECAR_CONTAINER, selector_matches
from .crd import GROUP

PodKey = tuple[str, str, str]  # (namespace, label key, label value)
ChildKey = tuple[str, str]  # (namespace, name), one index per kind


def pod_entry(body: Mapping[str, Any]) -> dict[str, Any]:
    """The pod as a reconcile reads it: identity, labels, our annotations, its controller, phase and IP, containers.

    A pod that already runs a sidecar keeps only its containers' names (all
    that is asked of it); the others keep their containers whole, which the
    port take-over check reads.
    """
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k.startswith(f"{GROUP}/")}
    groups = {group: list(spec.get(group) or []) for group in ("initContainers", "containers")}
    if any(c.get("name") == SIDECAR_CONTAINER for group in groups.values() for c in group):
        groups = {group: [{"name": c.get("name")} for c in items] for group, items in groups.items()}
    return {
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid"),
                     "labels": dict(meta.get("labels") or {}), "annotations": annotations,
                     "ownerReferences": [o for o in meta.get("ownerReferences") or [] if o.get("controller")]},
        "spec": groups,
        "status": {"phase": status.get("phase"), "podIP": status.get("podIP")},
    }  # fmt: skip


def pod_keys(namespace: str, labels: Mapping[str, str]) -> list[PodKey]:
    return [(namespace, key, value) for key, value in labels.items()]


def child_entry(body: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """A ConfigMap or Service as ``covers`` compares it with what the builders say (no managed fields)."""
    meta = body.get("metadata") or {}
    kept = {k: meta[k] for k in ("name", "namespace", "uid", "labels", "ownerReferences") if k in meta}
    return {"apiVersion": "v1", "kind": kind, "metadata": kept, **{k: body[k] for k in ("data", "spec") if k in body}}


@dataclass(frozen=True)
class Seen:
    """A policy's world as the watches show it, for one reconcile."""

    pods: list[dict[str, Any]] = field(default_factory=list)  # the pods its selector matches (``pod_entry``)
    children: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (kind, name) → as watched
    others: list[dict[str, Any]] = field(default_factory=list)  # the namespace's policies (``candidate()``)


def selected_pods(pods: Mapping[PodKey, Any], namespace: str, match_labels: Mapping[str, str]) -> list[dict[str, Any]]:
    """The indexed pods of ``namespace`` that carry every label of ``match_labels``, by name."""
    if not match_labels:
        return []
    first = next(iter(match_labels.items()))
    found = [p for p in pods.get((namespace, *first), ()) if selector_matches(match_labels, p["metadata"]["labels"])]
    return sorted(found, key=lambda p: p["metadata"]["name"])


def children_of(
    children: Mapping[ChildKey, Any], namespace: str, kind: str, names: Iterable[str]
) -> dict[tuple[str, str], dict[str, Any]]:
    """The watched children of one kind among ``names`` that exist, by (kind, name)."""
    return {(kind, name): entry for name in names for entry in children.get((namespace, name), ())}
