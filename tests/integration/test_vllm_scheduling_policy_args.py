"""The operator reads ``--scheduling-policy`` as vLLM itself does: every spelling, and the take-over's rewrite.

vLLM's own ``vllm serve`` argument parser (``make_arg_parser`` on a
``FlexibleArgumentParser``, from the vLLM venv the real-vLLM tests use) parses
each command line once, in one child process; what it sets ``scheduling_policy``
to must be what ``vllm_args.given`` reads (vLLM's default ``fcfs`` when it reads
none).  ``BINBATCH_SKIP_VLLM=1`` skips it, like every real-vLLM test.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from binbatch_operator import builders
from binbatch_operator.vllm_args import given
from vllm_support.server import _clean_env, _neutral_cwd, ensure_vllm_env

PARSE = """
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
print(json.dumps([parser.parse_args(args).scheduling_policy for args in json.load(sys.stdin)]))
"""
ORDERED = {
    "selector": {"matchLabels": {"app": "vllm"}},
    "batch": {"mode": "Continuous", "order": "EnginePriority", "followEngineQueue": False},
    "sidecar": {"takeOverServingPort": {"enabled": True}},
}
SPELLINGS = [
    [], ["--scheduling-policy", "priority"], ["--scheduling-policy=priority"], ["--scheduling_policy", "priority"],
    ["--scheduling_policy=priority"], ["--scheduling", "priority"], ["--scheduling-polic=fcfs"],
    ["--scheduling-policy", "priority", "--scheduling_policy=fcfs"], ["--scheduling-policy=fcfs", "--port", "8000"],
]  # fmt: skip


def taken_over(args: list[str]) -> list[str]:
    pod = {"metadata": {"labels": {"app": "vllm"}}, "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai", "args": args}]}}
    return [str(a) for a in builders.build_pod_patch(pod, "fast", 1, ORDERED, "img")["spec"]["containers"][0]["args"]]


@pytest.mark.vllm
def test_vllm_parses_the_scheduling_policy_the_operator_reads():
    if os.environ.get("BINBATCH_SKIP_VLLM") == "1":
        pytest.skip("BINBATCH_SKIP_VLLM=1: real-vLLM tests skipped on request")
    lines = [["--model", "m", *s] for s in SPELLINGS]
    lines += [taken_over(["--model", "m", *s]) for s in SPELLINGS]  # what the webhook lets vLLM run with
    done = subprocess.run([str(ensure_vllm_env()), "-c", PARSE], input=json.dumps(lines), capture_output=True,
                          text=True, timeout=300, env=_clean_env(), cwd=_neutral_cwd())  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    vllm_reads = json.loads(done.stdout.strip().splitlines()[-1])
    we_read = [given({"args": args}, "spec.containers[0]") for args in lines]
    assert vllm_reads == [g.value if g else "fcfs" for g in we_read]
    # The take-over gives priority to every line but the ones stating fcfs last.
    assert vllm_reads[len(SPELLINGS):] == ["priority"] * 6 + ["fcfs"] * 3
