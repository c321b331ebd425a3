"""The Admin replies are built from the running parts alone: no process object,
no sockets (``server/replies.py``, served by ``AdminServicer``)."""

from __future__ import annotations

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar.config import LoadedConfig, parse_config
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.engine.dispatcher import Dispatcher
from binbatch_sidecar.engine.metrics_feed import MetricsFeed
from binbatch_sidecar.engine.sidecar_metrics import SidecarMetrics
from binbatch_sidecar.server.assembly import build_core
from binbatch_sidecar.server.replies import Replies
from binbatch_sidecar.server.servicer import AdminServicer


def replies(serving: bool, reload_error: str | None) -> tuple[Replies, LoadedConfig]:
    clock = ManualClock(100.0)
    loaded = LoadedConfig(parse_config({"bins": {"count": 3, "maxOutputTokens": 300}}), sha256="ab", source="f.yaml",
                          generation=4)  # fmt: skip
    dispatcher = Dispatcher(build_core(loaded.config, clock), None, clock, SidecarMetrics())  # type: ignore[arg-type]
    feed = MetricsFeed(None, interval=1.0, stale_after=5.0, clock=clock, on_snapshot=dispatcher.on_snapshot)
    made = Replies(dispatcher, feed, clock, loaded=lambda: loaded, engine_serving=lambda: serving,
                   reload_error=lambda: reload_error, started_at=0.0)  # fmt: skip
    return made, loaded


async def test_stats_follow_the_engine_health_and_the_running_config():
    up, loaded = replies(serving=True, reload_error=None)
    stats = await AdminServicer(up).GetStats(pb.GetStatsRequest(), None)
    assert stats.engine_health == pb.ENGINE_HEALTH_SERVING
    assert stats.config_generation == 4 and len(stats.bins) == 3
    assert stats.bins[-1].upper_tokens == 300.0
    assert stats.metrics_source.state == pb.METRICS_STATE_DISABLED
    down, _ = replies(serving=False, reload_error=None)
    assert down.stats().engine_health == pb.ENGINE_HEALTH_NOT_SERVING


async def test_config_view_shows_the_refused_reload():
    made, loaded = replies(serving=True, reload_error="batch.staticSize: too large")
    view = await AdminServicer(made).GetConfig(pb.GetConfigRequest(), None)
    assert (view.generation, view.sha256, view.source) == (4, "ab", "f.yaml")
    assert view.last_reload_error == "batch.staticSize: too large"
    clean, _ = replies(serving=True, reload_error=None)
    assert clean.config_view().last_reload_error == ""
