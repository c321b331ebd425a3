"""The end-to-end bench's workloads: who arrives when, asking for how many tokens.

A workload is a fixed list of requests built from a seed, so "direct to the
engine" and every sidecar configuration see exactly the same prompts, lengths
and arrival times.  Output lengths are controlled the way a real vLLM allows it,
``max_tokens`` with ``ignore_eos`` (the emulator honours both the same way), so
the true length of every request is known and an oracle hint can carry it.

Synthetic length shapes (the three the field benchmarks with):

* ``chat``: long-tailed, lognormal (a few long answers behind many short ones:
  where head-of-line blocking hurts FCFS);
* ``short``: GSM8K-like short answers, narrow around one length;
* ``mixed``: bimodal, mostly short answers with a share of long ones.

Their prompts are unique (no prefix cache can share work) with a word count drawn
independently of the output length: nothing in the prompt gives the length away
to the online predictor.  And real traffic, ``sharegpt``: first turns of the
ShareGPT evaluation split (``sharegpt_replay``), the prompt as written and the
recorded answer's length, replayed with a client's usual ``max_tokens``: what the
prompt says of its answer is there for a predictor to read, as in service.

Arrivals are Poisson at a rate (a fraction of the measured direct capacity) or
all at once (a burst).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from . import sharegpt

SHAPES = ("chat", "short", "mixed", "system")
# The "system" shape: chat answers to questions that all begin with one system prompt of this
# many words (a chat application's instructions; vLLM's prefix cache holds its blocks once)
SYSTEM_PROMPT_WORDS = 256


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request: its prompt, its true output length and when it is sent.

    ``max_tokens`` None: the length is forced the way vLLM's serving benchmark
    does, ``max_tokens`` = ``output_tokens`` with ``ignore_eos``.  Set (a replay of
    recorded answers): the client's own cap, and the engine ends the answer at its
    recorded ``output_tokens`` by a way the request does not carry to the sidecar's
    predictor (the embedded engine's ``--answer-lengths`` file; ``min_tokens`` and
    stop strings on a real vLLM, see ``bench_clients``)."""

    prompt: str
    output_tokens: int
    arrival_s: float
    max_tokens: int | None = None


def output_length(shape: str, rng: random.Random, scale: float) -> int:
    """One output length of ``shape``; ``scale`` stretches every length (1.0 = default)."""
    if shape in ("chat", "system"):
        n = rng.lognormvariate(math.log(40 * scale), 0.8)
        return max(2, min(round(n), round(320 * scale)))
    if shape == "short":
        n = rng.gauss(24 * scale, 4 * scale)
        return max(2, min(round(n), round(48 * scale)))
    if shape == "mixed":
        if rng.random() < 0.75:
            return max(2, round(rng.uniform(8, 24) * scale))
        return max(2, round(rng.uniform(120, 200) * scale))
    raise ValueError(f"shape: expected one of {', '.join(SHAPES)}, got {shape!r}")


def longest(shape: str, scale: float) -> int:
    """The largest length ``output_length`` can return (the bins' upper end)."""
    return {"chat": round(320 * scale), "system": round(320 * scale), "short": round(48 * scale),
            "mixed": round(200 * scale)}[shape]  # fmt: skip


def build(shape: str, count: int, *, rate: float | None, seed: int, scale: float = 1.0) -> list[BenchRequest]:
    """``count`` requests of ``shape``, Poisson at ``rate`` per second (None: all at once).

    The lengths and prompts depend only on ``(shape, count, seed, scale)``: every
    load of one shape replays the same requests, only their arrival times differ.
    The arrivals are one unit-rate Poisson sequence of ``(shape, seed)`` divided by
    ``rate``: the rate is a fraction of a *measured* capacity, a different float
    in every run, and seeding with it drew a new arrival sample each time -- at
    95% of capacity a 256-request sample's own rate moves by ~6% (1/sqrt(256)),
    more than the 5% between that load and saturation, so whether a queue formed
    at all changed from run to run.  Now a seed fixes the pattern at every rate.
    """
    if count < 1:
        raise ValueError(f"count: must be >= 1, got {count}")
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate: must be a finite number > 0, got {rate}")
    body_rng = random.Random(f"{seed}/{shape}/{scale}/body")
    arrival_rng = random.Random(f"{seed}/{shape}/arrivals")
    system = system_prompt(seed) + "\n" if shape == "system" else ""
    t = 0.0
    out = []
    for i in range(count):
        words = " ".join(f"w{body_rng.randrange(1000)}" for _ in range(body_rng.randint(8, 40)))
        n = output_length(shape, body_rng, scale)
        if rate is not None and i > 0:
            t += arrival_rng.expovariate(1.0) / rate
        out.append(BenchRequest(prompt=f"{system}{shape}-{seed}-{i}: {words}", output_tokens=n, arrival_s=t))
    return out


def system_prompt(seed: int) -> str:
    """The "system" shape's shared instructions: ``SYSTEM_PROMPT_WORDS`` words of ``seed``."""
    rng = random.Random(f"{seed}/system-prompt")
    return " ".join(f"s{rng.randrange(1000)}" for _ in range(SYSTEM_PROMPT_WORDS))


def repeated(requests: list[BenchRequest], count: int) -> list[BenchRequest]:
    """``count`` requests cycling through ``requests`` (their lengths, in order),
    all at time 0 (a closed loop sends them): measures the capacity for exactly
    the lengths a workload replays.  Each pass prefixes its prompts, so no prefix
    cache serves a repeat from an earlier pass."""
    if count < 1 or not requests:
        raise ValueError(f"count: must be >= 1 with requests to repeat, got {count} of {len(requests)}")
    return [BenchRequest(prompt=f"pass{i // len(requests)} {r.prompt}", output_tokens=r.output_tokens, arrival_s=0.0)
            for i, r in ((i, requests[i % len(requests)]) for i in range(count))]  # fmt: skip


def equal_mass_bins(lengths: list[int], k: int) -> list[list[int]]:
    """Indices of ``lengths`` cut by length into ``k`` bins of equal count (the ideal
    gang client's bins: equal probability mass, true lengths known), each bin in
    arrival order -- a bin is a FIFO, as the sidecar's are, so k = 1 is no sorting."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [sorted(order[len(order) * j // k : len(order) * (j + 1) // k]) for j in range(k)]


# The ShareGPT replay: a client's usual max_tokens (not the answer's length), and the
# longest prompt replayed (``sharegpt.count_tokens``, which counts at least one token a
# word): with the cap it fits the 2048-token context of the embedded engine.
SHAREGPT_MAX_TOKENS = 1024
SHAREGPT_PROMPT_TOKENS = 1024


def sharegpt_turns(count: int, seed: int) -> list[sharegpt.Turn]:
    """``count`` first turns of ShareGPT's evaluation split whose prompts are at most
    ``SHAREGPT_PROMPT_TOKENS`` long, each prompt once (a prompt asked twice was
    answered twice, at two lengths: the first is kept, so the prompt names one
    length), in a seeded order (the first ``count`` of one shuffle: a longer list
    starts with a shorter one's turns)."""
    turns, seen = [], set()
    for t in sharegpt.split("eval"):
        if t.prompt not in seen and sharegpt.count_tokens(t.prompt) <= SHAREGPT_PROMPT_TOKENS:
            turns.append(t)
        seen.add(t.prompt)
    if not 1 <= count <= len(turns):
        raise ValueError(f"count: must be in [1, {len(turns)}] (the evaluation split's turns that fit), got {count}")
    random.Random(f"{seed}/sharegpt").shuffle(turns)
    return turns[:count]


def sharegpt_replay(count: int, *, rate: float | None, seed: int, scale: float = 1.0) -> list[BenchRequest]:
    """ShareGPT first turns replayed (``sharegpt_turns``): the prompt as written, the
    client's usual cap ``SHAREGPT_MAX_TOKENS``, the recorded answer's length within
    it, Poisson at ``rate`` per second (None: all at once) -- the arrivals one
    unit-rate sequence of the seed divided by the rate, as in :func:`build`.
    ``scale`` shortens every answer and the cap alike (a slow engine's run; the
    prompts stay as written)."""
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate: must be a finite number > 0, got {rate}")
    cap = sharegpt_scaled(SHAREGPT_MAX_TOKENS, scale)
    arrival_rng = random.Random(f"{seed}/sharegpt/arrivals")
    t, out = 0.0, []
    for i, turn in enumerate(sharegpt_turns(count, seed)):
        if rate is not None and i > 0:
            t += arrival_rng.expovariate(1.0) / rate
        out.append(BenchRequest(turn.prompt, min(sharegpt_scaled(turn.output_tokens, scale), cap), t, cap))
    return out


def sharegpt_scaled(tokens: int, scale: float) -> int:
    """A recorded length shortened by ``scale`` in (0, 1] (``sharegpt_replay``), at least 1."""
    if not 0 < scale <= 1:
        raise ValueError(f"scale: must be in (0, 1], got {scale}")
    return max(1, round(tokens * scale))
