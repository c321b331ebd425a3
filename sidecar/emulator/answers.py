"""Recorded answer lengths (``--answer-lengths FILE``): replaying real traffic.

A replay of recorded conversations (ShareGPT) needs each answer to end at its
recorded length without anyone in front of the engine knowing it: forcing the
length through the request (``max_tokens`` + ``ignore_eos``, as vLLM's serving
benchmark does) hands a length predictor the truth, since ``max_tokens`` caps
every prediction.  So the engine learns the lengths from a file the sidecar never
sees, keyed by the prompt, and a prompt it finds there ends with EOS after its
recorded count of tokens, as the recorded model's answer did -- within the
request's ``max_tokens`` and not before its ``min_tokens`` (``ignore_eos`` still
ignores it).  Other prompts draw their length as before.

The file is JSON Lines, one answer a line::

    {"prompt_sha256": "<64 hex digits>", "output_tokens": 412}

``prompt_sha256`` is the SHA-256 (hex) of the UTF-8 prompt text as the client
wrote it: the ``prompt`` string of ``/v1/completions``, or the content of the last
``user`` message of ``/v1/chat/completions`` (without the chat template, which is
the engine's).  :func:`prompt_key` computes it.  A prompt given as token ids has
no text and so no recorded answer.
"""

from __future__ import annotations

import hashlib
import json
import re

_HEX64 = re.compile(r"[0-9a-f]{64}")


class AnswerLengthsError(ValueError):
    """The answer-lengths file cannot be read or a line is malformed (the message names it)."""


def prompt_key(text: str) -> str:
    """The key of a prompt's recorded answer: SHA-256 of its UTF-8 text, hex."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_answer_lengths(path: str) -> dict[str, int]:
    """The recorded answer lengths of ``path`` (the module docstring's format), by key.

    Raises ``AnswerLengthsError`` naming the file, the line and the field (the CLI
    puts ``--answer-lengths`` before it)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as err:
        raise AnswerLengthsError(f"{path}: {err.strerror}") from None
    except UnicodeDecodeError:
        raise AnswerLengthsError(f"{path}: not UTF-8 text") from None
    out: dict[str, int] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise AnswerLengthsError(f"{where}: not JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise AnswerLengthsError(f"{where}: expected an object with prompt_sha256 and output_tokens")
        key, tokens = record.get("prompt_sha256"), record.get("output_tokens")
        if not (isinstance(key, str) and _HEX64.fullmatch(key)):
            raise AnswerLengthsError(f"{where}: prompt_sha256 must be 64 lowercase hex digits, got {key!r}")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise AnswerLengthsError(f"{where}: output_tokens must be a whole number >= 1, got {tokens!r}")
        out[key] = tokens
    return out
