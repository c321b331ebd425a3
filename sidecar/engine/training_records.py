"""Training records for the learned length predictor: one JSON object a line.

    {"prompt": "...", "output_tokens": 312}
    {"messages": [{"role": "user", "content": "..."}], "output_tokens": 48, "request_class": "chat", "max_tokens": 1024}

    {"features": {"indices": [5, 91, ...], "values": [0.21, 0.4, ...]}, "output_tokens": 97}

Exactly one of ``prompt`` (a string), ``messages`` (a list of {role, content}
strings) and ``features`` (a request's hashed feature vector, what a sidecar
keeps of a completion: ``binbatch predictor export`` writes these, no text), and
``output_tokens`` (a whole number >= 0); ``request_class`` and ``max_tokens``
are optional and become features as they do in the sidecar (a ``features``
record has them hashed in already).  A chat is read as the sidecar reads it
(``chat_text``).  Every bad line is reported, each naming its line and field
(``RecordsError``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ..core import length_model
from ..core.request import chat_text

MAX_TOKENS_LIMIT = 1_000_000  # bins.maxOutputTokens' bound
ERRORS_SHOWN = 20  # a file with more bad lines names the first ones and counts the rest
MAX_FEATURE_SLOTS = 4096  # a hashed record's slots, at most (featurize makes a few hundred)


@dataclass(frozen=True, slots=True)
class Record:
    prompt: str
    output_tokens: int
    request_class: str = ""
    max_tokens: int = 0
    hashed: length_model.Features | None = None  # a sidecar's record: the features, no prompt


def hashed_record(indices: Sequence[int], values: Sequence[float], output_tokens: int) -> Record:
    """A record of hashed features; ``ValueError("features.<field>: problem")`` when they are not a feature vector."""
    if len(indices) != len(values):
        raise ValueError(f"features.values: {len(values)} values for {len(indices)} indices")
    if not 0 < len(indices) <= MAX_FEATURE_SLOTS:
        raise ValueError(f"features.indices: 1 to {MAX_FEATURE_SLOTS} slots expected, got {len(indices)}")
    if not all(_whole(i, 0, length_model.N_FEATURES - 1) for i in indices):
        raise ValueError(f"features.indices: whole numbers in [0, {length_model.N_FEATURES - 1}] expected")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise ValueError("features.values: finite numbers expected")
    if not _whole(output_tokens, 0, 10**9):
        raise ValueError(f"output_tokens: must be a whole number >= 0, got {output_tokens!r}")
    features = length_model.Features(np.asarray(indices, np.int32), np.asarray(values, np.float32))
    return Record("", output_tokens, hashed=features)


class RecordsError(ValueError):
    """Bad records: ``problems`` holds one ``FILE:LINE: field: problem`` each."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        shown = self.problems[:ERRORS_SHOWN]
        more = len(self.problems) - len(shown)
        super().__init__("\n".join(shown + ([f"... and {more} more"] if more else [])))


def _whole(value: object, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def parse_record(obj: object) -> Record:
    """One decoded line as a ``Record``; ``ValueError("field: problem")`` otherwise."""
    if not isinstance(obj, dict):
        raise ValueError("<line>: expected a JSON object")
    if sum(k in obj for k in ("prompt", "messages", "features")) != 1:
        raise ValueError("prompt: exactly one of prompt, messages and features is needed")
    if "features" in obj:
        return _parse_hashed(obj)
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise ValueError("prompt: must be a string")
        text = obj["prompt"]
    else:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list of {role, content}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}]: must be an object with string role and content")
        text = chat_text((m["role"], m["content"]) for m in messages)
    if "output_tokens" not in obj:
        raise ValueError("output_tokens: missing")
    if not _whole(obj["output_tokens"], 0, 10**9):
        raise ValueError(f"output_tokens: must be a whole number >= 0, got {obj['output_tokens']!r}")
    request_class = obj.get("request_class", "")
    if not isinstance(request_class, str):
        raise ValueError("request_class: must be a string")
    max_tokens = obj.get("max_tokens", 0)
    if not _whole(max_tokens, 0, MAX_TOKENS_LIMIT):
        raise ValueError(f"max_tokens: must be a whole number in [0, {MAX_TOKENS_LIMIT}], got {max_tokens!r}")
    return Record(text, obj["output_tokens"], request_class, max_tokens)


def _parse_hashed(obj: dict) -> Record:
    for key in ("request_class", "max_tokens"):
        if key in obj:
            raise ValueError(f"{key}: not with features (a hashed record has it among its features)")
    features = obj["features"]
    if not isinstance(features, dict) or not isinstance(features.get("indices"), list) \
            or not isinstance(features.get("values"), list):
        raise ValueError("features: must be an object {indices: [...], values: [...]}")
    if "output_tokens" not in obj:
        raise ValueError("output_tokens: missing")
    return hashed_record(features["indices"], features["values"], obj["output_tokens"])


def read_records(path: str | os.PathLike[str]) -> list[Record]:
    """Every record of a JSONL file (blank lines skipped); ``RecordsError`` lists every bad line."""
    name, records, problems = os.fspath(path), [], []
    with open(path, encoding="utf-8", errors="strict") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(parse_record(json.loads(line)))
            except json.JSONDecodeError as exc:
                problems.append(f"{name}:{n}: <line>: not JSON ({exc.msg} at column {exc.colno})")
            except ValueError as exc:
                problems.append(f"{name}:{n}: {exc}")
    if problems:
        raise RecordsError(problems)
    if not records:
        raise RecordsError([f"{name}: no records"])
    return records


def write_records(path: str | os.PathLike[str], records: Iterable[Record]) -> int:
    """Write records as JSONL; how many."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            obj: dict[str, object] = {"prompt": r.prompt, "output_tokens": r.output_tokens}
            if r.hashed is not None:  # float32 values: 8 significant digits read back the same float32
                obj = {"features": {"indices": r.hashed.indices.tolist(),
                                    "values": [float(f"{v:.8g}") for v in r.hashed.values.tolist()]},
                       "output_tokens": r.output_tokens}  # fmt: skip
            if r.request_class:
                obj["request_class"] = r.request_class
            if r.max_tokens:
                obj["max_tokens"] = r.max_tokens
            f.write(json.dumps(obj, ensure_ascii=False) + "\n")
            n += 1
    return n


def features(records: Sequence[Record]) -> list[length_model.Features]:
    return [r.hashed if r.hashed is not None else length_model.featurize(r.prompt, r.request_class, r.max_tokens)
            for r in records]  # fmt: skip


def train(records: Sequence[Record]) -> length_model.LengthModel:
    """A model fitted to ``records`` (what ``binbatch predictor train`` writes)."""
    return length_model.fit(features(records), [float(r.output_tokens) for r in records])
