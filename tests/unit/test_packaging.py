"""What ``pip install`` ships: every package folder is listed in pyproject.toml,
and the engine emulator stands alone (the CPU sample and the demo run it)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_shipped():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(project["tool"]["setuptools"]["packages"])
    dirs = project["tool"]["setuptools"]["package-dir"]
    found = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join([name, *rel]))
    assert "binbatch_sidecar.emulator" in found
    assert found - listed == set()


def test_the_emulator_loads_no_sidecar_module():
    """Imported alone, in a fresh interpreter, it pulls in nothing else of binbatch."""
    code = (
        "import sys, binbatch_sidecar.emulator.cli\n"
        "print(sorted(m for m in sys.modules if m.startswith('binbatch') "
        "and m != 'binbatch_sidecar' and not m.startswith('binbatch_sidecar.emulator')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
