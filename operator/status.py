"""A policy's status: conditions and the aggregate of its sidecars' stats (pure).

Conditions follow the Kubernetes convention: ``type``, ``status`` (True, False,
Unknown), a CamelCase ``reason``, a ``message``, ``observedGeneration`` and a
``lastTransitionTime`` that changes only when ``status`` really changes.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from binbatch_api.v1 import binbatch_pb2 as pb

from .vllm_args import Finding

MAX_ADJUSTMENTS = 20  # the CRD's maxItems for status.adjustments


def iso(when: datetime.datetime) -> str:
    """RFC 3339 in UTC to the second, as Kubernetes writes times."""
    return when.astimezone(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def now_iso() -> str:
    return iso(datetime.datetime.now(datetime.UTC))


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str


def merge_conditions(
    old: Sequence[Mapping[str, Any]] | None, new: Sequence[Condition], generation: int, now: str
) -> list[dict[str, Any]]:
    """The new condition list; ``lastTransitionTime`` kept unless the status flipped."""
    previous = {c.get("type"): c for c in old or []}
    out = []
    for cond in new:
        before = previous.get(cond.type)
        changed = before is None or before.get("status") != cond.status
        out.append({
            "type": cond.type, "status": cond.status, "reason": cond.reason, "message": cond.message[:4096],
            "observedGeneration": generation,
            "lastTransitionTime": now if changed else before.get("lastTransitionTime", now),
        })  # fmt: skip
    return out


@dataclass
class PodReport:
    """What the operator saw of one selected pod."""

    name: str
    injected: bool  # carries this policy's sidecar (label set by the webhook)
    conflict: list[str] = field(default_factory=list)  # other policies that select it too
    outdated: bool = False  # its sidecar container is from an older spec.sidecar
    stats: pb.Stats | None = None  # None: not asked (not running) or no answer
    error: str = ""  # why there are no stats
    opted_out: bool = False  # binbatch.io/inject: "false": never injected, nothing to report
    sidecar_of: str | None = None  # a sidecar container it runs: the injecting policy ("" unknown); None: none
    refused: str = ""  # why the port take-over cannot rewrite it (field: message); "" when it can or is not asked
    engine_order: Finding | None = None  # batch.order EnginePriority: why its vLLM may not order by priority
    host_network: bool = False  # spec.hostNetwork: the webhook never injects it

    @property
    def missing(self) -> bool:
        """It has no sidecar and nothing but the moment it was created explains why."""
        return (not self.injected and self.sidecar_of is None and not self.conflict and not self.refused
                and not self.opted_out and not self.host_network)  # fmt: skip


@dataclass(frozen=True)
class ApiFailure:
    """A Kubernetes API call of the reconcile that failed: what it was for and the server's answer."""

    what: str  # e.g. "Service fast-binbatch", "listing pods"
    code: int  # HTTP status; 0 when no answer came
    message: str

    @property
    def rejected(self) -> bool:
        """The server refused what the spec made us send (bad request, invalid object)."""
        return self.code in (400, 422)

    def __str__(self) -> str:
        return f"{self.what}: {self.message}"


def valid_condition(problems: Sequence[tuple[str, str]], rejected: Sequence[ApiFailure] = ()) -> Condition:
    if not problems and not rejected:
        return Condition("Valid", "True", "SpecValid", "The spec renders a valid sidecar config.")
    text = "; ".join([*(f"{path}: {message}" for path, message in problems), *(str(f) for f in rejected)])
    return Condition("Valid", "False", "InvalidSpec" if problems else "RejectedByApiServer", text)


def _conflict_entry(pod: PodReport) -> str:
    """One conflicting pod, worded by its actual state (with or without a sidecar)."""
    if pod.sidecar_of is None:
        state = "has no sidecar"
    elif pod.sidecar_of:
        state = f"runs the sidecar of {pod.sidecar_of}"
    else:
        state = "runs a binbatch sidecar"
    return f"{pod.name} (also {', '.join(pod.conflict)}; {state})"


def aggregate(
    pods: Sequence[PodReport] | None,
    problems: Sequence[tuple[str, str]],
    children_ready: bool,
    failures: Sequence[ApiFailure] = (),
    not_reached: str = "",
    engine_priority: bool = False,
    child_conflicts: Sequence[str] = (),
) -> tuple[list[Condition], dict[str, Any]]:
    """Conditions and the status fields for a policy from what its pods report.

    ``pods`` is None when they could not be listed (the failure is in
    ``failures``): what they would say is then Unknown, and the pod fields are
    left as they were.  ``not_reached`` is why the webhook never sees the
    namespace's pods (``opt_in.not_reached``), "" when it does or cannot be told.
    ``engine_priority`` (``batch.order: EnginePriority``) adds ``EnginePriorityEnabled``.
    ``child_conflicts``: children whose names objects not the policy's hold (left untouched):
    Ready is False with reason ``ChildConflict`` naming them, before any other reason.
    """
    valid = valid_condition(problems, [f for f in failures if f.rejected])
    if pods is None:
        unknown = "Pods could not be listed: " + "; ".join(str(f) for f in failures)
        sidecars = Condition("SidecarsInjected", "Unknown", "PodsUnknown", unknown)
        metrics = Condition("MetricsAvailable", "Unknown", "PodsUnknown", unknown)
        checks = [valid, sidecars, metrics] + ([Condition("EnginePriorityEnabled", "Unknown", "PodsUnknown", unknown)] if engine_priority else [])
        return [_ready(checks, children_ready, failures, 0, child_conflicts), *checks], {}
    pods = [p for p in pods if not p.opted_out]
    injected = [p for p in pods if p.injected]
    refused = sorted(f"{p.name}: {p.refused}" for p in pods if not p.injected and p.refused)
    missing = sorted(p.name for p in pods if p.missing)
    host_network = sorted(p.name for p in pods if not p.injected and p.host_network)
    conflicts = sorted(_conflict_entry(p) for p in pods if p.conflict)
    outdated = sorted(p.name for p in injected if p.outdated)

    if conflicts:
        sidecars = Condition("SidecarsInjected", "False", "SelectorConflict",
                             "More than one policy selects these pods, so none is injected into them when they "
                             "are (re)created: " + "; ".join(conflicts[:10]))  # fmt: skip
    elif refused:
        sidecars = Condition("SidecarsInjected", "False", "TakeOverRefused",
                             f"{len(refused)} selected pod(s) cannot have their serving port taken over "
                             "(spec.sidecar.takeOverServingPort) and run without a sidecar; change the named field "
                             "and recreate them: " + "; ".join(refused[:10]))  # fmt: skip
    elif host_network:
        sidecars = Condition("SidecarsInjected", "False", "HostNetwork",
                             f"{len(host_network)} selected pod(s) use hostNetwork and are never injected (the "
                             "sidecar's ports and its loopback would be the node's, shared with every "
                             "hostNetwork pod there); run them without hostNetwork or narrow spec.selector: "
                             + ", ".join(host_network[:10]))  # fmt: skip
    elif missing and not_reached:
        sidecars = Condition("SidecarsInjected", "False", "NamespaceNotOptedIn",
                             f"{len(missing)} selected pod(s) have no sidecar: {not_reached}: {', '.join(missing[:10])}")
    elif missing:
        sidecars = Condition("SidecarsInjected", "False", "PodsNeedRestart",
                             f"{len(missing)} selected pod(s) have no sidecar: none was injected when they were "
                             f"created (before the policy existed, or while the webhook was unavailable); "
                             f"recreate them, e.g. kubectl rollout restart: {', '.join(missing[:10])}")  # fmt: skip
    elif outdated:
        sidecars = Condition("SidecarsInjected", "False", "SidecarOutdated",
                             f"{len(outdated)} pod(s) run a sidecar from an older spec.sidecar (image, ports, "
                             f"resources, grace, or which ConfigMap or Secret spec.predictor.model names; recreate them): "
                             f"{', '.join(outdated[:10])}")  # fmt: skip
    elif not pods:
        sidecars = Condition("SidecarsInjected", "True", "NoPods", "No pod matches the selector yet.")
    else:
        sidecars = Condition("SidecarsInjected", "True", "AllInjected", f"{len(injected)} pod(s) carry the sidecar.")

    reporting = [p for p in injected if p.stats is not None]
    silent = sorted(f"{p.name}: {p.error or 'no answer'}" for p in injected if p.stats is None)
    stale = sorted(p.name for p in reporting if p.stats.metrics_source.state == pb.METRICS_STATE_STALE)  # type: ignore[union-attr]
    if not injected:
        metrics = Condition("MetricsAvailable", "Unknown", "NoSidecars", "No sidecar to ask yet.")
    elif silent:
        metrics = Condition("MetricsAvailable", "False", "SidecarUnreachable", "; ".join(silent[:10]))
    elif stale:
        metrics = Condition("MetricsAvailable", "False", "EngineMetricsStale",
                            f"Engine metrics are stale on {', '.join(stale[:10])}; their batch sizes hold the last good value.")  # fmt: skip
    else:
        metrics = Condition("MetricsAvailable", "True", "MetricsFresh", f"{len(reporting)} sidecar(s) report.")

    checks = [valid, sidecars, metrics] + ([_engine_priority(injected)] if engine_priority else [])
    ready = _ready(checks, children_ready, failures, len(injected), child_conflicts)

    # None deletes a field in the merge patch: no reporting sidecar, no stale aggregate.
    fields: dict[str, Any] = {"pods": len(injected), "batchSize": None, "bins": None, "throughputRequestsPerSecond": None}
    if reporting:
        stats = [p.stats for p in reporting]
        fields["batchSize"] = max(s.target_batch_size for s in stats)  # type: ignore[union-attr]
        bounds = stats[0].bin_boundaries  # type: ignore[union-attr]
        fields["bins"] = ", ".join(f"{b:g}" for b in bounds) if bounds else "one bin"
        fields["throughputRequestsPerSecond"] = f"{sum(s.throughput.requests_per_second for s in stats):.3g}"  # type: ignore[union-attr]
    return [ready, *checks], fields


def model_condition(
    ref: tuple[str, str, str], namespace: str, configmap: Mapping[str, Any] | None, failure: ApiFailure | None = None
) -> Condition:
    """``ModelReady`` for ``spec.predictor.model`` (``ref``: kind, name, key) from what the operator could
    read: the ConfigMap (None: it does not exist), or ``failure``.  Secrets are not read (the
    operator has no cluster-wide access to them): their sidecars report through their metric."""
    kind, name, key = ref
    cold = ("the sidecars start cold and learn from completions; once it is there they load it without a restart "
            "(binbatch_predictor_model_loaded)")  # fmt: skip
    if kind == "Secret":
        return Condition("ModelReady", "Unknown", "SecretNotChecked",
                         f"spec.predictor.model: Secret {name} key {key} is mounted into the sidecars; the operator "
                         f"does not read Secrets, so each sidecar's binbatch_predictor_model_loaded says whether it "
                         f"loaded (0: missing or no model, it learns from completions)")  # fmt: skip
    if failure is not None:
        return Condition("ModelReady", "Unknown", "ModelUnknown", f"spec.predictor.model: {failure}")
    if configmap is None:
        return Condition("ModelReady", "False", "ModelNotFound",
                         f"spec.predictor.model: ConfigMap {name} not found in namespace {namespace}: {cold}; make it "
                         f"with kubectl create configmap {name} --from-file={key}=MODEL_FILE")  # fmt: skip
    binary, text = configmap.get("binaryData") or {}, configmap.get("data") or {}
    if key in binary:
        size = len(binary[key]) * 3 // 4  # base64
        return Condition("ModelReady", "True", "ModelFound",
                         f"spec.predictor.model: ConfigMap {name} key {key} holds {size // 1024} KiB; the sidecars load "
                         "it (binbatch_predictor_model_loaded says each one did)")  # fmt: skip
    if key in text:
        return Condition("ModelReady", "False", "ModelNotBinary",
                         f"spec.predictor.model: ConfigMap {name} key {key} is text (data), not a model file: {cold}; a "
                         f"model written by binbatch predictor train is binary (kubectl create configmap --from-file "
                         f"puts it in binaryData)")  # fmt: skip
    keys = sorted({*binary, *text})
    return Condition("ModelReady", "False", "ModelNotFound",
                     f"spec.predictor.model: ConfigMap {name} has no key {key} (its keys: {', '.join(keys) or 'none'}): "
                     f"{cold}")  # fmt: skip


def _engine_priority(injected: Sequence[PodReport]) -> Condition:
    """``batch.order: EnginePriority``: does every injected pod's vLLM run ``--scheduling-policy priority``?"""
    lacking = sorted(f"{p.name} ({p.engine_order.text})" for p in injected if p.engine_order and p.engine_order.certain)
    unsure = sorted(f"{p.name} ({p.engine_order.text})" for p in injected if p.engine_order and not p.engine_order.certain)
    if lacking:
        return Condition("EnginePriorityEnabled", "False", "SchedulingPolicyNotPriority",
                         f"batch.order EnginePriority hands vLLM each request's priority, which vLLM ignores unless it "
                         f"runs with --scheduling-policy priority (the order is then lost); give vLLM that flag "
                         f"(with spec.sidecar.takeOverServingPort the webhook appends it to new pods that state no "
                         f"--scheduling-policy) and recreate {len(lacking)} pod(s): " + "; ".join(lacking[:10]))  # fmt: skip
    if unsure:
        return Condition("EnginePriorityEnabled", "Unknown", "SchedulingPolicyUnknown",
                         "batch.order EnginePriority needs vLLM to run with --scheduling-policy priority; make sure "
                         f"these {len(unsure)} pod(s) do: " + "; ".join(unsure[:10]))  # fmt: skip
    if not injected:
        return Condition("EnginePriorityEnabled", "Unknown", "NoSidecars", "No pod carries the sidecar yet.")
    return Condition("EnginePriorityEnabled", "True", "SchedulingPolicyPriority",
                     f"{len(injected)} pod(s) run vLLM with --scheduling-policy priority.")


def _ready(
    checks: Sequence[Condition], children_ready: bool, failures: Sequence[ApiFailure], injected: int,
    child_conflicts: Sequence[str] = (),
) -> Condition:
    """Ready=True only when nothing blocks; otherwise the first blocker's reason and message."""
    blockers = [c for c in checks if c.status == "False"]
    if child_conflicts:
        blockers.insert(0, Condition("Ready", "False", "ChildConflict",
                                     "; ".join(child_conflicts) + ": the operator leaves it untouched and injects no "
                                     "pod; delete or rename it, or rename the policy"))  # fmt: skip
    errors = [f for f in failures if not f.rejected]
    if errors:
        blockers.append(Condition("Ready", "False", "ApiError", "; ".join(str(f) for f in errors)))
    if not children_ready and not blockers:
        blockers.append(Condition("Ready", "False", "Reconciling", "ConfigMap and Service not in place yet."))
    if blockers:
        return Condition("Ready", "False", blockers[0].reason, blockers[0].message)
    return Condition("Ready", "True", "Ready", f"ConfigMap and Service in place; {injected} sidecar(s).")


def changed_fields(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The part of ``new`` status that differs from ``old``: all a status patch should carry.

    An idle policy's status is then not written at all; ``None`` (delete the
    field) is kept only where the field is there to delete.
    """
    return {key: value for key, value in new.items() if old.get(key) != value}


def adjustments(pods: Sequence[PodReport], previous: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """The last ``MAX_ADJUSTMENTS`` changes the sidecars made, oldest first, without repeats.

    The sidecars report their recent changes on every ask; merging them with
    what status already holds and keeping the newest makes asking again a no-op.
    """
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for entry in previous or []:
        merged[(entry.get("time"), entry.get("pod"), entry.get("field"), entry.get("to"))] = dict(entry)
    for pod in pods:
        for adj in pod.stats.recent_adjustments if pod.stats is not None else ():
            entry = {
                "time": iso(datetime.datetime.fromtimestamp(adj.time_unix_seconds, datetime.UTC)),
                "pod": pod.name, "field": adj.field[:64], "from": adj.from_value[:256], "to": adj.to_value[:256],
                "reason": adj.reason[:1024],
            }  # fmt: skip
            merged.setdefault((entry["time"], entry["pod"], entry["field"], entry["to"]), entry)
    ordered = sorted(merged.values(), key=lambda a: (a.get("time") or "", a.get("pod") or ""))
    return ordered[-MAX_ADJUSTMENTS:]
