"""The emulated model: its tokenizer, its output words and length, and a sequence's state."""

from __future__ import annotations

import asyncio
import itertools
import random
from dataclasses import dataclass, field
from enum import Enum

VOCABULARY: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was",
    "on", "be", "at", "by", "this", "had", "not", "are", "but", "from", "or", "have",
    "an", "they", "which", "one", "you", "were", "all", "we", "her", "she", "there",
    "would", "their", "will", "when", "who", "him", "been", "has", "more", "if", "no",
    "out", "so", "said", "what", "up", "its", "about", "than", "into", "them", "can",
    "only", "other", "time", "new", "some", "could", "these",
)  # fmt: skip
"""The emulated model's output words."""

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def tokenize(text: str) -> tuple[str, ...]:
    """The emulated tokenizer: one token per whitespace-separated word (a prompt's
    count is its length; its words are what the prefix cache compares)."""
    return tuple(text.split())


def render_chat(messages: list[tuple[str, str]]) -> str:
    """A minimal chat template: ``<|role|>`` before each message, then ``<|assistant|>``.

    So a chat prompt costs one token per message plus one, plus its words.
    """
    parts = [f"<|{role}|>\n{content}\n" for role, content in messages]
    return "".join(parts) + "<|assistant|>\n"


def prefix_blocks(words: tuple[str, ...], block_size: int) -> tuple[int, ...]:
    """A key per full ``block_size``-token block of a prompt's ``words``: equal keys
    mean equal words in that block and in every one before it, as vLLM's prefix
    cache hashes each block with its parent's hash."""
    keys: list[int] = []
    key = 0
    for start in range(0, len(words) - block_size + 1, block_size):
        key = hash((key, words[start : start + block_size]))
        keys.append(key)
    return tuple(keys)


def sequence_rng(engine_seed: int, request_seed: int | None, prompt_key: str) -> random.Random:
    """The deterministic source of one sequence's length and words.

    A string seed is hashed with SHA-512 by :mod:`random`, so it does not depend on
    ``PYTHONHASHSEED``: the same request gets the same output in every process.
    """
    return random.Random(f"{engine_seed}|{request_seed}|{prompt_key}")


def eos_position(rng: random.Random, *, max_tokens: int, min_tokens: int, ignore_eos: bool) -> int | None:
    """After how many tokens the emulated model emits EOS; None when EOS is ignored."""
    if ignore_eos:
        return None
    return rng.randint(max(1, min_tokens), max_tokens)


# ----------------------------------------------------------------------- sequences


class SeqStatus(Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class SeqEvent:
    """What a sequence tells its HTTP handler: one token's text, its end, or an error."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    tokens: int = 0  # the sequence's output tokens with this one


_seq_ids = itertools.count()


@dataclass(eq=False, slots=True)
class Sequence:
    """One prompt being served (vLLM's ``Request`` with n=1)."""

    index: int
    """The choice index in its HTTP request."""
    prompt_tokens: int
    max_tokens: int
    min_tokens: int
    eos_after: int | None
    stop: tuple[str, ...]
    rng: random.Random
    arrival: float
    events: asyncio.Queue[SeqEvent]
    priority: int = 0
    """Its request's ``priority`` (lower first) under ``--scheduling-policy priority``."""
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SeqStatus = SeqStatus.WAITING
    blocks: int = 0
    output_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | None = None
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    preemptions: int = 0
    prefix: tuple[int, ...] = ()
    """The keys of its prompt's full KV blocks (``prefix_blocks``), with the prefix cache on."""
    cached: list[int] = field(default_factory=list)
    """The keys of the prompt blocks it holds in the prefix cache while it runs."""
    cached_tokens: int = 0
    """Prompt tokens the prefix cache held already when it was last admitted (not prefilled)."""
    prefill_left: int = 0
    """Tokens of its prefill still to compute since it was last admitted (a chunked prefill)."""

    @property
    def context_tokens(self) -> int:
        """Tokens whose KV the next step needs: the prompt and every generated token."""
        return self.prompt_tokens + self.output_tokens

    @property
    def priority_key(self) -> tuple[int, float, int]:
        """Its place under the priority policy: (priority, arrival), as vLLM orders requests."""
        return (self.priority, self.arrival, self.seq_id)

    @property
    def done(self) -> bool:
        return self.status in (SeqStatus.FINISHED, SeqStatus.ABORTED)


def append_token(seq: Sequence) -> str:
    """Generate one token for ``seq``, settle whether it finished, return the new text.

    The checks run in vLLM's order: nothing stops a sequence before ``min_tokens``;
    then EOS ("stop"), stop strings ("stop", with ``stop_reason``), ``max_tokens``
    ("length").
    """
    token = " " + seq.rng.choice(VOCABULARY)
    seq.output_tokens += 1
    before = len(seq.text)
    seq.text += token
    if seq.output_tokens < seq.min_tokens:
        return token
    if seq.eos_after is not None and seq.output_tokens >= seq.eos_after:
        seq.finish_reason = "stop"
    elif (hit := _find_stop(seq.text, seq.stop)) is not None:
        cut, seq.stop_reason = hit
        seq.text = seq.text[:cut]
        seq.finish_reason = "stop"
    elif seq.output_tokens >= seq.max_tokens:
        seq.finish_reason = "length"
    return seq.text[before:]


def _find_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string in ``text``: (where it starts, which one)."""
    hits = [(text.find(s), s) for s in stops if s and s in text]
    return min(hits) if hits else None
