"""The emulator charges for prefill: a step's duration includes the prompt tokens of
the sequences it admits and, for a preempted sequence admitted again, the prompt
and generated tokens it recomputes -- as every real engine does.  The step plan
and its duration are computed without a clock, so nothing here sleeps or times."""

from __future__ import annotations

import argparse
import asyncio
import random

import pytest

from binbatch_sidecar.bench import e2e
from binbatch_sidecar.bench.bench_processes import EngineShape, emulator_args
from binbatch_sidecar.emulator import EmulatorConfig, add_cli, config_from_args
from binbatch_sidecar.emulator.engine import step_seconds
from binbatch_sidecar.emulator.kv_blocks import BlockScheduler
from binbatch_sidecar.emulator.model import Sequence, append_token

A, C, P = 0.006, 0.0002, 0.0001


def seq(prompt_tokens: int, max_tokens: int = 100) -> Sequence:
    return Sequence(index=0, prompt_tokens=prompt_tokens, max_tokens=max_tokens, min_tokens=0, eos_after=None,
                    stop=(), rng=random.Random(0), arrival=0.0, events=asyncio.Queue())  # fmt: skip


def decode(scheduler: BlockScheduler, batch: list[Sequence]) -> None:
    """What the engine does at the end of a step: one token for every running
    sequence; a finished one frees its blocks."""
    for s in batch:
        append_token(s)
        if s.finish_reason is not None:
            scheduler.finish(s)


def test_a_step_that_admits_sequences_pays_for_their_prompt_tokens():
    config = EmulatorConfig(step_a=A, step_c=C, prefill_per_token=P)
    scheduler = BlockScheduler(num_blocks=64, block_size=16, max_num_seqs=8)
    for prompt in (10, 30):
        scheduler.add(seq(prompt))

    first = scheduler.schedule()
    assert first.prefill_tokens == 40
    assert step_seconds(config, first) == pytest.approx(A + 2 * C + 40 * P)

    decode(scheduler, first.batch)
    second = scheduler.schedule()  # nothing admitted: a decode-only step
    assert second.prefill_tokens == 0
    assert step_seconds(config, second) == pytest.approx(A + 2 * C)


def test_a_preempted_sequence_recomputes_its_prompt_and_generated_tokens_on_readmission():
    config = EmulatorConfig(step_a=A, step_c=C, prefill_per_token=P)
    # 4 blocks of 4 tokens, one the null block: two 3-token prompts fit until both need 2 blocks;
    # the old one ends at 11 tokens (3 blocks), so the preempted one can come back.
    scheduler = BlockScheduler(num_blocks=4, block_size=4, max_num_seqs=8)
    old, new = seq(3, max_tokens=8), seq(3)
    scheduler.add(old)
    scheduler.add(new)
    plan = scheduler.schedule()
    assert plan.prefill_tokens == 6
    for _ in range(20):  # decode until the cache overflows and the newest is preempted
        decode(scheduler, plan.batch)
        plan = scheduler.schedule()
        if plan.preempted:
            break
    assert plan.preempted == [new]
    assert plan.prefill_tokens == 0  # nothing is admitted in a step that preempts
    assert step_seconds(config, plan) == pytest.approx(A + C * len(plan.batch))
    recompute = new.prompt_tokens + new.output_tokens
    assert new.output_tokens > 0

    for _ in range(20):  # the old one runs on and ends; the preempted one comes back
        decode(scheduler, plan.batch)
        plan = scheduler.schedule()
        if new in plan.admitted:
            break
    assert plan.admitted == [new]
    assert plan.prefill_tokens == recompute
    assert step_seconds(config, plan) == pytest.approx(A + C * len(plan.batch) + recompute * P)


def test_prefill_costs_nothing_by_default():
    config = EmulatorConfig(step_a=A, step_c=C)
    scheduler = BlockScheduler(num_blocks=64, block_size=16, max_num_seqs=8)
    scheduler.add(seq(200))
    plan = scheduler.schedule()

    assert config.prefill_per_token == 0.0
    assert plan.prefill_tokens == 200
    assert step_seconds(config, plan) == pytest.approx(A + C)


@pytest.mark.parametrize("bad", [-0.001, float("nan"), float("inf")])
def test_config_refuses_a_bad_prefill_cost_naming_the_field(bad):
    with pytest.raises(ValueError, match="^prefill_per_token: must be a finite number >= 0"):
        EmulatorConfig(prefill_per_token=bad)


def test_prefill_per_token_flag_sets_the_config():
    parser = argparse.ArgumentParser(prog="binbatch")
    add_cli(parser.add_subparsers(dest="command"))

    assert config_from_args(parser.parse_args(["emulate-engine", "--prefill-per-token", "0.00008"])) == (
        EmulatorConfig(prefill_per_token=0.00008)
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["emulate-engine", "--prefill-per-token", "-1"])


def test_bench_engine_args_pass_the_prefill_cost_to_the_emulator():
    shape = EngineShape(step_a=0.006, step_c=0.0002, num_gpu_blocks=48, prefill_per_token=0.00008)
    args = emulator_args(shape)
    emulate = args[args.index("emulate-engine"):]
    parser = argparse.ArgumentParser(prog="binbatch")
    add_cli(parser.add_subparsers(dest="command"))

    config = config_from_args(parser.parse_args(emulate))
    assert config.prefill_per_token == 0.00008
    assert (config.step_a, config.step_c, config.num_gpu_blocks) == (0.006, 0.0002, 48)
    assert "0.08 ms per prefilled token" in shape.describe()


def test_both_embedded_engine_shapes_charge_the_same_prefill_cost():
    assert e2e.KV_LIMITED.prefill_per_token == e2e.AMPLE_KV.prefill_per_token > 0


def _prio(priority: int, arrival: float, prompt_tokens: int = 16, max_tokens: int = 100) -> Sequence:
    return Sequence(index=0, prompt_tokens=prompt_tokens, max_tokens=max_tokens, min_tokens=0, eos_after=None,
                    stop=(), rng=random.Random(0), arrival=arrival, events=asyncio.Queue(), priority=priority)  # fmt: skip


def test_the_priority_policy_admits_by_priority_then_arrival():
    scheduler = BlockScheduler(num_blocks=64, block_size=16, max_num_seqs=2, priority=True)
    a, b, c = _prio(5, 0.0), _prio(1, 1.0), _prio(1, 2.0)
    for s in (a, b, c):
        scheduler.add(s)
    assert scheduler.schedule().admitted == [b, c]
    assert list(scheduler.waiting) == [a]


def test_the_priority_policy_preempts_the_running_one_with_the_largest_key_and_requeues_it_by_its_key():
    # 4 usable blocks of 16 tokens; two sequences of 32 prompt tokens hold them all
    scheduler = BlockScheduler(num_blocks=5, block_size=16, max_num_seqs=4, priority=True)
    first, urgent = _prio(9, 0.0, prompt_tokens=32), _prio(0, 1.0, prompt_tokens=32)
    scheduler.add(first)
    assert scheduler.schedule().admitted == [first]
    scheduler.add(urgent)
    plan = scheduler.schedule()
    assert plan.admitted == [urgent] and plan.batch == [first, urgent]
    for s in plan.batch:
        append_token(s)  # each now needs a third block
    plan = scheduler.schedule()
    assert plan.preempted == [first]  # FCFS would have preempted the newest, ``urgent``
    assert plan.batch == [urgent]
    later = _prio(9, 5.0)
    scheduler.add(later)
    assert list(scheduler.waiting) == [first, later]  # back in its place, ahead of a later arrival


def test_the_fcfs_policy_still_preempts_the_newest():
    scheduler = BlockScheduler(num_blocks=5, block_size=16, max_num_seqs=4)
    first, urgent = _prio(9, 0.0, prompt_tokens=32), _prio(0, 1.0, prompt_tokens=32)
    scheduler.add(first)
    scheduler.add(urgent)
    for s in scheduler.schedule().batch:
        append_token(s)
    assert scheduler.schedule().preempted == [urgent]


def test_the_scheduling_policy_flag_sets_the_config_and_a_bad_one_names_the_field():
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["emulate-engine", "--scheduling-policy", "priority"])
    assert config_from_args(args).scheduling_policy == "priority"
    with pytest.raises(ValueError, match="scheduling_policy"):
        EmulatorConfig(scheduling_policy="lifo")
