"""The sidecar process: wiring of config, core, dispatcher, engine client, metrics
feed, gRPC server and the metrics HTTP endpoint; lifecycle (start, reload, drain).

``Sidecar`` is usable in-process (tests start one on port 0 against the emulator
or a real vLLM); ``serve`` runs it until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from importlib.metadata import PackageNotFoundError, version

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from binbatch_api.v1 import binbatch_pb2 as pb

from ..config import ConfigError, ConfigWatcher, LoadedConfig, SidecarConfig, config_json, restart_required
from ..core.autok import ArrivalWindow, BinCountController
from ..core.binner import AdaptiveBinner, AutoBinner, Binner, FixedBinner
from ..core.clock import Clock, MonotonicClock
from ..core.former import BatchFormer
from ..core.predictor import HintPredictor, LengthPredictor, OnlinePredictor
from ..core.sizer import INITIAL_REASON, BatchSizer
from ..core.smdp_policy import ServiceTimeFit, SmdpCache, SmdpDispatch, SmdpParams, solve_bucket
from ..core.throughput import ThroughputWindow
from ..core.tpot_gate import TpotGate
from ..engine.dispatcher import Adjustment, Core, Dispatcher
from ..engine.engine_client import EngineClient
from ..engine.metrics_feed import NO_SOURCE_KIND, MetricsFeed, PromQLSource, ScrapeSource
from ..engine.sidecar_metrics import SidecarMetrics
from . import logs
from .reflection import enable_reflection
from .servicer import AdminServicer, InferenceServicer, add_servicers

log = logging.getLogger("binbatch.sidecar")

SERVICE_NAMES = ("binbatch.v1.Inference", "binbatch.v1.Admin")
HEALTH_INTERVAL = 1.0


def sidecar_version() -> str:
    try:
        return version("binbatch")
    except PackageNotFoundError:
        return "0+unknown"


def build_binner(cfg: SidecarConfig, k: int | None = None) -> Binner:
    """The binner for ``cfg``, with ``k`` bins instead of ``bins.count`` (countMode Auto)."""
    b = cfg.bins
    k = b.count if k is None else k
    if b.mode == "Fixed":
        if b.boundaries:
            return FixedBinner(b.boundaries)
        return FixedBinner.uniform(k, 1, b.max_output_tokens)
    if b.mode == "Auto":
        return AutoBinner(
            k, FixedBinner.uniform(k, 1, b.max_output_tokens).boundaries,
            window=b.auto_window, min_samples=min(256, b.auto_window), refresh_every=b.auto_refresh_every,
        )  # fmt: skip
    n_max = b.max_requests_per_bin or cfg.batch.static_size  # 0: from KV memory once metrics arrive
    return AdaptiveBinner(1, b.max_output_tokens, n_max, theta=b.split_threshold_percent / 100, max_buckets=b.count)


def build_predictor(cfg: SidecarConfig) -> LengthPredictor:
    hint = HintPredictor(cfg.predictor.default_output_tokens)
    return hint if cfg.predictor.kind == "Hint" else OnlinePredictor(fallback=hint)


def build_core(
    cfg: SidecarConfig, clock: Clock, previous: Core | None = None, k: int | None = None,
    policy: SmdpDispatch | None = None,
) -> Core:  # fmt: skip
    """The scheduling core for ``cfg`` (with ``k`` bins: countMode Auto); what an
    online predictor learned is kept (with the new ``predictor.defaultOutputTokens``)."""
    bt = cfg.batch
    sizer = BatchSizer(
        mode=bt.sizing.lower(),  # type: ignore[arg-type]
        static_size=bt.static_size,
        min_size=bt.min_batch_size,
        max_size=bt.max_batch_size,
        eps_m=cfg.eps_m,
        kv_reserve_ratio=cfg.kv_reserve_ratio,
        kv_saturation=cfg.kv_saturation,
        d_sla=cfg.tpot_seconds,
        eps_d=None if cfg.tpot_seconds is None else cfg.tpot_seconds * cfg.eps_d,
    )
    binner = build_binner(cfg, k)
    former = BatchFormer(
        binner, clock, target_size=bt.static_size, max_wait=cfg.max_wait_seconds, max_queue=bt.max_queued_requests,
        gate=TpotGate(cfg.tpot_seconds), policy=policy,
    )  # fmt: skip
    predictor = build_predictor(cfg)
    learned = previous.predictor if previous is not None else None
    if isinstance(predictor, OnlinePredictor) and isinstance(learned, OnlinePredictor):
        learned.fallback = predictor.fallback
        predictor = learned
    return Core(predictor=predictor, binner=binner, former=former, sizer=sizer)


def build_bin_count(cfg: SidecarConfig, previous: BinCountController | None = None) -> BinCountController | None:
    """The k controller of ``bins.countMode: Auto`` (None: Fixed); a reload keeps the k chosen."""
    b = cfg.bins
    if b.count_mode != "Auto":
        return None
    k = b.count if previous is None else min(previous.k, b.count)
    return BinCountController(k, b.count, b.latency_target_milliseconds / 1000)


def build_smdp(cfg: SidecarConfig, previous: SmdpDispatch | None = None) -> SmdpDispatch | None:
    """The dispatch policy of ``batch.dispatch: Smdp`` (None: MaxWait); a reload with
    the same weight keeps the solutions cached."""
    if cfg.batch.dispatch != "Smdp":
        return None
    params = SmdpParams(w2=float(cfg.batch.smdp_engine_weight))
    if previous is not None and previous.cache.params == params:
        return previous
    return SmdpDispatch(SmdpCache(params))


def _mode(cfg: SidecarConfig):
    return "gang" if cfg.batch.mode == "Gang" else "continuous"


class Sidecar:
    """One sidecar.  ``await start()``, then ``grpc_port``/``metrics_port``; ``await stop()``."""

    def __init__(
        self,
        loaded: LoadedConfig,
        *,
        config_path: str | None = None,
        clock: Clock | None = None,
        host: str = "127.0.0.1",
        grpc_port: int | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.loaded = loaded
        self.config_path = config_path
        self.clock = clock or MonotonicClock()
        self.host = host
        self._grpc_port_req = loaded.config.server.grpc_port if grpc_port is None else grpc_port
        self._metrics_port_req = loaded.config.server.metrics_port if metrics_port is None else metrics_port
        self.metrics = SidecarMetrics()
        self.started_at = time.monotonic()
        self.throughput = ThroughputWindow(self.clock.now())  # fed by the servicer per completion
        self.service_fit = ServiceTimeFit()  # gang batches' l(b) = αb + β, for Smdp dispatch
        self.arrivals = ArrivalWindow()  # λ, sampled per metrics snapshot, for Smdp dispatch
        self._smdp_wanted = asyncio.Event()
        self.smdp_solved = asyncio.Event()  # set after each background solve (tests await it)
        self.engine_serving = False
        self._models: list[str] = []
        self._tasks: list[asyncio.Task] = []
        self.grpc_port = 0
        self.metrics_port = 0
        self._retiring: set[EngineClient] = set()  # replaced by a reload, closed once their calls end
        self._background: set[asyncio.Task] = set()

    @property
    def config(self) -> SidecarConfig:
        return self.loaded.config

    def default_model(self) -> str:
        if self.config.engine.model:
            return self.config.engine.model
        return self._models[0] if len(self._models) == 1 else ""

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        self.client = EngineClient(cfg.engine.url, timeout_seconds=cfg.engine.request_timeout_seconds,
                                   max_body_bytes=cfg.engine.max_request_body_bytes)  # fmt: skip
        self.bin_count = build_bin_count(cfg)
        self.smdp = build_smdp(cfg)
        self.dispatcher = Dispatcher(
            build_core(cfg, self.clock, k=self.bin_count and self.bin_count.k, policy=self.smdp), self.client, self.clock, self.metrics,
            mode=_mode(cfg), max_inflight_batches=cfg.batch.max_inflight_batches,
            engine_timeout=cfg.engine.request_timeout_seconds, wall_time=time.time,
        )  # fmt: skip
        self.feed = MetricsFeed(
            self._metrics_source(cfg), interval=cfg.scrape_interval_seconds, stale_after=cfg.stale_after_seconds,
            clock=self.clock, on_snapshot=self._on_snapshot,
        )  # fmt: skip
        self.watcher = (
            ConfigWatcher(self.config_path, initial=self.loaded, on_change=self._apply,
                          poll_seconds=cfg.server.config_poll_milliseconds / 1000)  # fmt: skip
            if self.config_path
            else None
        )
        self.health = health.aio.HealthServicer()
        self.server = grpc.aio.server()
        add_servicers(self.server, InferenceServicer(self), AdminServicer(self))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection(self.server, (*SERVICE_NAMES, health.SERVICE_NAME), (health_pb2.DESCRIPTOR,))
        self.grpc_port = self.server.add_insecure_port(f"{self.host}:{self._grpc_port_req}")
        await self._set_health(False)
        await self.server.start()
        self._runner = web.AppRunner(self._metrics_app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self._metrics_port_req)
        await site.start()
        self.metrics_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.metrics.config_generation.set(self.loaded.generation)
        await self._check_engine()
        loops = (self.dispatcher.run(), self.feed.run(), self._health_loop(), self._solve_smdp())
        self._tasks = [asyncio.create_task(t) for t in loops]
        if self.watcher:
            self._tasks.append(asyncio.create_task(self._watch()))
        log.info("sidecar serving gRPC on %s:%d, metrics on :%d, engine %s, mode %s",
                 self.host, self.grpc_port, self.metrics_port, cfg.engine.url, _mode(cfg))  # fmt: skip

    async def stop(self, grace: float | None = None) -> int:
        """Stop intake, drain within ``grace`` seconds, then shut everything down.
        Returns the number of requests answered UNAVAILABLE because time ran out."""
        grace = self.config.server.drain_grace_seconds if grace is None else grace
        await self.health.enter_graceful_shutdown()
        cut = await self.dispatcher.drain(grace)
        await self.server.stop(1.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._runner.cleanup()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for old in list(self._retiring):
            await old.close()
        await self.client.close()
        log.info("sidecar stopped (%d requests cut off by the grace period)", cut)
        return cut

    # -- background work ------------------------------------------------------------------

    def _metrics_source(self, cfg: SidecarConfig):
        m = cfg.metrics
        if m.source == "Scrape":
            return ScrapeSource(m.url)
        if m.source == "PromQL":
            return PromQLSource(m.url, m.promql_selector)
        return None

    def _on_snapshot(self, snapshot) -> None:
        self.metrics.metrics_fresh.set(1 if snapshot is not None and snapshot.fresh else 0)
        self._choose_bin_count(snapshot)
        self._update_smdp()
        gate = self.dispatcher.core.former.gate
        if gate is not None:  # before on_snapshot, whose wake lets held requests go
            gate.observe(snapshot.tpot_seconds if snapshot else None, fresh=snapshot is not None and snapshot.fresh)
        self.dispatcher.on_snapshot(snapshot)

    def _choose_bin_count(self, snapshot) -> None:
        """countMode Auto: re-choose k from the arrival rate; a new k rebuilds the
        core (the queue moves over) and is recorded as a "binCount" adjustment."""
        ctl = self.bin_count
        if ctl is None:
            return
        cfg, d = self.config, self.dispatcher
        fresh_tpot = snapshot.tpot_seconds if snapshot is not None and snapshot.fresh else None
        decision = ctl.on_snapshot(
            self.clock.now(), d.totals["accepted"], fresh_tpot or cfg.tpot_seconds,
            batch=max(d.core.former.target_sizes), lmin=1.0, lmax=float(cfg.bins.max_output_tokens),
        )  # fmt: skip
        if decision is None:
            return
        d.replace_core(
            build_core(cfg, self.clock, previous=d.core, k=decision.new, policy=self.smdp), mode=_mode(cfg),
            max_inflight_batches=cfg.batch.max_inflight_batches, engine_timeout=cfg.engine.request_timeout_seconds,
        )  # fmt: skip
        why = f"{decision.reason}: {decision.detail}"
        d.adjustments.append(Adjustment(time.time(), "binCount", str(decision.old), str(decision.new), why))
        log.info("adjusted binCount: %d -> %d (%s)", decision.old, decision.new, why)  # rare: hysteresis
        self.metrics.bin_count_changes.labels(decision.reason).inc()

    def on_completion(self, engine_seconds: float, batch_size: int, output_tokens: int) -> None:
        """A request was answered (the servicer calls this): feeds Stats.throughput
        and, in gang mode, the batch-time fit of Smdp dispatch."""
        self.throughput.completed(self.clock.now(), output_tokens)
        if self.dispatcher.mode == "gang":
            self.service_fit.observe(batch_size, engine_seconds)

    def _update_smdp(self) -> None:
        """Smdp dispatch: point the policy at the bucket of the current load; a
        bucket never solved wakes the background solver."""
        rate = self.arrivals.sample(self.clock.now(), self.dispatcher.totals["accepted"])
        if self.smdp is None:
            return
        former = self.dispatcher.core.former
        self.smdp.update(rate, former.k, self.service_fit.fit(), max(former.target_sizes))
        self._update_smdp_gauge()
        if self.smdp.cache.wanted():
            self._smdp_wanted.set()

    async def _solve_smdp(self) -> None:
        """Solve the SMDP for each wanted bucket in a worker thread (a solve takes
        tens to hundreds of milliseconds of CPU: never on the event loop)."""
        while True:
            await self._smdp_wanted.wait()
            self._smdp_wanted.clear()
            policy = self.smdp
            if policy is None:
                continue
            for key in policy.cache.wanted():
                try:
                    limit = await asyncio.to_thread(solve_bucket, key, policy.cache.params)
                except Exception:  # noqa: BLE001 - a failed solve leaves maxWait in charge
                    log.exception("SMDP solve failed for bucket %s", key)
                    limit = None
                policy.cache.put(key, limit)
                self.smdp_solved.set()
                log.info("SMDP control limit for bucket %s: %s", key, limit)
            self._update_smdp_gauge()

    def _update_smdp_gauge(self) -> None:
        threshold = self.smdp.threshold if self.smdp is not None else None
        self.metrics.smdp_control_limit.set(-1 if threshold is None else threshold)

    async def _check_engine(self) -> None:
        ok = await self.client.health(self.config.engine.health_path)
        if ok and not self._models:
            with contextlib.suppress(Exception):
                self._models = await self.client.models()
        await self._set_health(ok)
        self.dispatcher.on_engine_health(ok)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL)
            if self.dispatcher.accepting:
                await self._check_engine()

    async def _set_health(self, serving: bool) -> None:
        """Readiness follows the engine's health (DESIGN §2 Lifecycle)."""
        self.engine_serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, status)

    async def _watch(self) -> None:
        assert self.watcher is not None
        refused: str | None = None
        while True:
            await asyncio.sleep(self.watcher.poll_seconds)
            try:
                changed = await self.watcher.check()
            except Exception:  # noqa: BLE001 - a reload must never take the sidecar down
                log.exception("config check failed")
                continue
            error = self.watcher.last_error
            if not changed and error and error != refused:
                self.metrics.config_reload_errors.inc()  # once per refused file, not per poll
            refused = error

    async def _apply(self, loaded: LoadedConfig) -> None:
        """A new valid config file: apply every key live, or refuse the whole file.

        Keys bound at start-up (``RESTART_KEYS``: the ports) cannot change live;
        a file changing one is refused (raises, so the watcher keeps the running
        config and reports the error in GetConfig). Everything else takes effect
        here: the core and feed are rebuilt (the queue is kept), a new engine URL
        or timeout gets a new engine client for new dispatches, the log level and
        the poll interval are set; the rest is read from ``self.config`` at use.
        The watcher logs the applied generation (once).
        """
        cfg, running = loaded.config, self.config
        refused = restart_required(running, cfg)
        if refused:
            raise ConfigError(refused)
        self.bin_count = build_bin_count(cfg, self.bin_count)
        self.smdp = build_smdp(cfg, self.smdp)
        core = build_core(cfg, self.clock, previous=self.dispatcher.core, k=self.bin_count and self.bin_count.k,
                          policy=self.smdp)  # fmt: skip
        self.dispatcher.replace_core(
            core, mode=_mode(cfg), max_inflight_batches=cfg.batch.max_inflight_batches,
            engine_timeout=cfg.engine.request_timeout_seconds,
        )  # fmt: skip
        if (cfg.engine.url, cfg.engine.request_timeout_seconds) != (running.engine.url, running.engine.request_timeout_seconds):  # fmt: skip
            await self._swap_client(cfg, new_engine=cfg.engine.url != running.engine.url)
        self.client.max_body_bytes = cfg.engine.max_request_body_bytes  # read per call: applies live
        self.feed.source = self._metrics_source(cfg)
        self.feed.interval = cfg.scrape_interval_seconds
        self.feed.stale_after = cfg.stale_after_seconds
        if self.watcher is not None:
            self.watcher.poll_seconds = cfg.server.config_poll_milliseconds / 1000
        if cfg.logging.level != running.logging.level:
            logs.set_level(cfg.logging.level)
        self.loaded = loaded
        self.metrics.config_generation.set(loaded.generation)
        if cfg.engine.url != running.engine.url:
            await self._check_engine()

    async def _swap_client(self, cfg: SidecarConfig, *, new_engine: bool) -> None:
        """New dispatches use a client for the new engine; calls already running
        finish on the old one, which is closed once they are done.  For a new
        engine its served models are asked for before the swap, so requests that
        name no model never find the default missing meanwhile."""
        old = self.client
        client = EngineClient(cfg.engine.url, timeout_seconds=cfg.engine.request_timeout_seconds,
                              max_body_bytes=cfg.engine.max_request_body_bytes)  # fmt: skip
        if new_engine:
            models: list[str] = []
            with contextlib.suppress(Exception):  # down: learned at its first good health check
                models = await client.models()
            self._models = models
        self.client = client
        running = self.dispatcher.replace_client(self.client)
        self._retiring.add(old)
        task = asyncio.create_task(self._retire(old, running))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _retire(self, old: EngineClient, running: list[asyncio.Task]) -> None:
        try:
            await asyncio.gather(*running, return_exceptions=True)
        finally:
            self._retiring.discard(old)
            await old.close()

    # -- views ------------------------------------------------------------------------------

    def _metrics_app(self) -> web.Application:
        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

        async def healthz(_: web.Request) -> web.Response:
            return web.Response(text="ok" if self.engine_serving else "engine not serving",
                                status=200 if self.engine_serving else 503)  # fmt: skip

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/healthz", healthz)
        return app

    def stats(self) -> pb.Stats:
        d = self.dispatcher
        core = d.core
        former = core.former
        decision = d.last_decision
        counts = d.totals
        bounds = list(core.binner.boundaries)
        edges = [0.0, *bounds, float(self.config.bins.max_output_tokens)]
        oldest = former.oldest_arrivals()
        now = self.clock.now()
        rates = self.throughput.rates(now)
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
            engine_health=pb.ENGINE_HEALTH_SERVING if self.engine_serving else pb.ENGINE_HEALTH_NOT_SERVING,
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
                    )
                    for src in core.accuracy.sources()
                ],
            ),  # fmt: skip
            throughput=pb.Throughput(window_seconds=rates.window_seconds, requests_per_second=rates.requests_per_second,
                                     output_tokens_per_second=rates.output_tokens_per_second),  # fmt: skip
            metrics_source=self._source_status(),
            recent_adjustments=[
                pb.Adjustment(time_unix_seconds=a.time, field=a.field, from_value=a.old, to_value=a.new, reason=a.reason)
                for a in d.adjustments
            ],
            config_generation=self.loaded.generation,
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

    def _source_status(self) -> pb.MetricsSourceStatus:
        feed = self.feed
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

    def config_view(self) -> pb.ConfigView:
        lc = self.loaded
        return pb.ConfigView(
            config_json=config_json(lc.config), generation=lc.generation, sha256=lc.sha256,
            loaded_at_unix_seconds=lc.loaded_at, source=lc.source,
            last_reload_error=(self.watcher.last_error or "") if self.watcher else "",
        )  # fmt: skip


async def serve(loaded: LoadedConfig, config_path: str | None, host: str,
                grpc_port: int | None, metrics_port: int | None) -> int:  # fmt: skip
    """Run a sidecar until SIGTERM or SIGINT, then drain and exit."""
    sidecar = Sidecar(loaded, config_path=config_path, host=host, grpc_port=grpc_port, metrics_port=metrics_port)
    await sidecar.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received: draining")
    cut = await sidecar.stop()
    return 0 if cut == 0 else 1
