"""vLLM's Prometheus metrics, with its names, labels and bucket boundaries."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .config import EmulatorConfig
from .kv_blocks import BlockScheduler
from .model import Sequence

# Bucket boundaries as in vLLM's Prometheus stat logger (vllm/v1/metrics/loggers.py;
# factored out into vllm/v1/metrics/buckets.py in later releases).
TIME_TO_FIRST_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# quantity -> (current name, pre-0.10 name)
METRIC_NAMES: dict[str, tuple[str, str]] = {
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
}

_LABELS = ("model_name", "engine")


class EmulatorMetrics:
    """vLLM's Prometheus metrics in a private registry, labelled like vLLM
    (``model_name``, ``engine="0"``); ``vllm:cache_config_info`` carries the cache
    config as labels (and, as in vLLM, no ``model_name``)."""

    def __init__(self, config: EmulatorConfig, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._labels = {"model_name": config.model, "engine": "0"}
        legacy = int(config.legacy_names)
        self.running = self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = self._gauge(METRIC_NAMES["kv_usage"][legacy], "KV-cache usage. 1 means 100 percent usage.")
        self.preemptions = self._counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            [*_LABELS, "finished_reason"], registry=self.registry,
        )  # fmt: skip
        self.ttft = self._histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )  # fmt: skip
        self.itl = self._histogram(
            METRIC_NAMES["itl"][legacy], "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )  # fmt: skip
        self.e2e = self._histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.queue_time = self._histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self._cache_config_info(config)

    def _gauge(self, name: str, doc: str) -> Any:
        return Gauge(name, doc, _LABELS, registry=self.registry).labels(**self._labels)

    def _counter(self, name: str, doc: str) -> Any:
        return Counter(name, doc, _LABELS, registry=self.registry).labels(**self._labels)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Any:
        return Histogram(name, doc, _LABELS, registry=self.registry, buckets=buckets).labels(**self._labels)

    def _cache_config_info(self, config: EmulatorConfig) -> None:
        """An info-style gauge fixed at 1, like vLLM's ``log_metrics_info``."""
        info = {
            "block_size": str(config.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "gpu_memory_utilization": "0.9",
            "num_gpu_blocks": str(config.num_gpu_blocks),
            "engine": "0",
        }
        gauge = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
                      registry=self.registry)  # fmt: skip
        gauge.labels(**info).set(1)

    def publish_state(self, scheduler: BlockScheduler) -> None:
        """Scheduler gauges, set after every change as vLLM sets them every step."""
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.kv_usage.set(scheduler.usage)

    def request_finished(self, seq: Sequence, now: float) -> None:
        self._success.labels(**self._labels, finished_reason=seq.finish_reason or "abort").inc()
        self.e2e.observe(now - seq.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)
