"""Reading vLLM's Prometheus metrics into what the batch sizer needs.

vLLM has renamed its metrics over releases; ``ALIASES`` lists, for each quantity
the sizer uses, the names to look for, newest first (DESIGN §2).  Histograms are
read as deltas between two scrapes -- the mean over the last interval, not the
lifetime average.  Parsing uses prometheus-client's own text parser, handed
only the lines of the families in ``ALIASES`` (``relevant_lines``): a real vLLM
exposes dozens of histograms the sizer never reads, and parsing them all cost
~16 ms per scrape on the sidecar's event loop (issue 11, ``bench overhead``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from ..core.sizer import EngineSnapshot

# quantity -> metric family names, newest first
ALIASES: dict[str, tuple[str, ...]] = {
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "ttft": ("vllm:time_to_first_token_seconds",),
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "preemptions": ("vllm:num_preemptions", "vllm:num_preemptions_total"),
    "cache_config": ("vllm:cache_config_info",),
}

# The sample-name suffixes ``parse`` reads: a counter's total and a histogram's sum
# and count (its buckets, the bulk of the text, and ``_created`` are never read).
_SUFFIXES = ("_total", "_sum", "_count")
_RELEVANT = re.compile(
    r"^(?:# (?:HELP|TYPE) )?(?:"
    + "|".join(re.escape(name) for names in ALIASES.values() for name in names)
    + r")(?:" + "|".join(_SUFFIXES) + r")?(?=[{ \t]).*$",
    re.MULTILINE,
)  # fmt: skip
_ANY_VLLM_SAMPLE = re.compile(r"^vllm:", re.MULTILINE)


def relevant_lines(text: str) -> str:
    """The lines of ``text`` that ``parse`` reads, in order: for each family in
    ``ALIASES`` its ``# HELP`` / ``# TYPE`` lines and its samples other than
    buckets and ``_created``.  Parsing these gives ``parse`` the same values as
    parsing the whole text; the rest is never tokenised."""
    return "\n".join(m.group(0) for m in _RELEVANT.finditer(text)) + "\n"


def exposes_vllm(text: str) -> bool:
    """Does ``text`` hold any ``vllm:*`` sample (used or not)?"""
    return _ANY_VLLM_SAMPLE.search(text) is not None


@dataclass(frozen=True, slots=True)
class HistogramTotals:
    """Cumulative sum and count of one histogram (all label sets added)."""

    sum: float
    count: float

    def mean_since(self, earlier: HistogramTotals | None) -> float | None:
        """Mean of the observations made since ``earlier``; None if there were none
        or there is no earlier scrape (a lifetime mean is not a recent one).

        A count that went down means the engine restarted: its totals are all recent.
        """
        if earlier is None:
            return None
        if self.count < earlier.count:
            return self.sum / self.count if self.count > 0 else None
        dc = self.count - earlier.count
        return (self.sum - earlier.sum) / dc if dc > 0 else None


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """One scrape of the engine, by quantity (None = the engine did not expose it)."""

    kv_usage: float | None = None
    running: float | None = None
    waiting: float | None = None
    preemptions: float | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    itl: HistogramTotals | None = None
    ttft: HistogramTotals | None = None
    # vllm:num_requests_waiting by its model_name label ("" for a series without one),
    # for binbatch_requests_waiting; None when the engine does not expose it
    waiting_by_model: dict[str, float] | None = None
    names_seen: frozenset[str] = field(default_factory=frozenset)  # the ALIASES families present

    @property
    def kv_capacity_tokens(self) -> int | None:
        """η, the tokens the engine's requests can hold: (num_gpu_blocks - 1) ×
        block_size (DESIGN §3.2).  vLLM's v1 block pool keeps one block back as its
        null block (``BlockPool.null_block``; its ``get_usage`` divides by
        num_gpu_blocks - 1 too): on a 24-block test cache, counting it made the
        projected admission plan for 4% more than fits, and vLLM preempted."""
        if self.num_gpu_blocks is None or self.block_size is None:
            return None
        return max(self.num_gpu_blocks - 1, 0) * self.block_size


def parse(text: str) -> EngineMetrics:
    """Parse a Prometheus text exposition from vLLM (either naming generation).

    Only the families in ``ALIASES`` are parsed (``relevant_lines``); a malformed
    line of another family is not the sizer's concern and does not fail the scrape."""
    families = {f.name: f for f in text_string_to_metric_families(relevant_lines(text))}

    def family(quantity: str):
        for name in ALIASES[quantity]:
            if name in families:
                return families[name]
        return None

    def gauge_sum(quantity: str, reduce=sum) -> float | None:
        f = family(quantity)
        if f is None:
            return None
        values = [s.value for s in f.samples if not s.name.endswith("_created")]
        return float(reduce(values)) if values else None

    def histogram(quantity: str) -> HistogramTotals | None:
        f = family(quantity)
        if f is None:
            return None
        total = sum(s.value for s in f.samples if s.name.endswith("_sum"))
        count = sum(s.value for s in f.samples if s.name.endswith("_count"))
        return HistogramTotals(total, count)

    def by_model(quantity: str) -> dict[str, float] | None:
        f = family(quantity)
        if f is None:
            return None
        out: dict[str, float] = {}
        for s in f.samples:
            if not s.name.endswith("_created"):
                model = s.labels.get("model_name", "")
                out[model] = out.get(model, 0.0) + s.value
        return out

    blocks = block = None
    cfg = family("cache_config")
    if cfg is not None:
        for s in cfg.samples:
            blocks = int_label(s.labels, "num_gpu_blocks") or blocks
            block = int_label(s.labels, "block_size") or block
    return EngineMetrics(
        # several engines behind one endpoint: the fullest cache speaks for all
        kv_usage=gauge_sum("kv_usage", max),
        running=gauge_sum("running"),
        waiting=gauge_sum("waiting"),
        preemptions=gauge_sum("preemptions"),
        num_gpu_blocks=blocks,
        block_size=block,
        itl=histogram("itl"),
        ttft=histogram("ttft"),
        waiting_by_model=by_model("waiting"),
        names_seen=frozenset(families),
    )


def int_label(labels: dict[str, str], key: str) -> int | None:
    raw = labels.get(key)
    if raw in (None, "", "None"):
        return None
    try:
        v = float(raw)  # type: ignore[arg-type]
    except ValueError:
        return None
    return int(v) if math.isfinite(v) and v > 0 else None


def invalid_samples(metrics: EngineMetrics) -> list[str]:
    """The quantities of ``metrics`` that are NaN, ±Inf or negative, as "name=value".

    Prometheus' text format allows ``NaN`` and ``+Inf`` samples, and an engine bug
    can export them (or a negative count); the sizer cannot act on them
    (``int(NaN)`` raises), so the feed treats such a scrape as failed and names
    the culprits.
    """
    values: dict[str, float | None] = {
        "kv_usage": metrics.kv_usage,
        "running": metrics.running,
        "waiting": metrics.waiting,
        "preemptions": metrics.preemptions,
    }
    for name, hist in (("itl", metrics.itl), ("ttft", metrics.ttft)):
        if hist is not None:
            values[f"{name}_sum"], values[f"{name}_count"] = hist.sum, hist.count
    return [
        f"{name}={value!r}"
        for name, value in values.items()
        if value is not None and not (math.isfinite(value) and value >= 0)
    ]


def snapshot(current: EngineMetrics, previous: EngineMetrics | None, fresh: bool) -> EngineSnapshot:
    """What the sizer sees: capacity, usage, the TPOT of the last interval and the
    preemptions since the previous scrape (None without one, or after a restart)."""
    preempted = None
    if previous is not None and current.preemptions is not None and previous.preemptions is not None:
        delta = current.preemptions - previous.preemptions
        preempted = delta if delta >= 0 else None  # a counter that went down: the engine restarted
    return EngineSnapshot(
        preemptions_delta=preempted,
        kv_capacity_tokens=current.kv_capacity_tokens,
        kv_block_tokens=current.block_size,
        kv_usage_ratio=current.kv_usage,
        running=None if current.running is None else int(current.running),
        waiting=None if current.waiting is None else int(current.waiting),
        tpot_seconds=current.itl.mean_since(previous.itl if previous else None) if current.itl else None,
        fresh=fresh,
    )
