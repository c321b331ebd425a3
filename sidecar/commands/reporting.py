"""How the benches and the demo speak: progress lines on stderr, then tables or one JSON document."""

from __future__ import annotations

import argparse
import json
import sys


def progress(args: argparse.Namespace, command: str):
    """Progress lines on stderr, prefixed with the command (none with --quiet)."""

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"[{command}] {msg}", file=sys.stderr, flush=True)

    return say


def report(args: argparse.Namespace, doc: dict, print_tables, plot: str | None = None) -> None:
    """Write ``doc`` as JSON with --json, else the command's tables (and where the plot went)."""
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    print_tables()
    if plot:
        print(f"plot written to {plot}")
