"""The ``binbatch`` command."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace


def _progress(quiet: bool):
    def say(msg: str) -> None:
        if not quiet:
            print(f"[bench theory] {msg}", file=sys.stderr, flush=True)

    return say


def _bench_theory(args: argparse.Namespace) -> int:
    from .bench import theory

    cfg = theory.TheoryConfig(seed=args.seed)
    if args.requests is not None:
        cfg = replace(cfg, requests=args.requests)
    doc = theory.run(cfg, _progress(args.quiet))
    if args.plot:
        theory.plot(doc, args.plot)
        doc["plot"] = args.plot
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        theory.print_tables(doc)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="binbatch", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks: tables, JSON and plots")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    th = bench_sub.add_parser(
        "theory", help="reproduce the seeds' multi-bin and SMDP results on the scheduling core"
    )
    th.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    th.add_argument("--plot", metavar="FILE.png", help="also draw the four figures to this PNG")
    th.add_argument("--requests", type=_positive_int, help="requests per saturated-throughput run (default 128000)")
    th.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    th.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    th.set_defaults(func=_bench_theory)
    return p


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
