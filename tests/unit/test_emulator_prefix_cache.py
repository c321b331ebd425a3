"""The emulator's prefix cache (``--enable-prefix-caching``, on by default in vLLM):
sequences whose prompts begin with the same full blocks hold those blocks once and
do not prefill them again.  The scheduler is driven directly: no clock, no I/O."""

from __future__ import annotations

import asyncio
import random

from binbatch_sidecar.emulator import EmulatorConfig
from binbatch_sidecar.emulator.kv_blocks import BlockScheduler
from binbatch_sidecar.emulator.metrics import EmulatorMetrics
from binbatch_sidecar.emulator.model import Sequence, append_token, prefix_blocks
from binbatch_sidecar.emulator.openai_requests import build_sequences, parse_request

SYSTEM = tuple(f"s{i}" for i in range(32))  # two full 16-token blocks


def seq(words: tuple[str, ...], block: int = 16, max_tokens: int = 4) -> Sequence:
    return Sequence(index=0, prompt_tokens=len(words), max_tokens=max_tokens, min_tokens=0, eos_after=None, stop=(),
                    rng=random.Random(0), arrival=0.0, events=asyncio.Queue(), prefix=prefix_blocks(words, block))  # fmt: skip


def test_block_keys_are_equal_only_where_every_word_up_to_the_block_is():
    a = prefix_blocks((*SYSTEM, "q1"), 16)
    assert len(a) == 2  # the partial third block has no key
    assert prefix_blocks((*SYSTEM, "q2", "more"), 16) == a
    assert prefix_blocks(("other", *SYSTEM[1:], "q1"), 16)[1] != a[1]  # the second block's words alike, the first not


def test_sequences_that_begin_alike_hold_their_common_blocks_once():
    s = BlockScheduler(num_blocks=64, block_size=16, max_num_seqs=8, prefix_caching=True)
    first, second = seq((*SYSTEM, *"abcdefgh")), seq((*SYSTEM, *"ijklmnop"))
    s.add(first)
    s.add(second)
    plan = s.schedule()
    assert plan.admitted == [first, second]
    assert s.used_blocks == 2 + 1 + 1  # the two shared blocks once, and each one's partial block
    assert plan.prefill_tokens == 40 + 8  # the second prefilled only what the cache did not hold
    assert s.block_refs == dict.fromkeys(prefix_blocks(SYSTEM, 16), 2)
    s.finish(first)
    assert s.used_blocks == 2 + 1  # still held for the second
    s.finish(second)
    assert (s.used_blocks, s.block_refs) == (0, {})


def test_without_the_cache_or_with_other_prompts_nothing_is_shared():
    off = BlockScheduler(num_blocks=64, block_size=16, max_num_seqs=8)
    on = BlockScheduler(num_blocks=64, block_size=16, max_num_seqs=8, prefix_caching=True)
    for scheduler, prompts in ((off, [SYSTEM, SYSTEM]), (on, [SYSTEM, ("x", *SYSTEM[1:])])):
        for words in prompts:
            scheduler.add(seq((*words, "q")))
        plan = scheduler.schedule()
        assert len(plan.admitted) == 2
        assert scheduler.used_blocks == 2 * 3 and plan.prefill_tokens == 2 * 33


def test_a_preempted_sharer_gives_its_reference_back_and_takes_it_again():
    """A cache of 6 usable blocks: two sequences of a 32-word shared prompt and 4
    words of their own hold 2 + 1 + 1 blocks, and 2 + 2 + 2 past 48 tokens each;
    past 64 they would need 2 + 3 + 3.  The newest is preempted then, freeing its own
    blocks only (the shared ones stay with the other), and comes back sharing them."""
    s = BlockScheduler(num_blocks=7, block_size=16, max_num_seqs=8, prefix_caching=True)
    old, new = seq((*SYSTEM, *"abcd"), max_tokens=40), seq((*SYSTEM, *"efgh"), max_tokens=40)
    s.add(old)
    s.add(new)
    s.schedule()
    preempted = []
    while not preempted:
        for q in list(s.running):
            append_token(q)
        preempted = s.schedule().preempted
    assert preempted == [new] and new.cached == [] and new.blocks == 0
    assert s.block_refs == dict.fromkeys(prefix_blocks(SYSTEM, 16), 1)
    while new in s.waiting:
        for q in list(s.running):
            append_token(q)
            if q.finish_reason is not None:
                s.finish(q)
        s.schedule()
    assert new.cached == list(new.prefix) and old.done


def test_requests_through_the_openai_parser_carry_their_block_keys_when_the_cache_is_on():
    body = {"model": "emulated", "prompt": " ".join((*SYSTEM, "why")), "max_tokens": 4}
    for on in (False, True):
        config = EmulatorConfig(enable_prefix_caching=on, block_size=16)
        (made,) = build_sequences(parse_request(body, config, chat=False), config, 0.0, asyncio.Queue())
        assert made.prefix == (prefix_blocks(SYSTEM, 16) if on else ())
        info = EmulatorMetrics(config).render().decode()
        assert f'enable_prefix_caching="{on}"' in info
