"""Config → scheduling core: the one place a ``SidecarConfig`` becomes the
predictor, binner, former and sizer the dispatcher runs (at start and on every
reload), and the metrics source the feed reads.

Construction only: the lifecycle (``app.py``) decides when to build; the one file
read is ``predictor.warmStart``'s model, when the path or the file changes
(``model_stamp``: kubelet swaps a ConfigMap volume's files in place).
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import replace
from urllib.parse import urlsplit

from ..config import ConfigError, SidecarConfig
from ..core.admission import AdmissionOrder
from ..core.autok import BinCountController
from ..core.binner import AdaptiveBinner, AutoBinner, Binner, FixedBinner
from ..core.clock import Clock
from ..core.fair_share import TenantPolicy
from ..core.former import BatchFormer
from ..core.kv_plan import KvPlan
from ..core.predictor import ExternalFirst, HintPredictor, LearnedPredictor, LengthPredictor, OnlinePredictor
from ..core.sizer import BatchSizer
from ..core.smdp_policy import SmdpCache, SmdpDispatch, SmdpParams
from ..core.tpot_gate import TpotGate
from ..engine.dispatcher import Core, Mode
from ..engine.engine_key import EngineKey
from ..engine.metrics_feed import MetricsSource, PromQLSource, ScrapeSource
from ..engine.model_file import ModelFileError, load_model


_DEFAULT_PORTS = {"http": 80, "https": 443}
log = logging.getLogger("binbatch.predictor")

AUTO_FIRST_ESTIMATE = 16  # bins.mode Auto: arrivals before the first estimate (then at 32, 64, ...)


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
            window=b.auto_window, min_samples=min(AUTO_FIRST_ESTIMATE, b.auto_window),
            refresh_every=b.auto_refresh_every, batch=cfg.batch.static_size if cfg.batch.mode == "Gang" else None,
        )  # fmt: skip
    n_max = b.max_requests_per_bin or cfg.batch.static_size  # 0: from KV memory once metrics arrive
    return AdaptiveBinner(1, b.max_output_tokens, n_max, theta=b.split_threshold_percent / 100, max_buckets=b.count)


# This process's name for its training records' numbering (ExportTrainingRecords' epoch): a restarted
# sidecar numbers from 1 again, and a reader's cursor from before must not skip its records.
EPOCH = secrets.token_hex(8)


def model_stamp(path: str) -> tuple[int, int, int] | None:
    """What tells a changed model file: its inode, size and mtime (None: not there).  A
    ConfigMap volume's update swaps a symlink to new files, which ``stat`` follows."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def learned_of(predictor: LengthPredictor | None) -> LearnedPredictor | None:
    """The ``LearnedPredictor`` running (behind an external service's answers), if any."""
    if isinstance(predictor, ExternalFirst):
        predictor = predictor.inner
    return predictor if isinstance(predictor, LearnedPredictor) else None


def model_file_changed(cfg: SidecarConfig, predictor: LengthPredictor | None) -> bool:
    """The running Learned predictor's warm-start file is not the one it loaded (or failed to)."""
    learned = learned_of(predictor)
    if cfg.predictor.kind != "Learned" or learned is None or not learned.warm_start:
        return False
    return learned.warm_start == cfg.predictor.warm_start and model_stamp(learned.warm_start) != learned.warm_start_stamp


def build_predictor(cfg: SidecarConfig, previous: LengthPredictor | None = None, now: float = 0.0) -> LengthPredictor:
    """The predictor ``predictor.kind`` names; what a previous one learned is kept (an
    online predictor's estimates, a learned one's model and records unless its warm
    start's path or file changed; ``now`` dates a warm start's install).  A warm start
    that is no model raises ``ConfigError`` naming it; with ``warmStartOptional`` it
    is a warning instead: the predictor starts cold (or keeps the model it loaded
    from that path before)."""
    p = cfg.predictor
    hint = HintPredictor(p.default_output_tokens)
    if p.kind == "Hint":
        return hint
    online = previous.fallback if isinstance(previous, LearnedPredictor) else previous
    if not isinstance(online, OnlinePredictor):
        online = OnlinePredictor()
    online.fallback = hint
    if p.kind == "Online":
        return online
    stamp = model_stamp(p.warm_start) if p.warm_start else None  # before reading: a change meanwhile is seen next time
    same = previous if isinstance(previous, LearnedPredictor) and previous.warm_start == p.warm_start else None
    if same is not None and (not p.warm_start or same.warm_start_stamp == stamp):
        return _keep(same, online, p.refit_every_records, p.training_buffer_records)
    model = None
    if p.warm_start:
        try:
            model = load_model(p.warm_start)
        except ModelFileError as exc:
            if not p.warm_start_optional:
                raise ConfigError([("predictor.warmStart", str(exc))]) from None
            if same is not None and same.prior is not None:  # it went or broke after a model was loaded from it
                log.warning("predictor.warmStart: %s; keeping the model loaded from it before "
                            "(a policy's spec.predictor.model: its ConfigMap or Secret changed)", exc)  # fmt: skip
                same.warm_start_stamp = stamp
                return _keep(same, online, p.refit_every_records, p.training_buffer_records)
            log.warning("predictor.warmStart: %s; starting cold, learning from completions (a policy's "
                        "spec.predictor.model: its ConfigMap or Secret, or the key, is missing or holds no model "
                        "written by `binbatch predictor train`); binbatch_predictor_model_loaded is 0", exc)  # fmt: skip
        else:
            if same is not None:
                log.info("predictor.warmStart %s changed: its model (%d records) swapped in", p.warm_start, model.records)
    learned = LearnedPredictor(model=model, fallback=online, buffer=p.training_buffer_records,
                               refit_every=p.refit_every_records, warm_start=p.warm_start, epoch=EPOCH)  # fmt: skip
    if isinstance(previous, LearnedPredictor):  # a new model file: the completions seen stay (and exportable)
        learned.carry_records(previous)
    learned.warm_start_stamp = stamp
    learned.installed_at = now if model is not None else None
    return learned


def _keep(learned: LearnedPredictor, online: OnlinePredictor, refit_every: int, buffer: int) -> LearnedPredictor:
    learned.fallback, learned.refit_every = online, refit_every
    learned.resize(buffer)
    return learned


def build_core(
    cfg: SidecarConfig, clock: Clock, previous: Core | None = None, k: int | None = None,
    policy: SmdpDispatch | None = None,
) -> Core:  # fmt: skip
    """The scheduling core for ``cfg`` (with ``k`` bins: countMode Auto; ``policy``:
    Smdp dispatch); what a predictor learned is kept (``build_predictor``).  With
    ``predictor.external.url`` the external service's answers come after the hint and
    before the built-in predictor."""
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
        kv_plan=cfg.projected_kv,
    )
    binner = build_binner(cfg, k)
    former = BatchFormer(
        binner, clock, target_size=bt.static_size, max_wait=cfg.max_wait_seconds, max_queue=bt.max_queued_requests,
        gate=TpotGate(cfg.tpot_seconds), policy=policy,
    )  # fmt: skip
    learned = previous.predictor if previous is not None else None
    if isinstance(learned, ExternalFirst):
        learned = learned.inner
    predictor = build_predictor(cfg, learned, clock.now())
    if cfg.predictor.external.url:
        predictor = ExternalFirst(predictor)
    plan = None
    if cfg.projected_kv:
        # what the plan learned of the engine (capacity, step time, headroom, prompt scale) outlives a reload:
        # a fresh plan would admit freely until the next scrape and start its prompt scale over
        kept = previous.kv_plan if previous is not None else None
        live = cfg.metrics.source == "Scrape"
        plan = (KvPlan(reserve=cfg.kv_reserve_ratio, usage_live=live) if kept is None
                else replace(kept, reserve=cfg.kv_reserve_ratio, usage_live=live, shared_seen=kept.shared_seen.copy()))  # fmt: skip
    return Core(predictor=predictor, binner=binner, former=former, sizer=sizer, admission=build_admission(cfg),
                kv_plan=plan, max_queued_bytes=bt.max_queued_bytes, max_queued_requests=bt.max_queued_requests,
                tenants=build_tenants(cfg))  # fmt: skip


def build_tenants(cfg: SidecarConfig) -> TenantPolicy:
    """The ``tenants`` section as the scheduler takes it (fair_share.py)."""
    t = cfg.tenants
    return TenantPolicy(t.weights(), t.default_weight, t.max_queued_share_percent)


def build_admission(cfg: SidecarConfig) -> AdmissionOrder:
    """``batch.order`` with its aging and max wait, as the scheduler takes it."""
    b = cfg.batch
    engine_priority = b.order == "EnginePriority"  # what queues here (B_t) is ordered shortest first too
    return AdmissionOrder(
        "fifo" if b.order == "Fifo" else "shortest_first",
        aging=None if b.aging == "EnginePace" else float(b.aging_tokens_per_second),  # None: at the engine's pace
        max_wait=b.max_queue_wait_milliseconds / 1000,
        follow_engine=b.follow_engine_queue and not engine_priority,
        engine_priority=engine_priority,
        drain="longest_fit_first" if b.drain_order == "LongestFitFirst" else "shortest_first",
        by_footprint=cfg.rank_by == "KvFootprint",
    )


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


def dispatch_mode(cfg: SidecarConfig) -> Mode:
    """``batch.mode`` as the dispatcher spells it."""
    return "gang" if cfg.batch.mode == "Gang" else "continuous"


def metrics_source(cfg: SidecarConfig, engine_key: EngineKey | None = None) -> MetricsSource | None:
    """What the metrics feed reads: vLLM's ``/metrics``, a PromQL API, or nothing.

    A scrape of the engine's own address (scheme, host and port of ``engine.url``)
    carries ``engine_key``; the key never goes to any other host."""
    m = cfg.metrics
    if m.source == "Scrape":
        key = engine_key if engine_key is not None and same_origin(m.url, cfg.engine.url) else None
        return ScrapeSource(m.url, headers=key.headers if key is not None else None)
    if m.source == "PromQL":
        return PromQLSource(m.url, m.promql_selector)
    return None


def same_origin(a: str, b: str) -> bool:
    """Whether two URLs name the same scheme, host and port (a default port counts as given)."""
    def origin(url: str) -> tuple[str, str, int | None]:
        parts = urlsplit(url)  # both validated as http(s) URLs with a host by the config
        return parts.scheme, (parts.hostname or "").lower(), parts.port or _DEFAULT_PORTS.get(parts.scheme)

    return origin(a) == origin(b)
