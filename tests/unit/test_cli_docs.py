"""The command line reads as the docs do, and neither can drift from the other.

Every ``binbatch ...`` command the README and the docs show (in a code span or a
line of a code block) names a command that exists, with flags that command has,
and its ``--help`` exits 0; every command ``binbatch --help`` lists is shown
somewhere under docs/, and ``binbatch --help`` gives each one a single line.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from binbatch_sidecar import cli

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
SPAN = re.compile(r"`(?:\.venv/bin/)?(binbatch(?: [^`]*)?)`")
FENCE = re.compile(r"^```")
CODE_LINE = re.compile(r"^\s*(?:\$ )?(?:\.venv/bin/)?(binbatch(?: .*)?)$")
WORD = re.compile(r"[a-z][a-z0-9-]*")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _commands_in(text: str) -> list[str]:
    """Each ``binbatch ...`` command in ``text``: code spans, and code-block lines (with their
    continuation lines) that start with one; a span or line may hold several, after ``;``."""
    found: list[str] = []
    in_block = False
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line.strip()):
            in_block = not in_block
        elif in_block:
            m = CODE_LINE.match(line)
            if m:
                cmd = m.group(1)
                while cmd.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    cmd = cmd.rstrip()[:-1].rstrip() + " " + lines[i].strip()
                found.append(re.split(r"\s(?:#|&&|\|\|?|&)(?:\s|$)", cmd)[0])
        else:
            found.extend(m.group(1) for m in SPAN.finditer(line))
        i += 1
    return [part.strip() for cmd in found for part in re.split(r";\s*(?=binbatch\b)", cmd)]


def _mentions() -> list[tuple[str, str]]:
    """(where, command) for every command the README and the docs show."""
    return [(f"{path.relative_to(ROOT)}", cmd) for path in DOC_FILES for cmd in _commands_in(path.read_text())]


def _words(cmd: str) -> list[str]:
    """The command's words: ``binbatch bench e2e --engine URL`` -> [bench, e2e]."""
    words = []
    for token in cmd.split()[1:]:
        if not WORD.fullmatch(token):
            break
        words.append(token)
    return words


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _resolve(words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser ``binbatch <words>`` runs, and the words that name it (without words
    left over after a command that has no subcommands)."""
    parser, path = cli.build_parser(), []
    for word in words:
        sub = _subparsers(parser)
        if sub is None:
            break
        assert word in sub.choices, f"'binbatch {' '.join([*path, word])}': no such command ({', '.join(sub.choices)})"
        parser, path = sub.choices[word], [*path, word]
    return parser, path


MENTIONS = _mentions()


def test_the_docs_show_commands():
    """The walk is not vacuous: it finds spans, code-block lines and continuation lines."""
    commands = {cmd for _, cmd in MENTIONS}
    assert len(MENTIONS) > 30
    assert "binbatch bench e2e" in commands
    assert any(cmd.startswith("binbatch predictor train --records") for cmd in commands)  # a code block
    assert _commands_in("```sh\nbinbatch bench e2e --only chat \\\n  --repeats 2  # note\n```") == [
        "binbatch bench e2e --only chat --repeats 2"
    ]
    assert _commands_in("`binbatch demo --quick (run 1); binbatch bench sim`") == [
        "binbatch demo --quick (run 1)", "binbatch bench sim"
    ]  # fmt: skip


@pytest.mark.parametrize(("where", "cmd"), MENTIONS, ids=[f"{w}: {c[:60]}" for w, c in MENTIONS])
def test_a_command_the_docs_show_exists_with_its_flags(where, cmd, capsys):
    words = _words(cmd)
    parser, path = _resolve(words)
    assert path == words, f"{where}: {cmd!r}: 'binbatch {' '.join(path)}' takes no argument {words[len(path)]!r}"
    with pytest.raises(SystemExit) as done:
        cli.main([*path, "--help"])
    assert done.value.code == 0, f"{where}: 'binbatch {' '.join(path)} --help' exited {done.value.code}"
    assert capsys.readouterr().out.startswith(f"usage: binbatch{''.join(' ' + w for w in path)}")
    known = {opt for action in parser._actions for opt in action.option_strings}
    unknown = sorted(set(FLAG.findall(cmd)) - known)
    assert not unknown, f"{where}: {cmd!r}: 'binbatch {' '.join(path)}' has no {', '.join(unknown)}"


def test_a_made_up_command_or_flag_is_caught():
    with pytest.raises(AssertionError, match="no such command"):
        _resolve(_words("binbatch bench e2f --quick"))
    parser, path = _resolve(_words("binbatch bench e2e --engine URL"))
    assert path == ["bench", "e2e"] and "--engine" in parser._option_string_actions
    assert "--engin" not in parser._option_string_actions


def _not_in_docs(parser: argparse.ArgumentParser) -> list[str]:
    """The commands ``parser`` lists that no page under docs/ shows."""
    shown = {tuple(_words(cmd)) for where, cmd in MENTIONS if where.startswith("docs")}
    return [cmd for cmd, _ in cli.command_lines(parser) if tuple(cmd.split()[1:]) not in shown]


def test_every_command_of_binbatch_help_is_shown_in_the_docs():
    commands = [cmd for cmd, _ in cli.command_lines(cli.build_parser())]
    assert "binbatch bench fleet-model" in commands and "binbatch emulate-engine" in commands
    missing = _not_in_docs(cli.build_parser())
    assert not missing, f"commands no page under docs/ shows: {missing}"


def test_an_undocumented_command_is_caught():
    parser = cli.build_parser()
    bench = _subparsers(parser).choices["bench"]
    _subparsers(bench).add_parser("undocumented", help="a bench no page shows")
    assert _not_in_docs(parser) == ["binbatch bench undocumented"]


def test_binbatch_help_lists_every_command_on_one_line(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: binbatch [-h] [--version] COMMAND ...")
    listed = out.split("\ncommands:\n", 1)[1].splitlines()
    for cmd, text in cli.command_lines(cli.build_parser()):
        name = cmd.removeprefix("binbatch ")
        line = next((ln for ln in listed if ln.split(f"  {name}  ", 1)[0] == ""), None)
        assert line is not None, f"binbatch --help does not list {name!r}"
        assert text and line.rstrip().endswith(text), f"{name}: its help is not on its line: {line!r}"
        assert len(line) <= 79, f"{name}: its line is {len(line)} characters: {line!r}"


def test_each_command_has_its_own_description(capsys):
    """The one line is the summary; ``binbatch <command> --help`` says more."""
    for cmd, text in cli.command_lines(cli.build_parser()):
        parser, _ = _resolve(cmd.split()[1:])
        assert parser.description and len(parser.description) > len(text), cmd
