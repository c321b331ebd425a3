"""The release's steps that run in Python: one version everywhere, the chart packaged and pushed, the samples.

    .venv/bin/python charts/release.py check [--tag v0.1.0]      # every version agrees (and matches the tag)
    .venv/bin/python charts/release.py set-version 0.2.0          # write a new version everywhere it is carried
    .venv/bin/python charts/release.py package --destination dist # dist/binbatch-<version>.tgz
    .venv/bin/python charts/release.py push dist/binbatch-0.1.0.tgz oci://ghcr.io/binbatch/charts
    .venv/bin/python charts/release.py samples --image registry.example/binbatch:0.1.0 --destination dist/samples

``pyproject.toml``'s ``version`` is the one source.  The chart's ``version`` and
``appVersion`` and the CPU sample's image tag carry the same text (``check``
names each one that differs); the chart's ``image.tag`` is empty, which means
its appVersion; the operator's default sidecar image reads the installed
package's version (``binbatch_operator.main.DEFAULT_IMAGE``).

Packaging and pushing use the real Helm library (``helm-python-sdk``, which
carries ``libhelm_c.so``; no ``helm`` binary): ``package`` is ``helm package``,
``push`` is ``helm push`` to an OCI registry, logged in with
``REGISTRY_USERNAME``/``REGISTRY_PASSWORD`` when they are set.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[1]
IMAGE_REPOSITORY = "ghcr.io/binbatch/binbatch"
# X.Y.Z: the one spelling pip (PEP 440), Helm (SemVer) and the v<version> tag all keep as written (pip
# would turn a SemVer pre-release 0.2.0-rc1 into 0.2.0rc1, and the operator's default tag with it).
VERSION_PATTERN = re.compile(r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$")
_PYPROJECT_VERSION = re.compile(r'^(version = ")([^"]*)(")$', re.MULTILINE)
_CHART_FIELD = {
    "version": re.compile(r"^(version: )(\S+)()$", re.MULTILINE),
    "appVersion": re.compile(r'^(appVersion: ")([^"]*)(")$', re.MULTILINE),
}
_OUR_IMAGE = re.compile(re.escape(IMAGE_REPOSITORY) + r":([^\s\"']+)")


class ReleaseError(Exception):
    """A release step refused: the message names the file and field."""


@dataclass(frozen=True)
class Carried:
    """One place that carries the version: ``where`` (file: field) holds ``value``."""

    where: str
    value: str


def project_version(root: Path = ROOT) -> str:
    """``[project] version`` of pyproject.toml: the one source."""
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]


def carried(root: Path = ROOT) -> list[Carried]:
    """Every place besides pyproject.toml that carries the version, with what it holds."""
    chart = yaml.safe_load((root / "charts/binbatch/Chart.yaml").read_text())
    values = yaml.safe_load((root / "charts/binbatch/values.yaml").read_text())
    found = [
        Carried("charts/binbatch/Chart.yaml: version", str(chart["version"])),
        Carried("charts/binbatch/Chart.yaml: appVersion", str(chart["appVersion"])),
    ]
    if values["image"]["tag"]:  # empty means the chart's appVersion
        found.append(Carried("charts/binbatch/values.yaml: image.tag", str(values["image"]["tag"])))
    for sample in sorted((root / "manifests/samples").glob("*.yaml")):
        for tag in _OUR_IMAGE.findall(sample.read_text()):
            found.append(Carried(f"manifests/samples/{sample.name}: image {IMAGE_REPOSITORY}", tag))
    return found


def check(root: Path = ROOT, tag: str | None = None) -> str:
    """The version, when every place agrees with pyproject.toml (and ``tag`` is ``v<version>``)."""
    version = project_version(root)
    if not VERSION_PATTERN.match(version):
        raise ReleaseError(f"pyproject.toml: version {version!r} is not X.Y.Z (the chart needs SemVer)")
    wrong = [f"{c.where} is {c.value!r}" for c in carried(root) if c.value != version]
    if wrong:
        raise ReleaseError(f"pyproject.toml: version is {version!r}, but " + "; ".join(wrong)
                           + " (charts/release.py set-version writes them all)")  # fmt: skip
    if tag is not None and tag != f"v{version}":
        raise ReleaseError(f"tag {tag!r} is not v{version}, pyproject.toml's version")
    return version


def set_version(new: str, root: Path = ROOT) -> list[str]:
    """Write ``new`` into pyproject.toml, Chart.yaml and the samples; the files changed (nothing on an error)."""
    if not VERSION_PATTERN.match(new):
        raise ReleaseError(f"version {new!r} is not X.Y.Z")
    texts: dict[Path, str] = {}

    def rewrite(path: Path, pattern: re.Pattern[str]) -> None:
        text = texts.get(path, path.read_text())
        updated, n = pattern.subn(lambda m: f"{m.group(1)}{new}{m.group(3)}", text)
        if n != 1:
            raise ReleaseError(f"{path.relative_to(root)}: expected one line like {pattern.pattern!r}, found {n}")
        texts[path] = updated

    rewrite(root / "pyproject.toml", _PYPROJECT_VERSION)
    for pattern in _CHART_FIELD.values():
        rewrite(root / "charts/binbatch/Chart.yaml", pattern)
    for sample in sorted((root / "manifests/samples").glob("*.yaml")):
        text = sample.read_text()
        if _OUR_IMAGE.search(text):
            texts[sample] = _OUR_IMAGE.sub(f"{IMAGE_REPOSITORY}:{new}", text)
    for path, text in texts.items():
        path.write_text(text)
    return [str(path.relative_to(root)) for path in texts]


def package(destination: Path, root: Path = ROOT) -> Path:
    """``helm package charts/binbatch``: ``destination/binbatch-<version>.tgz``, after ``check``."""
    version = check(root)
    destination.mkdir(parents=True, exist_ok=True)
    archive = Path(helm.package(root / "charts" / "binbatch", destination=destination))
    expected = destination / f"binbatch-{version}.tgz"
    if archive.resolve() != expected.resolve():
        raise ReleaseError(f"helm wrote {archive}, expected {expected}")
    return archive


def push(archive: Path, remote: str, *, plain_http: bool = False) -> None:
    """``helm push archive remote`` (``oci://host/path``).

    With ``REGISTRY_USERNAME`` and ``REGISTRY_PASSWORD`` set it logs in first, keeping
    the login in a temporary file (never in the user's Helm configuration); without
    them it uses Helm's own (``helm registry login``).
    """
    if urlsplit(remote).scheme != "oci":
        raise ReleaseError(f"remote {remote!r} is not an oci:// reference")
    username, password = os.environ.get("REGISTRY_USERNAME", ""), os.environ.get("REGISTRY_PASSWORD", "")
    if bool(username) != bool(password):
        missing = "REGISTRY_PASSWORD" if username else "REGISTRY_USERNAME"
        raise ReleaseError(f"{missing} is not set (the registry login needs REGISTRY_USERNAME and REGISTRY_PASSWORD)")
    if not username:
        with helm.RegistryClient(plain_http=plain_http) as client:
            client.push(archive, remote, plain_http=plain_http)
        return
    with tempfile.TemporaryDirectory() as config:
        with helm.RegistryClient(plain_http=plain_http, credentials_file=Path(config) / "registry.json") as client:
            client.login(urlsplit(remote).netloc, username, password, plain_http=plain_http)
            client.push(archive, remote, plain_http=plain_http)


def samples(image: str, destination: Path, root: Path = ROOT) -> list[Path]:
    """The samples with binbatch's image replaced by ``image`` (``registry/name:tag``), written to ``destination``.

    The CPU sample's engine runs this image; its policy leaves ``spec.sidecar.image``
    empty, so its sidecar is the operator's image: install the chart with the same
    ``image.repository`` and ``image.tag``.
    """
    if not re.fullmatch(r"[a-z0-9.-]+(:[0-9]+)?(/[a-z0-9._-]+)+:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", image):
        raise ReleaseError(f"--image {image!r} is not registry/name:tag")
    destination.mkdir(parents=True, exist_ok=True)
    written = []
    for sample in sorted((root / "manifests/samples").glob("*.yaml")):
        out = destination / sample.name
        out.write_text(_OUR_IMAGE.sub(image, sample.read_text()))
        written.append(out)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="every version agrees with pyproject.toml (and the tag)")
    p.add_argument("--tag", help="the release tag, which must be v<version>")
    p = sub.add_parser("set-version", help="write a new version everywhere it is carried")
    p.add_argument("version")
    p = sub.add_parser("package", help="package the chart (helm package)")
    p.add_argument("--destination", type=Path, default=ROOT / "dist")
    p = sub.add_parser("push", help="push a packaged chart to an OCI registry (helm push)")
    p.add_argument("archive", type=Path)
    p.add_argument("remote", help="oci://host/path (the chart's name and version come from the archive)")
    p.add_argument("--plain-http", action="store_true", help="HTTP instead of HTTPS (a local registry)")
    p = sub.add_parser("samples", help="write the samples with another binbatch image")
    p.add_argument("--image", required=True, help="registry/name:tag")
    p.add_argument("--destination", type=Path, default=ROOT / "dist" / "samples")
    args = parser.parse_args(argv)
    try:
        if args.command == "check":
            print(check(tag=args.tag))
        elif args.command == "set-version":
            for path in set_version(args.version):
                print(f"wrote {path}", file=sys.stderr)
            print("now: .venv/bin/python charts/render_manifests.py", file=sys.stderr)
        elif args.command == "package":
            print(package(args.destination))
        elif args.command == "push":
            push(args.archive, args.remote, plain_http=args.plain_http)
            print(f"pushed {args.archive} to {args.remote}")
        else:
            for path in samples(args.image, args.destination):
                print(path)
    except (ReleaseError, helm.HelmError) as exc:
        print(f"release: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
