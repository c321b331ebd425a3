"""``binbatch emulate-engine`` and ``python -m binbatch_sidecar.emulator``."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from dataclasses import fields
from typing import Any

from .answers import AnswerLengthsError
from .config import SCHEDULING_POLICIES, EmulatorConfig
from .server import CannotListen, serve

DESCRIPTION = "A vLLM-compatible engine emulator: OpenAI API, /metrics, paged KV-cache blocks."
EXIT_CANNOT_START = 2  # a bad flag, or the port cannot be bound (docs/api.md: exit codes)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def _whole(text: str) -> int:
    """A whole number >= 0."""
    return _int_at_least(text, 0)


def port_number(text: str) -> int:
    """argparse type of a listen port (0: any free port); the sidecar's CLI uses it too."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The emulator's flags: ``--host``, ``--port`` and one per :class:`EmulatorConfig` field."""
    d = EmulatorConfig()
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=port_number, default=8000, help="port to bind, 0 for any (default 8000)")
    parser.add_argument("--model", "--served-model-name", dest="model", default=d.model,
                        help=f"served model name (default {d.model!r})")  # fmt: skip
    parser.add_argument("--step-a", type=_seconds, default=d.step_a,
                        help=f"fixed part of every engine step, seconds: a step with n running sequences takes "
                             f"step-a + step-c * n (default {d.step_a})")  # fmt: skip
    parser.add_argument("--step-c", type=_seconds, default=d.step_c,
                        help=f"step time added per running sequence, seconds (default {d.step_c})")  # fmt: skip
    parser.add_argument("--prefill-per-token", type=_seconds, default=d.prefill_per_token,
                        help=f"step time added per token prefilled in the step, seconds: a newly admitted "
                             f"sequence's prompt, or a preempted sequence's prompt and generated tokens when it "
                             f"is admitted again (real engines recompute them); 0 makes prefill free "
                             f"(default {d.prefill_per_token})")  # fmt: skip
    parser.add_argument("--num-gpu-blocks", type=_positive_int, default=d.num_gpu_blocks,
                        help=f"KV cache blocks (default {d.num_gpu_blocks})")  # fmt: skip
    parser.add_argument("--block-size", type=_positive_int, default=d.block_size,
                        help=f"tokens per KV block (default {d.block_size})")  # fmt: skip
    parser.add_argument("--max-num-seqs", type=_positive_int, default=d.max_num_seqs,
                        help=f"most sequences per step (default {d.max_num_seqs})")  # fmt: skip
    parser.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=d.scheduling_policy,
                        help="fcfs, or priority: waiting requests by their priority field (lower first), then "
                             "arrival; the running one with the largest preempted (vLLM's flag; default fcfs)")  # fmt: skip
    parser.add_argument("--enable-prefix-caching", action="store_true",
                        help="as vLLM's flag (on by default there): the full KV blocks of a prompt are held once "
                             "for every running sequence whose prompt begins with the same words, and not "
                             "prefilled again (default: off)")  # fmt: skip
    parser.add_argument("--max-num-batched-tokens", type=_whole, default=d.max_num_batched_tokens,
                        help="as vLLM's flag: the tokens one step computes (a decode is one, a prefill its prompt), "
                             "running sequences first; a prefill that does not fit is chunked over the next steps "
                             "(vLLM's OpenAI server: 2048 on CPUs; default 0: no budget, every prefill whole)")  # fmt: skip
    parser.add_argument("--max-model-len", type=_positive_int, default=d.max_model_len,
                        help=f"longest prompt + output in tokens (default {d.max_model_len})")  # fmt: skip
    parser.add_argument("--legacy-names", action="store_true",
                        help="expose vLLM's pre-0.10 metric names (gpu_cache_usage_perc, "
                             "time_per_output_token_seconds)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=d.seed, help=f"output seed (default {d.seed})")
    parser.add_argument("--max-request-body-bytes", type=_positive_int, default=d.max_request_body_bytes,
                        help=f"largest request body; larger ones get HTTP 413 (default {d.max_request_body_bytes})")  # fmt: skip
    parser.add_argument("--receipts-file", default=d.receipts_file, metavar="FILE",
                        help="append every accepted prompt to FILE, one JSON string a line (default: off)")  # fmt: skip
    parser.add_argument("--answer-lengths", default=d.answer_lengths, metavar="FILE",
                        help="recorded answer lengths, JSON Lines {\"prompt_sha256\": ..., \"output_tokens\": N}: "
                             "a prompt whose SHA-256 is listed ends after N tokens (within max_tokens), so a replay "
                             "of real traffic forces no length in the request (default: off)")  # fmt: skip
    parser.add_argument("--api-key", default=d.api_key, metavar="KEY",
                        help="as vLLM's flag: /v1/* answers 401 without 'Authorization: Bearer KEY' "
                             "(/health and /metrics stay open; default: off)")  # fmt: skip


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    """An :class:`EmulatorConfig` from parsed flags (raises ValueError naming a field)."""
    return EmulatorConfig(**{f.name: getattr(args, f.name) for f in fields(EmulatorConfig)})


def run_from_args(args: argparse.Namespace) -> int:
    """Run the emulator until interrupted; the exit status."""
    try:
        config = config_from_args(args)
    except ValueError as err:
        print(f"binbatch emulate-engine: {err}", file=sys.stderr)
        return EXIT_CANNOT_START
    if config.receipts_file:
        try:  # opened for append by the server anyway; a bad path is one line here, not a traceback
            open(config.receipts_file, "a", encoding="utf-8").close()  # noqa: SIM115
        except OSError as err:
            print(f"binbatch emulate-engine: --receipts-file {config.receipts_file}: {err.strerror}", file=sys.stderr)
            return EXIT_CANNOT_START
    try:
        asyncio.run(serve(args.host, args.port, config))
    except CannotListen as err:
        print(f"binbatch emulate-engine: {err}", file=sys.stderr)
        return EXIT_CANNOT_START
    except AnswerLengthsError as err:
        print(f"binbatch emulate-engine: --answer-lengths {err}", file=sys.stderr)
        return EXIT_CANNOT_START
    return 0


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``emulate-engine`` on a ``binbatch`` subparsers object; it sets ``func``."""
    parser = subparsers.add_parser(
        "emulate-engine", help="run a vLLM-compatible engine emulator",
        description=DESCRIPTION,
    )  # fmt: skip
    add_arguments(parser)
    parser.set_defaults(func=run_from_args)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The standalone command's parser (``python -m binbatch_sidecar.emulator``)."""
    parser = argparse.ArgumentParser(prog="binbatch emulate-engine", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m binbatch_sidecar.emulator [flags]``."""
    return run_from_args(build_parser().parse_args(argv))

