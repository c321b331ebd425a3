"""Level-triggered reconciliation of one BatchingPolicy, and the pod admission decision.

``reconcile`` is what create, update, resume and each policy's re-check all
run: make the world match the spec (ConfigMap + Service, owned by the policy),
then look at it (selected pods, their sidecars' stats) and return the status to
write.  What it looks at comes from the operator's watches (``Seen``, see
``indexes.py``), so only a difference costs an API request.  Running it twice
changes nothing the first run did not.

``admit`` is the webhook's decision for one new pod.  Both take their
collaborators (the API seam, the stats client) from a ``Context`` so tests run
them against a fake API server and real sidecars.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import logging
import time

import kopf
import urllib3
from kubernetes.client.exceptions import ApiException

from binbatch_sidecar.config import ConfigError

from . import fleet_model, opt_in, takeover, vllm_args
from .admin_signing import AdminSigner
from .allowlist import Allowlist
from .builders import (
    CONFLICT_ANNOTATION,
    INJECTED_ANNOTATION,
    POLICY_LABEL,
    REFUSED_ANNOTATION,
    SIDECAR_CONTAINER,
    SIDECAR_HASH_ANNOTATION,
    admin_audience,
    build_configmap,
    build_headless_service,
    build_network_policy,
    build_pod_patch,
    build_service,
    child_name,
    fleet_model_name,
    fleet_settings,
    headless_enabled,
    headless_name,
    matching_policies,
    model_ref,
    owned_by,
    opted_out,
    policy_label,
    sidecar_config,
    sidecar_hash,
    sidecar_serving_ports,
    sidecar_settings,
    take_over_plan,
)
from .indexes import Seen
from .k8s_rules import policy_problems
from .kube import ChildConflict, KubeApi, api_error_message, namespace_is_terminating
from .sidecar_stats import SidecarStats
from .status import ApiFailure, Condition, PodReport, adjustments, aggregate, merge_conditions, model_condition, now_iso

CHILD_KINDS = ("ConfigMap", "Service")
log = logging.getLogger("binbatch.operator")


@dataclass
class Context:
    kube: KubeApi
    sidecar_image: str
    stats: SidecarStats = field(default_factory=SidecarStats)
    stats_max_age: float = 7.5  # seconds an answer of a sidecar is reused (half the re-check interval)
    webhook_config: str = ""  # the install's MutatingWebhookConfiguration: which namespaces it sees
    model_check_seconds: float = 60.0  # spec.predictor.model's ConfigMap (up to 1 MiB) is read at most this often
    model_checks: dict[tuple[str, str, str], tuple[float, Condition]] = field(default_factory=dict)
    fleet: fleet_model.FleetModels = field(default_factory=fleet_model.FleetModels)  # spec.predictor.fleet's state
    allowlist: Allowlist | None = None  # the install's bounds on images and URLs; None: its default (allowlist.py)
    network_policy: bool = False  # a NetworkPolicy per policy (the chart's networkPolicy.enabled)
    metrics_from: list[dict[str, Any]] = field(default_factory=list)  # peers reaching the metrics port (its metricsFrom)
    # the operator's Admin credential (admin_signing.py): its public key goes into every ConfigMap and its signed
    # tokens on every Admin call; None: the ConfigMaps name no operator key (the sidecars then answer it on loopback only)
    admin_signer: AdminSigner | None = None

    def __post_init__(self) -> None:
        if self.allowlist is None:
            self.allowlist = Allowlist(self.sidecar_image)


@dataclass
class Outcome:
    """A reconcile's result: the status it saw, and the API calls that failed (to retry).

    ``terminating``: the namespace is being deleted, so nothing was written and
    the policy goes with it; nothing to report or retry.
    """

    status: dict[str, Any]
    failures: list[ApiFailure] = field(default_factory=list)
    terminating: bool = False


def _spec_problems(spec: Mapping[str, Any], allowlist: Allowlist | None = None) -> list[tuple[str, str]]:
    """Everything wrong with a spec: the sidecar config, what the API server would refuse later, and
    (given the install's ``allowlist``) an image or URL beyond what the install allows."""
    problems = policy_problems(spec) + takeover.spec_problems(spec)
    if allowlist is not None:
        problems += allowlist.problems(spec)
    try:
        sidecar_config(spec)
    except ConfigError as exc:
        problems += exc.problems
    return problems


def candidate(policy: Mapping[str, Any]) -> dict[str, Any]:
    """A policy as ``admit()`` and the conflict check see it (the index's entries and the webhook's)."""
    meta = policy.get("metadata") or {}
    ready = next((c for c in (policy.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {})
    return {
        "name": meta.get("name"), "spec": dict(policy.get("spec") or {}), "generation": meta.get("generation", 0),
        "deletionTimestamp": meta.get("deletionTimestamp"),
        # Its ConfigMap's name is held by an object not its own: a pod must not mount that.
        "childConflict": ready.get("reason") == "ChildConflict" and ready.get("message", ""),
    }  # fmt: skip


def deleting(meta: Mapping[str, Any]) -> bool:
    """A policy being deleted injects nothing: its ConfigMap is about to be collected."""
    return bool(meta.get("deletionTimestamp"))


def _failure(what: str, exc: Exception) -> ApiFailure:
    if isinstance(exc, ApiException):
        return ApiFailure(what, int(exc.status or 0), api_error_message(exc))
    return ApiFailure(what, 0, f"no answer ({type(exc).__name__}: {exc})")


# The errors an API call can end in: the server's answer, or none (connection, timeout).
API_ERRORS = (ApiException, urllib3.exceptions.HTTPError, OSError)


async def reconcile(ctx: Context, body: Mapping[str, Any], seen: Seen, logger: Any) -> Outcome:
    """Bring the policy's children in line with its spec; return its new status.

    ``seen`` is what the watches show: its children, the pods its selector
    matches, and the namespace's policies (for the conflict check).  Every API
    failure is reported in status (the server's message), never only raised.
    """
    meta, spec = body["metadata"], body.get("spec") or {}
    name, namespace = meta["name"], meta["namespace"]
    problems = _spec_problems(spec, ctx.allowlist)
    failures: list[ApiFailure] = []
    conflicts: list[str] = []  # children whose names someone else's objects hold (never written)
    children_ready = True
    network_policy = (body.get("status") or {}).get("networkPolicy")  # an invalid spec keeps what was in place
    if problems:
        # The old ConfigMap stays: running sidecars keep their last good config.
        old_valid = _condition(body, "Valid")
        text = "; ".join(f"{p}: {m}" for p, m in problems)
        if text not in (old_valid or {}).get("message", ""):  # once per change (an Event), not every tick
            logger.warning("invalid spec, keeping the last good config: %s", text)
        children_ready = all((kind, child_name(name)) in seen.children for kind in CHILD_KINDS)
    else:
        operator_key = ctx.admin_signer.public_pem if ctx.admin_signer is not None else ""
        children = [build_configmap(name, namespace, spec, operator_key), build_service(name, namespace, spec)]
        if headless_enabled(spec):
            children.append(build_headless_service(name, namespace, spec))
        if ctx.network_policy:
            children.append(build_network_policy(name, namespace, spec, sidecar_serving_ports(seen.pods, name),
                                                 ctx.metrics_from))  # fmt: skip
        network_policy = None
        for obj in children:
            _owned(obj, body)
            what = f"{obj['kind']} {obj['metadata']['name']}"
            try:
                done = await ctx.kube.ensure(obj, seen.children.get((obj["kind"], obj["metadata"]["name"])))
            except ChildConflict as exc:
                conflicts.append(str(exc))
                children_ready = False
                continue
            except API_ERRORS as exc:
                if namespace_is_terminating(exc):
                    return Outcome({}, terminating=True)
                failures.append(_failure(what, exc))
                children_ready = False
                continue
            if done != "unchanged":
                logger.info("%s %s", what, done)
            if obj["kind"] == "NetworkPolicy":
                network_policy = obj["metadata"]["name"]
        if not headless_enabled(spec):
            await _drop_child(ctx, body, build_headless_service(name, namespace, spec), seen, failures, logger,
                              "spec.service.headless is off")  # fmt: skip
        if not ctx.network_policy:
            await _drop_child(ctx, body, build_network_policy(name, namespace, spec), seen, failures, logger,
                              "the install makes no NetworkPolicy")  # fmt: skip
    outcome = await observe(ctx, body, seen, problems, children_ready, failures, conflicts, logger)
    outcome.status["networkPolicy"] = network_policy
    _warn_once(body, outcome, logger)
    return outcome


# Conditions that are also a warning Event: pods the take-over refused, vLLM ignoring the policy's order,
# a model the sidecars cannot load, a child's name taken by an object the policy does not own.
WARNED = (("SidecarsInjected", "TakeOverRefused"), ("EnginePriorityEnabled", "SchedulingPolicyNotPriority"),
          ("ModelReady", "ModelNotFound"), ("ModelReady", "ModelNotBinary"), ("Ready", "ChildConflict"))


def _warn_once(body: Mapping[str, Any], outcome: Outcome, logger: Any) -> None:
    """Each ``WARNED`` condition as a warning: an Event on the policy (posting.loggers), once per change."""
    for kind, reason in WARNED:
        now = next((c for c in outcome.status["conditions"] if c["type"] == kind), {})
        before = _condition(body, kind) or {}
        if now.get("reason") == reason and now.get("message") != before.get("message"):
            logger.warning("%s", now["message"])


def _owned(obj: dict[str, Any], body: Mapping[str, Any]) -> dict[str, Any]:
    kopf.adopt(obj, owner=dict(body))  # owner reference: deleted with the policy
    return obj


async def _drop_child(
    ctx: Context, body: Mapping[str, Any], obj: dict[str, Any], seen: Seen, failures: list[ApiFailure], logger: Any,
    why: str,
) -> None:
    """Delete a child the spec (or install) no longer asks for, if the watch shows it and it is the policy's own."""
    kind, name = obj["kind"], obj["metadata"]["name"]
    current = seen.children.get((kind, name))
    if current is None or not owned_by(current, _owned(obj, body)):
        return  # not there, or not ours: never deleted
    try:
        if await ctx.kube.delete(kind, name, obj["metadata"]["namespace"]):
            logger.info("%s %s deleted (%s)", kind, name, why)
    except API_ERRORS as exc:
        failures.append(_failure(f"deleting {kind} {name}", exc))


def _condition(body: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    conditions = (body.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == kind), None)


def _sidecar_of(pod: Mapping[str, Any]) -> str | None:
    """The policy whose sidecar the pod runs ("" if it does not say); None: no sidecar."""
    containers = (pod.get("spec") or {}).get("containers") or []
    if not any(c.get("name") == SIDECAR_CONTAINER for c in containers):
        return None
    injected = ((pod.get("metadata") or {}).get("annotations") or {}).get(INJECTED_ANNOTATION, "")
    return str(injected).rpartition("@")[0]


async def observe(
    ctx: Context,
    body: Mapping[str, Any],
    seen: Seen,
    problems: Sequence[tuple[str, str]],
    children_ready: bool,
    failures: list[ApiFailure],
    conflicts: Sequence[str] = (),
    logger: Any = None,
) -> Outcome:
    meta, spec = body["metadata"], body.get("spec") or {}
    name, namespace = meta["name"], meta["namespace"]
    generation = int(meta.get("generation") or 0)
    old = body.get("status") or {}

    # An invalid selector selects nothing (the API server would not have it either).
    pods = [] if any(path.startswith("spec.selector") for path, _ in problems) else seen.pods
    others = [o for o in seen.others if o["name"] != name]
    engine_priority = vllm_args.wanted(spec)
    current = sidecar_hash(spec, ctx.sidecar_image)
    port = sidecar_settings(spec)["grpcPort"]
    label = policy_label(name)
    reports, asked = [], {}
    for pod in pods:
        pod_meta, state = pod["metadata"], pod.get("status") or {}
        injected = (pod_meta.get("labels") or {}).get(POLICY_LABEL) == label
        digest = (pod_meta.get("annotations") or {}).get(SIDECAR_HASH_ANNOTATION)
        report = PodReport(
            name=pod_meta["name"], injected=injected,
            conflict=matching_policies(others, pod_meta.get("labels")),
            outdated=injected and digest is not None and digest != current,
            opted_out=opted_out(pod_meta), sidecar_of=_sidecar_of(pod),
            host_network=bool((pod.get("spec") or {}).get("hostNetwork")),
        )  # fmt: skip
        reports.append(report)
        if not injected:
            if report.sidecar_of is None and not report.conflict and not report.opted_out and not report.host_network:
                report.refused = _take_over_refusal(pod, spec)
            continue
        if engine_priority:
            report.engine_order = engine_order(pod, spec)
        if state.get("podIP") and state.get("phase") == "Running":
            asked[f"{namespace}/{pod_meta['name']}"] = (report, f"{state['podIP']}:{port}")
        else:
            report.error = f"pod is {state.get('phase') or 'Pending'}"
    answers = await ctx.stats.ask({key: address for key, (_, address) in asked.items()}, ctx.stats_max_age,
                                  audience=admin_audience(namespace, name))  # fmt: skip
    for key, (report, _) in asked.items():
        report.stats, report.error = answers[key].stats, answers[key].error
    unreached = await _not_reached(ctx, namespace) if any(r.missing for r in reports) else ""

    conditions, fields = aggregate(reports, problems, children_ready, failures, unreached, engine_priority, conflicts)
    model = await _model_ready(ctx, spec, namespace) if not problems else None
    fleet = fleet_settings(spec) if not problems else None
    published = None  # the status' model field: the fleet model in its ConfigMap (None: none, or fleet off)
    if fleet is not None:
        # the sidecars that answered are the ones asked for their records (their pods are Running and reachable)
        reachable = {key: address for key, (report, address) in asked.items() if report.stats is not None}
        state = ctx.fleet.maybe_start(ctx.kube, body, fleet, reachable, logger or log,
                                      current=seen.children.get(("ConfigMap", fleet_model_name(name))))  # fmt: skip
        model = fleet_model.condition(name, state, old.get("model"))
        published = state.published.status() if state.published is not None else old.get("model")
    else:
        ctx.fleet.forget(namespace, name)
    if model is not None:  # not one of Ready's checks: without its model a sidecar still serves (cold)
        conditions.append(model)
    status = {
        "observedGeneration": generation,
        "conditions": merge_conditions(old.get("conditions"), conditions, generation, now_iso()),
        **fields,
        "adjustments": adjustments(reports, old.get("adjustments")),
        "model": published,  # None deletes a stale one (fleet turned off)
    }
    return Outcome(status, failures)


async def _model_ready(ctx: Context, spec: Mapping[str, Any], namespace: str) -> Condition | None:
    """``ModelReady`` for ``spec.predictor.model`` (None without one); the ConfigMap is read at most
    every ``model_check_seconds`` per reference (it holds up to 1 MiB, and every policy is re-checked often)."""
    ref = model_ref(spec)
    if ref is None:
        return None
    kind, name, key = ref
    cache_key, now = (namespace, f"{kind}/{name}", key), time.monotonic()
    cached = ctx.model_checks.get(cache_key)
    if cached is not None and now - cached[0] < ctx.model_check_seconds:
        return cached[1]
    found, failure = None, None
    if kind == "ConfigMap":
        try:
            found = await ctx.kube.read_configmap(name, namespace)
        except API_ERRORS as exc:
            failure = _failure(f"reading ConfigMap {name}", exc)
    condition = model_condition(ref, namespace, found, failure)
    if failure is None:
        ctx.model_checks[cache_key] = (now, condition)
    return condition


async def _not_reached(ctx: Context, namespace: str) -> str:
    """Why the webhook never sees this namespace's pods; "" when it does, or when that cannot be told
    (then the usual advice, recreate the pods, stands)."""
    if not ctx.webhook_config:
        return ""
    try:
        selector = await ctx.kube.webhook_namespace_selector(ctx.webhook_config)
        labels = await ctx.kube.namespace_labels(namespace)
    except API_ERRORS:
        return ""
    return "" if selector is None else opt_in.not_reached(namespace, labels, selector)


def engine_order(pod: Mapping[str, Any], spec: Mapping[str, Any]) -> vllm_args.Finding | None:
    """Why the pod's vLLM may not order by priority (None: it runs --scheduling-policy priority)."""
    pod_spec = dict(pod.get("spec") or {})
    # The sidecar goes last (or into initContainers), so the others keep their index without it.
    pod_spec["containers"] = [c for c in pod_spec.get("containers") or [] if c.get("name") != SIDECAR_CONTAINER]
    try:
        index = takeover.find_container(pod_spec, str(takeover.settings(spec)["container"] or ""))
    except takeover.TakeOverRefused as exc:
        return vllm_args.Finding(f"{exc.field}: {exc.message}", certain=False)
    return vllm_args.check(pod_spec, index)


def _take_over_refusal(pod: Mapping[str, Any], spec: Mapping[str, Any]) -> str:
    """Why the port take-over would refuse this pod ("" if it would not, or is not asked for)."""
    try:
        take_over_plan(pod, spec)
    except takeover.TakeOverRefused as exc:
        return str(exc)
    return ""


async def cleanup(ctx: Context, body: Mapping[str, Any], carriers: Sequence[Mapping[str, Any]], logger: Any) -> list[str]:
    """On deletion: roll the workloads whose pods carry this policy's sidecar (``carriers``).

    The ConfigMap and Service go with the policy (owner references).  A running
    pod's containers cannot be removed, so the pods that carry the sidecar are
    recreated through their Deployment or StatefulSet, and come back without it.
    In a namespace being deleted everything goes anyway: nothing is rolled.
    """
    if not carriers or await ctx.kube.namespace_terminating(body["metadata"]["namespace"]):
        return []
    restarted: list[str] = []
    for pod in carriers:
        owner = await ctx.kube.restart_owner(pod)
        if owner is not None and owner not in restarted:
            restarted.append(owner)
        elif owner is None:
            logger.warning("pod %s has no Deployment/StatefulSet: it keeps the sidecar until recreated",
                           pod["metadata"]["name"])  # fmt: skip
    return restarted


def admit(
    pod: Mapping[str, Any], candidates: Sequence[Mapping[str, Any]], default_image: str,
    allowlist: Allowlist | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The merge patch for a new pod and the warnings for whoever created it.

    ``candidates`` are the policies of the pod's namespace as ``{"name", "spec",
    "generation", "deletionTimestamp"}``.  No policy: nothing.  Two or more: no
    sidecar, and an annotation that names them (never a silent merge).  An
    invalid policy: nothing, with a warning (its status says why).  A policy
    being deleted counts as gone (its rollout restart must bring pods back
    without it), and a pod annotated ``binbatch.io/inject: "false"`` is never
    touched, nor is a ``hostNetwork`` pod.  A policy asking for an image or URL beyond the install's ``allowlist`` (default:
    the default image's repository, loopback URLs) is invalid: nothing.
    """
    pod_meta = pod.get("metadata") or {}
    if opted_out(pod_meta):
        return {}, []
    candidates = [c for c in candidates if not c.get("deletionTimestamp")]
    names = matching_policies(candidates, pod_meta.get("labels"))
    if not names:
        return {}, []
    if len(names) > 1:
        message = f"binbatch: policies {', '.join(names)} all select this pod; no sidecar injected"
        return {"metadata": {"annotations": {CONFLICT_ANNOTATION: ",".join(names)}}}, [message]
    (policy,) = [c for c in candidates if c["name"] == names[0]]
    if (pod.get("spec") or {}).get("hostNetwork"):
        return {}, [f"binbatch: policy {policy['name']} selects this pod, but a hostNetwork pod is never injected "
                    "(the sidecar would listen on the node's network); no sidecar"]  # fmt: skip
    if policy.get("childConflict"):
        return {}, [f"binbatch: policy {policy['name']} does not own its children ({policy['childConflict']}); no sidecar"]
    problems = _spec_problems(policy.get("spec") or {}, allowlist or Allowlist(default_image))
    if problems:
        return {}, [f"binbatch: policy {policy['name']} is invalid ({problems[0][0]}: {problems[0][1]}); no sidecar"]
    try:
        patch = build_pod_patch(pod, policy["name"], int(policy.get("generation") or 0), policy["spec"], default_image)
    except takeover.TakeOverRefused as exc:
        # Never a half-patched pod: it runs as written, without a sidecar, and says why.
        message = f"binbatch: policy {policy['name']} cannot take over this pod's serving port ({exc}); no sidecar"
        return {"metadata": {"annotations": {REFUSED_ANNOTATION: str(exc)[:1024]}}}, [message]
    if patch and vllm_args.wanted(policy["spec"]):
        finding = engine_order({"spec": {**(pod.get("spec") or {}), **patch["spec"]}}, policy["spec"])
        if finding:
            return patch, [f"binbatch: policy {policy['name']} has batch.order EnginePriority, which vLLM ignores "
                           f"unless it runs with --scheduling-policy priority: {finding.text}"]  # fmt: skip
    return patch, []
