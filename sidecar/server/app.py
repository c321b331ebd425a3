"""The sidecar process's lifecycle: start (wire the dispatcher, engine client,
metrics feed, gRPC server, OpenAI-compatible HTTP door and metrics endpoint),
the engine health loop, reload (apply a new config live), drain and stop.

What it wires lives beside it: ``assembly`` turns a config into the scheduling
core, ``servicer`` holds the gRPC servicers (given only the collaborators they
call), ``openai_http`` the HTTP door (sharing the servicer's ``front``: one
scheduler, two doors), ``replies`` builds the Admin replies, ``metrics_endpoint``
the HTTP ``/metrics`` and ``/healthz``, ``config_watcher`` the reload by file content.

``Sidecar`` is usable in-process (tests start one on port 0 against the emulator
or a real vLLM); ``serve`` runs it until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2

from ..config import ConfigError, LoadedConfig, SidecarConfig, redact_urls, restart_required
from ..core.autok import ArrivalWindow
from ..core.clock import Clock, MonotonicClock
from ..core.length_model import load_fit_libraries
from ..core.smdp_policy import ServiceTimeFit, load_service_time_library, solve_bucket
from ..core.throughput import ThroughputWindow
from ..engine.dispatcher import Adjustment, Dispatcher
from ..engine.engine_client import EngineClient, EngineError
from ..engine.engine_key import EngineKey
from ..engine.external_predictor import ExternalPredictor
from ..engine.metrics_feed import MetricsFeed
from ..engine.sidecar_metrics import SidecarMetrics
from . import logs, ports
from .assembly import (
    build_bin_count,
    build_core,
    build_smdp,
    dispatch_mode,
    learned_of,
    metrics_source,
    model_file_changed,
    model_stamp,
)
from .caller_auth import ADMIN_FIELD, AdminGate, CallerAuth, CallerTokens, warn_unlisted
from .config_watcher import ConfigWatcher
from .connection_limits import cap_connections, grpc_server_options, http_runner_options
from .metrics_endpoint import metrics_app
from .openai_http import OpenAIDoor
from .reflection import enable_reflection
from .replies import Replies
from .servicer import AdminServicer, InferenceServicer, add_health, add_servicers

log = logging.getLogger("binbatch.sidecar")

SERVICE_NAMES = ("binbatch.v1.Inference", "binbatch.v1.Admin")
HEALTH_INTERVAL = 1.0


class Sidecar:
    """One sidecar.  ``await start()``, then ``grpc_port``/``http_port``/``metrics_port``; ``await stop()``.

    ``take_over_port``: the HTTP door listens there too (the operator's port
    take-over gives it vLLM's own serving port, while ``http_port`` stays the
    port the policy's Service targets).
    """

    def __init__(
        self,
        loaded: LoadedConfig,
        *,
        config_path: str | None = None,
        clock: Clock | None = None,
        host: str = "127.0.0.1",
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        http_port: int | None = None,
        take_over_port: int | None = None,
    ) -> None:
        self.loaded = loaded
        self.config_path = config_path
        self.clock = clock or MonotonicClock()
        self.host = host
        self._grpc_port_req = loaded.config.server.grpc_port if grpc_port is None else grpc_port
        self._metrics_port_req = loaded.config.server.metrics_port if metrics_port is None else metrics_port
        self._http_port_req = loaded.config.server.http_port if http_port is None else http_port
        self._take_over_port_req = take_over_port
        self._port_settings = (  # named in a ListenError
            ports.setting_name("server.grpcPort", "--grpc-port", "BINBATCH_GRPC_PORT", grpc_port is not None),
            ports.setting_name("server.metricsPort", "--metrics-port", "BINBATCH_METRICS_PORT", metrics_port is not None),
            ports.setting_name("server.httpPort", "--http-port", "BINBATCH_HTTP_PORT", http_port is not None),
        )  # fmt: skip
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
        self.http_port = 0
        self.take_over_port: int | None = None
        self._retiring: set[EngineClient] = set()  # replaced by a reload, closed once their calls end
        self.engine_key = EngineKey()  # engine.apiKeyFile's key, shared by every engine client and the scrape
        self._warned_unauthorized = False
        self.key_changed = asyncio.Event()  # set when the key loop picked up a rotated key file (tests await it)
        self.caller_tokens = CallerTokens()  # auth.callerTokensDir's tokens, re-read by the key loop too
        self.admin_token = EngineKey(field=ADMIN_FIELD)  # auth.adminTokenFile's token, likewise
        self.auth_changed = asyncio.Event()  # set when the key loop picked up rotated caller or admin tokens
        self._background: set[asyncio.Task] = set()

    @property
    def config(self) -> SidecarConfig:
        return self.loaded.config

    def ready(self) -> bool:
        """Serving: the engine answers its health check and no drain has begun."""
        return self.engine_serving and self.dispatcher.accepting

    def default_model(self) -> str:
        if self.config.engine.model:
            return self.config.engine.model
        return self._models[0] if len(self._models) == 1 else ""

    # -- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        self.bin_count = build_bin_count(cfg)
        self.smdp = build_smdp(cfg)
        # first: a config it cannot apply (a predictor.warmStart that is no model, an engine.apiKeyFile that
        # cannot be read) raises ConfigError before anything opens
        core = build_core(cfg, self.clock, k=self.bin_count and self.bin_count.k, policy=self.smdp)
        self.engine_key.load(cfg.engine.api_key_file)
        self.caller_tokens.load(cfg.auth.caller_tokens_dir)
        self.admin_token.load(cfg.auth.admin_token_file)
        warn_unlisted(cfg, self.caller_tokens)
        self.client = EngineClient(cfg.engine.url, timeout_seconds=cfg.engine.request_timeout_seconds,
                                   max_body_bytes=cfg.engine.max_request_body_bytes, api_key=self.engine_key)  # fmt: skip
        self.dispatcher = Dispatcher(
            core, self.client, self.clock, self.metrics,
            mode=dispatch_mode(cfg), max_inflight_batches=cfg.batch.max_inflight_batches,
            engine_timeout=cfg.engine.request_timeout_seconds, wall_time=time.time,
        )  # fmt: skip
        self.external = ExternalPredictor(lambda: self.config.predictor.external, self.clock, self.metrics)
        self.feed = MetricsFeed(
            metrics_source(cfg, self.engine_key), interval=cfg.scrape_interval_seconds, stale_after=cfg.stale_after_seconds,
            clock=self.clock, on_snapshot=self._on_snapshot,
        )  # fmt: skip
        self.metrics.model_label.watch(served=lambda: self._models, default=self.default_model)
        self.metrics.tenant_label.watch(lambda: self.config.tenants.weights())
        self.metrics.requests_waiting.engine = self.feed.engine_waiting
        self.feed.own = self.dispatcher  # the engine's waiting figure moves with the sidecar's requests, not a scrape later
        self.dispatcher.scrape_soon = self.feed.scrape_soon  # the KV plan learning what the prefix cache shares
        self.watcher = (
            ConfigWatcher(self.config_path, initial=self.loaded, on_change=self._apply,
                          poll_seconds=cfg.server.config_poll_milliseconds / 1000,
                          on_refused=lambda _: self.metrics.config_reload_errors.inc())  # fmt: skip
            if self.config_path
            else None
        )
        self.replies = Replies(
            self.dispatcher, self.feed, self.clock, loaded=lambda: self.loaded, engine_serving=lambda: self.engine_serving,
            reload_error=lambda: self.watcher.last_error if self.watcher else None, started_at=self.started_at,
            throughput=self.throughput,
        )  # fmt: skip
        self.caller_auth = CallerAuth(lambda: self.config, self.caller_tokens, self.metrics)
        self.admin_gate = AdminGate(lambda: self.config, self.admin_token, self.metrics)
        inference = InferenceServicer(
            self.dispatcher, self.clock, config=lambda: self.config, default_model=self.default_model,
            context_length=lambda model: self.client.context_lengths.get(model), on_completion=self.on_completion,
            external=self.external, metrics=self.metrics, auth=self.caller_auth,
        )  # fmt: skip
        self.health = health.aio.HealthServicer()
        # message size, streams per connection, keepalive enforcement, connection age (connection_limits)
        self.server = grpc.aio.server(options=grpc_server_options(cfg.server))
        add_servicers(self.server, inference, AdminServicer(self.replies, self.admin_gate))
        add_health(self.server, self.health)
        enable_reflection(self.server, (*SERVICE_NAMES, health.SERVICE_NAME), (health_pb2.DESCRIPTOR,))
        self.front = inference.front  # both doors' intake (read by tests: the bodies being read)
        door = OpenAIDoor(inference.front, engine=lambda: self.client, ready=self.ready, auth=self.caller_auth)
        self._http_runner = web.AppRunner(door.app(), access_log=None, handler_cancellation=True,
                                          **http_runner_options(cfg.server))  # fmt: skip
        self._runner = web.AppRunner(metrics_app(self.metrics.render, lambda: self.engine_serving), access_log=None)
        try:  # a port in use: ListenError, after closing what was opened
            self.grpc_port = ports.bind_grpc(self.server, self.host, self._grpc_port_req, self._port_settings[0])
            await self._set_health(False)
            await self.server.start()
            await self._runner.setup()
            self.metrics_port = await ports.start_site(self._runner, self.host, self._metrics_port_req,
                                                       self._port_settings[1])  # fmt: skip
            await self._http_runner.setup()
            http_server = self._http_runner.server
            assert http_server is not None
            cap_connections(http_server, lambda: self.config.server.max_connections,
                            self.metrics.http_connections_refused.inc)  # fmt: skip
            self.metrics.http_connections.set_function(lambda: len(http_server.connections))
            self.http_port = await ports.start_site(self._http_runner, self.host, self._http_port_req,
                                                    self._port_settings[2])  # fmt: skip
            if self._take_over_port_req is not None:
                self.take_over_port = await ports.start_site(self._http_runner, self.host, self._take_over_port_req,
                                                             "--take-over-port")  # fmt: skip
        except BaseException:
            await self._abort_start()
            raise
        self.metrics.config_generation.set(self.loaded.generation)
        await self._check_engine()
        loops = (self.dispatcher.run(), self.feed.run(), self._health_loop(), self._solve_smdp(), self.external.run(),
                 self._key_loop(), self._model_loop())  # fmt: skip
        self._tasks = [asyncio.create_task(t) for t in loops]
        if self.watcher:
            self._tasks.append(asyncio.create_task(self.watcher.run()))
        also = f" and :{self.take_over_port} (taken over)" if self.take_over_port is not None else ""
        log.info("sidecar serving gRPC on %s:%d, HTTP on :%d%s, metrics on :%d, engine %s, mode %s",
                 self.host, self.grpc_port, self.http_port, also, self.metrics_port, redact_urls(cfg.engine.url),
                 dispatch_mode(cfg))  # fmt: skip

    async def _abort_start(self) -> None:
        """A failed start (a port in use): close what was opened, so the process
        can exit with one clear line instead of leaking a server into a closed loop."""
        await self.server.stop(None)
        await self._runner.cleanup()
        await self._http_runner.cleanup()
        await self.client.close()

    async def stop(self, grace: float | None = None) -> int:
        """Stop intake, drain within ``grace`` seconds, then shut everything down.
        Returns the number of requests answered UNAVAILABLE because time ran out."""
        grace = self.config.server.drain_grace_seconds if grace is None else grace
        await self.health.enter_graceful_shutdown()
        cut = await self.dispatcher.drain(grace)
        await self.server.stop(1.0)
        await self._http_runner.cleanup()
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
        await self.external.close()
        log.info("sidecar stopped (%d requests cut off by the grace period)", cut)
        return cut

    # -- background work ------------------------------------------------------------------

    def _on_snapshot(self, snapshot) -> None:
        self.metrics.metrics_fresh.set(1 if snapshot is not None and snapshot.fresh else 0)
        self._choose_bin_count(snapshot)
        self._update_smdp()
        gate = self.dispatcher.core.former.gate
        if gate is not None:  # before on_snapshot, whose wake lets held requests go
            gate.observe(snapshot.tpot_seconds if snapshot else None, fresh=snapshot is not None and snapshot.fresh,
                         running=snapshot.running if snapshot else None)  # fmt: skip
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
            build_core(cfg, self.clock, previous=d.core, k=decision.new, policy=self.smdp), mode=dispatch_mode(cfg),
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
            try:
                self._models = await self.client.models()
            except EngineError as exc:
                self._warn_unauthorized(exc)
            except Exception:  # noqa: BLE001, S110 - learned at a later health check
                pass
        await self._set_health(ok)
        self.dispatcher.on_engine_health(ok)

    def _warn_unauthorized(self, exc: EngineError) -> None:
        """The engine refused the sidecar's key: said once (each request failing says it too)."""
        if exc.kind == "unauthorized" and not self._warned_unauthorized:
            self._warned_unauthorized = True
            log.warning("%s", exc.message)

    async def _key_loop(self) -> None:
        """Re-read ``engine.apiKeyFile``, ``auth.callerTokensDir`` and ``auth.adminTokenFile`` at the config
        poll interval: a rotated Secret is swapped into the mounted files without the config changing."""
        while True:
            await asyncio.sleep(self.config.server.config_poll_milliseconds / 1000)
            if self.engine_key.refresh():
                self._warned_unauthorized = False
                self.key_changed.set()
            if self.caller_tokens.refresh():
                warn_unlisted(self.config, self.caller_tokens)
                self.auth_changed.set()
            if self.admin_token.refresh():
                self.auth_changed.set()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL)
            if self.dispatcher.accepting:
                await self._check_engine()

    def check_model(self) -> bool:
        """``predictor.warmStart``'s file changed (kubelet updated the mounted ConfigMap or Secret,
        or a missing one appeared): swap its model in whole; True if the core was rebuilt.  A file
        that cannot be read keeps the running model (a strict warmStart logs why, once per file)."""
        cfg, d = self.config, self.dispatcher
        if not model_file_changed(cfg, d.core.predictor):
            return False
        try:
            core = build_core(cfg, self.clock, previous=d.core, k=self.bin_count and self.bin_count.k, policy=self.smdp)
        except ConfigError as exc:
            learned = learned_of(d.core.predictor)
            if learned is not None:  # model_file_changed saw one: not again until the file changes again
                learned.warm_start_stamp = model_stamp(learned.warm_start)
            log.warning("predictor.warmStart changed and cannot be read; keeping the running model: %s", exc)
            return False
        d.replace_core(core, mode=dispatch_mode(cfg), max_inflight_batches=cfg.batch.max_inflight_batches,
                       engine_timeout=cfg.engine.request_timeout_seconds)  # fmt: skip
        return True

    async def _model_loop(self) -> None:
        """Look at the warm-start file as often as at the config file."""
        while True:
            await asyncio.sleep(self.config.server.config_poll_milliseconds / 1000)
            try:
                self.check_model()
            except Exception:  # noqa: BLE001 - a model check must never stop the loop
                log.exception("model check failed")

    async def _set_health(self, serving: bool) -> None:
        """Readiness follows the engine's health (DESIGN §2 Lifecycle)."""
        self.engine_serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *SERVICE_NAMES):
            await self.health.set(name, status)

    async def _apply(self, loaded: LoadedConfig) -> None:
        """A new valid config file: apply every key live, or refuse the whole file.

        Keys bound at start-up (``RESTART_KEYS``: the ports) cannot change live;
        a file changing one is refused (raises, so the watcher keeps the running
        config and reports the error in GetConfig). Everything else takes effect
        here: the core and feed are rebuilt (the queue is kept), the engine key
        file is read again (a file that cannot be read refuses the reload), a new engine URL
        or timeout gets a new engine client for new dispatches, the log level,
        format and the poll interval are set; the rest is read from ``self.config`` at use.
        The watcher logs the applied generation (once).
        """
        cfg, running = loaded.config, self.config
        refused = restart_required(running, cfg)
        if refused:
            raise ConfigError(refused)
        # read before anything changes: a key file that cannot be read refuses the whole file
        new_key = EngineKey()
        new_key.load(cfg.engine.api_key_file)
        new_tokens, new_admin = CallerTokens(), EngineKey(field=ADMIN_FIELD)
        new_tokens.load(cfg.auth.caller_tokens_dir)
        new_admin.load(cfg.auth.admin_token_file)
        self.bin_count = build_bin_count(cfg, self.bin_count)
        self.smdp = build_smdp(cfg, self.smdp)
        core = build_core(cfg, self.clock, previous=self.dispatcher.core, k=self.bin_count and self.bin_count.k,
                          policy=self.smdp)  # fmt: skip
        self.dispatcher.replace_core(
            core, mode=dispatch_mode(cfg), max_inflight_batches=cfg.batch.max_inflight_batches,
            engine_timeout=cfg.engine.request_timeout_seconds,
        )  # fmt: skip
        self.engine_key.take(new_key)  # before a new engine is asked for its models: shared by every client
        self.caller_tokens.take(new_tokens)
        self.admin_token.take(new_admin)
        warn_unlisted(cfg, self.caller_tokens)
        self._warned_unauthorized = False
        if (cfg.engine.url, cfg.engine.request_timeout_seconds) != (running.engine.url, running.engine.request_timeout_seconds):  # fmt: skip
            await self._swap_client(cfg, new_engine=cfg.engine.url != running.engine.url)
        self.client.max_body_bytes = cfg.engine.max_request_body_bytes  # read per call: applies live
        self.feed.source = metrics_source(cfg, self.engine_key)
        self.feed.interval = cfg.scrape_interval_seconds
        self.feed.stale_after = cfg.stale_after_seconds
        if self.watcher is not None:
            self.watcher.poll_seconds = cfg.server.config_poll_milliseconds / 1000
        if cfg.logging.level != running.logging.level:
            logs.set_level(cfg.logging.level)
        if cfg.logging.format != running.logging.format:
            logs.set_format(cfg.logging.format)
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
                              max_body_bytes=cfg.engine.max_request_body_bytes, api_key=self.engine_key)  # fmt: skip
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


def settle_heap(cfg: SidecarConfig) -> None:
    """Ready the heap for ``gc.freeze`` once started: what start-up made (the modules, the
    core) lives as long as the process, and frozen it is left out of every cyclic garbage
    collection, which otherwise scans it again at each full one (under the overhead bench,
    collecting took ~4% of the sidecar's CPU; freezing cut that by ~40%).  A Learned
    predictor's fit libraries (sklearn, ~28,000 objects) are imported now rather than at
    its first refit, to be among them; so is Smdp dispatch's (scipy.stats)."""
    if cfg.predictor.kind == "Learned":
        load_fit_libraries()
    if cfg.batch.dispatch == "Smdp":
        load_service_time_library()


async def serve(loaded: LoadedConfig, config_path: str | None, host: str,
                grpc_port: int | None, metrics_port: int | None, http_port: int | None = None,
                take_over_port: int | None = None) -> int:  # fmt: skip
    """Run a sidecar until SIGTERM or SIGINT, then drain and exit."""
    logs.set_format(loaded.config.logging.format)  # the CLI's logs.setup chose the level
    sidecar = Sidecar(loaded, config_path=config_path, host=host, grpc_port=grpc_port, metrics_port=metrics_port,
                      http_port=http_port, take_over_port=take_over_port)  # fmt: skip
    settle_heap(loaded.config)
    await sidecar.start()
    gc.freeze()  # nothing runs between start's ready line and here: no request's objects are frozen
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received: draining")
    cut = await sidecar.stop()
    return 0 if cut == 0 else 1
