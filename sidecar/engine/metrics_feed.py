"""Feeding the batch sizer from the engine's metrics (DESIGN §2 "Metrics feedback").

A ``MetricsSource`` reads the engine's quantities into ``vllm_metrics.EngineMetrics``
-- ``ScrapeSource`` from the engine's own ``/metrics``, ``PromQLSource`` from a
Prometheus server.  ``MetricsFeed`` polls the source every ``interval`` and hands
the sizer an ``EngineSnapshot``:

* success: a fresh snapshot; the TPOT is the histogram delta since the previous
  successful fetch (``vllm_metrics.snapshot``);
* failure while the last success is at most ``stale_after`` old: the last snapshot
  again, fresh but without a TPOT (the sizer holds);
* failure after that, or before any success: a stale snapshot (``fresh=False``) --
  the sizer holds its last good size (the static size if there never was one) and
  shrinks only if the last fresh scrape showed pressure (``BatchSizer``);
* a scrape holding NaN, ±Inf or a negative value for a quantity the sizer uses
  is a failure, with the culprits in ``last_error``;
* no source: ``None`` ("disabled": the sizer falls back to the static size).

Sources open one short-lived HTTP session per fetch, so swapping ``feed.source``
(a config reload) needs no cleanup.

The engine's waiting figure (``engine_waiting``, half of binbatch_requests_waiting)
is a scrape's, so on its own it lags: a request the engine held waiting at the last
scrape still counted there after the sidecar had its answer, until the next scrape
(one ``interval``, longer on a busy machine).  With ``own`` set (the dispatcher) the
figure moves with the sidecar's own requests: of a scrape's waiting, at most the
requests the sidecar had sent and not seen start during the fetch can be its own, the
rest are other clients'; between scrapes it reads min(scraped, others + the sidecar's
requests in the engine not seen to start now), so a request that ended or streamed
its first token stops counting in the same step, never later.

``scrape_soon`` asks for a scrape before the interval is up (at most one between
two regular ones): the KV plan learns from the engine's usage what vLLM's
prefix cache shares, and a fresh sidecar would otherwise hold a burst back until
the next scrape (``Scheduler.usage_wanted``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import aiohttp

from ..core.clock import Clock
from ..core.sizer import EngineSnapshot
from . import vllm_metrics
from .vllm_metrics import EngineMetrics, HistogramTotals

log = logging.getLogger(__name__)

FETCH_TIMEOUT_SECONDS = 5.0
ERROR_LOG_EVERY_SECONDS = 60.0  # a repeated failure is logged at most this often
EARLY_GAP_SECONDS = 0.1  # scrape_soon: the soonest an early scrape follows the one before
NO_SOURCE_KIND = "none"  # MetricsSourceStatus.kind without a source (else the source's kind)


class MetricsUnavailable(Exception):
    """The source could not deliver engine metrics; the message says why."""


class OwnRequests(Protocol):
    """The sidecar's requests in the engine, by model (the dispatcher)."""

    def unstarted_by_model(self) -> dict[str, int]:
        """Sent to the engine, not ended, no token seen yet: what may wait there now."""
        ...

    def sent_by_model(self) -> dict[str, int]:
        """Requests sent to the engine so far (a count that only grows)."""
        ...


def _ours(counts: dict[str, int], model: str) -> int:
    """``counts`` for the series ``model``; "" (an engine gauge without model_name) is all of them."""
    return sum(counts.values()) if model == "" else counts.get(model, 0)


def others_waiting(
    scraped: dict[str, float], unstarted_before: dict[str, int], sent_before: dict[str, int],
    sent_after: dict[str, int],
) -> dict[str, float]:  # fmt: skip
    """Of each model's waiting requests in a scrape, those that cannot be the sidecar's:
    at most the requests not started when the fetch began, plus those sent during it, were its own."""
    return {
        m: max(0.0, w - _ours(unstarted_before, m) - (_ours(sent_after, m) - _ours(sent_before, m)))
        for m, w in scraped.items()
    }  # fmt: skip


def waiting_now(scraped: dict[str, float], others: dict[str, float], unstarted: dict[str, int]) -> dict[str, float]:
    """The engine's waiting requests by model now: the scrape's, less the sidecar's own
    that have left the engine's queue since (module docstring)."""
    return {m: min(w, others.get(m, 0.0) + _ours(unstarted, m)) for m, w in scraped.items()}


class MetricsSource(Protocol):
    """Where engine metrics come from: ``kind`` is "scrape" or "promql"."""

    kind: str
    url: str

    async def fetch(self) -> EngineMetrics: ...


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class ScrapeSource:
    """``GET url`` (the engine's ``/metrics``) parsed by ``vllm_metrics.parse``.

    ``headers`` (called at each fetch) are sent with it: the engine's key when
    ``url`` is the engine's own (``assembly.metrics_source``), so an engine that
    protects its metrics still answers, and a rotated key applies at once."""

    kind = "scrape"

    def __init__(
        self, url: str, *, timeout_seconds: float = FETCH_TIMEOUT_SECONDS,
        headers: Callable[[], Mapping[str, str]] | None = None,
    ) -> None:  # fmt: skip
        self.url = url
        self.timeout_seconds = timeout_seconds
        self.headers = headers

    async def fetch(self) -> EngineMetrics:
        timeout = aiohttp.ClientTimeout(total=self.timeout_seconds)
        headers = dict(self.headers()) if self.headers is not None else None
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session, session.get(self.url, headers=headers) as resp:
                status = resp.status
                text = await resp.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise MetricsUnavailable(f"GET {self.url}: {_describe(exc)}") from exc
        if status != 200:
            raise MetricsUnavailable(f"GET {self.url} answered HTTP {status}")
        try:
            metrics = vllm_metrics.parse(text)
        except ValueError as exc:
            raise MetricsUnavailable(f"{self.url} is not a Prometheus text exposition: {exc}") from exc
        if not metrics.names_seen and not vllm_metrics.exposes_vllm(text):
            raise MetricsUnavailable(f"{self.url} exposes no vllm:* metrics (is it the engine's /metrics?)")
        return metrics


class PromQLSource:
    """Instant queries against a Prometheus server's ``/api/v1/query``.

    ``selector`` is a label matcher put after every metric name, e.g. ``{pod="p"}``
    (or "" for all series).  Several engines behind one selector: counts are summed,
    the KV usage is the fullest cache (as ``vllm_metrics.parse`` does), the capacity
    is the smallest engine's.

    A quantity vLLM renamed is read as ``agg(new or old)``: the set operator picks,
    per series (label sets compared without the metric name), the new name where an
    engine exposes it and the old one elsewhere, and only then aggregates.  The
    former ``agg(new) or agg(old)`` read only the engines on new names as soon as
    one existed -- on a real Prometheus, a selector over engines of two vLLM
    releases saw the newer ones' KV usage (0) and missed a fuller cache on the
    older names (``tests/integration/test_promql_real_prometheus.py``).
    """

    kind = "promql"

    def __init__(self, url: str, selector: str = "", *, timeout_seconds: float = FETCH_TIMEOUT_SECONDS) -> None:
        self.url = url.rstrip("/")
        self.selector = selector
        self.timeout_seconds = timeout_seconds

    def queries(self) -> dict[str, str]:
        """Quantity -> PromQL expression."""
        s = self.selector

        def either(fn: str, suffix: str, quantity: str) -> str:
            return f"{fn}(" + " or ".join(f"{name}{suffix}{s}" for name in vllm_metrics.ALIASES[quantity]) + ")"

        return {
            "kv_usage": either("max", "", "kv_usage"),
            "running": f"sum(vllm:num_requests_running{s})",
            "waiting": f"sum(vllm:num_requests_waiting{s})",
            "waiting_by_model": f"sum by (model_name) (vllm:num_requests_waiting{s})",
            # a counter's samples carry _total under both naming generations
            "preemptions": f"sum(vllm:num_preemptions_total{s})",
            "itl_sum": either("sum", "_sum", "itl"),
            "itl_count": either("sum", "_count", "itl"),
            "ttft_sum": either("sum", "_sum", "ttft"),
            "ttft_count": either("sum", "_count", "ttft"),
            "cache_config": f"max by (num_gpu_blocks, block_size) (vllm:cache_config_info{s})",
        }

    async def fetch(self) -> EngineMetrics:
        queries = self.queries()
        timeout = aiohttp.ClientTimeout(total=self.timeout_seconds)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            answers = await asyncio.gather(
                *(self._query(session, q) for q in queries.values()), return_exceptions=True
            )
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        series: dict[str, list[dict[str, Any]]] = dict(zip(queries, answers, strict=True))  # type: ignore[arg-type]
        if not any(series.values()):
            raise MetricsUnavailable(f"Prometheus at {self.url} has no vllm:* series matching {self.selector or '{}'}")

        def value(quantity: str) -> float | None:
            rows = series[quantity]
            return _sample_value(rows[0]) if rows else None

        def histogram(name: str) -> HistogramTotals | None:
            total, count = value(f"{name}_sum"), value(f"{name}_count")
            return None if total is None or count is None else HistogramTotals(total, count)

        blocks = block = None
        for row in series["cache_config"]:
            labels = row.get("metric") or {}
            b, s = vllm_metrics.int_label(labels, "num_gpu_blocks"), vllm_metrics.int_label(labels, "block_size")
            if b is not None and s is not None and (blocks is None or block is None or b * s < blocks * block):
                blocks, block = b, s
        return EngineMetrics(
            kv_usage=value("kv_usage"),
            running=value("running"),
            waiting=value("waiting"),
            preemptions=value("preemptions"),
            num_gpu_blocks=blocks,
            block_size=block,
            itl=histogram("itl"),
            ttft=histogram("ttft"),
            waiting_by_model=_by_model(series["waiting_by_model"]) if series["waiting_by_model"] else None,
            names_seen=frozenset(q for q, rows in series.items() if rows),
        )

    async def _query(self, session: aiohttp.ClientSession, query: str) -> list[dict[str, Any]]:
        """One instant query; returns the result vector (maybe empty)."""
        url = f"{self.url}/api/v1/query"
        try:
            async with session.get(url, params={"query": query}) as resp:
                status = resp.status
                try:
                    body = await resp.json(content_type=None)
                except ValueError:
                    body = None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise MetricsUnavailable(f"GET {url}: {_describe(exc)}") from exc
        if not isinstance(body, dict):
            raise MetricsUnavailable(f"GET {url} answered HTTP {status} without a Prometheus API reply")
        if body.get("status") != "success":
            raise MetricsUnavailable(f"Prometheus at {self.url} refused a query (HTTP {status}): "
                                     f"{body.get('errorType', '')} {body.get('error', '')}".rstrip())  # fmt: skip
        data = body.get("data") or {}
        if data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
            raise MetricsUnavailable(f"Prometheus at {self.url} did not answer with an instant vector")
        return [row for row in data["result"] if isinstance(row, dict)]


def _by_model(rows: list[dict[str, Any]]) -> dict[str, float]:
    """A ``sum by (model_name)`` vector as model -> value ("" for series without the label)."""
    out: dict[str, float] = {}
    for row in rows:
        model = str((row.get("metric") or {}).get("model_name", ""))
        value = _sample_value(row)
        if value is not None:
            out[model] = out.get(model, 0.0) + value
    return out


def _sample_value(row: dict[str, Any]) -> float | None:
    """The value of one instant-vector row: ``{"value": [ts, "1.5"]}``."""
    pair = row.get("value")
    try:
        return float(pair[1])  # type: ignore[index]
    except (TypeError, ValueError, IndexError):
        raise MetricsUnavailable(f"Prometheus returned a malformed sample: {pair!r}") from None


class MetricsFeed:
    """Polls ``source`` every ``interval`` seconds and calls ``on_snapshot`` (module
    docstring for what it delivers).  ``source``, ``interval`` and ``stale_after`` may
    be replaced while it runs (a config reload)."""

    def __init__(
        self,
        source: MetricsSource | None,
        *,
        interval: float,
        stale_after: float,
        clock: Clock,
        on_snapshot: Callable[[EngineSnapshot | None], None],
    ) -> None:
        self._source = source
        self.interval = interval
        self.stale_after = stale_after
        self.clock = clock
        self.on_snapshot = on_snapshot
        self.last_metrics: EngineMetrics | None = None
        self.last_error = ""
        self._last_success: float | None = None
        self._last_fresh: EngineSnapshot | None = None
        self._failures = 0
        self._last_logged: tuple[str, float] | None = None
        self.own: OwnRequests | None = None  # the dispatcher: engine_waiting moves with its requests
        self._others: dict[str, float] = {}  # others_waiting of the last successful fetch
        self._soon = asyncio.Event()  # scrape_soon: set to scrape before the interval is up

    @property
    def source(self) -> MetricsSource | None:
        return self._source

    @source.setter
    def source(self, source: MetricsSource | None) -> None:
        """A different source starts afresh: no deltas across two engines."""
        old = self._source
        self._source = source
        if (old and (old.kind, old.url)) != (source and (source.kind, source.url)):
            self.last_metrics = self._last_fresh = self._last_success = None
            self.last_error = ""
            self._failures = 0

    @property
    def state(self) -> str:
        """"disabled" (no source), "fresh" (a success at most ``stale_after`` ago) or "stale"."""
        if self._source is None:
            return "disabled"
        age = self.last_success_age()
        return "fresh" if age is not None and age <= self.stale_after else "stale"

    def engine_waiting(self) -> dict[str, float] | None:
        """The engine's own waiting requests by model from the last successful fetch,
        while it is fresh (the engine part of binbatch_requests_waiting); None when
        stale, disabled, or the engine does not expose them."""
        if self.state != "fresh" or self.last_metrics is None:
            return None
        scraped = self.last_metrics.waiting_by_model
        if scraped is None or self.own is None:
            return scraped
        return waiting_now(scraped, self._others, self.own.unstarted_by_model())

    def last_success_age(self) -> float | None:
        """Seconds since the last successful fetch; None if there was none."""
        return None if self._last_success is None else self.clock.now() - self._last_success

    async def poll_once(self) -> EngineSnapshot | None:
        """Fetch once, deliver the snapshot to ``on_snapshot`` and return it."""
        source = self._source
        if source is None:
            self.last_error = ""
            return self._deliver(None)
        own = self.own
        before = (own.unstarted_by_model(), own.sent_by_model()) if own is not None else None
        try:
            current = await source.fetch()
            bad = vllm_metrics.invalid_samples(current)
            if bad:
                raise MetricsUnavailable(f"{source.url} reported non-finite or negative samples "
                                         f"({', '.join(bad)}); the scrape is ignored")  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - any source failure is "no metrics"
            return self._deliver(self._failed(source, exc))
        if self._failures:
            log.info("metrics from %s %s are back after %d failed fetches", source.kind, source.url, self._failures)
        snap = vllm_metrics.snapshot(current, self.last_metrics, fresh=True)
        self.last_metrics, self._last_fresh = current, snap
        if own is not None and before is not None and current.waiting_by_model is not None:
            self._others = others_waiting(current.waiting_by_model, before[0], before[1], own.sent_by_model())
        self._last_success = self.clock.now()
        self.last_error = ""
        self._failures = 0
        self._last_logged = None
        return self._deliver(snap)

    def _failed(self, source: MetricsSource, exc: Exception) -> EngineSnapshot:
        self._failures += 1
        self.last_error = str(exc) if isinstance(exc, MetricsUnavailable) else _describe(exc)
        self._log_failure(f"metrics from {source.kind} {source.url} unavailable: {self.last_error}", exc)
        age = self.last_success_age()
        if age is not None and age <= self.stale_after and self._last_fresh is not None:
            return dataclasses.replace(self._last_fresh, tpot_seconds=None)  # hold
        if self.last_metrics is not None:  # same previous as current: no TPOT
            return vllm_metrics.snapshot(self.last_metrics, self.last_metrics, fresh=False)
        return EngineSnapshot(fresh=False)

    def _deliver(self, snapshot: EngineSnapshot | None) -> EngineSnapshot | None:
        self.on_snapshot(snapshot)
        return snapshot

    def _log_failure(self, message: str, exc: BaseException) -> None:
        """Log a failure when it is new or at most every ERROR_LOG_EVERY_SECONDS."""
        now = self.clock.now()
        last = self._last_logged
        if last is not None and last[0] == message and now - last[1] < ERROR_LOG_EVERY_SECONDS:
            return
        self._last_logged = (message, now)
        if isinstance(exc, MetricsUnavailable):
            log.warning("%s", message)
        else:
            log.warning("%s", message, exc_info=exc)

    def scrape_soon(self) -> None:
        """Scrape before the interval is up (``run``)."""
        self._soon.set()

    async def run(self) -> None:
        """Poll every ``interval`` seconds until cancelled; survives any exception.
        Asked to (``scrape_soon``), it scrapes once between two regular scrapes,
        ``EARLY_GAP_SECONDS`` after the last at the soonest, and the interval counts
        from there: so never more than twice as often as the interval says."""
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        early = False  # the last scrape was an early one
        while True:
            started = loop.time()
            self._soon.clear()
            try:
                await self.poll_once()
            except Exception as exc:  # noqa: BLE001 - the feed must outlive a bad consumer
                self._log_failure(f"metrics poll failed: {_describe(exc)}", exc)
            next_at = max(next_at + self.interval, loop.time())
            if early:
                early = False
                await asyncio.sleep(next_at - loop.time())
                continue
            try:
                await asyncio.wait_for(self._soon.wait(), max(next_at - loop.time(), 0.0))
            except TimeoutError:
                continue  # the interval is up
            await asyncio.sleep(max(started + EARLY_GAP_SECONDS - loop.time(), 0.0))
            next_at = min(next_at, loop.time())
            early = True
