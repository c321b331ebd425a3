"""An engine started with ``--api-key`` behind the sidecar (engine.apiKeyFile).

The emulator with ``api_key`` behaves as vLLM's ``--api-key``: 401 on ``/v1/*``
without ``Authorization: Bearer <key>``, ``/health`` and ``/metrics`` open.  With
the key file, completions, chat and streams through the sidecar succeed; without
it every request fails at once with an error naming the setting (no hang); a
caller's own Authorization never reaches the engine; a rotated key is used after
a reload or a re-read; and the key shows in no reply and no log line.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from aiohttp import web
from sidecar_harness import prompt_request, running_sidecar, sidecar_config

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar.config import ConfigError, load_config, parse_config
from binbatch_sidecar.emulator import EmulatorConfig, running_emulator
from binbatch_sidecar.engine.engine_key import EngineKey
from binbatch_sidecar.engine.metrics_feed import MetricsUnavailable
from binbatch_sidecar.server.app import Sidecar
from binbatch_sidecar.server.assembly import metrics_source

KEY = "sk-engine-5f2c9a7e1b"
FAST = EmulatorConfig(step_a=0.001, step_c=0.0001, num_gpu_blocks=512, block_size=16)
LOCKED = EmulatorConfig(step_a=0.001, step_c=0.0001, num_gpu_blocks=512, block_size=16, api_key=KEY)
WAIT = aiohttp.ClientTimeout(total=30)
CHAT = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]), max_tokens=4,
                          ignore_eos=True)  # fmt: skip


def key_file(tmp_path: Path, key: str = KEY) -> Path:
    path = tmp_path / "api-key"
    path.write_text(f"{key}\n")
    return path


async def _get(url: str, **headers: str) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=WAIT) as http, http.get(url, headers=headers) as resp:
        return resp.status, await resp.text()


async def _post(url: str, body: dict, **headers: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=WAIT) as http, http.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


# -- the emulator's --api-key ---------------------------------------------------------


async def test_the_emulator_with_a_key_refuses_v1_without_it_like_vllm():
    async with running_emulator(LOCKED) as url:
        body = {"model": LOCKED.model, "prompt": "x", "max_tokens": 2}
        assert await _post(f"{url}/v1/completions", body) == (401, {"error": "Unauthorized"})
        assert await _post(f"{url}/v1/completions", body, Authorization="Bearer wrong") == (401, {"error": "Unauthorized"})
        assert await _post(f"{url}/v1/completions", body, Authorization=KEY) == (401, {"error": "Unauthorized"})  # no scheme
        assert (await _get(f"{url}/v1/models"))[0] == 401
        status, data = await _post(f"{url}/v1/completions", body, Authorization=f"bearer {KEY}")  # scheme: any case
        assert status == 200 and data["usage"]["completion_tokens"] <= 2
        assert (await _get(f"{url}/health"))[0] == 200  # open, as in vLLM
        assert (await _get(f"{url}/metrics"))[0] == 200
    assert KEY not in repr(LOCKED)


def test_the_emulator_cli_takes_api_key():
    from binbatch_sidecar.emulator import config_from_args
    from binbatch_sidecar.emulator.cli import build_parser

    assert config_from_args(build_parser().parse_args(["--api-key", KEY])).api_key == KEY
    assert config_from_args(build_parser().parse_args([])).api_key == ""


# -- through the sidecar --------------------------------------------------------------


async def test_completion_chat_and_stream_succeed_with_the_key_file(tmp_path, caplog):
    path = key_file(tmp_path)
    caplog.set_level(logging.DEBUG)
    async with running_emulator(LOCKED) as url:
        doc = sidecar_config(url, engine={"apiKeyFile": str(path)})
        async with running_sidecar(doc, tmp_path) as sc:
            resp = await sc.inference.Generate(prompt_request(1, 5), timeout=30)
            assert resp.completion_tokens == 5
            assert (await sc.inference.Generate(CHAT, timeout=30)).completion_tokens == 4
            chunks = [c async for c in sc.inference.GenerateStream(prompt_request(2, 6), timeout=30)]
            assert chunks[-1].HasField("final") and chunks[-1].final.completion_tokens == 6
            # the HTTP door: a completion, and a passthrough path the engine protects (/v1/models);
            # the caller's own (wrong) Authorization is replaced by the engine's key
            door = f"http://127.0.0.1:{sc.sidecar.http_port}"
            status, data = await _post(f"{door}/v1/completions", {"prompt": "x", "max_tokens": 3, "ignore_eos": True},
                                       Authorization="Bearer caller-token")  # fmt: skip
            assert status == 200 and data["usage"]["completion_tokens"] == 3
            status, text = await _get(f"{door}/v1/models", Authorization="Bearer caller-token")
            assert status == 200 and LOCKED.model in text
            # the metrics scrape of the engine's own /metrics carries the key too
            assert sc.sidecar.feed.source.headers() == {"Authorization": f"Bearer {KEY}"}
            assert (await sc.sidecar.feed.poll_once()).fresh
            view = await sc.admin.GetConfig(pb.GetConfigRequest())
            assert str(path) in view.config_json and KEY not in str(view)
            assert KEY not in str(await sc.stats())
            metrics_text = (await _get(f"http://127.0.0.1:{sc.sidecar.metrics_port}/metrics"))[1]
            assert KEY not in metrics_text
    assert caplog.records and KEY not in caplog.text


async def test_without_the_key_every_request_fails_at_once_naming_the_setting(tmp_path, caplog):
    # engine.model: without the key the engine's /v1/models is refused too, so no default model is learned
    # (the sidecar logs why, once); with the model named each request reaches the engine and says why it failed
    async with running_emulator(LOCKED) as url:
        doc = sidecar_config(url, engine={"model": LOCKED.model})
        async with running_sidecar(doc, tmp_path) as sc:
            await _refused_everywhere(sc)
    warned = [r.getMessage() for r in caplog.records if r.name == "binbatch.sidecar" and "apiKeyFile" in r.getMessage()]
    assert len(warned) == 1


async def _refused_everywhere(sc) -> None:
    assert sc.sidecar.ready()  # /health is open: the sidecar is ready, and says why each request fails
    for call in (sc.inference.Generate(prompt_request(1, 5), timeout=30), sc.inference.Generate(CHAT, timeout=30)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "engine.apiKeyFile" in err.value.details() and "401" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _ = [c async for c in sc.inference.GenerateStream(prompt_request(2, 6), timeout=30)]
    assert err.value.code() == grpc.StatusCode.INTERNAL and "engine.apiKeyFile" in err.value.details()
    door = f"http://127.0.0.1:{sc.sidecar.http_port}"
    status, data = await _post(f"{door}/v1/completions", {"prompt": "x", "max_tokens": 3})
    assert status == 502 and data["error"]["code"] == "engine_unauthorized"
    assert "engine.apiKeyFile" in data["error"]["message"]
    # a caller's own Authorization, even the right key, is never sent on in the sidecar's place
    status, _ = await _get(f"{door}/v1/models", Authorization=f"Bearer {KEY}")
    assert status == 401


async def test_a_rotated_key_is_used_after_a_reload_and_after_a_re_read(tmp_path):
    path = key_file(tmp_path, "old-key")
    async with running_emulator(LOCKED) as url:
        doc = sidecar_config(url, engine={"apiKeyFile": str(path), "model": LOCKED.model},
                             server={"configPollMilliseconds": 100})  # fmt: skip
        async with running_sidecar(doc, tmp_path) as sc:
            with pytest.raises(grpc.aio.AioRpcError, match="engine.apiKeyFile"):
                await sc.inference.Generate(prompt_request(1, 3), timeout=30)
            # a reload (the config file changed) re-reads the key file
            key_file(tmp_path, KEY)
            doc["batch"] = {"maxWaitMilliseconds": 40}
            sc.write_config(doc)
            assert await sc.sidecar.watcher.check(), sc.sidecar.watcher.last_error
            assert (await sc.inference.Generate(prompt_request(2, 3), timeout=30)).completion_tokens == 3
            # a Secret rotated in place: the config is unchanged, the sidecar's key loop (at the config
            # poll interval) picks the file up
            side = sc.sidecar
            side.key_changed.clear()
            key_file(tmp_path, "rotated-away")
            await asyncio.wait_for(side.key_changed.wait(), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError, match="engine.apiKeyFile"):
                await sc.inference.Generate(prompt_request(3, 3), timeout=30)
            side.key_changed.clear()
            key_file(tmp_path, KEY)
            await asyncio.wait_for(side.key_changed.wait(), timeout=30)
            assert (await sc.inference.Generate(prompt_request(4, 3), timeout=30)).completion_tokens == 3


async def test_a_reload_with_an_unreadable_key_file_is_refused_and_keeps_the_running_key(tmp_path):
    path = key_file(tmp_path)
    async with running_emulator(LOCKED) as url:
        doc = sidecar_config(url, engine={"apiKeyFile": str(path)})
        async with running_sidecar(doc, tmp_path) as sc:
            doc["engine"]["apiKeyFile"] = str(tmp_path / "missing")
            sc.write_config(doc)
            assert not await sc.sidecar.watcher.check()
            view = await sc.admin.GetConfig(pb.GetConfigRequest())
            assert "cannot apply: engine.apiKeyFile: cannot read the key file" in view.last_reload_error
            assert view.generation == 1 and str(path) in view.config_json and KEY not in str(view)
            assert (await sc.inference.Generate(prompt_request(1, 3), timeout=30)).completion_tokens == 3


async def test_a_sidecar_whose_key_file_cannot_be_read_does_not_start(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cfg_path = tmp_path / "sidecar.yaml"
    cfg_path.write_text(f"engine: {{url: 'http://127.0.0.1:9', apiKeyFile: '{empty}'}}\n"
                        "server: {grpcPort: 0, httpPort: 0, metricsPort: 0}\n")  # fmt: skip
    sidecar = Sidecar(load_config(cfg_path), config_path=str(cfg_path))
    with pytest.raises(ConfigError) as err:
        await sidecar.start()
    assert err.value.problems == [("engine.apiKeyFile", f"the key file {empty} is empty (or only whitespace)")]


# -- the scrape of an engine that protects /metrics -----------------------------------


@pytest.fixture
async def protected_metrics() -> AsyncIterator[str]:
    """An engine whose /metrics wants the key (vLLM's does not; a proxy in front of it may)."""

    async def metrics(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {KEY}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 2\n"
        return web.Response(text=text, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_the_scrape_carries_the_key_when_the_engine_wants_it(protected_metrics):
    cfg = parse_config({"engine": {"url": protected_metrics}, "metrics": {"url": f"{protected_metrics}/metrics"}})
    metrics = await metrics_source(cfg, EngineKey("/k", KEY)).fetch()
    assert metrics.running == 2
    with pytest.raises(MetricsUnavailable, match="HTTP 401"):
        await metrics_source(cfg, EngineKey()).fetch()
