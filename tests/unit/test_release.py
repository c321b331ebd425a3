"""The release: one version everywhere, the chart packaged, the samples' image, the scripts.

Packaging goes through the real Helm library (``helm-python-sdk``), and the
packaged chart is loaded and rendered by it.  Docker is not needed: the image
targets are checked with ``make -n`` and the Dockerfile against pyproject.toml.
The push to an OCI registry is in tests/integration/test_chart_push.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from packaging.specifiers import SpecifierSet

from binbatch_operator import main as operator_main

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "binbatch"
CPU_SAMPLE = ROOT / "manifests" / "samples" / "cpu-emulator.yaml"
GPU_SAMPLE = ROOT / "manifests" / "samples" / "gpu-vllm.yaml"
VENV = Path(sys.prefix)
# make with this test's own environment, never re-installing it (its stamp counts as up to date).
MAKE = ["make", "--no-print-directory", f"VENV={VENV}", "-o", str(VENV / ".installed")]


def release_module():
    """charts/release.py (a script, not a package module), loaded once per session."""
    if "charts_release" not in sys.modules:
        spec = importlib.util.spec_from_file_location("charts_release", ROOT / "charts" / "release.py")
        module = sys.modules["charts_release"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["charts_release"]


release = release_module()


def pyproject_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def containers(path: Path) -> list[dict[str, Any]]:
    return [c for d in docs(path) if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]]


def render(chart: helm.Chart, values: dict[str, Any] | None = None) -> dict[str, Any]:
    """The operator container of the chart rendered with ``values``."""
    rendered = chart.render(values, name="binbatch", namespace="binbatch-system", is_install=True)
    (deployment,) = [d for d in yaml.safe_load_all(rendered["binbatch/templates/deployment.yaml"]) if d]
    return deployment["spec"]["template"]["spec"]["containers"][0]


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def copy_tree(tmp_path: Path) -> Path:
    """The files that carry the version, copied (the chart whole, so it still renders)."""
    root = tmp_path / "repo"
    (root / "charts").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    shutil.copytree(CHART, root / "charts" / "binbatch")
    shutil.copytree(ROOT / "manifests" / "samples", root / "manifests" / "samples")
    return root


# ------------------------------------------------------------------ one version


def test_chart_samples_and_operator_default_carry_pyprojects_version():
    version = pyproject_version()
    assert release.check() == version
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert (chart["version"], chart["appVersion"]) == (version, version)
    assert yaml.safe_load((CHART / "values.yaml").read_text())["image"]["tag"] == "", "empty: the appVersion"
    image = f"ghcr.io/binbatch/binbatch:{version}"
    assert operator_main.DEFAULT_IMAGE == image
    with helm.Chart.load(CHART) as loaded:
        operator = render(loaded)
    assert operator["image"] == image and env(operator)["BINBATCH_SIDECAR_IMAGE"] == image
    assert [c["image"] for c in containers(CPU_SAMPLE)] == [image]
    assert f'image: "{image}"' in (ROOT / "manifests" / "install" / "binbatch.yaml").read_text()


@pytest.mark.parametrize(("path", "old", "new", "named"), [
    ("charts/binbatch/Chart.yaml", 'appVersion: "{v}"', 'appVersion: "9.9.9"', "Chart.yaml: appVersion"),
    ("charts/binbatch/Chart.yaml", "version: {v}", "version: 9.9.9", "Chart.yaml: version"),
    ("charts/binbatch/values.yaml", 'tag: ""', 'tag: "9.9.9"', "values.yaml: image.tag"),
    ("manifests/samples/cpu-emulator.yaml", "binbatch:{v}", "binbatch:9.9.9", "cpu-emulator.yaml"),
])  # fmt: skip
def test_a_place_whose_version_parts_from_pyproject_is_named(tmp_path, path, old, new, named):
    root = copy_tree(tmp_path)
    target = root / path
    text = target.read_text()
    old = old.format(v=pyproject_version())
    assert old in text
    target.write_text(text.replace(old, new, 1))
    with pytest.raises(release.ReleaseError, match=re.escape(named)) as refused:
        release.check(root)
    assert "'9.9.9'" in str(refused.value)
    with pytest.raises(release.ReleaseError, match=re.escape(named)):
        release.package(tmp_path / "dist", root)
    assert not (tmp_path / "dist").exists() or not any((tmp_path / "dist").iterdir())


def test_set_version_writes_every_place_and_the_chart_renders_the_new_image(tmp_path):
    root = copy_tree(tmp_path)
    changed = release.set_version("2.3.4", root)
    assert changed == ["pyproject.toml", "charts/binbatch/Chart.yaml", "manifests/samples/cpu-emulator.yaml"]
    assert release.check(root, tag="v2.3.4") == "2.3.4"
    with helm.Chart.load(root / "charts" / "binbatch") as chart:
        assert render(chart)["image"] == "ghcr.io/binbatch/binbatch:2.3.4"
    assert [c["image"] for c in containers(root / "manifests/samples/gpu-vllm.yaml")] == [
        c["image"] for c in containers(GPU_SAMPLE)
    ], "the vLLM image is not binbatch's version"


def test_set_version_writes_nothing_when_one_place_cannot_be_rewritten(tmp_path):
    root = copy_tree(tmp_path)
    chart = root / "charts/binbatch/Chart.yaml"
    chart.write_text(chart.read_text().replace("appVersion:", "# appVersion:"))
    before = (root / "pyproject.toml").read_text()
    with pytest.raises(release.ReleaseError, match=r"charts/binbatch/Chart.yaml: expected one line like .*appVersion.*found 0"):
        release.set_version("2.3.4", root)
    assert (root / "pyproject.toml").read_text() == before


@pytest.mark.parametrize("version", ["0.2.0-rc1", "1.2", "v1.2.3", "01.2.3"])
def test_a_version_pip_and_helm_would_spell_differently_is_refused(tmp_path, version):
    with pytest.raises(release.ReleaseError, match=re.escape(repr(version))):
        release.set_version(version, copy_tree(tmp_path))


def test_a_tag_other_than_v_and_the_version_is_refused():
    version = pyproject_version()
    for tag in (version, f"v{version}.1", "v9.9.9"):
        with pytest.raises(release.ReleaseError, match=f"tag {re.escape(repr(tag))} is not v{re.escape(version)}"):
            release.check(tag=tag)


# ------------------------------------------------------------------ make chart, make samples, make image


def test_make_chart_packages_a_chart_the_helm_library_loads_and_renders_as_the_source(tmp_path):
    version = pyproject_version()
    done = subprocess.run([*MAKE, "chart", f"DIST={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    archive = tmp_path / f"binbatch-{version}.tgz"
    assert done.stdout.strip().endswith(str(archive))
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert names[0] == "binbatch/Chart.yaml" and all(n.startswith("binbatch/") for n in names)
    assert "binbatch/crds/batchingpolicies.binbatch.io.yaml" in names
    assert "binbatch/values.schema.json" in names
    assert helm.digest(archive) == "sha256:" + hashlib.sha256(archive.read_bytes()).hexdigest()
    with helm.Chart.load_archive(archive.read_bytes()) as packaged, helm.Chart.load(CHART) as source:
        assert (packaged.metadata["version"], packaged.metadata["appVersion"]) == (version, version)
        assert packaged.render(name="binbatch", namespace="binbatch-system", is_install=True) == source.render(
            name="binbatch", namespace="binbatch-system", is_install=True
        )
        assert {c["filename"]: c["data"] for c in packaged.crds} == {c["filename"]: c["data"] for c in source.crds}
        assert render(packaged, {"image": {"tag": "7.7.7"}})["image"] == "ghcr.io/binbatch/binbatch:7.7.7"
    report = helm.lint(archive, strict=True, kube_version="v1.34.0")
    assert report["total_charts_linted"] == 1 and not report["errors"], report
    assert not [m for m in report["messages"] if m["severity"] >= 2], report


def test_make_samples_puts_one_image_in_the_engine_and_the_chart_values_put_it_in_the_sidecar(tmp_path):
    image = "registry.example:5000/team/binbatch:0.9.0-dev"
    done = subprocess.run([*MAKE, "samples", f"IMAGE={image}", f"DIST={tmp_path}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    cpu, gpu = tmp_path / "samples" / CPU_SAMPLE.name, tmp_path / "samples" / GPU_SAMPLE.name
    assert [c["image"] for c in containers(cpu)] == [image]
    assert "ghcr.io/binbatch" not in cpu.read_text()
    (policy,) = [d for d in docs(cpu) if d["kind"] == "BatchingPolicy"]
    assert policy["spec"]["sidecar"]["image"] == "", "the sidecar is the operator's image"
    assert gpu.read_text() == GPU_SAMPLE.read_text(), "the vLLM sample names no binbatch image"
    # The install half of the same value (docs/install-and-release.md): image.repository and image.tag.
    repository, tag = image.rsplit(":", 1)
    with helm.Chart.load(CHART) as chart:
        operator = render(chart, {"image": {"repository": repository, "tag": tag}})
    assert operator["image"] == image and env(operator)["BINBATCH_SIDECAR_IMAGE"] == image


@pytest.mark.parametrize("image", ["binbatch:1.0", "ghcr.io/binbatch/binbatch", "ghcr.io/x/y:1.0 --privileged"])
def test_samples_refuse_an_image_without_registry_name_and_tag(tmp_path, image):
    with pytest.raises(release.ReleaseError, match="--image"):
        release.samples(image, tmp_path)
    assert not any(tmp_path.iterdir())


def test_make_image_and_push_build_and_push_the_image_named_by_one_value():
    version = pyproject_version()
    default = subprocess.run([*MAKE, "-n", "image", "push"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert default.returncode == 0, default.stderr
    build, push = default.stdout.strip().splitlines()
    assert build.startswith("docker build ") and build.endswith(f" --tag ghcr.io/binbatch/binbatch:{version} .")
    assert f"org.opencontainers.image.version={version}" in build
    assert push == f"docker push ghcr.io/binbatch/binbatch:{version}"
    other = subprocess.run([*MAKE, "-n", "image", "push"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "IMAGE": "registry.example/b:dev"})  # fmt: skip
    assert other.stdout.split()[-6:] == ["--tag", "registry.example/b:dev", ".", "docker", "push", "registry.example/b:dev"]


def test_dockerfile_installs_the_project_pyproject_declares_on_a_python_it_supports():
    text = (ROOT / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    bases = re.findall(r"^FROM python:(\d+\.\d+)-slim\b", text, re.MULTILINE)
    assert len(bases) == 2 and len(set(bases)) == 1, "build and final stage on the same Python"
    assert SpecifierSet(project["project"]["requires-python"]).contains(f"{bases[0]}.0")
    copied = {dest for dest in re.findall(r"^COPY (?!--from)(.+)$", text, re.MULTILINE) for dest in dest.split()[:-1]}
    needed = {"pyproject.toml", project["project"]["readme"]}
    needed |= {folder.split("/")[0] for folder in project["tool"]["setuptools"]["package-dir"].values()}
    assert needed <= copied, f"the image build misses {needed - copied}"
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"}
    assert not needed & ignored, "a .dockerignore entry hides what the build copies"
    # The project without its test extra, installed as a wheel (not editable), run as the chart's user.
    assert "pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ." in text
    assert re.search(r"^RUN pip install --no-cache-dir /wheels/\*\.whl", text, re.MULTILINE)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    user = values["securityContext"]
    assert f"USER {user['runAsUser']}:{user['runAsGroup']}" in text


# ------------------------------------------------------------------ push (the round trip: tests/integration)


def test_push_refuses_a_remote_that_is_not_oci(tmp_path):
    with pytest.raises(release.ReleaseError, match="not an oci:// reference"):
        release.push(tmp_path / "binbatch.tgz", "https://charts.example/binbatch")


@pytest.mark.parametrize(("username", "password", "named"), [("me", "", "REGISTRY_PASSWORD"), ("", "pw", "REGISTRY_USERNAME")])
def test_push_refuses_half_a_login_naming_the_missing_variable(tmp_path, monkeypatch, username, password, named):
    monkeypatch.setenv("REGISTRY_USERNAME", username)
    monkeypatch.setenv("REGISTRY_PASSWORD", password)
    with pytest.raises(release.ReleaseError, match=f"^{named} is not set"):
        release.push(tmp_path / "binbatch.tgz", "oci://127.0.0.1:1/charts")


# ------------------------------------------------------------------ .ci/release and the workflow


def run_release(tag: str, dist: Path) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "DRY_RUN": "1", "MAKE": " ".join(MAKE), "VENV": str(VENV), "DIST": str(dist)}
    return subprocess.run([str(ROOT / ".ci" / "release"), tag], capture_output=True, text=True, timeout=180, env=environment)


def test_release_script_checks_the_tag_packages_the_chart_and_pushes_by_version(tmp_path):
    version = pyproject_version()
    done = run_release(f"v{version}", tmp_path)
    assert done.returncode == 0, done.stderr
    planned = [line.removeprefix("dry run: ") for line in done.stdout.splitlines() if line.startswith("dry run: ")]
    image = f"ghcr.io/binbatch/binbatch:{version}"
    assert planned[0] == ".ci/run", "the whole suite before anything is built"
    assert planned[1].endswith(f"image IMAGE={image}") and planned[3].endswith(f"push IMAGE={image}")
    assert f"'{image}' binbatch --version" in planned[2] and f"binbatch {version} " in planned[2]
    assert planned[4].endswith("chart-push CHART_REGISTRY=oci://ghcr.io/binbatch/charts")
    with helm.Chart.load_archive((tmp_path / f"binbatch-{version}.tgz").read_bytes()) as chart:
        assert chart.metadata["version"] == version


def test_release_script_refuses_a_tag_that_is_not_the_version_before_doing_anything(tmp_path):
    done = run_release("v9.9.9", tmp_path)
    assert done.returncode != 0
    assert "tag 'v9.9.9' is not v" in done.stderr
    assert "dry run" not in done.stdout and not any(tmp_path.iterdir())


def test_release_workflow_runs_the_script_on_version_tags_with_push_rights():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yaml").read_text())
    trigger = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert trigger == {"push": {"tags": ["v*"]}}
    assert workflow["permissions"]["packages"] == "write"
    (job,) = workflow["jobs"].values()
    runs = [step.get("run", "") for step in job["steps"]]
    assert '.ci/release "${GITHUB_REF_NAME}"' in runs
    release_step = job["steps"][runs.index('.ci/release "${GITHUB_REF_NAME}"')]
    assert set(release_step["env"]) == {"REGISTRY_USERNAME", "REGISTRY_PASSWORD"}  # read by charts/release.py push
    setup = [s for s in job["steps"] if s.get("uses", "").startswith("actions/setup-python")]
    image_python = re.search(r"^FROM python:(\S+)-slim", (ROOT / "Dockerfile").read_text(), re.MULTILINE).group(1)
    assert setup and setup[0]["with"]["python-version"] == image_python
    assert os.access(ROOT / ".ci" / "release", os.X_OK)
