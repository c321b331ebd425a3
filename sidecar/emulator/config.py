"""The emulator's settings: the engine's step time, KV cache, limits and seed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """How the emulated engine behaves; every field has a CLI flag of the same name."""

    model: str = "emulated"
    """Served model name: the only ``model`` accepted and the ``model_name`` label."""
    step_a: float = 0.002
    """Fixed part a of the step time τ(b) = a + c·b, seconds."""
    step_c: float = 0.0002
    """Per-sequence part c of the step time τ(b) = a + c·b, seconds."""
    prefill_per_token: float = 0.0
    """Seconds added to a step per token it prefills: the prompt of each sequence
    admitted in it, or the prompt and generated tokens of a preempted one admitted
    again (recompute).  Real engines pay for prefill, so recompute costs time; 0
    makes prefill free."""
    num_gpu_blocks: int = 512
    """KV cache blocks."""
    block_size: int = 16
    """Tokens per KV cache block."""
    max_num_seqs: int = 256
    """Most sequences running in one step (vLLM's ``--max-num-seqs``)."""
    scheduling_policy: str = "fcfs"
    """vLLM's ``--scheduling-policy``: "fcfs", or "priority" -- waiting requests
    taken by (``priority``, arrival), the running one with the largest key
    preempted; a request's ``priority`` field (default 0, lower first) has no
    effect under "fcfs", as in vLLM 0.32."""
    enable_prefix_caching: bool = False
    """vLLM's ``--enable-prefix-caching`` (on by default in vLLM itself): the full KV
    blocks of a prompt are held once for every running sequence whose prompt begins
    with the same tokens (a block is one if its words and every word before it are),
    and their tokens are not prefilled again.  Off here by default, so the bench's
    older shapes keep what they measured."""
    max_num_batched_tokens: int = 0
    """vLLM's ``--max-num-batched-tokens``: the tokens one step computes, a decode
    one and a prefill its prompt; running sequences take theirs first, and a prefill
    that does not fit what is left is chunked over the next steps (vLLM v1's chunked
    prefill: its OpenAI server's default is 2048 on CPUs and most GPUs).  0 sets no
    budget: every prefill is done whole in its first step, however long."""
    max_model_len: int = 2048
    """Longest prompt + output, tokens; must fit in the KV cache, as vLLM requires."""
    legacy_names: bool = False
    """Expose the pre-0.10 metric names (``vllm:gpu_cache_usage_perc``,
    ``vllm:time_per_output_token_seconds``) instead of the current ones."""
    seed: int = 0
    """Seed mixed into every sequence's output length and words."""
    max_request_body_bytes: int = 1024 * 1024
    """Largest request body accepted; a larger one gets HTTP 413 "Maximum request
    body size ... exceeded", as from aiohttp's ``client_max_size`` (1 MiB by default)
    in front of vLLM."""
    receipts_file: str = ""
    """Append every prompt the engine accepts to this file, one JSON string a line, so
    a chaos bench can count prompts sent twice across engine restarts; "" is off."""
    answer_lengths: str = ""
    """A JSON Lines file of recorded answer lengths keyed by prompt (``answers.py``):
    a prompt found there ends after its recorded count of tokens (within
    ``max_tokens``), so a replay of real traffic sends nothing that gives the length
    away; "" is off."""
    api_key: str = field(default="", repr=False)
    """vLLM's ``--api-key``: every ``/v1`` call without ``Authorization: Bearer
    <api_key>`` gets 401 ``{"error": "Unauthorized"}``; ``/health`` and ``/metrics``
    stay open, as in vLLM.  "" is off.  Never in a ``repr``."""

    def __post_init__(self) -> None:
        if not self.model or not self.model.strip():
            raise ValueError("model: must be a non-empty name")
        for name in ("step_a", "step_c", "prefill_per_token"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_model_len", "max_request_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)!r}")
        if self.max_num_batched_tokens < 0:
            raise ValueError(f"max_num_batched_tokens: must be >= 0 (0: no budget), got {self.max_num_batched_tokens!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: expected one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")  # fmt: skip
        if self.num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks: must be >= 2 (one is vLLM's null block), got {self.num_gpu_blocks}")
        if self.max_model_len > self.kv_capacity_tokens:
            raise ValueError(
                f"max_model_len: {self.max_model_len} tokens do not fit in the KV cache "
                f"({self.num_gpu_blocks} blocks, less the null block, x {self.block_size} = "
                f"{self.kv_capacity_tokens} tokens)"
            )

    @property
    def kv_capacity_tokens(self) -> int:
        """η = (num_gpu_blocks − 1) × block_size (DESIGN §3.2): vLLM v1 keeps one
        block back as its null block."""
        return (self.num_gpu_blocks - 1) * self.block_size

    def step_seconds(self, running: int, prefill_tokens: int = 0) -> float:
        """τ(b) = a + c·b (DESIGN §4) plus ``prefill_per_token`` for each token the
        step prefills (prompts admitted, or recomputed after a preemption)."""
        return self.step_a + self.step_c * running + self.prefill_per_token * prefill_tokens
