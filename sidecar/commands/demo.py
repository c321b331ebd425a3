"""``binbatch demo``: your engine called directly vs through the sidecar, on the embedded engine."""

from __future__ import annotations

import argparse

from .arguments import positive_int
from .reporting import progress, report


def _demo(args: argparse.Namespace) -> int:
    from ..bench import demo, e2e

    cfg = demo.config(quick=args.quick, seed=args.seed, requests=args.requests, repeats=args.repeats,
                      load_requests=args.load_requests)
    say = progress(args, "demo")
    doc = demo.run(cfg, say)
    if args.plot:
        e2e.plot({**doc, "_setup": doc["setup"]}, args.plot)
    report(args, doc, lambda: demo.print_report(doc), args.plot)
    return 0



def register(sub: argparse._SubParsersAction) -> None:
    """Add ``demo`` to the top-level subparsers."""
    dm = sub.add_parser(
        "demo", help="your engine called directly vs through the sidecar",
        description="Your engine called directly vs through the sidecar, one win at a time, on the embedded engine "
                    "(~4.5 min; --quick < 1 min).",
    )
    dm.add_argument("--plot", metavar="FILE.png", default="demo.png",
                    help="draw latency and goodput vs load, direct and sidecar (default demo.png; '' for none)")
    dm.add_argument("--quick", action="store_true", help="the seconds-long version (as in the test suite)")
    dm.add_argument("--requests", type=positive_int, help="requests per burst run (default 64)")
    dm.add_argument("--load-requests", type=positive_int, help="requests per Poisson load run (default 256)")
    dm.add_argument("--repeats", type=positive_int, help="interleaved repeats of every run (default 2)")
    dm.add_argument("--seed", type=int, default=1, help="random seed of the workloads (default 1)")
    dm.add_argument("--json", action="store_true", help="print one JSON document {setup, runs, ratios, wins}")
    dm.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    dm.set_defaults(func=_demo)
