"""The ShareGPT workload: complete records of the cut file, token counts, fixed disjoint splits."""

from __future__ import annotations

from binbatch_sidecar.bench import sharegpt


def test_a_cut_array_keeps_its_complete_records() -> None:
    text = '[\n {"id": "a", "v": [1, 2]},\n {"id": "b", "v": "x, y"},\n {"id": "c", "v": [3'
    assert [r["id"] for r in sharegpt._records(text)] == ["a", "b"]


def test_tokens_are_words_digits_and_other_characters() -> None:
    assert sharegpt.count_tokens("Hello, world!") == 4
    assert sharegpt.count_tokens("x = 1024") == 6  # x, =, 1, 0, 2, 4
    assert sharegpt.count_tokens("你好") == 2


def test_the_split_depends_only_on_the_prompt_as_worded() -> None:
    assert sharegpt.split_of("Write a poem  about\nthe sea") == sharegpt.split_of("Write a poem about the sea")
    shares = [sharegpt.split_of(f"prompt {i}") for i in range(4000)]
    assert 0.22 < shares.count("eval") / len(shares) < 0.28


def test_the_installed_dataset_gives_about_11k_first_turns_in_disjoint_splits() -> None:
    turns = sharegpt.first_turns()
    assert 11_000 <= len(turns) <= 11_300
    train, held_out = sharegpt.split("train"), sharegpt.split("eval")
    assert len(train) + len(held_out) == len(turns)
    assert not {t.prompt for t in train} & {t.prompt for t in held_out}
    assert all(t.output_tokens == sharegpt.count_tokens(t.answer) > 0 for t in held_out[:200])
