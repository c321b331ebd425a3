"""The Admin service's replies (``GetStats``, ``GetConfig``, ``ExportTrainingRecords``), built from the
running parts at each call.

Apart from the lifecycle (``app.py``) so that the servicers and the process
object need not know each other: the Admin servicer is given a ``Replies``, which
is given only what it reads -- the dispatcher, the metrics feed, the clock, and
getters for what a reload or a health check replaces.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

from binbatch_api.v1 import binbatch_pb2 as pb

from ..config import LoadedConfig, redact_urls, shown_config_json
from ..core.clock import Clock
from ..core.sizer import INITIAL_REASON
from ..core.throughput import ThroughputWindow
from ..engine.dispatcher import Dispatcher
from ..engine.metrics_feed import NO_SOURCE_KIND, MetricsFeed
from .assembly import learned_of

EXPORT_MAX_RECORDS = 2000  # records in one ExportTrainingRecords answer, at most
EXPORT_MAX_BYTES = 2 * 1024 * 1024  # and about this many bytes (gRPC's default receive limit is 4 MiB)


def sidecar_version() -> str:
    try:
        return version("binbatch")
    except PackageNotFoundError:
        return "0+unknown"


class Replies:
    """``stats()``, ``config_view()`` and ``training_records()`` for the Admin servicer."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        feed: MetricsFeed,
        clock: Clock,
        *,
        loaded: Callable[[], LoadedConfig],
        engine_serving: Callable[[], bool],
        reload_error: Callable[[], str | None] = lambda: None,
        started_at: float | None = None,
        throughput: ThroughputWindow | None = None,
    ) -> None:
        self.throughput = throughput
        self.dispatcher = dispatcher
        self.feed = feed
        self.clock = clock
        self.loaded = loaded
        self.engine_serving = engine_serving
        self.reload_error = reload_error
        self.started_at = time.monotonic() if started_at is None else started_at

    def training_records(self, since: int, epoch: str, max_records: int) -> pb.TrainingRecords | None:
        """The learned predictor's records after ``since`` (all held when ``epoch`` is set and not the
        predictor's), bounded by count and bytes; None when ``predictor.kind`` is not Learned."""
        learned = learned_of(self.dispatcher.core.predictor)
        if learned is None:
            return None
        if epoch and epoch != learned.epoch:
            since = 0
        limit = min(max_records or EXPORT_MAX_RECORDS, EXPORT_MAX_RECORDS)
        records, left = learned.export(since, limit)
        reply = pb.TrainingRecords(epoch=learned.epoch, oldest=learned.oldest_sequence, next=since)
        size = 0
        for i, r in enumerate(records):
            msg = pb.TrainingRecord(sequence=r.sequence, indices=r.features.indices.tolist(),
                                    values=r.features.values.tolist(), output_tokens=round(r.output_tokens))  # fmt: skip
            size += msg.ByteSize() + 4  # and the field's tag and length
            if size > EXPORT_MAX_BYTES and i > 0:  # one record always goes, whatever its size: the cursor moves on
                left += len(records) - i
                break
            reply.records.append(msg)
            reply.next = r.sequence
        reply.remaining = left
        return reply

    def stats(self) -> pb.Stats:
        d = self.dispatcher
        loaded = self.loaded()
        core = d.core
        former = core.former
        decision = d.last_decision
        counts = d.totals
        bounds = list(core.binner.boundaries)
        edges = [0.0, *bounds, float(loaded.config.bins.max_output_tokens)]
        oldest = former.oldest_arrivals()
        now = self.clock.now()
        bins = [
            pb.BinStats(
                index=i, lower_tokens=edges[i], upper_tokens=edges[i + 1] if i + 1 < len(edges) else edges[-1],
                target_batch_size=former.target_sizes[i], queue_depth=depth,
                oldest_wait_seconds=0.0 if oldest[i] is None else max(0.0, now - oldest[i]),
            )  # fmt: skip
            for i, depth in enumerate(former.bin_depths())
        ]
        stats = pb.Stats(
            sidecar_version=sidecar_version(),
            engine_health=pb.ENGINE_HEALTH_SERVING if self.engine_serving() else pb.ENGINE_HEALTH_NOT_SERVING,
            draining=not d.accepting,
            target_batch_size=max(former.target_sizes),
            sizer_reason=decision.reason if decision else INITIAL_REASON,
            bin_boundaries=bounds,
            bins=bins,
            inflight_batches=d.inflight_batches,
            inflight_requests=d.inflight_requests,
            pending_requests=d.pending_requests(),
            totals=pb.RequestTotals(
                accepted=counts["accepted"],
                completed=counts["completed"],
                rejected=counts["rejected"],
                expired=counts["expired"],
                cancelled=counts["cancelled"],
                failed=counts["failed"] + counts["unavailable"],
            ),
            predictor=pb.PredictorStats(
                name=core.predictor.name, samples=len(core.accuracy),
                bin_accuracy=core.accuracy.bin_accuracy(bounds) or 0.0,
                within_one_bin_accuracy=core.accuracy.within_one_bin_accuracy(bounds) or 0.0,
                sources=[
                    pb.PredictorSourceStats(
                        source=src, samples=core.accuracy.samples(src),
                        bin_accuracy=core.accuracy.bin_accuracy(bounds, src) or 0.0,
                        within_one_bin_accuracy=core.accuracy.within_one_bin_accuracy(bounds, src) or 0.0,
                        kendall_tau=core.accuracy.kendall_tau(src) or 0.0,
                    )
                    for src in core.accuracy.sources()
                ],
            ),  # fmt: skip
            throughput=self._throughput(now),
            metrics_source=source_status(self.feed),
            recent_adjustments=[
                pb.Adjustment(time_unix_seconds=a.time, field=a.field, from_value=a.old, to_value=a.new, reason=a.reason)
                for a in d.adjustments
            ],
            config_generation=loaded.generation,
            uptime_seconds=time.monotonic() - self.started_at,
            engine_breaker=pb.EngineBreakerStatus(
                state=d.breaker.state, open_seconds=d.breaker.open_seconds(now), reason=d.breaker.reason,
                opens=d.breaker.opens,
            ),  # fmt: skip
        )
        if decision is not None:
            mems = [m for m in decision.b_mem if m is not None]
            if mems:
                stats.b_mem = min(mems)
            if decision.b_sla is not None:
                stats.b_sla = decision.b_sla
        return stats

    def _throughput(self, now: float) -> pb.Throughput | None:
        if self.throughput is None:
            return None
        rates = self.throughput.rates(now)
        return pb.Throughput(window_seconds=rates.window_seconds, requests_per_second=rates.requests_per_second,
                             output_tokens_per_second=rates.output_tokens_per_second)  # fmt: skip

    def config_view(self) -> pb.ConfigView:
        lc = self.loaded()
        return pb.ConfigView(
            config_json=shown_config_json(lc.config), generation=lc.generation, sha256=lc.sha256,
            loaded_at_unix_seconds=lc.loaded_at, source=lc.source,
            last_reload_error=redact_urls(self.reload_error() or ""),
        )  # fmt: skip


def source_status(feed: MetricsFeed) -> pb.MetricsSourceStatus:
    """Where the sizer's engine metrics come from, and how fresh they are."""
    state = {"fresh": pb.METRICS_STATE_FRESH, "stale": pb.METRICS_STATE_STALE}.get(
        feed.state, pb.METRICS_STATE_DISABLED
    )
    src = feed.source
    out = pb.MetricsSourceStatus(
        kind=src.kind if src else NO_SOURCE_KIND, url=src.url if src else "", state=state, last_error=feed.last_error or ""
    )
    age = feed.last_success_age()
    if age is not None:
        out.last_scrape_age_seconds = age
    return out
