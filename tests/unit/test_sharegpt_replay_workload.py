"""The ShareGPT replay the e2e bench sends (workloads.sharegpt_replay) and how its
answers are made to end at their recorded lengths (bench_clients.length_fields)."""

from __future__ import annotations

import json

import pytest

from binbatch_sidecar.bench import sharegpt, workloads
from binbatch_sidecar.bench.bench_clients import RECORDED_STOPS, length_fields
from binbatch_sidecar.bench.bench_processes import write_answer_lengths
from binbatch_sidecar.emulator.answers import load_answer_lengths, prompt_key


def test_the_replay_sends_eval_prompts_as_written_each_once_with_the_clients_cap():
    replay = workloads.sharegpt_replay(600, rate=4.0, seed=1)
    held_out = {t.prompt: t for t in reversed(sharegpt.split("eval"))}  # a prompt asked twice: its first answer
    assert len({r.prompt for r in replay}) == 600 and all(r.prompt in held_out for r in replay)
    assert all(sharegpt.count_tokens(r.prompt) <= workloads.SHAREGPT_PROMPT_TOKENS for r in replay)
    assert {r.max_tokens for r in replay} == {workloads.SHAREGPT_MAX_TOKENS}
    assert all(r.output_tokens == min(held_out[r.prompt].output_tokens, 1024) for r in replay)
    arrivals = [r.arrival_s for r in replay]
    assert arrivals == sorted(arrivals) and 600 / 4.0 * 0.8 < arrivals[-1] < 600 / 4.0 * 1.2


def test_a_longer_replay_starts_with_a_shorter_ones_turns_and_a_seed_fixes_them():
    short, long = workloads.sharegpt_turns(50, seed=1), workloads.sharegpt_turns(200, seed=1)
    assert long[:50] == short and workloads.sharegpt_turns(50, seed=2) != short
    with pytest.raises(ValueError, match="count"):
        workloads.sharegpt_turns(10**6, seed=1)


def test_a_scaled_replay_shortens_the_answers_and_the_cap_alike():
    full, quarter = (workloads.sharegpt_replay(100, rate=None, seed=1, scale=s) for s in (1.0, 0.25))
    assert {r.max_tokens for r in quarter} == {256}
    assert [r.prompt for r in quarter] == [r.prompt for r in full]
    assert all(max(1, round(f.output_tokens * 0.25)) == q.output_tokens for f, q in zip(full, quarter) if f.output_tokens < 1024)


def test_how_each_answer_is_made_to_end_at_its_length():
    synthetic = workloads.build("chat", 1, rate=None, seed=1)[0]
    (recorded,) = workloads.sharegpt_replay(1, rate=None, seed=1)
    assert length_fields(synthetic, recorded=False) == {"max_tokens": synthetic.output_tokens, "ignore_eos": True}
    # the embedded engine knows the recorded length: the request says only the client's cap
    assert length_fields(recorded, recorded=False) == {"max_tokens": 1024}
    # a real vLLM does not: min_tokens holds the answer to it, the stop strings end it there
    assert length_fields(recorded, recorded=True) == {"max_tokens": 1024, "min_tokens": recorded.output_tokens,
                                                       "stop": list(RECORDED_STOPS)}  # fmt: skip
    assert len(RECORDED_STOPS) <= 4  # vLLM takes at most four (OpenAI's limit)


def test_the_answers_file_is_what_the_emulator_reads(tmp_path):
    replay = workloads.sharegpt_replay(20, rate=None, seed=1)
    path = tmp_path / "answers.jsonl"
    write_answer_lengths(path, ((r.prompt, r.output_tokens) for r in replay))
    assert load_answer_lengths(str(path)) == {prompt_key(r.prompt): r.output_tokens for r in replay}
    assert all(set(json.loads(line)) == {"prompt_sha256", "output_tokens"} for line in path.read_text().splitlines())
