"""What the operator keeps of the cluster from its watches, and the look-ups a reconcile makes.

Every pod, every policy, and the ConfigMaps and Services the operator made are
listed once and then watched (``kube.Informer``), into the ``Watched`` store
here, so a policy's reconcile reads its children and its pods without one API
request: idle policies cost nothing, and the API is asked only to write what
differs.  Each entry is a trimmed copy (what the reconcile reads: no managed
fields, status conditions or foreign annotations).

Not kopf's indexes: kopf holds every handler back until each indexed object has
been indexed, and wakes every waiting object at each step, which took minutes
for a few thousand pods at every start and failover.  And not paused with kopf:
a follower's store stays current, so it takes over without stale entries.

Pods are kept once per label, under ``(namespace, key, value)``: a policy finds
its candidates under the first pair of its selector, not by scanning its
namespace.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .builders import POLICY_LABEL, selector_matches
from .crd import GROUP

API_VERSIONS = {"NetworkPolicy": "networking.k8s.io/v1"}  # list items carry none; the builders' objects do
KINDS = ("Pod", "ConfigMap", "Service", "NetworkPolicy", "BatchingPolicy")


def pod_entry(body: Mapping[str, Any]) -> dict[str, Any]:
    """The pod as a reconcile reads it: identity, labels, our annotations, its controller, phase and IP, containers.

    The containers stay whole: the port take-over check and the engine-order
    check read vLLM's command line, ports and environment.
    """
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    annotations = {k: v for k, v in (meta.get("annotations") or {}).items() if k.startswith(f"{GROUP}/")}
    groups: dict[str, Any] = {group: list(spec.get(group) or []) for group in ("initContainers", "containers")}
    if spec.get("hostNetwork"):
        groups["hostNetwork"] = True  # never injected (reconcile.admit); the status says so
    return {
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid"),
                     "labels": dict(meta.get("labels") or {}), "annotations": annotations,
                     "ownerReferences": [o for o in meta.get("ownerReferences") or [] if o.get("controller")]},
        "spec": groups,
        "status": {"phase": status.get("phase"), "podIP": status.get("podIP")},
    }  # fmt: skip


def child_entry(body: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """A ConfigMap or Service as ``covers`` compares it with what the builders say (no managed fields)."""
    meta = body.get("metadata") or {}
    kept = {k: meta[k] for k in ("name", "namespace", "uid", "labels", "ownerReferences") if k in meta}
    return {"apiVersion": API_VERSIONS.get(kind, "v1"), "kind": kind, "metadata": kept, **{k: body[k] for k in ("data", "spec") if k in body}}


@dataclass(frozen=True)
class Seen:
    """A policy's world as the watches show it, for one reconcile."""

    pods: list[dict[str, Any]] = field(default_factory=list)  # the pods its selector matches (``pod_entry``)
    children: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (kind, name) → as watched
    others: list[dict[str, Any]] = field(default_factory=list)  # the namespace's policies (``candidate()``)


class Watched:
    """The store the informers fill: pods by label, children by name, policies by namespace.

    ``replace`` takes a kind's full list (the first, and each relist after a
    watch broke off: whatever vanished meanwhile leaves with it), ``apply`` one
    watch event.  Policies are stored as ``candidate()`` makes them (given).
    """

    def __init__(self, candidate: Any, namespaces: Iterable[str] = ()) -> None:
        self._candidate = candidate
        # A namespaced operator lists each kind once per namespace; a kind is synced once all were listed.
        self._scopes: tuple[str | None, ...] = tuple(namespaces) or (None,)
        self._scopes_listed: dict[str, set[str | None]] = {kind: set() for kind in KINDS}
        self._entries: dict[str, dict[str, dict[str, Any]]] = {kind: {} for kind in KINDS}  # kind → uid → entry
        self._by: dict[str, dict[Any, dict[str, dict[str, Any]]]] = {kind: {} for kind in KINDS}  # kind → key → uid → entry
        self._listed = {kind: asyncio.Event() for kind in KINDS}

    async def synced(self, kinds: Iterable[str] = KINDS) -> None:
        """Wait until every one of ``kinds`` was listed once."""
        for kind in kinds:
            await self._listed[kind].wait()

    def replace(self, kind: str, bodies: Iterable[Mapping[str, Any]], namespace: str | None = None) -> None:
        """A kind's full list: across the cluster, or (``namespace``) the full list of one namespace."""
        for uid, entry in list(self._entries[kind].items()):
            if namespace is None or _namespace(kind, entry) == namespace:
                self._drop(kind, uid)
        for body in bodies:
            self.apply(kind, "ADDED", body)
        self._scopes_listed[kind].add(namespace)
        if self._scopes_listed[kind] >= set(self._scopes):
            self._listed[kind].set()

    def apply(self, kind: str, event: str, body: Mapping[str, Any]) -> None:
        uid = body["metadata"]["uid"]
        self._drop(kind, uid)
        if event == "DELETED":
            return
        if kind in ("ConfigMap", "Service", "NetworkPolicy") and POLICY_LABEL not in (body["metadata"].get("labels") or {}):
            return  # not ours (the server filters by this label; a fake one may not)
        if kind == "Pod":
            entry = pod_entry(body)
        elif kind == "BatchingPolicy":
            entry = {**self._candidate(body), "namespace": body["metadata"]["namespace"]}
        else:
            entry = child_entry(body, kind)
        self._entries[kind][uid] = entry
        for key in _keys(kind, entry):
            self._by[kind].setdefault(key, {})[uid] = entry

    def written(self, kind: str, body: Mapping[str, Any]) -> None:
        """A child as the server answered the operator's write: stored now, so a re-check that runs before the
        watch's event for it compares with what was written and does not write it again.  An event already on
        its way from before the write may still put the older copy back until the event for the write follows;
        the worst that does is one redundant patch."""
        self.apply(kind, "MODIFIED", body)

    def _drop(self, kind: str, uid: str) -> None:
        entry = self._entries[kind].pop(uid, None)
        for key in _keys(kind, entry) if entry is not None else ():
            bucket = self._by[kind][key]
            del bucket[uid]
            if not bucket:
                del self._by[kind][key]

    def pods(self, namespace: str, match_labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """The pods of ``namespace`` that carry every label of ``match_labels``, by name."""
        if not match_labels:
            return []
        first = next(iter(match_labels.items()))
        found = [p for p in self._by["Pod"].get((namespace, *first), {}).values()
                 if selector_matches(match_labels, p["metadata"]["labels"])]  # fmt: skip
        return sorted(found, key=lambda p: p["metadata"]["name"])

    def children(self, namespace: str, wanted: Iterable[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
        """The watched children among ``wanted`` (kind, name) that exist."""
        return {(kind, name): entry for kind, name in wanted
                for entry in self._by[kind].get((namespace, name), {}).values()}  # fmt: skip

    def policies(self, namespace: str) -> list[dict[str, Any]]:
        """The namespace's policies (``candidate()``), those being deleted left out."""
        return [p for p in self._by["BatchingPolicy"].get(namespace, {}).values() if not p.get("deletionTimestamp")]


def _namespace(kind: str, entry: Mapping[str, Any]) -> str | None:
    return entry.get("namespace") if kind == "BatchingPolicy" else (entry.get("metadata") or {}).get("namespace")


def _keys(kind: str, entry: Mapping[str, Any]) -> list[Any]:
    """Where an entry is looked up: a pod under each label, a child by name, a policy by namespace."""
    if kind == "BatchingPolicy":
        return [entry["namespace"]]
    meta = entry["metadata"]
    if kind == "Pod":
        return [(meta["namespace"], key, value) for key, value in meta["labels"].items()]
    return [(meta["namespace"], meta["name"])]
