"""When to dispatch a partial batch: the SMDP of smdp-dynamic-batching.txt (DESIGN §3.4).

One server, Poisson arrivals at rate λ. At a decision epoch (a batch finished, or a
request arrived to an idle server) the state s is the number of requests present
and the action a is 0 (wait) or a batch size 1 ≤ a ≤ min(s, B_max).
Serving a takes l(a) = αa + β (Eq. 1) and ζ(a) = γa + δ energy (Eq. 2); meanwhile
n ~ Poisson(λ l(a)) requests arrive (Eq. 4), so the next state is s − a + n (Eq. 5).
Waiting lasts Exp(λ) and leads to s + 1 (Eq. 6, 7).
Cost of an epoch (Eq. 8, 9): w1 · area under the number in system + w2 · ζ(a),
i.e. w1·s/λ for waiting, w1·(s·l(a) + λ l(a)²/2) + w2·ζ(a) for serving a.
Objective: long-run average cost per unit time (Eq. 3, 10) = w1·E[number in
system] + w2·average power. States ≥ S are lumped into an overflow state S that
pays an abstract tail cost (Eq. 12, 13); uniformisation (Eq. 17–19) gives a discrete
MDP solved by relative value iteration (Eq. 20–22). The optimum is a control
limit: wait below a threshold, serve from it on (§V-A).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import sparse
from scipy.sparse import csgraph
from scipy.stats import poisson

# Uniformisation constant as a fraction of its upper bound (Eq. 19): the paper notes
# a larger η converges faster; staying just below the bound keeps a self-loop on
# every state, which makes relative value iteration aperiodic.
ETA_FRACTION = 0.95


@dataclass(frozen=True)
class SmdpModel:
    """The batch service queue of §II with the truncation of §IV-A.

    Units are the caller's, used consistently: with time in ms and energy in mJ,
    ``lam`` is requests/ms and w2 weighs average power in mJ/ms (= W).
    States ≥ s_max are lumped into the overflow state s_max (§IV-A). Its abstract
    cost (Eq. 13) has two parts: ``tail_excess`` requests are assumed to sit beyond
    s_max and are held at w1 per unit time (``None``: ρ/(2(1−ρ)), the heavy-traffic
    mean overshoot when serving full batches); and every request pushed past s_max
    by the lumping is charged the least energy it would have needed, γ + δ/B_max,
    so a policy cannot look cheap by letting requests vanish into the overflow.
    """

    lam: float
    alpha: float
    beta: float
    gamma: float
    delta: float
    b_max: int = 32
    w1: float = 1.0
    w2: float = 1.0
    s_max: int = 200
    tail_excess: float | None = None

    def __post_init__(self) -> None:
        for name in ("lam", "alpha", "beta", "gamma", "delta", "w1", "w2", "tail_excess"):
            value = getattr(self, name)
            if value is None and name == "tail_excess":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            if value < 0 or (name == "lam" and value == 0):
                raise ValueError(f"{name} must be {'> 0' if name == 'lam' else '>= 0'}, got {value}")
        for name in ("b_max", "s_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.alpha + self.beta <= 0:
            raise ValueError("alpha and beta cannot both be 0 (service time l(a) = alpha*a + beta)")
        if self.w1 + self.w2 <= 0:
            raise ValueError("w1 and w2 cannot both be 0")
        if self.s_max < self.b_max:  # §IV-A
            raise ValueError(f"s_max must be >= b_max={self.b_max}, got {self.s_max}")
        if self.lam >= self.mu_max:  # §II: ρ < 1 is necessary for stability
            raise ValueError(f"lam must be < the maximum throughput {self.mu_max:.6g}, got {self.lam}")

    def service_time(self, a):
        """l(a) = αa + β (Eq. 1); works on ints and numpy arrays."""
        return self.alpha * a + self.beta

    def energy(self, a):
        """ζ(a) = γa + δ (Eq. 2)."""
        return self.gamma * a + self.delta

    @property
    def mu_max(self) -> float:
        """Maximum throughput B_max / l(B_max) (§II)."""
        return self.b_max / self.service_time(self.b_max)

    @property
    def rho(self) -> float:
        """Traffic intensity λ / μ_max (§II)."""
        return self.lam / self.mu_max

    @property
    def overflow_excess(self) -> float:
        """Requests assumed beyond s_max while in the overflow state (Eq. 13)."""
        if self.tail_excess is not None:
            return float(self.tail_excess)
        return self.rho / (2 * (1 - self.rho))


@dataclass(frozen=True)
class SmdpSolution:
    """Result of :func:`solve`.

    ``actions[s]`` is the optimal action in state s (0 = wait, a > 0 = serve a), the
    last entry being the overflow state. ``avg_cost`` is the exact long-run average
    cost per unit time of that policy on the truncated chain (:func:`average_cost`);
    ``bounds`` are RVI's lower/upper bounds on the optimal average cost (Eq. 22).
    ``control_limit`` is the smallest state that serves, or ``None`` if the policy
    never serves on the truncated chain (it would then pile up in the overflow state).
    """

    model: SmdpModel
    actions: tuple[int, ...]
    avg_cost: float
    control_limit: int | None
    bounds: tuple[float, float]
    iterations: int
    converged: bool


# --- the truncated SMDP as arrays over (state s, action a) -------------------------


def _grid(m: SmdpModel) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(m.s_max + 1)[:, None], np.arange(m.b_max + 1)[None, :]


def feasible(m: SmdpModel) -> np.ndarray:
    """A_s = {0} ∪ {1..min(s, B_max)} as a boolean (S+1, B+1) mask (§III)."""
    s, a = _grid(m)
    return a <= s


def sojourn(m: SmdpModel) -> np.ndarray:
    """Expected sojourn y(s, a): 1/λ when waiting, l(a) when serving (Eq. 7)."""
    s, a = _grid(m)
    return np.where(a == 0, 1 / m.lam, m.service_time(a)) * np.ones_like(s)


def lost_requests(m: SmdpModel) -> np.ndarray:
    """Expected requests pushed past s_max by the lumping of Eq. 12, per (s, a).

    Serving a from s: E[(s − a + n − S)^+] = μ P(n ≥ k) − k P(n > k) with k = S − s + a,
    n ~ Poisson(μ = λ l(a)) (Eq. 4). Waiting: one request when already at S.
    """
    s, a = _grid(m)
    k = m.s_max - s + a
    mean = m.lam * m.service_time(a)
    serve = mean * poisson.sf(k - 1, mean) - k * poisson.sf(k, mean)
    return np.where(a == 0, (s == m.s_max).astype(float), np.maximum(serve, 0.0))


def epoch_cost(m: SmdpModel) -> np.ndarray:
    """Expected cost c(s, a) until the next epoch (Eq. 8, 9) plus the abstract cost (Eq. 13)."""
    s, a = _grid(m)
    la = m.service_time(a)
    serve = m.w1 * (s * la + m.lam * la**2 / 2) + m.w2 * m.energy(a)  # Eq. 9: area + energy
    wait = m.w1 * s / m.lam  # Eq. 9: s held for an Exp(λ) time
    held_beyond = np.where(s == m.s_max, m.w1 * m.overflow_excess, 0.0) * sojourn(m)  # Eq. 13
    unserved = m.w2 * (m.gamma + m.delta / m.b_max) * lost_requests(m)  # Eq. 13
    return np.where(a == 0, wait, serve) + held_beyond + unserved


def transition_matrix(model: SmdpModel, actions) -> np.ndarray:
    """Embedded-chain transition matrix of a stationary policy (Eq. 5, 12), exact."""
    m = model
    acts = _check_actions(m, actions)
    states = np.arange(m.s_max + 1)
    base = states - acts  # requests left behind by the batch
    mean = m.lam * m.service_time(acts)  # Eq. 4: Poisson mean of arrivals during l(a)
    p = poisson.pmf(states[None, :] - base[:, None], mean[:, None])
    p[:, -1] = poisson.sf(m.s_max - base - 1, mean)  # Eq. 12: s - a + n >= S lands on S
    waiting = acts == 0
    p[waiting] = 0.0
    p[states[waiting], np.minimum(states[waiting] + 1, m.s_max)] = 1.0  # Eq. 5: s -> s + 1
    return p


class _Uniformised:
    """The discrete MDP of Eq. 17 for one model, set up for fast Bellman sweeps."""

    def __init__(self, m: SmdpModel) -> None:
        tau = sojourn(m)
        self.eta = _eta(m, tau)
        self.rate = np.where(feasible(m), epoch_cost(m) / tau, np.inf)  # Eq. 17: c / y
        self.step = self.eta / tau  # Eq. 17: p~(j|s,a) = η p(j|s,a) / y(s,a) for j != s
        self.keep = 1.0 - self.step
        mean = m.lam * m.service_time(np.arange(m.b_max + 1))
        # Arrivals n beyond n_cut have probability < 1e-20; they are sent to n_cut.
        n_cut = int(min(m.s_max, math.ceil(mean[-1] + 12 * math.sqrt(mean[-1]) + 30)))
        self.table = poisson.pmf(np.arange(n_cut + 1)[:, None], mean[None, :])  # Eq. 4
        self.table[n_cut] = poisson.sf(n_cut - 1, mean)
        self.padded = np.empty(m.s_max + 1 + n_cut)
        self.windows = np.lib.stride_tricks.sliding_window_view(self.padded, n_cut + 1)[: m.s_max + 1]
        s, a = _grid(m)
        self.gather = (np.clip(s - a, 0, None) * (m.b_max + 1) + a).ravel()
        self.wait_next = np.minimum(np.arange(m.s_max + 1) + 1, m.s_max)

    def q_values(self, h: np.ndarray) -> np.ndarray:
        """c~(s,a) + Σ_j p~(j|s,a) h(j), the bracket of Eq. 21, for every (s, a)."""
        self.padded[: h.size] = h
        self.padded[h.size :] = h[-1]  # Eq. 12: beyond S counts as S
        after = self.windows @ self.table  # after[k, a] = E h(min(k + n, S)), n ~ Poisson(λ l(a))
        nxt = after.ravel()[self.gather].reshape(self.rate.shape)  # k = s - a (Eq. 5)
        nxt[:, 0] = h[self.wait_next]  # waiting: s -> s + 1; the overflow state stays
        return self.rate + self.keep * h[:, None] + self.step * nxt


def _eta(m: SmdpModel, tau: np.ndarray) -> float:
    """Uniformisation constant η < y(s,a) / (1 − p(s|s,a)) for all (s,a) (Eq. 18, 19)."""
    a = np.arange(1, m.b_max + 1)
    mean = m.lam * m.service_time(a)
    bounds = [1 / m.lam]  # waiting below S never stays put
    for stay in (poisson.pmf(a, mean), poisson.sf(a - 1, mean)):  # s < S: n = a; s = S: n >= a
        bounds.extend(tau[0, a] / (1 - stay))
    return ETA_FRACTION * min(bounds)


# --- solving and evaluating ---------------------------------------------------------


def control_limit(actions: tuple[int, ...]) -> int | None:
    """Smallest state whose action serves, or None if the policy never serves."""
    return next((s for s, a in enumerate(actions) if a > 0), None)


def _evaluate(m: SmdpModel, actions) -> tuple[float, np.ndarray]:
    """Gain g and relative values H (H(0) = 0) of a unichain policy: H = c − gy + PH (Eq. 16)."""
    states = np.arange(m.s_max + 1)
    acts = np.asarray(actions)
    lhs = np.eye(m.s_max + 1) - transition_matrix(m, acts)
    lhs[:, 0] = sojourn(m)[states, acts]  # unknown 0 is g, since H(0) = 0
    x = np.linalg.solve(lhs, epoch_cost(m)[states, acts])
    return float(x[0]), np.concatenate([[0.0], x[1:]])


def solve(
    model: SmdpModel, tol: float = 1e-6, max_iter: int = 100_000, evaluate_every: int | None = 100
) -> SmdpSolution:
    """Optimal stationary policy by relative value iteration on the uniformised MDP.

    Iterates Eq. 21 with reference state 0 and stops when the span of successive
    differences is below ``tol`` (Eq. 22) or after ``max_iter`` sweeps. Because the
    uniformised chain moves slowly (η is set by the shortest sojourn, a batch of 32
    takes ~30 sweeps), every ``evaluate_every`` sweeps the greedy policy is evaluated
    exactly and RVI resumes from its relative values (a policy-iteration step; any
    start is valid for RVI, and Eq. 22's bounds still certify the result).
    ``None`` runs plain RVI.
    """
    if tol <= 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    if evaluate_every is not None and evaluate_every < 1:
        raise ValueError(f"evaluate_every must be >= 1 or None, got {evaluate_every}")
    mdp = _Uniformised(model)
    h = np.zeros(model.s_max + 1)
    lo, hi, it, converged = -math.inf, math.inf, 0, False
    while it < max_iter:
        it += 1
        q = mdp.q_values(h)
        th = q.min(axis=1)  # Eq. 21
        lo, hi = float((th - h).min()), float((th - h).max())
        if hi - lo < tol:  # Eq. 22
            converged = True
            break
        h = th - th[0]
        if evaluate_every and it % evaluate_every == 0:
            try:
                _, big_h = _evaluate(model, np.argmin(q, axis=1))
            except np.linalg.LinAlgError:  # a multichain greedy policy: keep iterating
                continue
            if np.all(np.isfinite(big_h)):
                h = big_h / mdp.eta  # uniformised relative values are H / η
    actions = tuple(int(x) for x in np.argmin(q, axis=1))
    return SmdpSolution(
        model=model,
        actions=actions,
        avg_cost=average_cost(model, actions),
        control_limit=control_limit(actions),
        bounds=(lo, hi),
        iterations=it,
        converged=converged,
    )


def _check_actions(m: SmdpModel, actions) -> np.ndarray:
    acts = np.asarray(actions)
    if acts.shape != (m.s_max + 1,) or not np.issubdtype(acts.dtype, np.integer):
        raise ValueError(f"actions must hold {m.s_max + 1} integers (states 0..s_max), got {acts.shape}")
    states = np.arange(m.s_max + 1)
    bad = (acts < 0) | (acts > np.minimum(states, m.b_max))
    if bad.any():
        s = int(np.argmax(bad))
        raise ValueError(f"actions[{s}]={int(acts[s])} is not in 0..min({s}, b_max={m.b_max})")
    return acts


def stationary_distribution(model: SmdpModel, actions) -> np.ndarray:
    """Stationary distribution π of the embedded chain started empty (Eq. 14).

    States not reachable from 0 get probability 0. Raises ValueError if more than one
    closed class is reachable (the long-run cost would then depend on chance).
    """
    p = transition_matrix(model, actions)
    reach = np.sort(csgraph.breadth_first_order(sparse.csr_matrix(p > 0), 0, return_predecessors=False))
    sub = p[np.ix_(reach, reach)]
    edges = sparse.coo_matrix(sub > 0)
    n_comp, label = csgraph.connected_components(edges, connection="strong")
    leaving = label[edges.row] != label[edges.col]
    if n_comp - np.unique(label[edges.row[leaving]]).size != 1:  # one closed class only
        raise ValueError("actions leave several closed classes reachable from 0; no unique average cost")
    lhs = sub.T - np.eye(reach.size)
    lhs[-1] = 1.0  # replace one balance equation by Σπ = 1
    rhs = np.zeros(reach.size)
    rhs[-1] = 1.0
    pi = np.zeros(model.s_max + 1)
    pi[reach] = np.clip(np.linalg.solve(lhs, rhs), 0.0, None)
    return pi / pi.sum()


def average_cost(model: SmdpModel, actions) -> float:
    """Exact long-run average cost per unit time of a stationary policy (Eq. 14).

    Σ_s π(s) c(s, d(s)) / Σ_s π(s) y(s, d(s)) on the truncated chain, tail cost
    included, so every policy is measured on the yardstick :func:`solve` optimises.
    """
    pi = stationary_distribution(model, actions)
    states, acts = np.arange(model.s_max + 1), np.asarray(actions)
    return float(pi @ epoch_cost(model)[states, acts] / (pi @ sojourn(model)[states, acts]))


def overflow_share(model: SmdpModel, actions) -> float:
    """Share of the average cost earned in the overflow state (Eq. 15 over Eq. 14).

    §IV-A accepts the truncation when this is below a tolerance; a policy that
    cannot keep up with λ lives in the overflow state and scores near 1.
    """
    pi = stationary_distribution(model, actions)
    states, acts = np.arange(model.s_max + 1), np.asarray(actions)
    cost = pi * epoch_cost(model)[states, acts]
    return float(cost[-1] / cost.sum())


# --- reference policies and the dispatch rule the batch former uses -----------------


def static_policy(model: SmdpModel, b: int) -> tuple[int, ...]:
    """Static batching (§V-B): serve exactly b once s ≥ b, else wait."""
    if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= model.b_max:
        raise ValueError(f"b must be an integer in 1..b_max={model.b_max}, got {b!r}")
    return tuple(b if s >= b else 0 for s in range(model.s_max + 1))


def work_conserving_policy(model: SmdpModel) -> tuple[int, ...]:
    """Work-conserving (§V-B): serve min(s, B_max) whenever anything waits."""
    return tuple(min(s, model.b_max) for s in range(model.s_max + 1))


class ControlLimit:
    """The solved policy as the batch former's ``DispatchPolicy``.

    ``decide(waiting)`` is asked when a server is idle and returns how many requests
    to serve now (0 = wait). Counts at or beyond the overflow state serve B_max.
    """

    def __init__(self, solution: SmdpSolution) -> None:
        self._actions = solution.actions
        self._b_max = solution.model.b_max
        self.threshold = solution.control_limit

    @classmethod
    def from_model(cls, model: SmdpModel) -> ControlLimit:
        """Solve ``model`` and wrap the optimal policy."""
        return cls(solve(model))

    def decide(self, waiting: int) -> int:
        """Requests to serve now out of ``waiting`` (0 = wait for more)."""
        if waiting <= 0:
            return 0
        if waiting >= len(self._actions) - 1:
            return self._b_max
        return self._actions[waiting]

    def __repr__(self) -> str:
        return f"ControlLimit(threshold={self.threshold}, b_max={self._b_max})"
