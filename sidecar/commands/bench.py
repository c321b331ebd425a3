"""``binbatch bench ...``: the benchmarks (docs/benchmarks.md), each printing tables or, with --json, one document."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from dataclasses import replace

from .arguments import EXIT_CANNOT_START, byte_size, cpu_list, int_in, load_fraction, positive_float, positive_int, share
from .reporting import progress, report

_CHAOS_SCENARIOS = ("overload", "engine_kill", "config_churn", "sigterm", "metrics_faults")
# bench e2e's scenario keys and shapes (bench/e2e.py SCENARIO_NAMES; the CLI imports benches lazily)
_E2E_SCENARIOS = ("chat", "short", "mixed", "system", "chat@burst", "short@ample", "mixed@gang", "system@burst",
                  "sharegpt")  # fmt: skip
_E2E_CLIENTS = ("direct", "priority", "hint", "engine-order", "packed", "online", "free", "default", "default-http",
                "ideal1", "ideal4", "ideal8", "gang1", "gang4", "gang8", "learned", "learned-http", "cold",
                "learned-engine-order")  # fmt: skip


def _bench_theory(args: argparse.Namespace) -> int:
    from ..bench import theory

    cfg = theory.TheoryConfig(seed=args.seed)
    if args.requests is not None:
        cfg = replace(cfg, requests=args.requests)
    doc = theory.run(cfg, progress(args, "bench theory"))
    if args.plot:
        theory.plot(doc, args.plot)
        doc["plot"] = args.plot
    report(args, doc, lambda: theory.print_tables(doc), args.plot)
    return 0


def _bench_chaos(args: argparse.Namespace) -> int:
    from ..bench import chaos

    cfg = chaos.configure(
        args.quick, overload_seconds=args.overload_seconds, outage_seconds=args.outage_seconds,
        phase_seconds=args.phase_seconds, scenarios=tuple(args.only) if args.only else None,
    )  # fmt: skip
    say = progress(args, "bench chaos")
    doc = chaos.run(cfg, say)
    report(args, doc, lambda: chaos.print_tables(doc))
    return 0 if doc["lost"] == doc["duplicated"] == doc["hung"] == 0 else 1


def _bench_tenants(args: argparse.Namespace) -> int:
    from ..bench import tenants

    cfg = tenants.TenantsConfig()
    if args.quick:
        cfg = cfg.quick()
    if args.phase_seconds is not None:
        cfg = replace(cfg, phase_seconds=args.phase_seconds)
    doc = tenants.run(cfg, progress(args, "bench tenants"))
    report(args, doc, lambda: tenants.print_tables(doc))
    return 0


def _bench_sim(args: argparse.Namespace) -> int:
    from ..bench import sim

    cfg = sim.SimBenchConfig(seed=args.seed)
    if args.requests is not None:
        cfg = replace(cfg, requests=args.requests)
    return sim.main(args.json, cfg=cfg)


def _bench_e2e(args: argparse.Namespace) -> int:
    from ..bench import e2e

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
    if args.sidecar_cpus:
        from ..bench.chaos_processes import cpus_left

        try:
            cpus_left(args.sidecar_cpus, frozenset(os.sched_getaffinity(0)))
        except ValueError as exc:
            given = ",".join(map(str, sorted(args.sidecar_cpus)))
            raise SystemExit(f"binbatch bench e2e: --sidecar-cpus {given}: {exc}") from None
        cfg = replace(cfg, sidecar_cpus=args.sidecar_cpus)
    if args.samples:
        try:
            open(args.samples, "w", encoding="utf-8").close()  # each run appends to it: start empty
        except OSError as exc:
            raise SystemExit(f"binbatch bench e2e: --samples {args.samples}: {exc.strerror or exc}") from None
        cfg = replace(cfg, samples_path=args.samples)
    if cfg.capacity_requests < 3 * cfg.capacity_concurrency:
        raise SystemExit(f"binbatch bench e2e: --capacity-requests must be at least 3x --capacity-concurrency "
                         f"(warm-up, window, drain), got {cfg.capacity_requests} for {cfg.capacity_concurrency}")
    say = progress(args, "bench e2e")
    doc = e2e.run(cfg, say)
    if args.plot:
        e2e.plot(doc, args.plot)
    # the setup too: a result file keeps what the figures came from (engine, load, capacity, the notes)
    report(args, {"setup": doc.get("_setup", {}), "runs": doc["runs"], "ratios": doc["ratios"]}, lambda: e2e.print_tables(doc),
            args.plot)  # fmt: skip
    return 0


def _bench_overhead(args: argparse.Namespace) -> int:
    from ..bench import overhead

    cfg = overhead.quick() if args.quick else overhead.OverheadConfig()
    cfg = replace(cfg, profile=args.profile) if args.profile else cfg
    say = progress(args, "bench overhead")
    doc = overhead.run(cfg, say)
    report(args, {k: doc[k] for k in overhead.JSON_KEYS}, lambda: overhead.print_table(doc))
    return 0


def _bench_slowloris(args: argparse.Namespace) -> int:
    from ..bench import slowloris

    cfg = slowloris.SlowlorisConfig(connections=args.connections, max_connections=args.max_connections,
                                    read_timeout_ms=args.read_timeout_ms, requests=args.requests)  # fmt: skip
    doc = slowloris.run(cfg, progress(args, "bench slowloris"))
    report(args, doc, lambda: slowloris.print_table(doc))
    return 0


def _bench_memory(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("psutil") is None:
        print(f"binbatch bench memory: needs psutil (not installed): pip install psutil, or {OPERATOR_BENCH_EXTRA}",
              file=sys.stderr)  # fmt: skip
        return EXIT_CANNOT_START
    from ..bench import big_posts

    cfg = big_posts.MemoryConfig(posts=args.posts, body_bytes=args.bytes, max_request_bytes=args.bytes)
    cfg = big_posts.quick(cfg) if args.quick else cfg
    doc = big_posts.run(cfg, progress(args, "bench memory"))
    report(args, doc, lambda: big_posts.print_table(doc))
    return 0 if doc["unanswered"] == 0 and doc["all_alive"] else 1


def _bench_liar(args: argparse.Namespace) -> int:
    from ..bench import liar

    cfg = liar.LiarConfig(seed=args.seed, load=args.load)
    cfg = liar.quick(cfg) if args.quick else cfg
    cfg = replace(cfg, requests=args.requests) if args.requests else cfg
    cfg = replace(cfg, repeats=args.repeats) if args.repeats else cfg
    doc = liar.run(cfg, progress(args, "bench liar"))
    report(args, doc, lambda: liar.print_table(doc))
    return 0 if doc["failures"] == 0 else 1


_FUZZ_TARGETS = ("http", "grpc", "config")  # bench/fuzz.py TARGETS


def _fuzz_targets(text: str) -> tuple[str, ...]:
    targets = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in targets if t not in _FUZZ_TARGETS]
    if bad or not targets or len(set(targets)) != len(targets):
        raise argparse.ArgumentTypeError(f"a comma-separated list of distinct targets from {','.join(_FUZZ_TARGETS)}, "
                                         f"got {text!r}")  # fmt: skip
    return targets


def _bench_fuzz(args: argparse.Namespace) -> int:
    from ..bench import fuzz

    cfg = fuzz.FuzzConfig(inputs=args.inputs, seed=args.seed, targets=args.targets, concurrency=args.concurrency)
    doc = fuzz.run(cfg, progress(args, "bench fuzz"))
    report(args, doc, lambda: fuzz.print_table(doc))
    return 0 if fuzz.passed(doc) else 1


def _bench_predictor(args: argparse.Namespace) -> int:
    from ..bench import predictor, sharegpt

    say = progress(args, "bench predictor")
    try:
        doc = predictor.run(predictor.PredictorBenchConfig(seed=args.seed), say)
    except sharegpt.DatasetMissing as exc:
        print(f"binbatch bench predictor: {exc}", file=sys.stderr)
        return EXIT_CANNOT_START
    report(args, doc, lambda: predictor.print_tables(doc))
    return 0


def _bench_fleet_model(args: argparse.Namespace) -> int:
    from ..bench import fleet_model, sharegpt

    say = progress(args, "bench fleet-model")
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
    report(args, doc, lambda: fleet_model.print_tables(doc))
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
    from ..bench import fleet

    cfg = fleet.quick() if args.quick else fleet.FleetConfig()
    cfg = replace(cfg, policies=tuple(args.policies)) if args.policies else cfg
    cfg = replace(cfg, idle_seconds=args.idle_seconds) if args.idle_seconds else cfg
    cfg = replace(cfg, stats_interval=args.stats_interval) if args.stats_interval else cfg
    cfg = replace(cfg, failover_kills=args.failover) if args.failover else cfg
    cfg = replace(cfg, kubeconfig=args.kubeconfig, operator_kubeconfig=args.operator_kubeconfig,
                  audit_log=args.audit_log) if args.kubeconfig else cfg  # fmt: skip
    if args.kubeconfig is None and (args.operator_kubeconfig or args.audit_log):
        raise SystemExit("binbatch bench operator: --operator-kubeconfig and --audit-log need --kubeconfig (a real API server)")
    say = progress(args, "bench operator")
    doc = fleet.run(cfg, say)
    report(args, doc, lambda: fleet.print_table(doc))
    return 0



def register(sub: argparse._SubParsersAction) -> None:
    """Add ``bench`` and its subcommands to the top-level subparsers."""
    bench = sub.add_parser(
        "bench", help="the benchmarks: tables, JSON and plots",
        description="The benchmarks. Each prints tables, or one JSON document with --json; 'binbatch bench NAME "
                    "--help' describes one.",
    )
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    th = bench_sub.add_parser(
        "theory", help="reproduce the papers' results on the scheduling core",
        description="Reproduce the published multi-bin batching and semi-Markov (SMDP) dispatch results on the "
                    "scheduling core; --plot draws the four figures.",
    )
    th.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    th.add_argument("--plot", metavar="FILE.png", help="also draw the four figures to this PNG")
    th.add_argument("--requests", type=positive_int, help="requests per saturated-throughput run (default 128000)")
    th.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    th.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    th.set_defaults(func=_bench_theory)
    ch = bench_sub.add_parser(
        "chaos", help="faults against a sidecar and an engine emulator",
        description="Run the faults an adversary would try against a sidecar and an engine emulator, each a child "
                    "process on 127.0.0.1: overload, engine kill, config churn, SIGTERM, bad metrics. Exits 1 unless "
                    "lost, duplicated and hung are all 0.",
    )  # fmt: skip
    ch.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    ch.add_argument("--quick", action="store_true", help="the seconds-long version (as in the test suite)")
    ch.add_argument("--overload-seconds", type=positive_float, help="length of the 10x overload (default 60)")
    ch.add_argument("--outage-seconds", type=positive_float, help="engine down time before its restart (default 5)")
    ch.add_argument("--phase-seconds", type=positive_float, help="length of each metrics-fault phase (default 10)")
    ch.add_argument("--only", action="append", choices=_CHAOS_SCENARIOS, metavar="SCENARIO",
                    help=f"run only this scenario (repeatable): {', '.join(_CHAOS_SCENARIOS)}")  # fmt: skip
    ch.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ch.set_defaults(func=_bench_chaos)
    tn = bench_sub.add_parser(
        "tenants", help="one tenant's flood beside a steady tenant",
        description="A steady tenant at its fair share of 0.9 load beside a tenant flooding at 10x its share, on "
                    "the embedded engine through one sidecar: the steady tenant's p50/p99 E2E alone, in the flood, "
                    "and in the same flood without fair share (one tenant name for both); the flood's 429s "
                    "(~2 min; --quick < 30 s).",
    )  # fmt: skip
    tn.add_argument("--json", action="store_true", help="print one JSON document {setup, phases, ratios} instead of tables")
    tn.add_argument("--quick", action="store_true", help="the seconds-long version (as in the test suite)")
    tn.add_argument("--phase-seconds", type=positive_float, help="length of each phase (default 30)")
    tn.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    tn.set_defaults(func=_bench_tenants)
    sm = bench_sub.add_parser(
        "sim", help="the scheduler in front of a simulated KV-limited engine",
        description="Put the sidecar's scheduler in front of a simulated KV-limited engine at a few Poisson loads: "
                    "direct first, then continuous admission with the static size and with the memory sizer, and gang"
                    " mode (seconds).",
    )
    sm.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    sm.add_argument("--requests", type=positive_int, help="requests per load (default 1000)")
    sm.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    sm.set_defaults(func=_bench_sim)

    e2 = bench_sub.add_parser(
        "e2e", help="the sidecar vs your engine called directly, same run",
        description="The sidecar against calling the engine directly, same workload, same run, reported as ratios of "
                    "sidecar over direct; the embedded engine unless --engine URL (15-20 min; --quick about 2 min).",
    )  # fmt: skip
    e2.add_argument("--engine", metavar="URL", help="an OpenAI-compatible server (e.g. vLLM); default: the embedded engine")
    e2.add_argument("--priority-engine", metavar="URL",
                    help="the same engine and model as --engine, started with --scheduling-policy priority: the "
                         "'priority' client sends there, each request's true length its priority (vLLM's own "
                         "shortest-first, the sidecar's yardstick); without it that client is left out")  # fmt: skip
    e2.add_argument("--json", action="store_true", help="print one JSON document {setup, runs, ratios} instead of tables")
    e2.add_argument("--plot", metavar="FILE.png", help="also draw latency and goodput vs load to this PNG")
    e2.add_argument("--samples", metavar="FILE.jsonl",
                    help="also write each answered request to this file as a JSON line: scenario, load, client, "
                         "repeat, its index in the workload (the same request in every client's run), output "
                         "tokens, TTFT and E2E seconds")  # fmt: skip
    e2.add_argument("--quick", action="store_true", help="the seconds-long version (as in the test suite)")
    e2.add_argument("--repeats", type=positive_int, help="interleaved repeats of every run (default 2)")
    e2.add_argument("--requests", type=positive_int, help="requests per burst run (default 64)")
    e2.add_argument("--load-requests", type=positive_int, help="requests per Poisson load run (default 256)")
    e2.add_argument("--sharegpt-requests", type=positive_int,
                    help="ShareGPT first turns replayed per run (default 500)")  # fmt: skip
    e2.add_argument("--sharegpt-scale", type=share, metavar="SHARE",
                    help="shorten the ShareGPT answers and their 1024-token cap by this share (0, 1] for a slow "
                         "engine; the prompts stay as written (default 1)")  # fmt: skip
    e2.add_argument("--sharegpt-load", type=load_fraction, metavar="FRACTION",
                    help="the ShareGPT replay's Poisson load as a fraction of direct's capacity on it (default "
                         "0.95; ratios.sharegpt are taken there)")  # fmt: skip
    e2.add_argument("--capacity-concurrency", type=positive_int,
                    help="requests kept outstanding while measuring direct's capacity (default 32; must exceed what "
                         "the engine runs at once)")
    e2.add_argument("--capacity-requests", type=positive_int,
                    help="requests of that capacity run (default 512; at least 3x the concurrency)")
    e2.add_argument("--loads", type=load_fraction, nargs="+", metavar="FRACTION",
                    help="Poisson loads as fractions of direct capacity (default 0.5 0.8 0.95 1.1)")  # fmt: skip
    e2.add_argument("--slo-ttft-ms", type=positive_float, default=500.0,
                    help="time to first token, ms, a request must meet to count as goodput (default 500)")
    e2.add_argument("--slo-tpot-ms", type=positive_float, default=20.0,
                    help="time per output token, ms, a request must meet to count as goodput (default 20)")
    e2.add_argument("--seed", type=int, default=1, help="random seed of the workloads (default 1)")
    e2.add_argument("--only", action="append", choices=_E2E_SCENARIOS, metavar="SCENARIO",
                    help=f"run only this scenario or shape (repeatable): {', '.join(_E2E_SCENARIOS)}")  # fmt: skip
    e2.add_argument("--client", action="append", choices=_E2E_CLIENTS, metavar="CLIENT",
                    help=f"send only with this client (repeatable; keep direct, every ratio divides by it): "
                         f"{', '.join(_E2E_CLIENTS)}")  # fmt: skip
    e2.add_argument("--sidecar-cpus", type=cpu_list, metavar="LIST",
                    help="run the sidecars on these CPUs (comma-separated numbers, e.g. 1) and this bench, its "
                         "client and the embedded engines on the others, as a pod's own CPU keeps a sidecar off "
                         "the engine's; default: all share every CPU")  # fmt: skip
    e2.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    e2.set_defaults(func=_bench_e2e)
    oh = bench_sub.add_parser(
        "overhead", help="the latency one sidecar adds, and its most requests/s",
        description="Put one sidecar in front of an instant engine and measure the latency it adds and the most "
                    "requests per second through it, against the engine called directly.",
    )  # fmt: skip
    oh.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    oh.add_argument("--quick", action="store_true", help="the seconds-long version (as in the test suite)")
    oh.add_argument("--profile", metavar="FILE.prof", help="run the sidecar under cProfile and write its stats here")
    oh.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    oh.set_defaults(func=_bench_overhead)
    sl = bench_sub.add_parser(
        "slowloris", help="HTTP door latency while connections hold half a header",
        description="A normal request's latency on the HTTP door, before and while many connections hold half-sent "
                    "headers (an instant engine and one sidecar on this machine).",
    )  # fmt: skip
    sl.add_argument("--connections", type=int_in(1, 20_000), default=2000,
                    help="half-sent connections to open (default 2000)")  # fmt: skip
    sl.add_argument("--max-connections", type=int_in(1, 1_000_000), default=4096,
                    help="the sidecar's server.maxConnections (default 4096, above the flood)")  # fmt: skip
    sl.add_argument("--read-timeout-ms", type=int_in(100, 600_000), default=5000,
                    help="the sidecar's server.httpRequestReadTimeoutMilliseconds (default 5000)")  # fmt: skip
    sl.add_argument("--requests", type=int_in(1, 10_000), default=50,
                    help="normal requests measured before and during the flood (default 50)")  # fmt: skip
    sl.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    sl.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    sl.set_defaults(func=_bench_slowloris)
    mem = bench_sub.add_parser(
        "memory", help="the sidecar's memory under many ~4 MiB POSTs at once",
        description="The sidecar's resident memory while many clients POST bodies of about server.maxRequestBytes "
                    "at once (a slow embedded engine and one sidecar on this machine), against the memory the "
                    "operator gives it; every request must get one answer (200, 413 or 429).",
    )  # fmt: skip
    mem.add_argument("--posts", type=int_in(1, 5000), default=200, help="concurrent POSTs (default 200)")
    mem.add_argument("--bytes", type=byte_size, default=4 * 1024 * 1024, metavar="SIZE",
                     help="body size, also the sidecar's server.maxRequestBytes: half the posts just under it, "
                          "half just over (bytes, or with KiB / MiB; default 4MiB)")  # fmt: skip
    mem.add_argument("--quick", action="store_true", help="the seconds-long version (as in the test suite)")
    mem.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    mem.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    mem.set_defaults(func=_bench_memory)
    li = bench_sub.add_parser(
        "liar", help="honest callers' latency beside one whose hints lie",
        description="Honest callers (true length hints) beside one request class whose hints are an eighth of its "
                    "answers, on the embedded engine at a fraction of its capacity: the honest callers' E2E with the "
                    "lies over the same run without them, and when the liar's hints were distrusted.",
    )  # fmt: skip
    li.add_argument("--load", type=load_fraction, default=0.9, help="fraction of direct's capacity (default 0.9)")
    li.add_argument("--requests", type=int_in(8, 100_000), help="requests per run (default 400)")
    li.add_argument("--repeats", type=int_in(1, 100), help="repeats of the pair of runs (default 2)")
    li.add_argument("--seed", type=int, default=1, help="workload seed (default 1)")
    li.add_argument("--quick", action="store_true", help="the seconds-long version (as in the test suite)")
    li.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    li.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    li.set_defaults(func=_bench_liar)
    fz = bench_sub.add_parser(
        "fuzz", help="generated bad input on both doors and the config parsers",
        description="Send generated inputs (mutated requests, raw bytes, headers, metadata, config files and "
                    "BatchingPolicy specs) to a sidecar in front of an instant engine and to the config parsers; "
                    "report the answers, any 5xx / INTERNAL / UNKNOWN / exception with its reproducer, ERROR log "
                    "records and the sidecar's memory. Exits 1 when any input failed.",
    )  # fmt: skip
    fz.add_argument("--inputs", type=int_in(1, 10_000_000), default=120_000,
                    help="inputs in all, split evenly across the targets (default 120000)")  # fmt: skip
    fz.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="the run's seed (default 0)")
    fz.add_argument("--targets", type=_fuzz_targets, default=_FUZZ_TARGETS, metavar="http,grpc,config",
                    help="what to fuzz (default all three)")  # fmt: skip
    fz.add_argument("--concurrency", type=int_in(1, 1024), default=32, help="inputs in flight on a door (default 32)")
    fz.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    fz.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    fz.set_defaults(func=_bench_fuzz)
    op = bench_sub.add_parser(
        "operator", help="what the operator costs while it holds a fleet",
        description="What the operator costs while it holds a fleet: idle API requests per policy, spec change to "
                    "ConfigMap, webhook admission, RSS and CPU at 100 and 1,000 policies (kmock unless --kubeconfig).",
    )  # fmt: skip
    op.add_argument("--json", action="store_true", help="print one JSON document {runs} instead of a table")
    op.add_argument("--quick", action="store_true", help="the seconds-long version (as in the test suite)")
    op.add_argument("--policies", type=positive_int, nargs="+", metavar="N", help="fleet sizes (default 100 1000)")
    op.add_argument("--idle-seconds", type=positive_float, help="length of the idle window (default 120)")
    op.add_argument("--stats-interval", type=positive_float,
                    help="the operator's BINBATCH_STATS_INTERVAL_SECONDS (default 15)")
    op.add_argument("--failover", type=positive_int, nargs="?", const=3, metavar="KILLS",
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
        "predictor", help="length predictors judged on ShareGPT's held-out turns",
        description="Judge the length predictors on ShareGPT's held-out split: bin accuracy with 2, 4 and 8 bins, "
                    "rank correlation, mean error, the KV plan quantile's coverage, predict latency, learning curve "
                    "(~1 min).",
    )  # fmt: skip
    bp.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    bp.add_argument("--seed", type=int, default=1, help="the order of the learning curve's training records (default 1)")
    bp.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    bp.set_defaults(func=_bench_predictor)

    fm = bench_sub.add_parser(
        "fleet-model", help="the fleet's model: exported, fitted, warm-started",
        description="The fleet's model end to end: a sidecar serves ShareGPT turns, its records are exported and "
                    "fitted, and a new sidecar started from that model ranks new turns as well as the first one "
                    "(rank correlation within 0.02 of it); a cold one for comparison (~7 min; --quick ~1.5 min). "
                    "Exits 1 outside that tolerance.",
    )  # fmt: skip
    fm.add_argument("--train-requests", type=positive_int, default=2048, metavar="N",
                    help="training turns the first sidecar serves, a power of two >= 64 (default 2048)")
    fm.add_argument("--eval-requests", type=positive_int, default=200, metavar="N",
                    help="evaluation turns each sidecar ranks (default 200)")
    fm.add_argument("--seed", type=int, default=1, help="which turns, in which order (default 1)")
    fm.add_argument("--quick", action="store_true", help="256 training and 64 evaluation turns")
    fm.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    fm.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    fm.set_defaults(func=_bench_fleet_model)
