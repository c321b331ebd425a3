"""The emulator's ``--max-num-batched-tokens``: vLLM v1's token budget per step and its
chunked prefill.  Running sequences take their tokens first (a decode one, an unfinished
prefill what is left of it), then the waiting are admitted while budget is left; a
prefill that does not fit is cut, and its sequence emits nothing until the step that
ends it.  Step plans are computed without a clock: nothing here sleeps or times."""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from binbatch_sidecar.emulator import EmulatorConfig, add_cli, config_from_args
from binbatch_sidecar.emulator.engine import EmulatedEngine, step_seconds
from binbatch_sidecar.emulator.kv_blocks import BlockScheduler
from binbatch_sidecar.emulator.metrics import EmulatorMetrics
from binbatch_sidecar.emulator.model import SeqEvent, Sequence, append_token

A, C, P = 0.006, 0.0002, 0.0001


def seq(prompt_tokens: int, max_tokens: int = 100, seed: int = 0) -> Sequence:
    return Sequence(index=0, prompt_tokens=prompt_tokens, max_tokens=max_tokens, min_tokens=0, eos_after=None,
                    stop=(), rng=random.Random(seed), arrival=0.0, events=asyncio.Queue())  # fmt: skip


def run_step(scheduler: BlockScheduler, emitting: list[Sequence]) -> None:
    """The end of a step: a token for each sequence the plan said emits; a finished one frees its blocks."""
    for s in emitting:
        append_token(s)
        if s.finish_reason is not None:
            scheduler.finish(s)


def test_a_prompt_longer_than_the_budget_is_prefilled_over_steps_and_emits_when_it_ends():
    config = EmulatorConfig(step_a=A, step_c=C, prefill_per_token=P, max_num_batched_tokens=100)
    scheduler = BlockScheduler(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=100)
    long = seq(250)
    scheduler.add(long)
    chunks, emitted_at = [], None
    for step in range(3):
        plan = scheduler.schedule()
        chunks.append(plan.prefill_tokens)
        assert plan.batch == [long]
        assert step_seconds(config, plan) == pytest.approx(A + C + plan.prefill_tokens * P)  # only its chunk
        if plan.emits:
            emitted_at = step
        run_step(scheduler, plan.emits)
    assert chunks == [100, 100, 50] and emitted_at == 2 and long.output_tokens == 1
    assert scheduler.used_blocks == 16  # its whole prompt's blocks from its admission on


def test_running_sequences_take_the_budget_first_and_the_waiting_get_what_is_left():
    scheduler = BlockScheduler(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=10)
    decoding = [seq(2, seed=i) for i in range(3)]
    for s in decoding:
        scheduler.add(s)
    run_step(scheduler, scheduler.schedule().emits)  # 3 x 2 prompt tokens: one step, a token each
    newcomer, behind = seq(20), seq(5)
    scheduler.add(newcomer)
    scheduler.add(behind)

    plan = scheduler.schedule()  # 3 decodes, then 7 of the newcomer's 20; none left for the one behind it
    assert plan.admitted == [newcomer] and plan.prefill_tokens == 7
    assert plan.emits == decoding and behind in scheduler.waiting
    run_step(scheduler, plan.emits)
    plan = scheduler.schedule()  # 3 decodes and the newcomer's next 7
    assert plan.admitted == [] and plan.prefill_tokens == 7 and newcomer not in plan.emits
    run_step(scheduler, plan.emits)
    plan = scheduler.schedule()  # 3 decodes, the newcomer's last 6 (it emits), 1 token left: the one behind starts
    assert plan.admitted == [behind] and plan.prefill_tokens == 6 + 1
    assert plan.emits == [*decoding, newcomer]


def test_a_sequence_the_budget_does_not_reach_skips_the_step_and_keeps_its_blocks():
    scheduler = BlockScheduler(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=2)
    first, second, third = seq(1, seed=1), seq(1, seed=2), seq(1, seed=3)
    for s in (first, second, third):
        scheduler.add(s)
    plan = scheduler.schedule()  # two prompts of one token fill the budget: the third waits
    assert plan.admitted == [first, second] and third in scheduler.waiting
    run_step(scheduler, plan.emits)
    scheduler.running.append(third)  # as if it ran already: three decoders over a budget of two
    third.status, third.blocks = first.status, 1
    scheduler.free_blocks -= 1
    plan = scheduler.schedule()
    assert plan.batch == [first, second] and third.blocks == 1 and third.output_tokens == 0


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.integers(1, 120), min_size=1, max_size=12), blocks=st.integers(24, 64),
       lengths=st.lists(st.integers(1, 30), min_size=12, max_size=12))  # fmt: skip
def test_a_budget_no_step_reaches_changes_nothing(prompts, blocks, lengths):
    """Property: with a budget larger than any step's tokens the plans, preemptions
    included, are those of an engine with none."""
    runs = []
    for budget in (0, 10**9):
        scheduler = BlockScheduler(num_blocks=blocks, block_size=16, max_num_seqs=6, max_num_batched_tokens=budget)
        made = [seq(p, max_tokens=n, seed=i) for i, (p, n) in enumerate(zip(prompts, lengths))]
        for s in made:
            scheduler.add(s)
        trace = []
        for _ in range(200):
            if not (scheduler.running or scheduler.waiting):
                break
            plan = scheduler.schedule()
            trace.append(([made.index(s) for s in plan.batch], [made.index(s) for s in plan.emits],
                          [made.index(s) for s in plan.preempted], plan.prefill_tokens))  # fmt: skip
            run_step(scheduler, plan.emits)
        runs.append(trace)
    assert runs[0] == runs[1]


def test_the_engine_gives_a_chunked_prompt_its_first_token_at_the_step_that_ends_its_prefill():
    async def main() -> tuple[int, list[SeqEvent]]:
        config = EmulatorConfig(step_a=0.0, step_c=0.0, max_num_batched_tokens=64, max_model_len=512)
        engine = EmulatedEngine(config, EmulatorMetrics(config))
        engine.start()
        long = seq(300, max_tokens=2)
        engine.submit([long])
        events = [await long.events.get(), await long.events.get()]
        steps = engine.stats.steps
        await engine.stop()
        return steps, events

    steps, events = asyncio.run(main())
    assert steps == 6  # ceil(300 / 64) = 5 steps of prefill, the last with the first token; one more for the second
    assert [e.tokens for e in events] == [1, 2] and events[-1].finish_reason == "length"


def test_the_budget_is_vllms_flag_and_a_bad_one_names_its_field():
    import argparse

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["emulate-engine", "--max-num-batched-tokens", "2048"])
    assert config_from_args(args).max_num_batched_tokens == 2048
    assert config_from_args(parser.parse_args(["emulate-engine"])).max_num_batched_tokens == 0  # none by default
    with pytest.raises(SystemExit):
        parser.parse_args(["emulate-engine", "--max-num-batched-tokens", "-1"])
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EmulatorConfig(max_num_batched_tokens=-5)
