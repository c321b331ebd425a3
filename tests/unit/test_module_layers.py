"""The sidecar's module graph, read from the source with ``ast`` (nothing imported).

DESIGN §2 "Layers": each layer imports only from the layers below it and no
module imports a module that imports it back.  Every import counts, also those
inside functions and under ``TYPE_CHECKING``: the servicers used to reach back to
``app.Sidecar`` that way, which made the whole process object their dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import binbatch_sidecar

ROOT = Path(binbatch_sidecar.__file__).parent
PACKAGE = "binbatch_sidecar"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(module: str, node: ast.ImportFrom) -> list[str]:
    """The sidecar modules a ``from ... import ...`` names (a name may be a submodule)."""
    if node.level:
        is_package = MODULES[module].name == "__init__.py"
        base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    found = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        found.append(sub if sub in MODULES else target)
    return [m for m in found if m in MODULES]


def imports_of(module: str) -> set[str]:
    """Every sidecar module that ``module`` imports, anywhere in its source."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out.update(_resolve(module, node))
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in MODULES)
    out.discard(module)
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


def external_imports(module: str) -> set[str]:
    """Top-level names of every module ``module`` imports that is not a sidecar module."""
    tree = ast.parse(MODULES[module].read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_from_the_source():
    """The walk sees relative, absolute and function-level imports (the check is not vacuous)."""
    assert "binbatch_sidecar.server.app" in MODULES
    assert "binbatch_sidecar.engine.dispatcher" in GRAPH["binbatch_sidecar.server.app"]
    assert "binbatch_sidecar.server.app" in GRAPH["binbatch_sidecar.commands.serve"]  # imported inside a function


def test_the_cycle_finder_finds_a_back_reference():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_a_module_that_imports_it_back():
    assert cycles(GRAPH) == []


def test_the_servicers_do_not_import_the_process_object():
    """Servicers are given their collaborators; they never reach for ``app.Sidecar``."""
    assert "binbatch_sidecar.server.app" not in GRAPH["binbatch_sidecar.server.servicer"]
    assert "binbatch_sidecar.server.app" not in GRAPH["binbatch_sidecar.server.replies"]


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


@pytest.mark.parametrize(
    ("layer", "allowed"),
    [
        ("config", {"config"}),  # the schema the operator imports
        ("core", {"core", "config"}),  # the scheduling core: nothing above it
        ("emulator", {"emulator"}),  # a vLLM-compatible engine: imports no sidecar code
        ("engine", {"engine", "core", "config"}),  # the async driver and engine client
        ("sim", {"sim", "emulator", "core", "config"}),  # the discrete-event driver
        ("server", {"server", "engine", "core", "config"}),  # front doors and lifecycle
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_layer_imports_only_what_lies_below_it(layer, allowed):
    """DESIGN §2 "Layers" (bench and cli sit on top and may import any of them)."""
    offenders = {
        m: sorted(i for i in GRAPH[m] if _layer(i) not in allowed and i != PACKAGE)
        for m in MODULES
        if _layer(m) == layer
    }
    assert any(_layer(m) == layer for m in MODULES)
    assert {m: bad for m, bad in offenders.items() if bad} == {}


def test_the_config_schema_has_no_asyncio_or_file_watcher():
    """The operator imports ``config``: it holds the schema, parsing and validation only."""
    assert "asyncio" not in external_imports("binbatch_sidecar.config")
    assert "ConfigWatcher" not in MODULES["binbatch_sidecar.config"].read_text()


def test_the_scheduling_core_does_no_io():
    forbidden = {"asyncio", "aiohttp", "grpc", "socket", "httpx", "prometheus_client"}
    used = {m: sorted(external_imports(m) & forbidden) for m in MODULES if _layer(m) == "core"}
    assert {m: bad for m, bad in used.items() if bad} == {}
