"""The metrics sources over real HTTP on 127.0.0.1 (port 0): PromQLSource against a
scripted Prometheus API, ScrapeSource against a scripted /metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qs

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.sizer import EngineSnapshot
from binbatch_sidecar.engine.metrics_feed import MetricsFeed, MetricsUnavailable, PromQLSource, ScrapeSource
from binbatch_sidecar.engine.vllm_metrics import HistogramTotals


def make_feed(source: Any, clock: ManualClock, stale_after: float = 3.0):
    delivered: list[EngineSnapshot | None] = []
    feed = MetricsFeed(source, interval=1.0, stale_after=stale_after, clock=clock, on_snapshot=delivered.append)
    return feed, delivered


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
    assert q["kv_usage"] == f"max(vllm:kv_cache_usage_perc{sel} or vllm:gpu_cache_usage_perc{sel})"
    assert q["itl_sum"] == (f"sum(vllm:inter_token_latency_seconds_sum{sel} or "
                            f"vllm:time_per_output_token_seconds_sum{sel})")  # fmt: skip
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
    assert (m.num_gpu_blocks, m.block_size, m.kv_capacity_tokens) == (100, 16, 99 * 16)  # less vLLM's null block
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
