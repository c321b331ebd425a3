"""The ``binbatch`` command: the top-level parser and ``main()``.

Each command group lives in its own module under ``binbatch_sidecar.commands`` (``bench``,
``demo``, ``predictor``, ``serve`` for ``sidecar``) and registers its subcommands here;
``emulate-engine`` comes from the emulator, which imports no sidecar code.

Exit codes (docs/api.md, 'Version and exit codes'): 0 success; 1 the sidecar cut off requests
when its drain grace ran out, or ``bench chaos`` found a lost, duplicated or hung
request; 2 it could not start (a bad flag, environment variable or config file,
or a port it cannot listen on), one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from . import emulator
from .commands import bench, demo, predictor, serve
from .commands.arguments import EXIT_CANNOT_START
from .commands.bench import (  # noqa: F401 - tests read these names from binbatch_sidecar.cli
    _CHAOS_SCENARIOS,
    _E2E_CLIENTS,
    _E2E_SCENARIOS,
    _missing_operator_bench_module,
)
from .server.ports import EXIT_CANNOT_LISTEN, ListenError

DESCRIPTION = (
    "binbatch: multi-bin batching for vLLM. Run the batching sidecar in front of a vLLM server, "
    "the vLLM engine emulator, the demo, or the benchmarks."
)
COMMAND_GROUPS = (serve, demo, bench, predictor)  # the order `binbatch --help` lists them in


def command_lines(parser: argparse.ArgumentParser, path: str = "binbatch") -> list[tuple[str, str]]:
    """Every runnable command under ``parser`` with its one-line help: (``binbatch bench e2e``, help)."""
    out: list[tuple[str, str]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                below = command_lines(sub, f"{path} {name}")
                out.extend(below or [(f"{path} {name}", helps[name])])
    return out


def _epilog(parser: argparse.ArgumentParser) -> str:
    """The list of commands ``binbatch --help`` ends with, one line each (nested ones in full)."""
    lines = [(cmd.removeprefix("binbatch "), text) for cmd, text in command_lines(parser)]
    width = max(len(cmd) for cmd, _ in lines) + 2
    listed = "\n".join(f"  {cmd:<{width}}{text}" for cmd, text in lines)
    return f"commands:\n{listed}\n\n'binbatch COMMAND --help' describes a command and its flags."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="binbatch", usage="%(prog)s [-h] [--version] COMMAND ...",
                                description="\n".join(textwrap.wrap(DESCRIPTION, 78)),
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--version", action=_VersionAction, help="print the installed version and exit")
    # prog: subcommands say "usage: binbatch demo", not the top-level usage line
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS, prog="binbatch")
    for group in COMMAND_GROUPS:
        group.register(sub)
    emulator.add_cli(sub)
    p.epilog = _epilog(p)
    return p


def version_text() -> str:
    """``binbatch --version``: the installed distribution's version, then Python's
    and the serving libraries' (what a bug report needs)."""
    from importlib import metadata

    def installed(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    libs = ", ".join(f"{d} {installed(d)}" for d in ("grpcio", "aiohttp", "pydantic", "prometheus-client", "kopf"))
    return f"binbatch {installed('binbatch')} (Python {sys.version.split()[0]}; {libs})"


class _VersionAction(argparse.Action):
    """``--version``, computed only when asked (reading package metadata is not free)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001 - argparse's signature
        print(version_text())
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ListenError as exc:  # a port in use: one line, not a traceback
        print(f"binbatch {args.command}: {exc}", file=sys.stderr)
        return EXIT_CANNOT_LISTEN


if __name__ == "__main__":
    sys.exit(main())
