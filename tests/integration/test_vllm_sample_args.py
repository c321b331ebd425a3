"""The GPU sample's vLLM command line, as the checked vLLM version's own parser reads it.

docs/compatibility.md lists the vLLM version the GPU sample runs as checked; this
parses the sample's arguments (and the port take-over's rewrite of them) with
``vllm serve``'s argument parser from the vLLM venv the real-vLLM tests use, in
one child process.  ``BINBATCH_SKIP_VLLM=1`` skips it, like every real-vLLM test.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from binbatch_operator import builders
from vllm_support.server import _clean_env, _neutral_cwd, ensure_vllm_env

ROOT = Path(__file__).resolve().parents[2]
GPU_SAMPLE = ROOT / "manifests" / "samples" / "gpu-vllm.yaml"
FIELDS = ("model", "host", "port", "max_model_len", "max_num_seqs", "gpu_memory_utilization", "scheduling_policy")
PARSE = f"""
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
print(json.dumps([{{k: getattr(parser.parse_args(args), k) for k in {FIELDS!r}}} for args in json.load(sys.stdin)]))
"""


@pytest.mark.vllm
def test_the_checked_vllm_parses_the_gpu_samples_arguments_and_their_take_over():
    if os.environ.get("BINBATCH_SKIP_VLLM") == "1":
        pytest.skip("BINBATCH_SKIP_VLLM=1: real-vLLM tests skipped on request")
    documents = [d for d in yaml.safe_load_all(GPU_SAMPLE.read_text()) if d]
    (policy,) = [d for d in documents if d["kind"] == "BatchingPolicy"]
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    pod = {"metadata": deployment["spec"]["template"]["metadata"], "spec": deployment["spec"]["template"]["spec"]}
    (container,) = pod["spec"]["containers"]
    spec = {**policy["spec"], "sidecar": {**policy["spec"]["sidecar"], "takeOverServingPort": {"enabled": True}},
            "batch": {**policy["spec"]["batch"], "order": "EnginePriority", "followEngineQueue": False}}  # fmt: skip
    patched = builders.build_pod_patch(pod, "qwen", 1, spec, "img")["spec"]["containers"]
    (taken,) = [c for c in patched if c["name"] == container["name"]]
    lines = [[str(a) for a in container["args"]], [str(a) for a in taken["args"]]]
    done = subprocess.run([str(ensure_vllm_env()), "-c", PARSE], input=json.dumps(lines), capture_output=True,
                          text=True, timeout=300, env=_clean_env(), cwd=_neutral_cwd())  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    as_given, as_taken_over = json.loads(done.stdout.strip().splitlines()[-1])
    expected = {"model": policy["spec"]["engine"]["model"], "host": "0.0.0.0", "port": 8000, "max_model_len": 4096,
                "max_num_seqs": 256, "gpu_memory_utilization": 0.9, "scheduling_policy": "fcfs"}  # fmt: skip
    assert as_given == expected
    engine_port = spec["sidecar"]["takeOverServingPort"].get("enginePort", 8001)
    assert as_taken_over == {**expected, "host": "127.0.0.1", "port": engine_port, "scheduling_policy": "priority"}
