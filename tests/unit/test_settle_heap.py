"""The sidecar process readies its heap before freezing it (``app.settle_heap``, then ``gc.freeze``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import sys
from binbatch_sidecar.config import SidecarConfig
from binbatch_sidecar.server.app import settle_heap
before = "sklearn.linear_model" in sys.modules
settle_heap(SidecarConfig.model_validate({"predictor": {"kind": sys.argv[1]}}))
print(before, "sklearn.linear_model" in sys.modules)
"""


@pytest.mark.parametrize("kind, loaded", [("Learned", True), ("Online", False), ("Hint", False)])
def test_a_learned_predictor_has_its_fit_libraries_imported_before_the_freeze(kind, loaded):
    # a fresh interpreter: this test session may have imported sklearn already
    out = subprocess.run([sys.executable, "-c", _PROBE, kind], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", str(loaded)]
