"""MetricsFeed with a fake source and a manual clock; PromQLSource against a scripted
Prometheus API on 127.0.0.1 (port 0)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.sizer import EngineSnapshot
from binbatch_sidecar.engine.metrics_feed import MetricsFeed, MetricsUnavailable, PromQLSource, ScrapeSource
from binbatch_sidecar.engine.vllm_metrics import EngineMetrics, HistogramTotals


class FakeSource:
    """Returns (or raises) the scripted outcomes in order."""

    kind = "scrape"
    url = "http://engine/metrics"

    def __init__(self, *outcomes: EngineMetrics | Exception) -> None:
        self.outcomes = list(outcomes)
        self.fetched = asyncio.Event()

    def push(self, *outcomes: EngineMetrics | Exception) -> None:
        self.outcomes.extend(outcomes)

    async def fetch(self) -> EngineMetrics:
        self.fetched.set()
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def metrics(itl_sum: float = 0.0, itl_count: float = 0.0, **kw: Any) -> EngineMetrics:
    base: dict[str, Any] = {"kv_usage": 0.25, "running": 3.0, "waiting": 1.0, "num_gpu_blocks": 100, "block_size": 16}
    return EngineMetrics(**(base | kw), itl=HistogramTotals(itl_sum, itl_count), names_seen=frozenset({"vllm:x"}))


def make_feed(source: FakeSource | None, clock: ManualClock, stale_after: float = 3.0):
    delivered: list[EngineSnapshot | None] = []
    feed = MetricsFeed(source, interval=1.0, stale_after=stale_after, clock=clock, on_snapshot=delivered.append)
    return feed, delivered


async def test_success_is_fresh_and_histogram_deltas_feed_tpot() -> None:
    clock = ManualClock()
    source = FakeSource(metrics(itl_sum=10.0, itl_count=100), metrics(itl_sum=12.0, itl_count=140))
    feed, delivered = make_feed(source, clock)
    first = await feed.poll_once()
    assert first is not None and first.fresh and first.tpot_seconds is None  # no earlier fetch: no delta
    assert first.kv_capacity_tokens == 1600 and first.running == 3 and first.waiting == 1
    clock.advance(1)
    second = await feed.poll_once()
    assert second is not None and second.tpot_seconds == pytest.approx(2.0 / 40)  # the interval, not lifetime
    assert delivered == [first, second]
    assert feed.state == "fresh" and feed.last_error == "" and feed.last_success_age() == 0
    assert feed.last_metrics == metrics(itl_sum=12.0, itl_count=140)


async def test_failures_hold_until_stale_after_then_go_stale_and_recover() -> None:
    clock = ManualClock()
    source = FakeSource(metrics(1.0, 10), *[MetricsUnavailable("GET x answered HTTP 503")] * 3)
    feed, delivered = make_feed(source, clock, stale_after=3.0)
    fresh = await feed.poll_once()
    clock.advance(3.0)
    held = await feed.poll_once()  # 3 s old: still within stale_after
    assert held == EngineSnapshot(kv_capacity_tokens=1600, kv_usage_ratio=0.25, running=3, waiting=1,
                                  tpot_seconds=None, fresh=True)  # fmt: skip
    assert fresh is not None and held is not None and held.kv_capacity_tokens == fresh.kv_capacity_tokens
    assert feed.state == "fresh" and feed.last_error == "GET x answered HTTP 503"
    clock.advance(0.5)
    stale = await feed.poll_once()
    assert stale is not None and not stale.fresh and stale.tpot_seconds is None
    assert feed.state == "stale" and feed.last_success_age() == 3.5
    clock.advance(1)
    stale_again = await feed.poll_once()
    assert stale_again is not None and not stale_again.fresh
    # recovery: fresh at once, and the delta spans the outage
    source.push(metrics(3.0, 20))
    clock.advance(1)
    back = await feed.poll_once()
    assert back is not None and back.fresh and back.tpot_seconds == pytest.approx(0.2)
    assert feed.state == "fresh" and feed.last_error == ""
    assert len(delivered) == 5


async def test_failure_before_any_success_is_stale_at_once() -> None:
    feed, delivered = make_feed(FakeSource(ConnectionRefusedError("refused")), ManualClock())
    assert feed.state == "stale" and feed.last_success_age() is None
    snap = await feed.poll_once()
    assert snap == EngineSnapshot(fresh=False) and delivered == [snap]
    assert feed.last_error == "ConnectionRefusedError: refused"


async def test_no_source_delivers_none_and_is_disabled() -> None:
    feed, delivered = make_feed(None, ManualClock())
    assert await feed.poll_once() is None
    assert delivered == [None] and feed.state == "disabled"


async def test_switching_source_drops_the_previous_engines_totals() -> None:
    clock = ManualClock()
    feed, _ = make_feed(FakeSource(metrics(10.0, 100)), clock)
    await feed.poll_once()
    other = FakeSource(metrics(12.0, 140))
    other.url = "http://other/metrics"
    feed.source = other
    assert feed.state == "stale" and feed.last_metrics is None
    snap = await feed.poll_once()
    assert snap is not None and snap.fresh and snap.tpot_seconds is None  # no delta across engines


async def test_run_survives_exceptions_from_the_source_and_the_consumer() -> None:
    clock = ManualClock()
    got_fresh = asyncio.Event()
    calls = 0

    def on_snapshot(snap: EngineSnapshot | None) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("consumer bug")
        if snap is not None and snap.fresh and calls > 2:
            got_fresh.set()

    source = FakeSource(RuntimeError("source bug"), metrics(), metrics())
    feed = MetricsFeed(source, interval=0.001, stale_after=1.0, clock=clock, on_snapshot=on_snapshot)
    task = asyncio.create_task(feed.run())
    try:
        await got_fresh.wait()  # 1: source raised, 2: consumer raised, 3: fresh again
        assert not task.done()
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert calls == 3 and feed.state == "fresh"


# ----------------------------------------------------------------------- PromQL


class Prometheus:
    """Answers /api/v1/query from a table: query text -> result vector."""

    def __init__(self, answers: dict[str, list[dict[str, Any]]]) -> None:
        self.answers = answers
        self.queries: list[str] = []
        self.fail_with: tuple[int, dict[str, Any]] | None = None
        app = web.Application()
        app.router.add_get("/api/v1/query", self.query)
        self.server = TestServer(app, host="127.0.0.1", port=0)

    async def query(self, request: web.Request) -> web.Response:
        q = parse_qs(request.query_string)["query"][0]
        self.queries.append(q)
        if self.fail_with:
            return web.json_response(self.fail_with[1], status=self.fail_with[0])
        result = self.answers.get(q, [])
        return web.json_response({"status": "success", "data": {"resultType": "vector", "result": result}})


def vec(value: float, **labels: str) -> list[dict[str, Any]]:
    return [{"metric": labels, "value": [1700000000.0, str(value)]}]


@pytest.fixture
async def prometheus() -> AsyncIterator[Prometheus]:
    prom = Prometheus({})
    await prom.server.start_server()
    try:
        yield prom
    finally:
        await prom.server.close()


async def test_promql_source_builds_engine_metrics(prometheus: Prometheus) -> None:
    sel = '{pod="p"}'
    source = PromQLSource(str(prometheus.server.make_url("/")), sel)
    q = source.queries()
    assert q["kv_usage"] == f"max(vllm:kv_cache_usage_perc{sel}) or max(vllm:gpu_cache_usage_perc{sel})"
    assert q["itl_sum"] == (f"sum(vllm:inter_token_latency_seconds_sum{sel}) or "
                            f"sum(vllm:time_per_output_token_seconds_sum{sel})")  # fmt: skip
    assert q["cache_config"] == f"max by (num_gpu_blocks, block_size) (vllm:cache_config_info{sel})"
    prometheus.answers = {
        q["kv_usage"]: vec(0.4),
        q["running"]: vec(5),
        q["waiting"]: vec(2),
        q["preemptions"]: vec(7),
        q["itl_sum"]: vec(3.0),
        q["itl_count"]: vec(60),
        q["cache_config"]: vec(1, num_gpu_blocks="200", block_size="16")
        + vec(1, num_gpu_blocks="100", block_size="16"),  # two engines: the smaller one speaks
    }
    m = await source.fetch()
    assert (m.kv_usage, m.running, m.waiting, m.preemptions) == (0.4, 5, 2, 7)
    assert m.itl == HistogramTotals(3.0, 60) and m.ttft is None
    assert (m.num_gpu_blocks, m.block_size, m.kv_capacity_tokens) == (100, 16, 1600)
    assert sorted(prometheus.queries) == sorted(q.values())
    # and through the feed: two fetches give the TPOT of the interval
    clock = ManualClock()
    feed, _ = make_feed(None, clock)
    feed.source = source
    await feed.poll_once()
    prometheus.answers[q["itl_sum"]] = vec(4.0)
    prometheus.answers[q["itl_count"]] = vec(80)
    snap = await feed.poll_once()
    assert snap is not None and snap.fresh and snap.tpot_seconds == pytest.approx(0.05)


async def test_promql_source_failures_are_metrics_unavailable(prometheus: Prometheus) -> None:
    source = PromQLSource(str(prometheus.server.make_url("/")), "")
    with pytest.raises(MetricsUnavailable, match="no vllm:\\* series"):
        await source.fetch()  # every query empty
    prometheus.fail_with = (400, {"status": "error", "errorType": "bad_data", "error": "parse error"})
    with pytest.raises(MetricsUnavailable, match="bad_data parse error"):
        await source.fetch()


# -------------------------------------------------------------- non-finite samples

EXPOSITION = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="m"}} 0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{model_name="m"}} {kv}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{num_gpu_blocks="100",block_size="16"}} 1
"""


@pytest.mark.parametrize(
    ("running", "kv", "culprit"),
    [("NaN", "0.5", "running=nan"), ("2", "+Inf", "kv_usage=inf"), ("-1", "0.5", "running=-1.0")],
)
async def test_non_finite_engine_samples_are_a_failed_scrape_with_the_reason(running: str, kv: str,
                                                                              culprit: str) -> None:  # fmt: skip
    """Defect 9: NaN/Inf in /metrics raised outside the fetch error handling
    (``int(NaN)``), froze the size and left ``last_error`` empty."""
    served = {"text": EXPOSITION.format(running="3", kv="0.25")}

    async def handler(_: web.Request) -> web.Response:
        return web.Response(text=served["text"])

    app = web.Application()
    app.router.add_get("/metrics", handler)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        clock = ManualClock()
        feed, delivered = make_feed(None, clock, stale_after=3.0)
        feed.source = ScrapeSource(str(server.make_url("/metrics")))
        good = await feed.poll_once()
        assert good is not None and good.fresh and good.running == 3
        served["text"] = EXPOSITION.format(running=running, kv=kv)
        clock.advance(4.0)  # past stale_after: the bad scrape makes the snapshot stale
        bad = await feed.poll_once()
        assert bad is not None and not bad.fresh and bad.running == 3  # the last good values, not NaN
        assert feed.state == "stale"
        assert "non-finite" in feed.last_error and culprit in feed.last_error
        served["text"] = EXPOSITION.format(running="5", kv="0.5")
        back = await feed.poll_once()
        assert back is not None and back.fresh and back.running == 5 and feed.last_error == ""
        assert len(delivered) == 3
    finally:
        await server.close()
