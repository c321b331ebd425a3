"""Start-up mistakes a person makes first get one line on stderr and exit 2.

Each runs the installed console script (``binbatch``) as a process that fails
before it opens a socket: a bad port variable, a config file that is not there,
an emulator receipts file it cannot create.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def run(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "binbatch"), *argv], capture_output=True, text=True, timeout=60, cwd=cwd,
                          env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)  # fmt: skip


def test_a_bad_port_variable_names_it_and_exits_2(tmp_path):
    out = run("sidecar", cwd=tmp_path, env={"BINBATCH_GRPC_PORT": "fifty"})
    assert (out.returncode, out.stderr.splitlines()) == (
        2, ["binbatch: $BINBATCH_GRPC_PORT: expected a port number, got 'fifty'"],
    )  # fmt: skip


def test_a_missing_config_file_is_one_line(tmp_path):
    missing = tmp_path / "nope.yaml"
    out = run("sidecar", "--config", str(missing), cwd=tmp_path)
    assert (out.returncode, out.stderr.splitlines()) == (
        2, [f"binbatch sidecar: cannot read config {missing}: no such file or directory"],
    )  # fmt: skip


def test_an_emulator_receipts_file_it_cannot_create_is_one_line(tmp_path):
    path = tmp_path / "no-such-dir" / "receipts.jsonl"
    out = run("emulate-engine", "--port", "0", "--receipts-file", str(path), cwd=tmp_path)
    assert (out.returncode, out.stderr.splitlines()) == (
        2, [f"binbatch emulate-engine: --receipts-file {path}: No such file or directory"],
    )  # fmt: skip


def test_an_emulator_answer_lengths_file_it_cannot_read_is_one_line(tmp_path):
    path = tmp_path / "answers.jsonl"
    path.write_text('{"prompt_sha256": "abc", "output_tokens": 3}\n')
    out = run("emulate-engine", "--port", "0", "--answer-lengths", str(path), cwd=tmp_path)
    assert (out.returncode, out.stderr.splitlines()) == (
        2, [f"binbatch emulate-engine: --answer-lengths {path} line 1: prompt_sha256 must be 64 lowercase hex "
            "digits, got 'abc'"],
    )  # fmt: skip


def test_a_warm_start_that_is_no_model_names_the_field_and_exits_2(tmp_path):
    config = tmp_path / "sidecar.yaml"
    config.write_text(f"predictor:\n  kind: Learned\n  warmStart: {tmp_path / 'missing.npz'}\n")
    out = run("sidecar", "--config", str(config), "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
              cwd=tmp_path)  # fmt: skip
    assert (out.returncode, out.stderr.splitlines()) == (
        2, [f"binbatch sidecar: invalid config {config}:",
            f"predictor.warmStart: cannot read {tmp_path / 'missing.npz'}: no such file or directory"],
    )  # fmt: skip


def test_an_engine_key_file_that_cannot_be_read_names_the_field_and_exits_2(tmp_path):
    config = tmp_path / "sidecar.yaml"
    key = tmp_path / "api-key"
    key.write_text("\n")
    config.write_text(f"engine:\n  apiKeyFile: {key}\n")
    out = run("sidecar", "--config", str(config), "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
              cwd=tmp_path)  # fmt: skip
    assert (out.returncode, out.stderr.splitlines()) == (
        2, [f"binbatch sidecar: invalid config {config}:",
            f"engine.apiKeyFile: the key file {key} is empty (or only whitespace)"],
    )  # fmt: skip
