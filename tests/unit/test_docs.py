"""The README and docs/ stay true to what they are generated from, and readable.

- Every result table in README.md and docs/ is what ``docs/render_results.py``
  renders from the JSON files in docs/results/ (no drift), and adding a result file
  plus one run of the script is the whole job of publishing a run.
- docs/configuration.md is what ``docs/generate_configuration.py`` writes from the
  CRD schema and the sidecar's config model, and lists every field; the README's
  defaults are the config model's.
- Every condition reason the operator sets is explained in docs/troubleshooting.md.
- No work-log language (sessions, issue numbers, paths outside the repository).
- The README fits one screen's budget and its relative links resolve.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from binbatch_sidecar.config import SidecarConfig

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
# Pages other branches add; linked from the index before they land.
PAGES_OF_OTHER_BRANCHES = {"security.md", "predictor-in-cluster.md", "operator-security.md",
                           "install-and-release.md", "compatibility.md"}  # fmt: skip


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pydantic resolves the models' annotations through it
    spec.loader.exec_module(module)
    return module


render_results = _load("render_results")
generate_configuration = _load("generate_configuration")


def _documents() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


# -- result tables -------------------------------------------------------------------


def test_every_rendered_result_table_matches_its_result_file():
    assert render_results.sync(REPO, write=False) == [], "run: python docs/render_results.py"


def test_every_result_file_has_its_setup_and_every_table_is_shown_somewhere():
    results = render_results.load_results(DOCS / "results")
    assert len(results) >= 10
    shown = {m["name"] for path in _documents() for m in render_results.MARKER.finditer(path.read_text())}
    for stem, result in results.items():
        assert result.setup.command and result.setup.machine and result.setup.engine, stem
        for table in result.tables:
            assert f"{stem}/{table}" in shown, f"{stem}.json's table {table!r} is shown on no page"
    assert {"summary:embedded", "summary:vllm-cpu"} <= {m["name"] for m in render_results.MARKER.finditer(README.read_text())}


def _copy_of_the_docs(tmp_path: Path) -> Path:
    shutil.copy(README, tmp_path / "README.md")
    shutil.copytree(DOCS, tmp_path / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_adding_a_result_file_and_rerunning_the_script_publishes_it(tmp_path):
    repo = _copy_of_the_docs(tmp_path)
    new = {
        "title": "2099-01-01: the ShareGPT replay, new defaults",
        "summary": "A newer run of the headline measurement.",
        "setup": {"engine": "the embedded engine", "load": "500 first turns at 0.95", "config": "the defaults",
                  "machine": "2 vCPUs", "date": "2099-01-01", "command": "binbatch bench e2e --only sharegpt"},
        "tables": {"rows": {"columns": ["client", "mean E2E"], "rows": [["direct", 1], ["sidecar, no hint", 0.777]]}},
        "headlines": [{"engine": "embedded", "key": "sharegpt95-mean", "order": 60, "traffic": "real prompts, no hint",
                       "configuration": "the new defaults", "measure": "mean E2E", "value": "0.777",
                       "target": "<= 0.85", "met": True}],
    }  # fmt: skip
    (repo / "docs" / "results" / "2099-01-01-sharegpt-embedded.json").write_text(json.dumps(new))

    changed = render_results.sync(repo)

    page = repo / "docs" / "results" / "2099-01-01-sharegpt-embedded.md"
    assert "docs/results/2099-01-01-sharegpt-embedded.md (new page)" in changed
    assert "README.md" in changed and "docs/benchmarks.md" in changed
    assert "| sidecar, no hint | 0.777 |" in page.read_text() and "2099-01-01" in page.read_text()
    readme = (repo / "README.md").read_text()
    summary = readme.split("<!-- results:summary:embedded -->", 1)[1].split("<!-- /results:summary:embedded -->")[0]
    row = next(line for line in summary.splitlines() if "mean E2E" in line and "the new defaults" in line)
    assert "0.777" in row and "(docs/results/2099-01-01-sharegpt-embedded.md)" in row
    assert "| 0.912 |" not in summary  # the older run's row with the same key is replaced
    assert "2099-01-01-sharegpt-embedded.md" in (repo / "docs" / "benchmarks.md").read_text()  # in the index
    assert render_results.sync(repo, write=False) == []  # one run is the whole job


def test_a_bad_result_file_is_refused_naming_the_file_and_field(tmp_path):
    repo = _copy_of_the_docs(tmp_path)
    source = json.loads((DOCS / "results" / "2026-11-25-sidecar-overhead.json").read_text())
    source["setup"].pop("command")
    source["tables"]["overhead"]["rows"][0].append("one cell too many")
    (repo / "docs" / "results" / "2026-11-25-sidecar-overhead.json").write_text(json.dumps(source))
    with pytest.raises(render_results.ResultError) as err:
        render_results.sync(repo, write=False)
    assert "2026-11-25-sidecar-overhead.json" in str(err.value)
    assert "setup.command" in str(err.value) and "tables.overhead" in str(err.value)


def test_a_marker_naming_no_result_is_an_error(tmp_path):
    repo = _copy_of_the_docs(tmp_path)
    (repo / "docs" / "extra.md").write_text("<!-- results:2001-01-01-nothing/rows -->\n<!-- /results:2001-01-01-nothing/rows -->\n")
    with pytest.raises(render_results.ResultError, match="no docs/results/2001-01-01-nothing.json"):
        render_results.sync(repo, write=False)


def test_a_hand_edited_rendered_table_is_drift(tmp_path):
    repo = _copy_of_the_docs(tmp_path)
    page = repo / "docs" / "results" / "2026-11-26-operator-bench.md"
    page.write_text(page.read_text().replace("| 100 / 500 | in-process | 0.02", "| 100 / 500 | in-process | 0.01", 1))
    assert render_results.sync(repo, write=False) == ["docs/results/2026-11-26-operator-bench.md"]


# -- configuration reference ----------------------------------------------------------


def test_the_configuration_reference_is_generated_from_the_schema():
    assert (DOCS / "configuration.md").read_text() == generate_configuration.generate(), (
        "run: python docs/generate_configuration.py")  # fmt: skip


def _leaves(node: dict, path: str):
    props = node.get("properties") or {}
    if not props and path:
        yield path
    for key, child in props.items():
        yield from _leaves(child, f"{path}.{key}" if path else key)
    items = node.get("items") or {}
    for key, child in (items.get("properties") or {}).items():
        yield from _leaves(child, f"{path}[].{key}")


def test_the_configuration_reference_lists_every_policy_field_and_file_key():
    page = (DOCS / "configuration.md").read_text()
    fields = list(_leaves(generate_configuration.spec_schema(), ""))
    assert len(fields) > 60
    missing = [f for f in fields if f"| `{f}`" not in page]
    assert not missing
    for key in ("grpcPort", "httpPort", "metricsPort", "drainGraceSeconds", "configPollMilliseconds"):
        assert f"| `server.{key}`" in page
    for key in ("grpcPort", "httpPort", "metricsPort", "drainGraceSeconds"):
        assert f"| `server.{key}` | `spec.sidecar.{key}` |" in page


def test_the_readme_states_the_config_models_defaults():
    text = README.read_text()
    assert generate_configuration.readme_with_defaults(text) == text, "run: python docs/generate_configuration.py"
    section = text.split("## The settings that matter", 1)[1].split("\n## ", 1)[0]
    defaults = json.loads(SidecarConfig().model_dump_json(by_alias=True))
    rows = re.findall(r"^\| `([a-z]+)\.([A-Za-z]+)` \| `([^`]*)`", section, re.M)
    assert len(rows) >= 6
    assert all(str(defaults[s][f]) == d for s, f, d in rows)


def test_a_changed_default_is_rewritten_into_the_readme(monkeypatch):
    class Changed(SidecarConfig):
        def model_dump_json(self, **kw):  # what a branch that changes a default would give
            doc = json.loads(super().model_dump_json(**kw))
            doc["memory"]["admission"] = "Projected"
            return json.dumps(doc)

    monkeypatch.setattr(generate_configuration, "SidecarConfig", Changed)
    new = generate_configuration.readme_with_defaults(README.read_text())
    assert "| `memory.admission` | `Projected` |" in new
    assert new.count("\n") == README.read_text().count("\n")  # only the cell changed


# -- troubleshooting --------------------------------------------------------------------


def _condition_reasons() -> set[str]:
    """Every reason string a ``Condition(type, status, reason, ...)`` call in operator/ sets."""
    reasons: set[str] = set()
    for path in (REPO / "operator").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Condition" and len(node.args) >= 3:
                arg = node.args[2]
                options = [arg.body, arg.orelse] if isinstance(arg, ast.IfExp) else [arg]
                reasons |= {o.value for o in options if isinstance(o, ast.Constant) and isinstance(o.value, str)}
    return reasons


def test_every_condition_reason_the_operator_sets_is_in_troubleshooting():
    reasons = _condition_reasons()
    assert {"PodsNeedRestart", "NamespaceNotOptedIn", "RejectedByApiServer", "SchedulingPolicyNotPriority"} <= reasons
    page = (DOCS / "troubleshooting.md").read_text()
    assert sorted(r for r in reasons if f"`{r}`" not in page) == []


# -- words and links ------------------------------------------------------------------

WORK_LOG = re.compile(
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|this|that|last|previous|next|earlier|later"
    r"|same|each|every|one|another)\s+sessions?\b|\bsessions?\b|\bissues?\s+#?[0-9]+|\.\./shared",
    re.I,
)


@pytest.mark.parametrize("path", _documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_work_log_language(path):
    hits = [(n, m.group(0)) for n, line in enumerate(path.read_text().splitlines(), 1) for m in WORK_LOG.finditer(line)]
    assert hits == []


def test_the_readme_is_one_screen_and_starts_with_what_matters():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250
    head = "\n".join(lines[:60])
    assert "helm install" in head
    assert "results:summary:embedded" in head and "results:summary:vllm-cpu" in head
    for shorthand in ("kmock", "B_t", "judged row", "stand-in", "engine model", "door"):
        assert shorthand not in README.read_text(), shorthand


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("path", _documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_and_their_anchors_resolve(path):
    text = path.read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        name, _, anchor = target.partition("#")
        file = (path.parent / name).resolve() if name else path
        if file.name in PAGES_OF_OTHER_BRANCHES:
            continue
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
            broken.append(target)
    assert broken == []
