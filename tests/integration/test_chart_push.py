"""The packaged chart pushed to an OCI registry (``charts/release.py push``, ``make chart-push``).

The registry is a small implementation of the OCI distribution API's push half
(monolithic blob uploads and manifests, basic auth), served on 127.0.0.1 by the
test; the push itself is the real Helm library's (``helm-python-sdk``).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib.util
import json
import sys
import tomllib
import uuid
from pathlib import Path

import helm_python as helm
import pytest
from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]


def release_module():
    """charts/release.py (a script, not a package module), loaded once per session."""
    if "charts_release" not in sys.modules:
        spec = importlib.util.spec_from_file_location("charts_release", ROOT / "charts" / "release.py")
        module = sys.modules["charts_release"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["charts_release"]


release = release_module()


class Registry:
    """The OCI distribution API's push half (blobs by monolithic upload, manifests), behind basic auth."""

    def __init__(self, username: str, password: str) -> None:
        self.authorization = "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()
        self.blobs: dict[str, bytes] = {}
        self.manifests: dict[tuple[str, str], tuple[str, bytes]] = {}  # (repository, tag or digest) -> type, body
        self.uploads: dict[str, bytes] = {}
        self.refused = 0

    @web.middleware
    async def auth(self, request: web.Request, handler):
        if request.headers.get("Authorization") != self.authorization:
            self.refused += 1
            raise web.HTTPUnauthorized(headers={"WWW-Authenticate": 'Basic realm="test"'})
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.auth])
        app.router.add_get("/v2/", self.ping)
        app.router.add_route("*", r"/v2/{name:.+}/blobs/uploads/{id:.*}", self.upload)
        app.router.add_route("*", r"/v2/{name:.+}/blobs/{digest}", self.blob)
        app.router.add_route("*", r"/v2/{name:.+}/manifests/{ref}", self.manifest)
        return app

    async def ping(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def upload(self, request: web.Request) -> web.Response:
        name, upload = request.match_info["name"], request.match_info["id"]
        if request.method == "POST":
            upload = uuid.uuid4().hex
            self.uploads[upload] = b""
        else:
            self.uploads[upload] += await request.read()
        if request.method == "PUT":
            data, digest = self.uploads.pop(upload), request.query["digest"]
            if digest != "sha256:" + hashlib.sha256(data).hexdigest():
                raise web.HTTPBadRequest(text="digest mismatch")
            self.blobs[digest] = data
            return web.Response(status=201, headers={"Location": f"/v2/{name}/blobs/{digest}", "Docker-Content-Digest": digest})
        return web.Response(status=202, headers={"Location": f"/v2/{name}/blobs/uploads/{upload}", "Range": "0-0"})

    async def blob(self, request: web.Request) -> web.Response:
        data = self.blobs.get(request.match_info["digest"])
        if data is None or request.method not in ("GET", "HEAD"):
            raise web.HTTPNotFound()
        headers = {"Docker-Content-Digest": request.match_info["digest"], "Content-Length": str(len(data))}
        return web.Response(body=data if request.method == "GET" else None, headers=headers)

    async def manifest(self, request: web.Request) -> web.Response:
        key = (request.match_info["name"], request.match_info["ref"])
        if request.method == "PUT":
            body = await request.read()
            digest = "sha256:" + hashlib.sha256(body).hexdigest()
            media = request.content_type
            self.manifests[key] = self.manifests[(key[0], digest)] = (media, body)
            return web.Response(status=201, headers={"Docker-Content-Digest": digest,
                                                     "Location": f"/v2/{key[0]}/manifests/{digest}"})  # fmt: skip
        if key not in self.manifests:
            raise web.HTTPNotFound()
        media, body = self.manifests[key]
        headers = {"Docker-Content-Digest": "sha256:" + hashlib.sha256(body).hexdigest(), "Content-Type": media,
                   "Content-Length": str(len(body))}  # fmt: skip
        return web.Response(body=body if request.method == "GET" else None, headers=headers)


@pytest.fixture
async def registry():
    served = Registry("releaser", "s3cret")
    runner = web.AppRunner(served.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    served.host = "127.0.0.1:%d" % runner.addresses[0][1]
    try:
        yield served
    finally:
        await runner.cleanup()


async def test_the_packaged_chart_is_pushed_to_an_oci_registry_with_the_environments_login(
    registry, tmp_path, monkeypatch, capsys
):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    archive = release.package(tmp_path)
    monkeypatch.setenv("REGISTRY_USERNAME", "releaser")
    monkeypatch.setenv("REGISTRY_PASSWORD", "s3cret")
    remote = f"oci://{registry.host}/charts"
    argv = ["push", str(archive), remote, "--plain-http"]  # what `make chart-push` runs, over HTTP
    assert await asyncio.wait_for(asyncio.to_thread(release.main, argv), timeout=60) == 0
    assert capsys.readouterr().out == f"pushed {archive} to {remote}\n"
    media, body = registry.manifests[("charts/binbatch", version)]
    manifest = json.loads(body)
    (layer,) = [layer for layer in manifest["layers"] if layer["mediaType"].startswith("application/vnd.cncf.helm.chart.content")]
    assert registry.blobs[layer["digest"]] == archive.read_bytes()
    config = json.loads(registry.blobs[manifest["config"]["digest"]])
    assert (config["name"], config["version"]) == ("binbatch", version)

    monkeypatch.setenv("REGISTRY_PASSWORD", "wrong")
    refused_before = registry.refused
    with pytest.raises(helm.HelmError):
        await asyncio.wait_for(asyncio.to_thread(release.push, archive, remote, plain_http=True), timeout=60)
    assert registry.refused > refused_before
