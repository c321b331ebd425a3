"""The batch sizer: how many requests a batch (or the engine) should hold now.

B_t = min(b_mem, b_sla), clamped to [min_size, max_size] (DESIGN §2, §3.2-3.3;
memory-sla-dynamic-batching.md, "the seed" below):

* ``b_mem`` - Eq. 12 / Algorithm 1: the largest b whose total KV tokens exceed the
  cache with probability at most ε_M, from per-request length statistics.
* ``LengthStats`` - those statistics, a bounded running estimate per bin.
* ``SlaSizer`` - Algorithm 2: a binary search on the observed time per output
  token (TPOT) against the target D_SLA.
* ``combine`` - the min of whichever bounds exist, clamped.
* ``EngineSnapshot`` / ``BatchSizer`` - what one metrics scrape says, and the
  per-bin decision with a machine-readable reason.

No I/O and no clock: the caller scrapes, and calls ``BatchSizer.update`` every
scrape interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from scipy.stats import norm

Mode = Literal["static", "memory", "sla", "combined"]
MODES: tuple[Mode, ...] = ("static", "memory", "sla", "combined")

# SizeDecision.reason values (a Prometheus label, so a closed set).  When bins are
# bound by different terms the reason joins them in this order with "+",
# e.g. "memory+sla".
REASONS = (
    "static",  # mode "static": metrics are ignored
    "no-metrics",  # no snapshot: the static size, never more than before
    "stale-last-good",  # snapshot not fresh: hold the last size decided from fresh metrics
    "stale-static",  # snapshot not fresh and never a fresh one: the static size
    "stale-pressure",  # snapshot not fresh, the last fresh one showed pressure: half the last good size
    "kv-saturated",  # KV usage at or above kv_saturation: no bin grows
    "warming-up",  # too few length samples: the static size (max_size while the KV cache has room) stands in for b_mem
    "no-kv-capacity",  # the engine did not report η: as "warming-up"
    "memory",  # b_mem is the binding bound
    "kv-plan",  # memory is admitted per request (kv_plan.py), no batch-size bound; b_sla (if any) does not bind
    "sla",  # b_sla is the binding bound
    "sla-infeasible",  # the engine misses the TPOT SLO at the smallest size too: b_sla is lifted (SlaSizer)
)
# What Stats.sizer_reason reports before the sizer's first update.
INITIAL_REASON = "initial"


def _check(name: str, value: object, ok: bool, rule: str) -> None:
    """Raise ValueError("<name> must be <rule>, got <value>") unless ``ok``."""
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")


def _clamp(b: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, b))


# -- memory-aware size (seed Eq. 12, Algorithm 1) -------------------------------------


def b_mem(eta: float, mu: float, sigma: float, eps_m: float, running: int = 0) -> int:
    """The largest batch b with P(Σ_i (l_in,i + l_out,i) > η) ≤ ε_M.

    ``eta`` is the total KV capacity in tokens (num_gpu_blocks × block_size), not
    the free part: b counts every request in the engine, those already running
    included (DESIGN §3.2).  The running requests' future tokens are not in the
    usage gauge yet, so "free capacity + running" would undercount them.
    ``mu`` = E[l_in + l_out] and ``sigma`` = sqrt(Var l_in + Var l_out) per request.
    The result is never below ``running`` (Algorithm 1 line 6): those requests are
    in the engine already, and a target equal to them means "admit nothing more".
    """
    _check("eta", eta, math.isfinite(eta) and eta > 0, "finite and > 0")
    _check("mu", mu, math.isfinite(mu) and mu > 0, "finite and > 0")
    _check("sigma", sigma, math.isfinite(sigma) and sigma >= 0, "finite and >= 0")
    _check("eps_m", eps_m, 0 < eps_m < 1, "in (0, 1)")
    _check("running", running, running >= 0, ">= 0")
    theta = float(norm.ppf(1.0 - eps_m))
    s = sigma * theta
    # Eq. 12: b ≤ ((√((σθ)² + 4μη) − σθ) / (2μ))², i.e. √b is the positive root of
    # μx² + σθx − η = 0.  For σθ ≥ 0 the same root is written 2η / (√(…) + σθ),
    # which avoids subtracting two nearly equal numbers when σθ is large.
    disc = math.sqrt(s * s + 4.0 * mu * eta)
    root = 2.0 * eta / (disc + s) if s >= 0 else (disc - s) / (2.0 * mu)
    return max(_floor(root * root), int(running))


def _floor(x: float) -> int:
    """⌊x⌋, but a value within rounding error of an integer counts as that integer
    (η/μ = 100 must not become 99 because the square root lost a bit)."""
    nearest = round(x)
    return int(nearest) if abs(x - nearest) <= 1e-9 * max(1.0, abs(x)) else math.floor(x)


class LengthStats:
    """Running per-request mean and variance of prompt and output lengths.

    Exponentially weighted with a half-life in samples: each sample gets weight
    max(1/n, α) with α = 1 − 2^(−1/half_life), so the first ~1/α samples are an
    exact mean and (population) variance, and after that the last ``half_life``
    samples carry half the weight - it follows drift.  Five numbers, whatever the
    traffic (West's incremental weighted variance).
    """

    __slots__ = ("half_life", "_alpha", "count", "_mean", "_var")

    def __init__(self, half_life: float = 256.0) -> None:
        _check("half_life", half_life, math.isfinite(half_life) and half_life > 0, "finite and > 0")
        self.half_life = float(half_life)
        self._alpha = 1.0 - 0.5 ** (1.0 / half_life)
        self.count = 0  # samples seen (not capped)
        self._mean = [0.0, 0.0]  # [prompt, output]
        self._var = [0.0, 0.0]

    def observe(self, prompt_tokens: float, output_tokens: float) -> None:
        """One completed request: its prompt and output lengths in tokens."""
        _check("prompt_tokens", prompt_tokens, math.isfinite(prompt_tokens) and prompt_tokens >= 0, ">= 0")
        _check("output_tokens", output_tokens, math.isfinite(output_tokens) and output_tokens >= 0, ">= 0")
        self.count += 1
        w = max(1.0 / self.count, self._alpha)
        for i, x in enumerate((float(prompt_tokens), float(output_tokens))):
            diff = x - self._mean[i]
            self._mean[i] += w * diff
            self._var[i] = (1.0 - w) * (self._var[i] + w * diff * diff)

    @property
    def mu(self) -> float | None:
        """E[l_in + l_out] (DESIGN §3.2); None before the first sample."""
        return self._mean[0] + self._mean[1] if self.count else None

    @property
    def sigma(self) -> float | None:
        """sqrt(Var l_in + Var l_out) (DESIGN §3.2, seed Eq. 9: covariance ignored)."""
        return math.sqrt(self._var[0] + self._var[1]) if self.count else None


# -- SLA-constrained size (seed Algorithm 2) ------------------------------------------


# Slow scrapes in a row at the smallest batch size after which a TPOT SLO counts as
# beyond the engine (``SlaSizer.infeasible``): three, so one slow interval (a long
# prefill, a noisy neighbour) does not give the SLO up.
INFEASIBLE_AFTER = 3


class SlaSizer:
    """Algorithm 2 as a state machine: a noisy binary search for the largest batch
    whose TPOT stays within ``eps_d`` of ``d_sla``.

    State: the search window [low, high] inside [b_min, b_max] and the current b.
    Each ``update`` with an observed TPOT τ̄ at batch b̄:

    * τ̄ > D_SLA + ε_D (too slow): high ← max(b̄, low + α), low ← max(low − δ, b_min);
    * τ̄ < D_SLA − ε_D (fast):     low ← min(b̄, high − α), high ← min(high + δ, b_max);
    * otherwise: the window b̄ ± ⌊α/2⌋;

    then b ← ⌊(low + high)/2⌋.  Defaults (the seed gives none but D_SLA = 50 ms in
    its experiments): ε_D = 5% of D_SLA, α = 4, δ = 2 - small integers, as it says.

    With a linear TPOT(b) this settles within a few updates on a b whose TPOT is
    within ε_D of the target, provided that band spans a couple of integer sizes;
    a band narrower than δ can make it cycle around the target instead.

    Our changes to the seed's algorithm:
    * a slow TPOT never leaves b unchanged or larger (b ≤ previous b − 1, down to
      b_min), a fast one never makes it smaller - the paper's window arithmetic can
      otherwise step the wrong way when b̄ is far from b;
    * ``update(None)`` (no fresh TPOT - e.g. nothing decoded in the interval) holds
      b and the window: an idle engine is not evidence either way, and shrinking on
      idleness would start every burst at b_min.  Staleness of the whole scrape is
      handled by ``BatchSizer``, which holds the last good size.
    * line 15's floor at the running count is left out: outside the engine, a
      target below the running count is how we shrink ("admit none until enough
      finish").
    * an SLO the engine cannot meet is given up, not chased: after
      ``INFEASIBLE_AFTER`` slow scrapes in a row at b_min (the engine decoding at
      most b_min requests), no batch size can meet D_SLA, so b ← b_max
      (``infeasible``) until a TPOT within D_SLA + ε_D is seen, when the search
      starts again from the whole window.  Chasing it held a real vLLM CPU
      server (32 ms a token alone) at one sequence for a 20 ms SLO: a quarter of
      its throughput, and every request still missed.
    """

    def __init__(
        self,
        d_sla: float,
        *,
        b_min: int = 1,
        b_max: int = 256,
        eps_d: float | None = None,
        alpha: int = 4,
        delta: int = 2,
        initial: int | None = None,
    ) -> None:
        _check("d_sla", d_sla, math.isfinite(d_sla) and d_sla > 0, "finite and > 0")
        _check("b_min", b_min, b_min >= 1, ">= 1")
        _check("b_max", b_max, b_max >= b_min, f">= b_min ({b_min})")
        eps_d = 0.05 * d_sla if eps_d is None else eps_d
        _check("eps_d", eps_d, math.isfinite(eps_d) and eps_d >= 0, "finite and >= 0")
        _check("alpha", alpha, alpha >= 1, ">= 1")
        _check("delta", delta, delta >= 0, ">= 0")
        if initial is not None:
            _check("initial", initial, b_min <= initial <= b_max, f"in [b_min, b_max] = [{b_min}, {b_max}]")
        self.d_sla, self.eps_d, self.alpha, self.delta = float(d_sla), float(eps_d), alpha, delta
        self.b_min, self.b_max = b_min, b_max
        self.low, self.high = b_min, b_max  # Algorithm 2 line 1
        self.b = (b_min + b_max) // 2 if initial is None else initial
        self.infeasible = False  # D_SLA is beyond the engine at b_min: b is lifted to b_max
        self.tpot_at_min: float | None = None  # the TPOT of the last slow scrape at b_min
        self._slow_at_min = 0  # slow scrapes in a row at b_min

    def update(self, tpot: float | None, observed_batch: float | None = None) -> int:
        """One scrape interval: ``tpot`` = recent mean seconds per output token
        (None = no fresh data: hold), ``observed_batch`` = the mean number of
        requests decoding while it was measured (None = the previous b, the seed's
        full-batch assumption, Eq. 5).  Returns b_sla."""
        if tpot is None:
            return self.b
        _check("tpot", tpot, math.isfinite(tpot) and tpot >= 0, "finite and >= 0")
        prev, low, high, a = self.b, self.low, self.high, self.alpha
        b_bar = prev if observed_batch is None else _clamp(int(observed_batch), self.b_min, self.b_max)
        slow, fast = tpot > self.d_sla + self.eps_d, tpot < self.d_sla - self.eps_d
        if self.infeasible:
            if slow:
                return self.b  # still beyond it: nothing to buy with a smaller batch
            self.infeasible, low, high = False, self.b_min, self.b_max  # within reach again: search anew
        if slow and (prev if observed_batch is None else observed_batch) <= self.b_min:  # unrounded: at most b_min
            self._slow_at_min += 1
            self.tpot_at_min = tpot
            if self._slow_at_min >= INFEASIBLE_AFTER:
                self.infeasible, self._slow_at_min = True, 0
                self.low, self.high, self.b = self.b_min, self.b_max, self.b_max
                return self.b
        else:
            self._slow_at_min = 0
        # Algorithm 2 lines 5-13 (each right-hand side uses the previous window)
        if slow:
            low, high = max(low - self.delta, self.b_min), max(b_bar, low + a)
        elif fast:
            low, high = min(b_bar, high - a), min(high + self.delta, self.b_max)
        else:
            low, high = max(b_bar - a // 2, self.b_min), min(b_bar + a // 2, self.b_max)
        high = _clamp(high, self.b_min, self.b_max)
        low = _clamp(low, self.b_min, high)
        b = (low + high) // 2  # line 14
        if slow:  # our direction guards (class docstring)
            b = min(b, max(prev - 1, self.b_min))
            low = min(low, b)
        elif fast:
            b = max(b, prev)
        self.low, self.high, self.b = low, high, b
        return b


def combine(b_mem: int | None, b_sla: int | None, min_size: int, max_size: int) -> int:
    """B_t = min(b_mem, b_sla) clamped to [min_size, max_size] (DESIGN §2).

    A missing bound is no bound; with neither, the result is ``max_size`` (the
    policy's own limit).  ``BatchSizer`` never asks with neither: it substitutes
    the static size.
    """
    _check("min_size", min_size, min_size >= 1, ">= 1")
    _check("max_size", max_size, max_size >= min_size, f">= min_size ({min_size})")
    bounds = [b for b in (b_mem, b_sla) if b is not None]
    return _clamp(min(bounds) if bounds else max_size, min_size, max_size)


# -- putting it together --------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSnapshot:
    """What one metrics scrape tells the sizer (None = the engine did not say)."""

    kv_capacity_tokens: float | None = None  # η = num_gpu_blocks × block_size
    kv_block_tokens: int | None = None  # block_size: tokens per KV block
    kv_usage_ratio: float | None = None  # 0..1
    running: int | None = None  # requests in the engine's batch now
    waiting: int | None = None  # requests queued inside the engine
    tpot_seconds: float | None = None  # mean inter-token latency since the last scrape
    preemptions_delta: float | None = None  # preemptions since the previous scrape
    fresh: bool  # False when the scrape is stale or failed


@dataclass(frozen=True, slots=True)
class SizeDecision:
    """Per-bin target sizes, why (a ``REASONS`` value or several joined by "+"),
    and a sentence for humans.  ``b_mem`` is per bin (None where not computed),
    ``b_sla`` is engine-wide."""

    sizes: list[int]
    reason: str
    detail: str
    b_mem: list[int | None]
    b_sla: int | None


class BatchSizer:
    """Per-bin target batch sizes from length statistics and engine metrics.

    Call ``observe`` for every completion and ``update`` every scrape interval.
    ``update`` follows these rules, first match wins:

    1. mode "static": ``static_size`` for every bin, metrics ignored.
    2. no snapshot (no metrics source, or nothing scraped yet: "no-metrics"): each
       bin goes to min(previous, static_size) - the policy's static size (DESIGN
       §2), but never larger than before.  A failed scrape is a stale snapshot.
    3. snapshot not fresh: blind is not saturated.  Each bin falls back to the
       size last decided from fresh metrics ("stale-last-good"), or to
       ``static_size`` if there never were any ("stale-static").  It shrinks only
       on evidence of pressure in the last fresh snapshot -- KV usage at or above
       ``kv_saturation``, preemptions since the scrape before it, or a TPOT over
       D_SLA + ε_D -- and then once, to half the last good size
       ("stale-pressure"), not step by step to ``min_size``: a healthy engine
       whose metrics endpoint broke keeps its throughput.  A stale decision is
       never larger than the previous one.
    4. fresh: per bin, b_mem (modes memory/combined) from that bin's μ, σ once it
       has ``min_samples`` completions, else from all completions, else the static
       size stands in ("warming-up"; also "no-kv-capacity" when η is unknown) --
       or ``max_size`` while the engine reports room (``has_room``: KV usage
       under ``kv_saturation``, no preemptions): without a length model the
       engine's own report is the best evidence, and a static guess must not
       cap a burst the engine could take whole (issue 11 "free when there is
       nothing to win");
       b_sla (modes sla/combined, needs ``d_sla``) is one value for the engine;
       size = ``combine(b_mem, b_sla)``.  With ``kv_plan`` there is no b_mem
       ("kv-plan"): the scheduler admits each request on its projected KV use
       (``kv_plan.py``) instead.  If the KV usage is at or above
       ``kv_saturation`` no bin grows past its previous size ("kv-saturated": the
       length model underestimates; let the engine drain).

    η is the total capacity times (1 − ``kv_reserve_ratio``) with the running
    count as the floor, as ``b_mem`` documents (DESIGN §3.2).  Per-bin b_mem asks
    "how many requests like this bin's fit in the cache", so short-output bins
    batch wider.  Per-bin statistics are keyed by bin index: call ``reset_bins``
    when the binner moves its boundaries.
    """

    def __init__(
        self,
        *,
        mode: Mode = "combined",
        static_size: int = 32,
        min_size: int = 1,
        max_size: int = 256,
        eps_m: float = 0.01,
        kv_reserve_ratio: float = 0.0,
        kv_saturation: float = 0.95,
        d_sla: float | None = None,
        eps_d: float | None = None,
        alpha: int = 4,
        delta: int = 2,
        min_samples: int = 32,
        half_life: float = 256.0,
        kv_plan: bool = False,
    ) -> None:
        _check("mode", mode, mode in MODES, f"one of {MODES}")
        _check("min_size", min_size, min_size >= 1, ">= 1")
        _check("max_size", max_size, max_size >= min_size, f">= min_size ({min_size})")
        in_limits = min_size <= static_size <= max_size
        _check("static_size", static_size, in_limits, f"in [min_size, max_size] = [{min_size}, {max_size}]")
        _check("eps_m", eps_m, 0 < eps_m < 1, "in (0, 1)")
        _check("kv_reserve_ratio", kv_reserve_ratio, 0 <= kv_reserve_ratio < 1, "in [0, 1)")
        _check("kv_saturation", kv_saturation, 0 < kv_saturation <= 1, "in (0, 1]")
        _check("min_samples", min_samples, min_samples >= 1, ">= 1")
        if mode == "sla" and d_sla is None:
            raise ValueError("d_sla must be set when mode is 'sla'")
        self.mode: Mode = mode
        self.static_size, self.min_size, self.max_size = static_size, min_size, max_size
        self.eps_m, self.kv_reserve_ratio, self.kv_saturation = eps_m, kv_reserve_ratio, kv_saturation
        self.min_samples, self.half_life = min_samples, half_life
        self.kv_plan = kv_plan  # memory is the per-request KV plan's (scheduler), not b_mem's
        self.sla: SlaSizer | None = None
        if d_sla is not None:
            self.sla = SlaSizer(
                d_sla, b_min=min_size, b_max=max_size, eps_d=eps_d, alpha=alpha, delta=delta,
                initial=static_size,
            )
        self.overall = LengthStats(half_life)
        self._bins: dict[int, LengthStats] = {}
        self._sizes: list[int] = [static_size]
        self._last_good: tuple[list[int], EngineSnapshot] | None = None  # the last fresh decision

    @property
    def sizes(self) -> list[int]:
        """The last decision's per-bin sizes (before any update: the static size)."""
        return list(self._sizes)

    def bin_stats(self, bin: int) -> LengthStats | None:
        return self._bins.get(bin)

    def observe(self, bin: int, prompt_tokens: float, output_tokens: float) -> None:
        """A completed request of bin ``bin``."""
        _check("bin", bin, bin >= 0, ">= 0")
        stats = self._bins.get(bin)
        if stats is None:
            stats = self._bins[bin] = LengthStats(self.half_life)
        stats.observe(prompt_tokens, output_tokens)
        self.overall.observe(prompt_tokens, output_tokens)

    def reset_bins(self) -> None:
        """Forget per-bin statistics (the overall ones stay)."""
        self._bins.clear()

    def update(
        self, snapshot: EngineSnapshot | None, k: int, *, observed_batch: float | None = None
    ) -> SizeDecision:
        """The target sizes of ``k`` bins for the next interval.

        ``observed_batch`` is the mean number of requests the engine decoded over
        the interval the TPOT covers (the dispatcher knows it); None = assume the
        previous target (see ``SlaSizer.update``).  The instantaneous running
        gauge is deliberately not used for it: one sample at an idle moment would
        collapse the search.
        """
        _check("k", k, k >= 1, ">= 1")
        prev = self._sizes if len(self._sizes) == k else [min(self._sizes)] * k
        if self.mode == "static":
            decision = _without_metrics([self.static_size] * k, "static", "static mode: metrics ignored")
        elif snapshot is None:
            sizes = [min(p, self.static_size) for p in prev]
            decision = _without_metrics(sizes, "no-metrics", "no engine metrics: static size, never growing")
        elif not snapshot.fresh:
            decision = self._stale(k, prev)
        else:
            decision = self._from_metrics(snapshot, k, prev, observed_batch)
            self._last_good = (list(decision.sizes), snapshot)
        self._sizes = list(decision.sizes)
        return decision

    def _from_metrics(
        self, snap: EngineSnapshot, k: int, prev: list[int], observed_batch: float | None
    ) -> SizeDecision:
        """Rule 4 of the class docstring: a fresh snapshot."""
        sla = self.sla if self.mode in ("sla", "combined") else None
        b_sla = sla.update(snap.tpot_seconds, observed_batch) if sla else None
        mem_label, mems, mem_bounds = self._memory_bounds(snap, k)
        sizes: list[int] = []
        labels: set[str] = set()
        for mem in mem_bounds:
            sizes.append(combine(mem, b_sla, self.min_size, self.max_size))
            if (mem is not None and (b_sla is None or mem <= b_sla)) or (mem is None and b_sla is None):
                labels.add(mem_label)
            else:
                labels.add("sla-infeasible" if sla is not None and sla.infeasible else "sla")
        reason = "+".join(r for r in REASONS if r in labels)
        detail = f"{mem_label}: b_mem={mems}" if self.mode in ("memory", "combined") else "memory term off"
        if mem_label == "kv-plan":
            detail = "kv-plan: each request is admitted only if the KV cache holds it to the end"
        if mem_label in ("warming-up", "no-kv-capacity"):
            standin = self._standin(snap)
            room = " (the engine has room: KV usage under saturation, no preemptions)"
            if standin != self.max_size:
                room = ""
            detail += f"; {standin} stands in{room}"
        if sla:
            tpot = "none" if snap.tpot_seconds is None else f"{snap.tpot_seconds * 1e3:.1f} ms"
            detail += f"; b_sla={b_sla} (TPOT {tpot}, target {sla.d_sla * 1e3:.1f} ms)"
            if sla.infeasible and sla.tpot_at_min is not None:
                detail += (f"; the target is lifted: at {sla.b_min} running the engine took "
                           f"{sla.tpot_at_min * 1e3:.1f} ms a token")  # fmt: skip
        usage = snap.kv_usage_ratio
        if usage is not None and usage >= self.kv_saturation:
            sizes = [min(s, p) for s, p in zip(sizes, prev)]
            reason = "kv-saturated"
            detail = f"KV usage {usage:.2f} >= {self.kv_saturation}: no bin grows; {detail}"
        return SizeDecision(sizes, reason, detail, mems, b_sla)

    def _stale(self, k: int, prev: list[int]) -> SizeDecision:
        """Rule 3 of the class docstring: metrics are stale."""
        if self._last_good is None:
            return _without_metrics(
                [min(p, self.static_size) for p in prev], "stale-static",
                f"engine metrics stale and never fresh: the static size {self.static_size}",
            )  # fmt: skip
        good, snap = self._last_good
        base = good if len(good) == k else [min(good)] * k
        pressure = self.pressure(snap)
        if pressure:
            sizes = [min(p, self.min_size + (b - self.min_size) // 2) for p, b in zip(prev, base)]
            return _without_metrics(
                sizes, "stale-pressure",
                f"engine metrics stale after a fresh scrape showed {pressure}: half the last good sizes {base}",
            )  # fmt: skip
        sizes = [min(p, b) for p, b in zip(prev, base)]
        return _without_metrics(sizes, "stale-last-good", f"engine metrics stale: holding the last good sizes {base}")

    def pressure(self, snap: EngineSnapshot) -> str:
        """Why ``snap`` shows the engine under pressure ("" if it does not)."""
        signs = []
        if snap.kv_usage_ratio is not None and snap.kv_usage_ratio >= self.kv_saturation:
            signs.append(f"KV usage {snap.kv_usage_ratio:.2f} >= {self.kv_saturation}")
        if snap.preemptions_delta:
            signs.append(f"{snap.preemptions_delta:g} preemptions")
        sla = self.sla if self.mode in ("sla", "combined") else None
        # an SLO given up as beyond the engine (SlaSizer.infeasible) is no sign of pressure
        if sla and not sla.infeasible and snap.tpot_seconds is not None and snap.tpot_seconds > sla.d_sla + sla.eps_d:
            signs.append(f"TPOT {snap.tpot_seconds * 1e3:.1f} ms over {sla.d_sla * 1e3:.1f} ms")
        return ", ".join(signs)

    def _memory_bounds(self, snap: EngineSnapshot, k: int) -> tuple[str, list[int | None], list[int | None]]:
        """(label, per-bin b_mem, per-bin memory bound): the bound is b_mem, or the
        static size standing in for it while it cannot be computed."""
        none: list[int | None] = [None] * k
        if self.mode not in ("memory", "combined"):
            return "memory", none, none
        if self.kv_plan:
            return "kv-plan", none, none
        eta = snap.kv_capacity_tokens
        if eta is None or eta <= 0:
            return "no-kv-capacity", none, [self._standin(snap)] * k
        if self.overall.count < self.min_samples:
            return "warming-up", none, [self._standin(snap)] * k
        eta_eff = eta * (1.0 - self.kv_reserve_ratio)
        mems: list[int | None] = [self._bin_b_mem(i, eta_eff, snap.running or 0) for i in range(k)]
        return "memory", mems, mems

    def _standin(self, snap: EngineSnapshot) -> int:
        """The bound standing in for b_mem while it cannot be computed."""
        return self.max_size if self.has_room(snap) else self.static_size

    def has_room(self, snap: EngineSnapshot) -> bool:
        """Does a fresh ``snap`` say the engine's KV cache takes more now: usage
        reported and under ``kv_saturation``, no preemptions since the scrape
        before?  The stand-in replaces b_mem, a memory bound, so room is memory.
        The engine's waiting count is not asked: in a burst vLLM reports the
        requests that arrived since its last step as waiting, and falling back
        to the static size on that halved a burst's throughput."""
        return (
            snap.fresh
            and snap.kv_usage_ratio is not None
            and snap.kv_usage_ratio < self.kv_saturation
            and not snap.preemptions_delta
        )

    def _bin_b_mem(self, bin: int, eta: float, running: int) -> int:
        """b_mem from the bin's own statistics if it has enough, else the overall ones."""
        stats = self._bins.get(bin)
        if stats is None or stats.count < self.min_samples:
            stats = self.overall
        mu = max(stats.mu or 0.0, 1.0)  # a request holds at least one token slot
        return b_mem(eta, mu, stats.sigma or 0.0, self.eps_m, running)


def _without_metrics(sizes: list[int], reason: str, detail: str) -> SizeDecision:
    return SizeDecision(sizes, reason, detail, [None] * len(sizes), None)
