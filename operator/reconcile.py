"""Level-triggered reconciliation of one BatchingPolicy, and the pod admission decision.

``reconcile`` is what create, update, resume and the status timer all run: make
the world match the spec (ConfigMap + Service, owned by the policy), then look
at it (selected pods, their sidecars' stats) and return the status to write.
Running it twice changes nothing the first run did not.

``admit`` is the webhook's decision for one new pod.  Both take their
collaborators (the API seam, the stats client) from a ``Context`` so tests run
them against a fake API server and real sidecars.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import kopf

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar.config import ConfigError

from .builders import (
    CONFLICT_ANNOTATION,
    POLICY_LABEL,
    SIDECAR_HASH_ANNOTATION,
    build_configmap,
    build_pod_patch,
    build_service,
    child_name,
    matching_policies,
    sidecar_config,
    sidecar_hash,
    sidecar_settings,
)
from .k8s_rules import policy_problems
from .kube import KubeApi
from .sidecar_stats import describe_error, get_stats
from .status import PodReport, adjustments, aggregate, merge_conditions, now_iso

StatsFn = Callable[[str], Awaitable[pb.Stats]]


@dataclass
class Context:
    kube: KubeApi
    sidecar_image: str
    stats: StatsFn = get_stats


def _spec_problems(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Everything wrong with a spec: the sidecar config, and what the API server would refuse later."""
    problems = policy_problems(spec)
    try:
        sidecar_config(spec)
    except ConfigError as exc:
        problems += exc.problems
    return problems


async def reconcile(ctx: Context, body: Mapping[str, Any], logger: Any) -> dict[str, Any]:
    """Bring the policy's children in line with its spec; return its new status."""
    meta, spec = body["metadata"], body.get("spec") or {}
    name, namespace = meta["name"], meta["namespace"]
    problems = _spec_problems(spec)
    if problems:
        # The old ConfigMap stays: running sidecars keep their last good config.
        logger.warning("invalid spec, keeping the last good config: %s", "; ".join(f"{p}: {m}" for p, m in problems))
        children_ready = await _children_exist(ctx, name, namespace)
    else:
        for obj in (build_configmap(name, namespace, spec), build_service(name, namespace, spec)):
            kopf.adopt(obj, owner=dict(body))  # owner reference: deleted with the policy
            await ctx.kube.apply(obj)
        children_ready = True
    return await observe(ctx, body, problems, children_ready)


async def _children_exist(ctx: Context, name: str, namespace: str) -> bool:
    found = [await ctx.kube.read(kind, child_name(name), namespace) for kind in ("ConfigMap", "Service")]
    return all(obj is not None for obj in found)


async def observe(
    ctx: Context, body: Mapping[str, Any], problems: Sequence[tuple[str, str]], children_ready: bool
) -> dict[str, Any]:
    meta, spec = body["metadata"], body.get("spec") or {}
    name, namespace = meta["name"], meta["namespace"]
    generation = int(meta.get("generation") or 0)
    old = body.get("status") or {}

    match_labels = (spec.get("selector") or {}).get("matchLabels") or {}
    bad_selector = any(path.startswith("spec.selector") for path, _ in problems)
    pods = [] if bad_selector else await ctx.kube.list_pods(namespace, match_labels)  # the API server would answer 400
    others = [
        {"name": p["metadata"]["name"], "spec": p.get("spec") or {}}
        for p in await ctx.kube.list_policies(namespace)
        if p["metadata"]["name"] != name
    ]
    current = sidecar_hash(spec, ctx.sidecar_image)
    port = sidecar_settings(spec)["grpcPort"]
    reports, asks = [], []
    for pod in pods:
        pod_meta, state = pod["metadata"], pod.get("status") or {}
        injected = (pod_meta.get("labels") or {}).get(POLICY_LABEL) == name
        digest = (pod_meta.get("annotations") or {}).get(SIDECAR_HASH_ANNOTATION)
        report = PodReport(
            name=pod_meta["name"], injected=injected,
            conflict=matching_policies(others, pod_meta.get("labels")),
            outdated=injected and digest is not None and digest != current,
        )  # fmt: skip
        reports.append(report)
        if not injected:
            continue
        if state.get("podIP") and state.get("phase") == "Running":
            asks.append(_ask(ctx, report, f"{state['podIP']}:{port}"))
        else:
            report.error = f"pod is {state.get('phase', 'Pending')}"
    await asyncio.gather(*asks)

    conditions, fields = aggregate(reports, problems, children_ready)
    return {
        "observedGeneration": generation,
        "conditions": merge_conditions(old.get("conditions"), conditions, generation, now_iso()),
        **fields,
        "adjustments": adjustments(reports, old.get("adjustments")),
    }


async def _ask(ctx: Context, report: PodReport, address: str) -> None:
    try:
        report.stats = await ctx.stats(address)
    except Exception as exc:  # noqa: BLE001 - any failure is reported in status, never raised
        report.error = describe_error(exc)


async def cleanup(ctx: Context, body: Mapping[str, Any], logger: Any) -> list[str]:
    """On deletion: roll the workloads whose pods carry this policy's sidecar.

    The ConfigMap and Service go with the policy (owner references).  A running
    pod's containers cannot be removed, so the pods that carry the sidecar are
    recreated through their Deployment or StatefulSet, and come back without it.
    """
    meta = body["metadata"]
    pods = await ctx.kube.list_pods(meta["namespace"], {POLICY_LABEL: meta["name"]})
    restarted: list[str] = []
    for pod in pods:
        owner = await ctx.kube.restart_owner(pod)
        if owner is not None and owner not in restarted:
            restarted.append(owner)
        elif owner is None:
            logger.warning("pod %s has no Deployment/StatefulSet: it keeps the sidecar until recreated",
                           pod["metadata"]["name"])  # fmt: skip
    return restarted


def admit(
    pod: Mapping[str, Any], candidates: Sequence[Mapping[str, Any]], default_image: str
) -> tuple[dict[str, Any], list[str]]:
    """The merge patch for a new pod and the warnings for whoever created it.

    ``candidates`` are the policies of the pod's namespace as ``{"name", "spec",
    "generation"}``.  No policy: nothing.  Two or more: no sidecar, and an
    annotation that names them (never a silent merge).  An invalid policy:
    nothing, with a warning (its status says why).
    """
    labels = (pod.get("metadata") or {}).get("labels")
    names = matching_policies(candidates, labels)
    if not names:
        return {}, []
    if len(names) > 1:
        message = f"binbatch: policies {', '.join(names)} all select this pod; no sidecar injected"
        return {"metadata": {"annotations": {CONFLICT_ANNOTATION: ",".join(names)}}}, [message]
    (policy,) = [c for c in candidates if c["name"] == names[0]]
    problems = _spec_problems(policy.get("spec") or {})
    if problems:
        return {}, [f"binbatch: policy {policy['name']} is invalid ({problems[0][0]}: {problems[0][1]}); no sidecar"]
    patch = build_pod_patch(pod, policy["name"], int(policy.get("generation") or 0), policy["spec"], default_image)
    return patch, []
