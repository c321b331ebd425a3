"""``Admin/ExportTrainingRecords`` over real gRPC on 127.0.0.1: a Learned sidecar in front of the
engine emulator serves some requests, then hands out their hashed records (no prompt text), only
the new ones after a cursor; ``binbatch predictor export`` writes them as records ``predictor train``
fits a model on; a sidecar whose predictor is not Learned answers FAILED_PRECONDITION."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from sidecar_harness import running_sidecar, sidecar_config

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar import cli
from binbatch_sidecar.core import length_model
from binbatch_sidecar.emulator import EmulatorConfig, running_emulator
from binbatch_sidecar.engine.model_file import load_model
from binbatch_sidecar.engine.record_export import export_records

FAST = EmulatorConfig(step_a=0.0005, step_c=0.0001, num_gpu_blocks=512, block_size=16)
SECRET = "zanzibar-quokka"  # a word of every prompt: it must not leave the sidecar


def _prompt(i: int) -> str:
    return f"{SECRET} write {'a long essay' if i % 2 else 'one word'} about thing {i}"


async def _serve(sc, first: int, n: int) -> list[int]:
    async def one(i: int) -> int:
        req = pb.GenerateRequest(prompt=_prompt(i), max_tokens=40 if i % 2 else 4, ignore_eos=True)
        return (await sc.inference.Generate(req, timeout=30)).completion_tokens

    return list(await asyncio.gather(*(one(i) for i in range(first, first + n))))


async def test_export_returns_the_served_requests_hashed_and_only_the_new_ones_after_the_cursor(tmp_path):
    predictor = {"kind": "Learned", "trainingBufferRecords": 64}
    async with running_emulator(FAST) as url, running_sidecar(sidecar_config(url, predictor=predictor), tmp_path) as sc:
        lengths = await _serve(sc, 0, 12)
        first = await sc.admin.ExportTrainingRecords(pb.ExportTrainingRecordsRequest(), timeout=10)
        assert [r.sequence for r in first.records] == list(range(1, 13))
        assert first.next == 12 and first.remaining == 0 and first.oldest == 1 and first.epoch
        assert sorted(r.output_tokens for r in first.records) == sorted(lengths)
        want = length_model.featurize(_prompt(0), "", 4)  # what the sidecar keeps of request 0
        assert any(list(r.indices) == want.indices.tolist() for r in first.records)
        assert SECRET.encode() not in first.SerializeToString()

        page = await sc.admin.ExportTrainingRecords(
            pb.ExportTrainingRecordsRequest(since=4, epoch=first.epoch, max_records=3), timeout=10)
        assert [r.sequence for r in page.records] == [5, 6, 7] and page.next == 7 and page.remaining == 5

        await _serve(sc, 12, 5)
        new = await sc.admin.ExportTrainingRecords(
            pb.ExportTrainingRecordsRequest(since=first.next, epoch=first.epoch), timeout=10)
        assert [r.sequence for r in new.records] == [13, 14, 15, 16, 17]
        other = await sc.admin.ExportTrainingRecords(  # a cursor of another run: everything held
            pb.ExportTrainingRecordsRequest(since=first.next, epoch="not-this-one"), timeout=10)
        assert len(other.records) == 17

        got = await export_records(f"127.0.0.1:{sc.sidecar.grpc_port}", since=10, epoch=first.epoch)
        assert (len(got.records), got.next, got.dropped) == (7, 17, 0)
        assert all(r.hashed is not None and r.prompt == "" for r in got.records)


async def test_predictor_export_writes_records_predictor_train_fits(tmp_path, capsys):
    async with running_emulator(FAST) as url, running_sidecar(sidecar_config(url), tmp_path) as sc:
        await _serve(sc, 0, 24)
        out = tmp_path / "records.jsonl"
        target = f"127.0.0.1:{sc.sidecar.grpc_port}"
        assert await asyncio.to_thread(cli.main, ["predictor", "export", "--target", target, "--out", str(out)]) == 0
    text = out.read_text()
    assert SECRET not in text and "prompt" not in text
    assert len([json.loads(line) for line in text.splitlines()]) == 24
    assert cli.main(["predictor", "train", "--records", str(out), "--out", str(tmp_path / "m.npz")]) == 0
    model = load_model(tmp_path / "m.npz")
    assert model.records == 24
    long, short = (model.dist(length_model.featurize(_prompt(i), "", m)).median for i, m in ((1, 40), (2, 4)))
    assert long > short


async def test_a_sidecar_that_is_not_learned_refuses_the_export(tmp_path):
    async with running_emulator(FAST) as url, running_sidecar(sidecar_config(url, predictor={"kind": "Online"}), tmp_path) as sc:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sc.admin.ExportTrainingRecords(pb.ExportTrainingRecordsRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "predictor.kind" in err.value.details()


def test_predictor_export_names_the_target_it_cannot_reach(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    code = cli.main(["predictor", "export", "--target", "127.0.0.1:1", "--out", str(out)])
    assert code != 0 and not out.exists()
    err = capsys.readouterr().err
    assert err.startswith("binbatch predictor export: --target 127.0.0.1:1: UNAVAILABLE")
