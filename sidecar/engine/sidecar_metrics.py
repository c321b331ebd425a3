"""The sidecar's own Prometheus metrics (DESIGN §2 "Own metrics").

Names follow Prometheus conventions: ``binbatch_`` prefix, base units, ``_total``
on counters (the client library appends it), and no high-cardinality labels: the
bin index, a small fixed set of reasons/outcomes, and ``model_name`` bounded by
``ModelLabels`` (the engine's served models; any other name is "other") are the
only labels.  The registry is injected so tests (and several sidecars in one test
process) never share global state.

The per-request signals the ecosystem reads (issue 12) carry ``model_name`` like
vLLM's own ``vllm:*`` series and the inference extension's
``inference_objective_*``: ``binbatch_request_e2e_seconds``,
``binbatch_request_ttft_seconds`` and ``binbatch_requests_waiting``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from ..config import CALLER_INPUTS

if TYPE_CHECKING:
    from ..core.predictor import AccuracyTracker

# Seconds: from sub-millisecond queueing to long generations.
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

OUTCOMES = ("completed", "rejected", "expired", "cancelled", "failed", "unavailable")
EXTERNAL_OUTCOMES = ("answered", "timeout", "error", "invalid", "skipped")  # of a call to the external predictor
OTHER_MODEL = "other"  # model_name of a request naming a model the engine does not serve


class ModelLabels:
    """The ``model_name`` label of a model, with bounded cardinality.

    A request may name any model (the engine refuses an unknown one only after
    the sidecar accepted it), so a label per named model would let clients mint
    series.  Only the models the engine serves (its ``/v1/models``) and the
    configured default keep their name; every other name is ``OTHER_MODEL``.
    ``watch`` points it at the sidecar's live lists (a reload or an engine that
    came up changes them); until then every name is "other".
    """

    def __init__(self) -> None:
        self._served: Callable[[], Collection[str]] = tuple
        self._default: Callable[[], str] = str

    def watch(self, served: Callable[[], Collection[str]], default: Callable[[], str]) -> None:
        self._served, self._default = served, default

    def known(self) -> list[str]:
        """The names that label as themselves (the default first), without duplicates."""
        return list(dict.fromkeys(m for m in (self._default(), *self._served()) if m))

    def __call__(self, model: str) -> str:
        """``model``'s label; "" (a series without a model, e.g. an engine's
        unlabelled gauge) is the default model's."""
        if not model:
            return self._default() or OTHER_MODEL
        return model if model == self._default() or model in self._served() else OTHER_MODEL


class RequestsWaiting:
    """``binbatch_requests_waiting{model_name}``, computed when /metrics is scraped.

    The honest per-pod backlog: requests the sidecar holds that the engine has not
    started (in the bins, or taken and not yet sent) plus the engine's own
    ``vllm:num_requests_waiting`` from the last fresh metrics fetch.  With the
    sidecar in front, vLLM's own "waiting" stays near zero -- the queue moved into
    the sidecar -- so autoscalers (KEDA, HPA) and endpoint pickers should read
    this one instead.  While the engine's metrics are stale or off (no source)
    only the sidecar's part is counted: an old engine figure could be anything.

    ``sidecar`` and ``engine`` are set by their owners (the dispatcher, the
    metrics feed): each returns requests by model name (the engine's may be None:
    nothing fresh).  Every known model is exported, at 0 when idle, so a query on
    one model's series finds it before its first request.
    """

    NAME = "binbatch_requests_waiting"
    DOC = ("Requests waiting for the engine to start them: held by the sidecar (bins and pending) plus the "
           "engine's own vllm:num_requests_waiting from the last fresh scrape (the sidecar's part alone while "
           "engine metrics are stale); the per-pod backlog autoscalers and endpoint pickers should read")  # fmt: skip

    def __init__(self, labels: ModelLabels) -> None:
        self.labels = labels
        self.sidecar: Callable[[], Mapping[str, float]] = dict
        self.engine: Callable[[], Mapping[str, float] | None] = lambda: None

    def values(self) -> dict[str, float]:
        """model_name label -> requests waiting."""
        totals = dict.fromkeys((self.labels(m) for m in self.labels.known()), 0.0)
        for part in (self.sidecar(), self.engine() or {}):
            for model, n in part.items():
                label = self.labels(model)
                totals[label] = totals.get(label, 0.0) + max(0.0, n)
        return totals

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, self.DOC, labels=["model_name"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.NAME, self.DOC, labels=["model_name"])
        for label, value in sorted(self.values().items()):
            family.add_metric([label], value)
        yield family


SHARED_TENANT_LABEL = "_shared"  # tenant label of requests that name no tenant
OTHER_TENANT_LABEL = "_other"  # tenant label of every tenant the config does not list (no listed name starts with "_")


class TenantLabels:
    """The ``tenant`` label of a tenant, with bounded cardinality: a tenant the
    config lists (``tenants.tenants``, at most 256) keeps its name, the shared
    tenant is ``_shared`` and every other is ``_other`` (a header may name any
    tenant, so a label per name would let clients mint series).  ``watch`` points
    it at the running config's names (a reload changes them)."""

    def __init__(self) -> None:
        self._names: Callable[[], Collection[str]] = tuple

    def watch(self, names: Callable[[], Collection[str]]) -> None:
        self._names = names

    def known(self) -> list[str]:
        return [SHARED_TENANT_LABEL, *self._names(), OTHER_TENANT_LABEL]

    def __call__(self, tenant: str) -> str:
        if not tenant:
            return SHARED_TENANT_LABEL
        return tenant if tenant in self._names() else OTHER_TENANT_LABEL


class TenantsQueued:
    """``binbatch_tenant_queued_requests{tenant}``, computed when /metrics is scraped
    from ``queued`` (the scheduler's requests queued per tenant); every known label
    is exported, at 0 when it has none queued."""

    NAME = "binbatch_tenant_queued_requests"
    DOC = ("Requests queued (accepted, not yet sent to the engine) by tenant: a tenant listed in tenants.tenants, "
           "_shared (requests naming none) or _other (every other tenant)")  # fmt: skip

    def __init__(self, labels: TenantLabels) -> None:
        self.labels = labels
        self.queued: Callable[[], Mapping[str, int]] = dict

    def values(self) -> dict[str, float]:
        totals = dict.fromkeys(self.labels.known(), 0.0)
        for tenant, n in self.queued().items():
            label = self.labels(tenant)
            totals[label] = totals.get(label, 0.0) + n
        return totals

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, self.DOC, labels=["tenant"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.NAME, self.DOC, labels=["tenant"])
        for label, value in sorted(self.values().items()):
            family.add_metric([label], value)
        yield family


class PredictorAccuracy:
    """The predictor's accuracy gauges, computed from its window when /metrics is scraped.

    ``window`` (set by the dispatcher) returns the running core's accuracy
    tracker and bin boundaries: a completion counts in the next scrape, not
    only after the sizer's next tick.  The per-source families carry a
    ``source`` label for each source with completions in the window; the
    overall ones are absent until there is a completion to judge.
    """

    FAMILIES = (
        ("binbatch_predictor_bin_accuracy_ratio", "Share of completions predicted into their true bin", ()),
        ("binbatch_predictor_within_one_bin_accuracy_ratio",
         "Share of completions predicted into their true bin or a neighbour", ()),
        ("binbatch_predictor_source_bin_accuracy_ratio",
         "Share of completions predicted into their true bin, by where the prediction came from "
         "(hint|external|learned|online|max_tokens|default)", ("source",)),
        ("binbatch_predictor_source_within_one_bin_accuracy_ratio",
         "Share of completions predicted into their true bin or a neighbour, by prediction source", ("source",)),
        ("binbatch_predictor_source_kendall_tau",
         "Kendall rank correlation of predicted and actual output lengths over the accuracy window, by "
         "prediction source (how well the order of the predictions matches the order of the answers)", ("source",)),
    )  # fmt: skip

    def __init__(self) -> None:
        self.window: Callable[[], tuple[AccuracyTracker, Sequence[float]] | None] = lambda: None

    def _families(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(name, doc, labels=list(labels)) for name, doc, labels in self.FAMILIES]

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families = self._families()
        overall, within, by_source, within_by_source, tau = families
        held = self.window()
        if held is not None:
            acc, b = held
            for family, value in ((overall, acc.bin_accuracy(b)), (within, acc.within_one_bin_accuracy(b))):
                if value is not None:
                    family.add_metric([], value)
            for source in acc.sources():
                by_source.add_metric([source], acc.bin_accuracy(b, source) or 0.0)
                within_by_source.add_metric([source], acc.within_one_bin_accuracy(b, source) or 0.0)
                if (t := acc.kendall_tau(source)) is not None:
                    tau.add_metric([source], t)
        yield from families


class SidecarMetrics:
    """Every binbatch_* metric; one instance per sidecar."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "binbatch_requests", "Requests by how they ended (accepted ones end exactly once)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.accepted = Counter("binbatch_requests_accepted", "Requests accepted into a bin", registry=r)
        self.model_label = ModelLabels()
        self.e2e = Histogram(
            "binbatch_request_e2e_seconds", "Time from acceptance to the last token of completed requests, by model",
            ["model_name"], buckets=TIME_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "binbatch_request_ttft_seconds",
            "Time from acceptance to the first token, by model: a stream's first delta; "
            "the whole answer (= e2e) for a request not streamed", ["model_name"], buckets=TIME_BUCKETS, registry=r,
        )  # fmt: skip
        self.requests_waiting = RequestsWaiting(self.model_label)
        r.register(self.requests_waiting)
        self.queue_depth = Gauge("binbatch_queue_depth", "Requests waiting in each bin", ["bin"], registry=r)
        self.queued_bytes = Gauge(
            "binbatch_queued_bytes", "Bytes of the request bodies queued and not yet sent to the engine, which "
            "batch.maxQueuedBytes bounds", registry=r,
        )  # fmt: skip
        self.http_connections = Gauge(
            "binbatch_http_connections", "HTTP connections open now (server.maxConnections bounds them)", registry=r
        )
        self.http_connections_refused = Counter(
            "binbatch_http_connections_refused", "HTTP connections closed as they were made because "
            "server.maxConnections were open", registry=r,
        )  # fmt: skip
        self.batches = Counter(
            "binbatch_batches", "Batches dispatched, by bin and reason (full|timeout|slo|policy|room|drain)",
            ["bin", "reason"], registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "binbatch_batch_size", "Requests per dispatched batch", ["bin"], buckets=SIZE_BUCKETS, registry=r
        )
        self.wait = Histogram(
            "binbatch_queue_wait_seconds", "Time from acceptance to dispatch", buckets=TIME_BUCKETS, registry=r
        )
        self.service = Histogram(
            "binbatch_engine_seconds", "Time from dispatch to the engine's answer", buckets=TIME_BUCKETS, registry=r
        )
        self.target_batch_size = Gauge(
            "binbatch_target_batch_size", "Current target batch size B_t per bin", ["bin"], registry=r
        )
        self.size_changes = Counter(
            "binbatch_batch_size_changes", "Changes of B_t, by the sizer's reason", ["reason"], registry=r
        )
        self.bin_count_changes = Counter(
            "binbatch_bin_count_changes", "Changes of k by bins.countMode Auto, by reason", ["reason"], registry=r
        )
        self.smdp_control_limit = Gauge(
            "binbatch_smdp_control_limit", "Smdp dispatch: the queue length that sends a partial batch (-1: none yet)",
            registry=r,
        )
        self.b_mem = Gauge("binbatch_b_mem", "Memory-aware batch size per bin (-1: not computed)", ["bin"], registry=r)
        self.b_sla = Gauge("binbatch_b_sla", "SLA-constrained batch size (-1: not computed)", registry=r)
        self.inflight_requests = Gauge("binbatch_inflight_requests", "Requests in the engine", registry=r)
        self.kv_plan_budget = Gauge(
            "binbatch_kv_plan_budget_tokens",
            "KV tokens the plan lets the requests in flight reach (-1: no plan, or the engine's cache not known yet)",
            registry=r,
        )
        self.kv_plan_shared = Gauge(
            "binbatch_kv_plan_shared_prompt_tokens",
            "Prompt tokens the engine's prefix cache is seen to hold once for every sequence (out of each one's count)",
            registry=r,
        )
        self.inflight_batches = Gauge("binbatch_inflight_batches", "Batches in the engine", registry=r)
        self.pending_requests = Gauge(
            "binbatch_pending_requests", "Requests out of their bins, not yet sent to the engine", registry=r
        )
        self.predicted_tokens = Histogram(
            "binbatch_predicted_output_tokens", "Predicted output length of completed requests",
            buckets=TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.actual_tokens = Histogram(
            "binbatch_actual_output_tokens", "Actual output length of completed requests",
            buckets=TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.accuracy = PredictorAccuracy()
        r.register(self.accuracy)
        self.predictor_refits = Counter(
            "binbatch_predictor_refits", "Learned predictor: model refits off the request path, by outcome "
            "(installed|failed)", ["outcome"], registry=r,
        )  # fmt: skip
        self.predictor_model_version = Gauge(
            "binbatch_predictor_model_version", "Learned predictor: the running model's number, counting the "
            "models installed since start (0: none yet; 1: the warm start or the first fit)", registry=r,
        )  # fmt: skip
        self.predictor_model_age = Gauge(
            "binbatch_predictor_model_age_seconds", "Learned predictor: seconds since the running model was "
            "installed (-1: no model yet)", registry=r,
        )  # fmt: skip
        self.predictor_model_records = Gauge(
            "binbatch_predictor_model_records", "Learned predictor: training records behind the running model "
            "(the warm start's included)", registry=r,
        )  # fmt: skip
        self.predictor_model_loaded = Gauge(
            "binbatch_predictor_model_loaded", "Learned predictor: 1 when the model file predictor.warmStart names "
            "(a policy's spec.predictor.model) is loaded, 0 when that file is missing or holds no model (the "
            "predictor started cold and learns from completions), -1 with no warmStart", registry=r,
        )  # fmt: skip
        self.predictor_buffered_records = Gauge(
            "binbatch_predictor_training_records", "Learned predictor: completions held to refit on "
            "(hashed features, bounded by predictor.trainingBufferRecords)", registry=r,
        )  # fmt: skip
        self.bins = Gauge("binbatch_bins", "Number of bins k", registry=r)
        self.metrics_fresh = Gauge(
            "binbatch_engine_metrics_fresh", "1 when the last engine scrape is fresh, else 0", registry=r
        )
        self.config_generation = Gauge("binbatch_config_generation", "Generation of the loaded config", registry=r)
        self.config_reload_errors = Counter(
            "binbatch_config_reload_errors", "Config files refused on reload", registry=r
        )
        self.draining = Gauge("binbatch_draining", "1 while draining for shutdown", registry=r)
        self.breaker_state = Gauge(
            "binbatch_engine_breaker_state",
            "1 for the engine circuit breaker's current state (closed|open|half_open), 0 for the others",
            ["state"], registry=r,
        )  # fmt: skip
        self.breaker_opens = Counter(
            "binbatch_engine_breaker_opens", "Times the engine circuit breaker opened (an outage began)", registry=r
        )
        self.requeued = Counter(
            "binbatch_requests_requeued",
            "Requests queued again because the engine never received them (connection refused)", registry=r,
        )  # fmt: skip
        self.sizer_fallback = Gauge(
            "binbatch_batch_size_stale_fallback",
            "1 for the batch-size fallback in use while engine metrics are stale "
            "(last-good|static|pressure), 0 for the others", ["fallback"], registry=r,
        )  # fmt: skip
        self.external_predictor_calls = Counter(
            "binbatch_external_predictor_calls",
            "Calls to the external length predictor (predictor.external.url), by outcome "
            "(answered|timeout|error|invalid|skipped: the breaker is open); on all but answered the built-in "
            "predictor places the request", ["outcome"], registry=r,
        )  # fmt: skip
        self.external_predictor_seconds = Histogram(
            "binbatch_external_predictor_call_seconds", "Time a call to the external length predictor took",
            buckets=TIME_BUCKETS, registry=r,
        )  # fmt: skip
        self.external_predictor_breaker_opens = Counter(
            "binbatch_external_predictor_breaker_opens",
            "Times the external length predictor's breaker opened (a timeout or an outage began)", registry=r,
        )  # fmt: skip
        self.external_predictor_feedback = Counter(
            "binbatch_external_predictor_feedback",
            "Completions reported to the external length predictor (predictor.external.feedbackUrl), by outcome "
            "(sent|failed|dropped: the service fell behind)", ["outcome"], registry=r,
        )  # fmt: skip
        self.ignored_inputs = Counter(
            "binbatch_ignored_inputs",
            "Caller inputs ignored, by input (hint|priority|slo): sent by a request whose class may not steer "
            "with it (classes.*.allowHints|allowPriority|allowSloHeaders), or a hint of a class whose hints ran "
            "long; the request was served as if it had not sent it", ["input"], registry=r,
        )  # fmt: skip
        self.hints_distrusted = Gauge(
            "binbatch_hints_distrusted",
            "1 while a request class's length hints are ignored because its answers ran over twice its hints "
            "(median of its latest hinted completions), else 0; request_class _default: requests naming no class; "
            "with caller authentication on (auth.callerTokensDir) kept per caller and class, caller \"\" otherwise",
            ["request_class", "caller"], registry=r,
        )  # fmt: skip
        self.unauthenticated = Counter(
            "binbatch_unauthenticated",
            "Calls refused for want of a valid credential, by door (http|grpc: a generation or passthrough call "
            "without a known caller token, auth.callerTokensDir; admin: an Admin call off loopback without the "
            "admin token or an operator-signed token)", ["door"], registry=r,
        )  # fmt: skip
        for door in ("http", "grpc", "admin"):
            self.unauthenticated.labels(door)
        self.tenant_label = TenantLabels()
        self.tenant_admitted = Counter(
            "binbatch_tenant_admitted", "Requests sent to the engine, by tenant (a tenant listed in tenants.tenants, "
            "_shared: requests naming none, _other: every other tenant)", ["tenant"], registry=r,
        )  # fmt: skip
        self.tenant_rejected = Counter(
            "binbatch_tenant_rejected", "Requests refused as they arrived (a full queue, the tenant's share of it, "
            "draining, the engine down), by tenant (as binbatch_tenant_admitted)", ["tenant"], registry=r,
        )  # fmt: skip
        self.tenant_queued = TenantsQueued(self.tenant_label)
        r.register(self.tenant_queued)
        for what in CALLER_INPUTS:
            self.ignored_inputs.labels(what)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # export zeros so rate() works from the start
        for outcome in EXTERNAL_OUTCOMES:
            self.external_predictor_calls.labels(outcome)

    def render(self) -> bytes:
        return generate_latest(self.registry)
