"""Caller authentication through both doors, and the Admin gate, on a real sidecar in front of the emulator.

HTTP with the official ``openai`` client (a caller's token as its api_key: 200; a wrong one or none:
``openai.AuthenticationError``), gRPC with and without ``authorization`` metadata, a Secret rotated in
place (the old token refused, the new one accepted, awaited on the sidecar's event), and Admin: answered
on 127.0.0.1 without a credential; off loopback refused unless it carries the admin token or an
operator-signed JWT.  "Off loopback" is tested twice: through the gate's ``is_loopback`` seam (every
machine), and by binding the sidecar on a non-loopback address of this machine when it has one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import psutil
import pytest
from sidecar_harness import Running, prompt_request, running_sidecar, sidecar_config

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc
from binbatch_operator.sidecar_stats import get_stats
from binbatch_sidecar import cli
from binbatch_sidecar.config import load_config
from binbatch_sidecar.emulator import EmulatorConfig, running_emulator
from binbatch_sidecar.engine.admin_token import load_private_pem, new_private_pem, public_pem, sign
from binbatch_sidecar.engine.record_export import export_records
from binbatch_sidecar.server.app import Sidecar

FAST = EmulatorConfig(step_a=0.001, step_c=0.0001, num_gpu_blocks=512, block_size=16)
WAIT = 30.0
TOKENS = {"team-a": "tok-a-7d1e", "team-b": "tok-b-93fa"}
KEY = load_private_pem(new_private_pem())
AUDIENCE = "llm/chat"
ADMIN_TOKEN = "adm-41c0e2"


def kubelet_secret(folder: Path, tokens: dict[str, str], stamp: str) -> Path:
    """A Secret volume as the kubelet writes it: ``name -> ..data/name`` and ``..data`` swapped atomically."""
    folder.mkdir(exist_ok=True)
    data = folder / f"..{stamp}"
    data.mkdir()
    for name, token in tokens.items():
        (data / name).write_text(token + "\n")
    (folder / "..data_tmp").symlink_to(data.name)
    os.replace(folder / "..data_tmp", folder / "..data")
    for name in tokens:
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")
    return folder


def auth_doc(url: str, tmp_path: Path, **auth: Any) -> dict[str, Any]:
    secret = kubelet_secret(tmp_path / "callers", TOKENS, "1")
    (tmp_path / "admin-token").write_text(ADMIN_TOKEN)
    return sidecar_config(url, server={"configPollMilliseconds": 100}, predictor={"kind": "Learned"},
                          auth={"callerTokensDir": str(secret), "adminTokenFile": str(tmp_path / "admin-token"),
                                "operatorPublicKeys": [public_pem(KEY)], "audience": AUDIENCE, **auth})  # fmt: skip


@contextlib.asynccontextmanager
async def locked_sidecar(tmp_path: Path, **auth: Any) -> AsyncIterator[Running]:
    async with running_emulator(FAST) as url, running_sidecar(auth_doc(url, tmp_path, **auth), tmp_path) as sc:
        yield sc


def client(sc: Running, api_key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{sc.sidecar.http_port}/v1", api_key=api_key,
                              max_retries=0, timeout=WAIT)  # fmt: skip


def unauthenticated(sc: Running, door: str) -> float:
    return sc.sidecar.metrics.registry.get_sample_value("binbatch_unauthenticated_total", {"door": door})


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def test_the_http_door_serves_a_known_caller_and_refuses_others_with_401(tmp_path):
    async with locked_sidecar(tmp_path) as sc, client(sc, TOKENS["team-a"]) as ok, client(sc, "tok-a-7d1") as wrong:
        model = FAST.model
        done = await ok.completions.create(model=model, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 3
        chat = await ok.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert chat.choices[0].message.content is not None
        stream = await ok.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=4, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        pieces = [c async for c in stream]
        assert pieces and pieces[-1].choices[0].finish_reason == "length"
        assert [m.id async for m in ok.models.list()] == [model]  # passthrough, with a token
        accepted = sc.sidecar.dispatcher.totals["accepted"]
        with pytest.raises(openai.AuthenticationError) as err:
            await wrong.completions.create(model=model, prompt="hi", max_tokens=3)
        assert err.value.status_code == 401 and "not a known caller's" in err.value.message  # a token's prefix
        assert err.value.response.headers["WWW-Authenticate"] == 'Bearer realm="binbatch", error="invalid_token"'
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                                max_tokens=2, stream=True)  # fmt: skip
        with pytest.raises(openai.AuthenticationError):
            await wrong.models.list()  # passthrough is gated too
        door = f"http://127.0.0.1:{sc.sidecar.http_port}"
        async with aiohttp.ClientSession() as http:  # no Authorization at all (the openai client always sends one)
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
                async with http.request(method, f"{door}{path}", json={"prompt": "x"}) as resp:
                    body = await resp.json()
                    assert resp.status == 401 and body["error"]["code"] == "missing_api_key"
                    assert resp.headers["WWW-Authenticate"] == 'Bearer realm="binbatch"'
            async with http.post(f"{door}/v1/completions", json={"prompt": "x"},
                                 headers={"Authorization": "Basic dXNlcg=="}) as resp:  # fmt: skip
                body = await resp.json()
                assert resp.status == 401 and body["error"]["code"] == "invalid_api_key"
                assert "not a bearer token" in body["error"]["message"]
            async with http.get(f"{door}/health") as resp:
                assert resp.status == 200  # probes need no token
            async with http.get(f"http://127.0.0.1:{sc.sidecar.metrics_port}/metrics") as resp:
                assert resp.status == 200  # the sidecar's own metrics port stays open (Prometheus)
        assert sc.sidecar.dispatcher.totals["accepted"] == accepted  # nothing refused was queued
        assert unauthenticated(sc, "http") == 6


async def test_grpc_generate_needs_a_known_callers_token_in_its_metadata(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    async with locked_sidecar(tmp_path) as sc:
        reply = await sc.inference.Generate(prompt_request(1, 3), metadata=bearer(TOKENS["team-b"]), timeout=WAIT)
        assert reply.completion_tokens == 3
        chunks = [c async for c in sc.inference.GenerateStream(prompt_request(2, 3), metadata=bearer(TOKENS["team-a"]),
                                                                 timeout=WAIT)]  # fmt: skip
        assert chunks[-1].final.completion_tokens == 3
        accepted = sc.sidecar.dispatcher.totals["accepted"]
        for metadata, words in ((None, "authorization: missing"), (bearer("nope"), "not a known caller's")):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await sc.inference.Generate(prompt_request(3, 3), metadata=metadata, timeout=WAIT)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and words in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                _ = [c async for c in sc.inference.GenerateStream(prompt_request(4, 3), metadata=metadata, timeout=WAIT)]
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert sc.sidecar.dispatcher.totals["accepted"] == accepted
        assert unauthenticated(sc, "grpc") == 4
    assert "unauthenticated call(s)" in caplog.text  # said, at INFO, once
    assert all(token not in caplog.text for token in (*TOKENS.values(), ADMIN_TOKEN, "nope"))


async def test_a_rotated_secret_refuses_the_old_token_and_accepts_the_new(tmp_path):
    async with locked_sidecar(tmp_path) as sc:
        side = sc.sidecar
        side.auth_changed.clear()
        kubelet_secret(tmp_path / "callers", {**TOKENS, "team-a": "tok-a-rotated"}, "2")
        await asyncio.wait_for(side.auth_changed.wait(), timeout=WAIT)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sc.inference.Generate(prompt_request(1, 2), metadata=bearer(TOKENS["team-a"]), timeout=WAIT)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = await sc.inference.Generate(prompt_request(2, 2), metadata=bearer("tok-a-rotated"), timeout=WAIT)
        assert reply.completion_tokens == 2
        async with client(sc, "tok-a-rotated") as rotated:
            new = await rotated.completions.create(model=FAST.model, prompt="x", max_tokens=2)
        assert new.usage.completion_tokens >= 1


async def test_a_reload_to_an_empty_token_directory_is_refused_naming_the_key(tmp_path):
    async with locked_sidecar(tmp_path) as sc:
        (tmp_path / "empty").mkdir()
        doc = json.loads(json.dumps(sc.sidecar.loaded.config.model_dump(mode="json", by_alias=True)))
        doc["auth"]["callerTokensDir"] = str(tmp_path / "empty")
        sc.write_config(doc)
        assert await sc.sidecar.watcher.check() is False
        assert "auth.callerTokensDir" in sc.sidecar.watcher.last_error and "holds no token file" in sc.sidecar.watcher.last_error
        reply = await sc.inference.Generate(prompt_request(1, 2), metadata=bearer(TOKENS["team-a"]), timeout=WAIT)
        assert reply.completion_tokens == 2  # the running tokens stay


async def test_admin_answers_loopback_and_off_loopback_only_a_credential(tmp_path):
    async with locked_sidecar(tmp_path) as sc:
        view = await sc.admin.GetConfig(pb.GetConfigRequest())  # 127.0.0.1, no credential
        shown = json.loads(view.config_json)
        assert shown["auth"]["callerTokensDir"] == str(tmp_path / "callers")
        assert all(token not in view.config_json for token in (*TOKENS.values(), ADMIN_TOKEN))
        sc.sidecar.admin_gate.is_loopback = lambda peer: False  # the seam: this peer is taken for a remote one
        address = f"127.0.0.1:{sc.sidecar.grpc_port}"
        for call in (sc.admin.GetConfig(pb.GetConfigRequest()), sc.admin.GetStats(pb.GetStatsRequest()),
                     sc.admin.ExportTrainingRecords(pb.ExportTrainingRecordsRequest()),
                     sc.admin.GetConfig(pb.GetConfigRequest(), metadata=bearer(TOKENS["team-a"])),  # a caller's token
                     sc.admin.GetConfig(pb.GetConfigRequest(), metadata=bearer(sign(KEY, "llm/other")))):  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert unauthenticated(sc, "admin") == 5
        assert (await sc.admin.GetConfig(pb.GetConfigRequest(), metadata=bearer(ADMIN_TOKEN))).generation == 1
        stats = await get_stats(address, token=sign(KEY, AUDIENCE))  # the operator's GetStats
        assert stats.sidecar_version
        await sc.inference.Generate(prompt_request(1, 2), metadata=bearer(TOKENS["team-a"]), timeout=WAIT)
        exported = await export_records(address, token=lambda: sign(KEY, AUDIENCE))  # the fleet's export, per page
        assert exported.epoch
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await get_stats(address)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "needs a credential" in err.value.details()


async def test_predictor_export_off_loopback_needs_the_admin_token_file(tmp_path, capsys):
    async with locked_sidecar(tmp_path) as sc:
        sc.sidecar.admin_gate.is_loopback = lambda peer: False
        target, out = f"127.0.0.1:{sc.sidecar.grpc_port}", tmp_path / "records.jsonl"
        export = ["predictor", "export", "--target", target, "--out", str(out)]
        assert await asyncio.to_thread(cli.main, export) != 0 and not out.exists()
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        missing = ["--token-file", str(tmp_path / "nope")]
        assert await asyncio.to_thread(cli.main, [*export, *missing]) != 0
        assert "--token-file: cannot read the key file" in capsys.readouterr().err
        assert await asyncio.to_thread(cli.main, [*export, "--token-file", str(tmp_path / "admin-token")]) == 0
        assert out.exists()


def non_loopback_ipv4() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return a.address
    return None


async def test_admin_refuses_a_real_peer_off_loopback_without_a_credential(tmp_path):
    host = non_loopback_ipv4()
    if host is None:
        pytest.skip("this machine has no non-loopback IPv4 address to bind the sidecar on (the seam test covers the gate)")
    async with running_emulator(FAST) as url:
        doc = auth_doc(url, tmp_path)
        path = tmp_path / "sidecar.yaml"
        path.write_text(json.dumps(doc))
        sidecar = Sidecar(load_config(path), config_path=str(path), host=host)
        await sidecar.start()
        try:
            async with grpc.aio.insecure_channel(f"{host}:{sidecar.grpc_port}") as channel:
                admin = pb_grpc.AdminStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await admin.GetConfig(pb.GetConfigRequest(), timeout=WAIT)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                view = await admin.GetConfig(pb.GetConfigRequest(), metadata=bearer(sign(KEY, AUDIENCE)), timeout=WAIT)
                assert view.generation == 1
        finally:
            await sidecar.stop(grace=5)
