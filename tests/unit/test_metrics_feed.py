"""MetricsFeed with a fake source and a manual clock (the sources over HTTP are in
tests/integration/test_metrics_sources.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.sizer import EngineSnapshot
from binbatch_sidecar.engine.metrics_feed import MetricsFeed, MetricsUnavailable
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
    assert first.kv_capacity_tokens == 99 * 16 and first.running == 3 and first.waiting == 1
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
    assert held == EngineSnapshot(kv_capacity_tokens=99 * 16, kv_block_tokens=16, kv_usage_ratio=0.25, running=3, waiting=1,
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


async def test_engine_waiting_is_read_only_while_the_metrics_are_fresh() -> None:
    """The engine part of binbatch_requests_waiting: the last fetch's per-model
    waiting while fresh; None once stale (the gauge then counts the sidecar alone)."""
    clock = ManualClock()
    source = FakeSource(metrics(waiting_by_model={"m": 3.0}), MetricsUnavailable("down"), MetricsUnavailable("down"))
    feed, _ = make_feed(source, clock, stale_after=3.0)
    assert feed.engine_waiting() is None  # nothing fetched yet
    await feed.poll_once()
    assert feed.engine_waiting() == {"m": 3.0}
    clock.advance(2.0)
    await feed.poll_once()  # failed, but the last success is 2 s old: still fresh
    assert feed.engine_waiting() == {"m": 3.0}
    clock.advance(2.0)
    await feed.poll_once()
    assert feed.state == "stale" and feed.engine_waiting() is None


class Own:
    """The dispatcher's side of the engine's waiting figure: scripted counts by model."""

    def __init__(self) -> None:
        self.unstarted: dict[str, int] = {}
        self.sent: dict[str, int] = {}

    def unstarted_by_model(self) -> dict[str, int]:
        return dict(self.unstarted)

    def sent_by_model(self) -> dict[str, int]:
        return dict(self.sent)


class DuringFetch(FakeSource):
    """Runs ``during`` while the fetch is in flight (after the engine rendered its metrics)."""

    def __init__(self, outcome: EngineMetrics, during) -> None:
        super().__init__(outcome)
        self.during = during

    async def fetch(self) -> EngineMetrics:
        out = await super().fetch()
        self.during()
        return out


async def test_the_engines_waiting_drops_in_the_same_step_as_the_sidecars_request_leaves_it() -> None:
    """The flake of test_request_signals_emulator: a scrape taken while the only request waited
    in the engine kept binbatch_requests_waiting at 1 after its answer, until the next scrape."""
    clock = ManualClock()
    feed, _ = make_feed(FakeSource(metrics(waiting_by_model={"m": 1.0})), clock)
    own = feed.own = Own()
    own.unstarted, own.sent = {"m": 1}, {"m": 1}
    await feed.poll_once()
    assert feed.engine_waiting() == {"m": 1.0}
    own.unstarted = {}  # answered (or its first token came): no longer waiting, no new scrape needed
    assert feed.engine_waiting() == {"m": 0.0}


async def test_other_clients_waiting_requests_stay_counted_until_the_next_scrape() -> None:
    clock = ManualClock()
    feed, _ = make_feed(FakeSource(metrics(waiting_by_model={"m": 3.0, "n": 2.0})), clock)
    own = feed.own = Own()
    own.unstarted, own.sent = {"m": 1}, {"m": 1}
    await feed.poll_once()
    own.unstarted = {}
    assert feed.engine_waiting() == {"m": 2.0, "n": 2.0}  # two of m's and both of n's were never the sidecar's
    own.unstarted = {"m": 4}  # sent since the scrape: not counted above what the scrape saw
    assert feed.engine_waiting() == {"m": 3.0, "n": 2.0}


async def test_a_request_sent_or_ended_during_the_fetch_is_taken_as_possibly_the_sidecars() -> None:
    clock = ManualClock()
    own = Own()
    own.unstarted, own.sent = {"m": 1}, {"m": 1}

    def during() -> None:  # one ends, another is sent, while the engine's answer is on its way
        own.unstarted, own.sent = {"m": 1}, {"m": 2}

    feed, _ = make_feed(DuringFetch(metrics(waiting_by_model={"m": 2.0}), during), clock)
    feed.own = own
    await feed.poll_once()
    assert feed.engine_waiting() == {"m": 1.0}  # both scraped waiting could be the sidecar's: one still is
    own.unstarted = {}
    assert feed.engine_waiting() == {"m": 0.0}


async def test_an_engine_gauge_without_model_name_is_matched_against_all_of_the_sidecars_requests() -> None:
    clock = ManualClock()
    feed, _ = make_feed(FakeSource(metrics(waiting_by_model={"": 2.0})), clock)
    own = feed.own = Own()
    own.unstarted, own.sent = {"a": 1, "b": 1}, {"a": 1, "b": 1}
    await feed.poll_once()
    own.unstarted = {"b": 1}
    assert feed.engine_waiting() == {"": 1.0}


async def test_scrape_soon_scrapes_before_the_interval_is_up() -> None:
    """``scrape_soon``: the next scrape comes without waiting out the interval (an
    hour here), and the interval then counts from it."""
    source = FakeSource(metrics(), metrics(), metrics())
    delivered: list[EngineSnapshot | None] = []
    feed = MetricsFeed(source, interval=3600.0, stale_after=7200.0, clock=ManualClock(), on_snapshot=delivered.append)
    task = asyncio.create_task(feed.run())
    try:
        async with asyncio.timeout(10):
            await source.fetched.wait()  # the first scrape, at start
            source.fetched.clear()
            feed.scrape_soon()
            await source.fetched.wait()  # the early one
        assert len(source.outcomes) == 1 and len(delivered) >= 1
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
