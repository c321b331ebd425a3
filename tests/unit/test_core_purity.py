"""core/ does no I/O: the simulator drives the very code that serves (DESIGN §2 Layers)."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import binbatch_sidecar.core as core_pkg

CORE = Path(core_pkg.__file__).parent
MODULES = sorted(m.name for m in pkgutil.iter_modules([str(CORE)]))
# Event loops, network, processes and files: a driver's business, never the core's.
FORBIDDEN = {
    "asyncio", "socket", "selectors", "ssl", "aiohttp", "grpc", "httpx", "urllib", "http", "subprocess",
    "threading", "os", "io", "pathlib", "shutil", "tempfile", "logging", "kubernetes", "kopf", "prometheus_client",
}  # fmt: skip
THIRD_PARTY = ("numpy", "scipy.stats", "scipy.sparse", "scipy.sparse.csgraph")


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_the_core_has_the_scheduler_both_drivers_use():
    assert "scheduler" in MODULES and "inflight" in MODULES and "breaker" in MODULES


def test_no_core_module_imports_io_network_or_an_event_loop():
    bad = {m: sorted(_imported_roots(CORE / f"{m}.py") & FORBIDDEN) for m in MODULES}
    assert {m: b for m, b in bad.items() if b} == {}


def test_no_core_module_opens_files():
    opens = []
    for m in MODULES:
        for node in ast.walk(ast.parse((CORE / f"{m}.py").read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("open", "input"):
                opens.append(f"{m}:{node.lineno}")
    assert opens == []


def test_importing_the_core_loads_no_io_module_of_its_own():
    """In a fresh interpreter: after the third-party libraries the core uses are
    loaded, importing every core module adds none of the forbidden modules (so
    nothing reaches them through another of our packages either)."""
    code = f"""
import importlib, json, sys
for name in {THIRD_PARTY!r}:
    importlib.import_module(name)
before = set(sys.modules)
for m in {MODULES!r}:
    importlib.import_module("binbatch_sidecar.core." + m)
new = sorted(set(sys.modules) - before)
print(json.dumps(new))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120)
    new = json.loads(out.stdout)
    assert [n for n in new if n.split(".")[0] in FORBIDDEN] == []
    assert [n for n in new if n.startswith("binbatch_sidecar.") and not n.startswith("binbatch_sidecar.core")] == []
