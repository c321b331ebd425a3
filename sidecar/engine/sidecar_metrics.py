"""The sidecar's own Prometheus metrics (DESIGN §2 "Own metrics").

Names follow Prometheus conventions: ``binbatch_`` prefix, base units, ``_total``
on counters (the client library appends it), and no high-cardinality labels: the
bin index and a small fixed set of reasons/outcomes are the only labels.  The
registry is injected so tests (and several sidecars in one test process) never
share global state.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: from sub-millisecond queueing to long generations.
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

OUTCOMES = ("completed", "rejected", "expired", "cancelled", "failed", "unavailable")


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
        self.queue_depth = Gauge("binbatch_queue_depth", "Requests waiting in each bin", ["bin"], registry=r)
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
        self.bin_accuracy = Gauge(
            "binbatch_predictor_bin_accuracy_ratio", "Share of completions predicted into their true bin", registry=r
        )
        self.within_one_accuracy = Gauge(
            "binbatch_predictor_within_one_bin_accuracy_ratio",
            "Share of completions predicted into their true bin or a neighbour", registry=r,
        )  # fmt: skip
        self.bin_accuracy_by_source = Gauge(
            "binbatch_predictor_source_bin_accuracy_ratio",
            "Share of completions predicted into their true bin, by where the prediction came from "
            "(hint|online|max_tokens|default)", ["source"], registry=r,
        )  # fmt: skip
        self.within_one_accuracy_by_source = Gauge(
            "binbatch_predictor_source_within_one_bin_accuracy_ratio",
            "Share of completions predicted into their true bin or a neighbour, by prediction source",
            ["source"], registry=r,
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
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # export zeros so rate() works from the start

    def render(self) -> bytes:
        return generate_latest(self.registry)
