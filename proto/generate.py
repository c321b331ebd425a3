#!/usr/bin/env python3
"""Regenerate the Python gRPC stubs of the binbatch API.

Usage (from the repository root, with the project's virtual environment):

    .venv/bin/python proto/generate.py             # rewrite the committed stubs
    .venv/bin/python proto/generate.py --out DIR   # write them under DIR instead

For every ``proto/binbatch_api/**/*.proto`` it writes, next to the ``.proto``
(or at the same relative path under ``--out``):

    <name>_pb2.py  <name>_pb2_grpc.py  <name>_pb2.pyi  <name>_pb2_grpc.pyi
    <name>_descriptor_set.binpb

The last is a FileDescriptorSet *with source info* (the comments of the
``.proto``).  ``*_pb2.py`` embeds the descriptor without comments, and the stock
reflection service serves that, so grpcurl's ``describe`` would show no
documentation; the sidecar's reflection serves the FileDescriptorProtos of this
set instead (``binbatch_api.v1.source_file_descriptors``, read by
``binbatch_sidecar/server/reflection.py``).

protoc runs in-process from ``grpc_tools`` (grpcio-tools) with ``-I proto``, so
the generated code imports its siblings as ``from binbatch_api.v1 import
binbatch_pb2`` -- the import package ``binbatch_api`` is the folder
``proto/binbatch_api``.  The ``.pyi`` stubs come from mypy-protobuf's
``protoc-gen-mypy`` / ``protoc-gen-mypy_grpc`` plugins, taken from the same
environment as this interpreter.

tests/unit/test_proto_stubs.py regenerates into a temporary directory and fails
if the committed files differ: after editing a ``.proto``, run this script and
commit the result.  The generated code requires at run time
``protobuf >=`` the gencode version written in ``*_pb2.py`` and
``grpcio >=`` ``GRPC_GENERATED_VERSION`` in ``*_pb2_grpc.py``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE = "binbatch_api"

# The files protoc writes per .proto, as suffixes replacing ".proto".
DESCRIPTOR_SET_SUFFIX = "_descriptor_set.binpb"
GENERATED_SUFFIXES = (
    "_pb2.py",
    "_pb2_grpc.py",
    "_pb2.pyi",
    "_pb2_grpc.pyi",
    DESCRIPTOR_SET_SUFFIX,
)


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    """The API's .proto files, relative to the include root, in a stable order."""
    return sorted(p.relative_to(root) for p in (root / PACKAGE).rglob("*.proto"))


def generated_files(root: Path = PROTO_ROOT) -> list[Path]:
    """Relative paths of every file this script generates."""
    out: list[Path] = []
    for proto in proto_files(root):
        stem = proto.with_suffix("")
        out.extend(stem.parent / (stem.name + suffix) for suffix in GENERATED_SUFFIXES)
    return out


def _plugin(name: str) -> str:
    """Path of a protoc plugin executable installed beside this interpreter."""
    bindir = Path(sys.executable).parent
    for candidate in (bindir / name, bindir / (name + ".exe")):
        if candidate.is_file():
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise SystemExit(
            f"{name} not found next to {sys.executable} or on PATH; "
            "install mypy-protobuf into this environment (pip install -e '.[test]')"
        )
    return found


def generate(out_dir: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc; return the absolute paths of the files it wrote."""
    try:
        from grpc_tools import protoc
    except ImportError:  # pragma: no cover - depends on the environment
        raise SystemExit(
            "grpc_tools not importable; install grpcio-tools (pip install -e '.[test]')"
        ) from None
    import grpc_tools

    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = proto_files()
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_ROOT / PACKAGE}")

    # The well-known types (google/protobuf/*.proto) ship inside grpc_tools.
    wkt_include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{wkt_include}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        # Relative paths (with -I PROTO_ROOT) keep absolute paths out of the output.
        *(p.as_posix() for p in protos),
    ]
    invocations = [args]
    # One descriptor set (with comments) per .proto; --include_imports makes it
    # self-contained should the .proto ever import other files.
    for proto in protos:
        stem = proto.with_suffix("")
        target = out_dir / stem.parent / (stem.name + DESCRIPTOR_SET_SUFFIX)
        target.parent.mkdir(parents=True, exist_ok=True)
        invocations.append(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"-I{wkt_include}",
                "--include_source_info",
                "--include_imports",
                f"--descriptor_set_out={target}",
                proto.as_posix(),
            ]
        )
    cwd = os.getcwd()
    os.chdir(PROTO_ROOT)
    try:
        for invocation in invocations:
            rc = protoc.main(invocation)
            if rc != 0:
                raise SystemExit(f"protoc failed with exit code {rc}: {' '.join(invocation)}")
    finally:
        os.chdir(cwd)

    written = [out_dir / rel for rel in generated_files()]
    missing = [str(p) for p in written if not p.is_file()]
    if missing:
        raise SystemExit(f"protoc did not write: {', '.join(missing)}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Regenerate the binbatch API's Python stubs (_pb2, _pb2_grpc, .pyi) and "
        "descriptor set."
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=PROTO_ROOT,
        metavar="DIR",
        help="output root; files land at DIR/binbatch_api/... (default: %(default)s, "
        "i.e. next to the .proto files)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    ns = parser.parse_args(argv)
    for path in generate(ns.out):
        if not ns.quiet:
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
