"""A vLLM-compatible engine emulator (``binbatch emulate-engine``).

It speaks the part of vLLM's OpenAI server that binbatch uses -- ``POST
/v1/completions``, ``POST /v1/chat/completions`` (both with SSE streaming),
``GET /health``, ``GET /v1/models`` and ``GET /metrics`` with vLLM's metric names --
and behind it runs a token-step engine that batches the way vLLM does:

* **Continuous batching.** Each engine step takes τ(b) = a + c·b seconds for b
  running sequences (DESIGN §4), plus ``prefill_per_token`` seconds for every token
  it prefills, and every running sequence emits one token per step. A newly
  admitted sequence's first step is its prefill (its prompt tokens) and yields its
  first token; a preempted sequence's readmission prefills its prompt and the
  tokens it had generated again, so recompute costs time, as on every real engine.
* **Paged KV cache.** ``num_gpu_blocks`` blocks of ``block_size`` tokens, one of
  them held back as vLLM v1's null block (never given to a sequence; the usage
  gauge counts the others, as vLLM's does). Before a
  step a sequence must hold ceil((prompt + generated) / block_size) blocks -- the
  tokens whose KV the step computes. Running sequences grow first, in admission
  order; when a block is missing the most recently admitted sequence is preempted
  (recompute mode: its blocks are freed, it goes back to the front of the FIFO
  waiting queue and its prompt and the tokens generated so far are prefilled again
  on readmission; already streamed tokens stand). Waiting sequences are admitted in
  FIFO order while their blocks fit, fewer than ``max_num_seqs`` run and nothing was
  preempted in this step -- the order of vLLM v1's scheduler. With
  ``--scheduling-policy priority`` (vLLM's flag) the waiting queue is kept in
  (``priority``, arrival) order, a preempted sequence goes back into it by the
  same key, and the running sequence with the largest key is the one preempted;
  under the default "fcfs" a request's ``priority`` is accepted and has no
  effect, as in vLLM 0.32.
* **Chunked prefill.** With ``--max-num-batched-tokens N`` (vLLM's flag; its
  OpenAI server's default is 2048 on CPUs and most GPUs) a step computes at most N
  tokens: running sequences first, in admission order (a decode is one token, an
  unfinished prefill the rest of it, or what is left), then waiting ones while some
  is left; a prefill that does not fit is cut and goes on in the next steps, and its
  sequence's first token comes in the step that ends it.  A sequence's blocks are
  still all taken at admission (vLLM takes them a chunk at a time).  The default, 0,
  sets no budget: every prefill is done whole in its first step, as the bench's
  engines run (the ample-KV bursts measured both ways through the sidecar: a budget
  of 2048 moved their ratios to direct by 0.02 at most, and not in its favour).
* **Tokens.** The emulated tokenizer counts one token per whitespace-separated word
  of the prompt (a chat prompt is rendered with a tiny template first, see
  :func:`render_chat`; a prompt given as token ids counts its ids). Every output
  token is one word `` <word>`` from :data:`VOCABULARY`.
* **Output length.** Exactly ``max_tokens`` with ``ignore_eos``; otherwise the
  emulated model emits EOS after a pseudo-random number of tokens drawn uniformly
  from [max(1, min_tokens), max_tokens], seeded from the emulator's seed, the
  request's ``seed`` and the prompt -- the same request gives the same answer.
  With ``--answer-lengths FILE`` (``answers``) a prompt whose recorded answer is
  listed there emits EOS after that many tokens instead (within ``max_tokens``),
  so a replay of real traffic sends nothing that gives the length away.
  ``temperature`` and ``top_p`` are validated but do not change the output.
  Stop strings end a sequence (finish_reason "stop") once ``min_tokens`` are out,
  as in vLLM; in a stream, text already sent before a stop string that spans
  tokens is not taken back.
* **Metrics** with vLLM's names and bucket boundaries (see :class:`EmulatorMetrics`),
  or with the pre-0.10 names when ``legacy_names`` is set.

Everything runs on one asyncio loop, without threads. It imports no sidecar code
(DESIGN §2 "Layers"): it stands in for vLLM, so it must not share the sidecar's
assumptions. Its modules, in the order a request meets them:

* ``openai_requests`` -- OpenAI request bodies parsed and validated like vLLM;
* ``server`` -- the HTTP routes, response and SSE shapes, and ``Emulator``;
* ``engine`` -- the step loop; ``kv_blocks`` -- admission, KV blocks, preemption;
* ``model`` -- tokens, output words and lengths, sequences; ``answers`` --
  recorded answer lengths; ``metrics`` -- vLLM's
  Prometheus metrics; ``config`` -- ``EmulatorConfig``; ``cli`` -- the command.

Tests start it in-process::

    async with running_emulator(EmulatorConfig(step_a=0.001)) as base_url:
        ...

and :class:`Emulator` gives access to the engine (peaks, counters) as well.
"""

from .cli import add_arguments, add_cli, config_from_args, main, run_from_args
from .config import EmulatorConfig
from .engine import EmulatedEngine, EngineStats, EngineStopped
from .metrics import (
    INTER_TOKEN_LATENCY_BUCKETS,
    METRIC_NAMES,
    REQUEST_LATENCY_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    EmulatorMetrics,
)
from .server import Emulator, build_app, running_emulator, serve

__all__ = [
    "INTER_TOKEN_LATENCY_BUCKETS",
    "METRIC_NAMES",
    "REQUEST_LATENCY_BUCKETS",
    "TIME_TO_FIRST_TOKEN_BUCKETS",
    "EmulatedEngine",
    "Emulator",
    "EmulatorConfig",
    "EmulatorMetrics",
    "EngineStats",
    "EngineStopped",
    "add_arguments",
    "add_cli",
    "build_app",
    "config_from_args",
    "main",
    "run_from_args",
    "running_emulator",
    "serve",
]
