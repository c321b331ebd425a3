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
