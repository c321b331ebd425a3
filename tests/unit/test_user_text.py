"""The text a person meets first reads as plain words.

Every ``--help`` of every command (all subcommands, recursively, and the
emulator's standalone command), every config field description (the README's
config table) and every CRD description and validation message (``kubectl
explain``, ``kubectl apply`` errors) is free of reStructuredText markup, math
symbols and the papers' notation: a user knows "KV-cache overflow probability",
not ``ε_M``; "target batch size", not ``B_t``.  ``binbatch --version`` prints the
installed distribution's version.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from binbatch_operator.crd import build_crd
from binbatch_sidecar import cli
from binbatch_sidecar.config import SidecarConfig
from binbatch_sidecar.emulator import cli as emulator_cli

# Typographic punctuation reads fine in a terminal; every other non-ASCII character
# in help text is a math symbol (ε, τ, Φ, ⁻, ≤, ·, ×) a person has to decode.
TYPOGRAPHY = set("—–…‘’“”")
RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("reStructuredText literal or Markdown code", re.compile(r"`")),
    ("reStructuredText role", re.compile(r":[a-z]+:`")),
    ("reStructuredText bold or emphasis", re.compile(r"\*\*\S|(?<![\w*])\*[A-Za-z][^*]*\*(?![\w*])")),
    ("subscripted symbol (B_t, b_mem, D_SLA, N_max)", re.compile(r"(?<![\w$-])[A-Za-z]_[A-Za-z]+\b")),
    ("Greek letter spelled out (eps_M, tau(b), theta)",
     re.compile(r"\b(eps|tau|phi|theta|lambda|eta|alpha|beta)(_|\b)", re.I)),
    ("function notation (tau(b), l(b))", re.compile(r"\b[A-Za-z]\([a-z]\)")),
    ("a one-letter variable (k, b)", re.compile(r"(?<![\w$./-])[kbB](?![\w/-])")),
    ("a citation of the papers (Theorem, Lemma, Eq., Algorithm, the seeds)",
     re.compile(r"\b(Theorem|Lemma|Eq\.|Equation|Algorithm) ?\d|\bseeds?'s?\b(?! \()")),
)  # fmt: skip


def problems(text: str) -> list[str]:
    """What in ``text`` a person would not read as plain words (empty: none)."""
    found = [f"{why}: {m.group(0)!r}" for why, rule in RULES if (m := rule.search(text))]
    symbols = sorted({ch for ch in text if ord(ch) > 127 and ch not in TYPOGRAPHY})
    if symbols:
        found.append(f"non-ASCII symbol: {''.join(symbols)!r}")
    if "SMDP" in text and "semi-Markov" not in text:
        found.append("SMDP without its expansion (semi-Markov decision process)")
    return found


def parser_texts(parser: argparse.ArgumentParser, path: str) -> Iterator[tuple[str, str]]:
    """Every description, epilog and help of ``parser`` and its subcommands, recursively."""
    for where, text in ((f"{path} (description)", parser.description), (f"{path} (epilog)", parser.epilog)):
        if text:
            yield where, text
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.help:
                    yield f"{path} {choice.dest} (help line)", choice.help
            for name, sub in action.choices.items():
                yield from parser_texts(sub, f"{path} {name}")
        elif action.help and action.help is not argparse.SUPPRESS:
            yield f"{path} {'/'.join(action.option_strings) or action.dest}", action.help


def schema_texts(node: object, path: str, keys: tuple[str, ...] = ("description",)) -> Iterator[tuple[str, str]]:
    """Every string under one of ``keys`` in a JSON schema or CRD."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in keys and isinstance(value, str):
                yield f"{path} ({key})", value
            else:
                yield from schema_texts(value, f"{path}.{key}", keys)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from schema_texts(value, f"{path}[{i}]", keys)


def all_texts() -> list[tuple[str, str]]:
    return [
        *parser_texts(cli.build_parser(), "binbatch"),
        *parser_texts(emulator_cli.build_parser(), "python -m binbatch_sidecar.emulator"),
        *schema_texts(SidecarConfig.model_json_schema(by_alias=True), "config"),
        *schema_texts(build_crd(), "CRD", keys=("description", "message")),
    ]


def test_help_and_descriptions_are_plain_words():
    texts = all_texts()
    assert len(texts) > 150  # the walk reached the subcommands and the nested schemas
    assert any(where.startswith("binbatch bench theory --seed") for where, _ in texts)
    assert any(where.startswith("binbatch emulate-engine --step-a") for where, _ in texts)
    assert any("overflowPerMille" in where for where, _ in texts if where.startswith("CRD"))
    bad = [f"{where}: {why}\n    {text}" for where, text in texts for why in problems(text)]
    assert not bad, "text a person meets first uses markup or notation:\n" + "\n".join(bad)


@pytest.mark.parametrize("text", [
    "ε_M: accepted probability of KV-cache overflow",
    "Time-per-output-token SLO D_SLA; 0 means none.",
    "Number of bins k (the maximum number of buckets)",
    "fixed step time a in tau(b) = a + c*b",
    "batch time l(b) = αb + β",
    "more bins raise throughput, Theorem 4.2",
    "The ``binbatch`` command.",
    "see :class:`EmulatorConfig`",
    "**Engine down**: held",
    "B_t holds the last size",
    "eps_M of 0.01",
    "b ≤ b_max",
    "Batches in the engine at once (the seed's servers).",
    "sends at the SMDP control limit",
])  # fmt: skip
def test_the_check_catches_notation(text):
    assert problems(text), text


@pytest.mark.parametrize("text", [
    "Accepted probability that a batch overflows the KV cache, per mille (10 means 1%).",
    "gRPC port (default $BINBATCH_GRPC_PORT, else server.grpcPort; fixed until restart)",
    "a step with n running sequences takes step-a + step-c * n (default 0.002)",
    "random seed (default 1)",
    "Smdp: request-seconds of waiting one engine-second is worth",
    "the threshold of a semi-Markov decision process (SMDP)",
    "Largest JSON body; vLLM refuses bodies over 1 MiB — split it",
    "expose the pre-0.10 names (gpu_cache_usage_perc, time_per_output_token_seconds)",
    "Label matcher appended to every metric, e.g. '{pod=\"x\"}'.",
])  # fmt: skip
def test_the_check_passes_plain_words(text):
    assert problems(text) == []


def test_version_prints_the_installed_distribution():
    script = Path(sys.executable).parent / "binbatch"
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith(f"binbatch {metadata.version('binbatch')} (Python {sys.version.split()[0]};"), line
    assert f"grpcio {metadata.version('grpcio')}" in line
    assert out.stderr == ""
