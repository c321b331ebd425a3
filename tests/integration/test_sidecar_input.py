"""Every input gets a clear answer, over real gRPC on 127.0.0.1 (issue 9 defects 7, 8).

Bad input - a number out of its documented bound, a loosely spelled number, a
body that is not a GenerateRequest at all - is INVALID_ARGUMENT naming the field,
and never an ERROR log record (a client must not be able to flood the logs).
Request classes come from the policy; an unknown one is refused.  Prompts are
logged only when the policy asks for it.
"""

from __future__ import annotations

import logging
import math

import grpc
import pytest
from sidecar_harness import prompt_request, running_sidecar, sidecar_config

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar.core import length_model
from binbatch_sidecar.emulator import EmulatorConfig, running_emulator
from binbatch_sidecar.engine.model_file import save_model

FAST = EmulatorConfig(step_a=0.001, step_c=0.0001, num_gpu_blocks=512, block_size=16)
CAP = 512  # bins.maxOutputTokens of these tests

BAD_METADATA = [
    ("x-slo-ttft-ms", "9" * 400),  # was OverflowError: UNKNOWN and a traceback per request
    ("x-slo-ttft-ms", " 7 "),
    ("x-slo-ttft-ms", "1_000"),
    ("x-slo-ttft-ms", str(10**18)),
    ("x-slo-ttft-ms", "+5"),
    ("x-slo-ttft-ms", "-5"),
    ("x-slo-ttft-ms", "0"),
    ("x-slo-ttft-ms", "600001"),
    ("x-slo-ttft-ms", "1e3"),
    ("x-slo-ttft-ms", ""),
    ("x-slo-tpot-ms", "100001"),
    ("x-slo-tpot-ms", "fast"),
]

BAD_FIELDS = [
    ({"max_tokens": CAP + 1}, "max_tokens"),
    ({"expected_output_tokens": 0}, "expected_output_tokens"),
    ({"expected_output_tokens": CAP + 1}, "expected_output_tokens"),
    ({"expected_output_tokens": 2**32 - 1}, "expected_output_tokens"),
    ({"priority": 1001}, "priority"),
    ({"priority": -(2**31)}, "priority"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": 101.0}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"min_tokens": 2**32 - 1}, "min_tokens"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": [""]}, "stop[0]"),
    ({"stop": ["ok", "y" * 1025]}, "stop[1]"),
    ({"model": "m" * 513}, "model"),
    ({"request_id": "r" * 129}, "request_id"),
    ({"request_class": "nope"}, "request_class"),
    ({"request_class": "x" * 10_000}, "request_class"),
]

# Raw bodies sent with identity serializers: not a GenerateRequest.
CORRUPT = [
    b"\x0a\x02\xff\xfe",  # field 1 (prompt), a string that is not UTF-8
    b"\xff\xff\xff\xff",  # no valid tag
    b"\x0a\x7f",  # a length beyond the end of the body
]


def _errors(caplog) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]


CLASSES = {"classes": [{"name": "interactive", "priority": 100}, {"name": "batch", "priority": -100}]}


async def test_bad_input_is_invalid_argument_naming_the_field_and_never_logged_as_an_error(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    async with running_emulator(FAST) as url, running_sidecar(sidecar_config(url, bins={"maxOutputTokens": CAP}), tmp_path) as sc:  # fmt: skip
        for key, value in BAD_METADATA:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await sc.inference.Generate(prompt_request(1, 3), metadata=((key, value),), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (key, value, err.value.details())
            assert err.value.details().startswith(key), (key, value)
            assert len(err.value.details()) < 200  # a 400-digit value is not echoed whole
        twice = (("x-slo-ttft-ms", "100"), ("x-slo-ttft-ms", "200"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await sc.inference.Generate(prompt_request(1, 3), metadata=twice, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than once" in err.value.details()

        for fields, name in BAD_FIELDS:
            msg = pb.GenerateRequest(prompt="x", max_tokens=fields.pop("max_tokens", 8), **fields)
            for call in (sc.inference.Generate(msg, timeout=10), _drain(sc.inference.GenerateStream(msg, timeout=10))):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, err.value.details())
                assert err.value.details().startswith(name + ":"), (name, err.value.details())

        unary = sc.channel.unary_unary("/binbatch.v1.Inference/Generate")  # no serializers: raw bytes
        streaming = sc.channel.unary_stream("/binbatch.v1.Inference/GenerateStream")
        stats = sc.channel.unary_unary("/binbatch.v1.Admin/GetStats")
        config = sc.channel.unary_unary("/binbatch.v1.Admin/GetConfig")
        for body in CORRUPT:
            calls = [unary(body, timeout=10), _drain(streaming(body, timeout=10))]
            if body != CORRUPT[0]:  # the Admin requests have no fields: a bad string is an unknown field there
                calls += [stats(body, timeout=10), config(body, timeout=10)]
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (body, err.value.details())
                assert err.value.details().startswith("request: "), err.value.details()

        # Bounds are inclusive and plain digits pass: the sidecar still serves.
        ok = await sc.inference.Generate(
            prompt_request(2, 3, expected_output_tokens=CAP, priority=1000, stop=["x"] * 16),
            metadata=(("x-slo-ttft-ms", "600000"), ("x-slo-tpot-ms", "0100")), timeout=30,
        )  # fmt: skip
        assert ok.completion_tokens == 3
        stats = await sc.stats()
        assert stats.totals.accepted == 1  # nothing invalid was queued
    assert _errors(caplog) == []


async def _drain(stream) -> None:
    async for _ in stream:
        pass


async def test_request_classes_come_from_the_policy(tmp_path):
    async with running_emulator(FAST) as url:
        doc = sidecar_config(url, classes=CLASSES)
        async with running_sidecar(doc, tmp_path) as sc:
            for name in ("interactive", "batch", ""):
                resp = await sc.inference.Generate(prompt_request(1, 3, request_class=name), timeout=30)
                assert resp.completion_tokens == 3
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await sc.inference.Generate(prompt_request(1, 3, request_class="offline"), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == (
                "request_class: unknown class 'offline' (the policy's classes.classes defines: interactive, batch)"
            )
            doc["classes"] = {"classes": [{"name": "offline"}]}  # a reload defines it
            sc.write_config(doc)
            assert await sc.sidecar.watcher.check()
            resp = await sc.inference.Generate(prompt_request(1, 3, request_class="offline"), timeout=30)
            assert resp.completion_tokens == 3
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await sc.inference.Generate(prompt_request(1, 3, request_class="batch"), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_prompts_are_logged_only_when_log_prompts_is_set(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    async with running_emulator(FAST) as url:
        doc = sidecar_config(url)
        async with running_sidecar(doc, tmp_path) as sc:
            quiet = pb.GenerateRequest(prompt="secret-quiet-prompt", max_tokens=3, ignore_eos=True)
            resp = await sc.inference.Generate(quiet, timeout=30)
            chunks = [c async for c in sc.inference.GenerateStream(quiet, timeout=30)]
            texts = [r.getMessage() for r in caplog.records]
            assert not any("secret-quiet-prompt" in t for t in texts)  # at no level
            assert not any(resp.text in t for t in texts if resp.text)
            assert chunks[-1].HasField("final")

            doc["logging"] = {"logPrompts": True}
            sc.write_config(doc)
            assert await sc.sidecar.watcher.check()
            caplog.clear()
            loud = pb.GenerateRequest(prompt="loud-prompt", max_tokens=3, ignore_eos=True, request_id="r1")
            resp = await sc.inference.Generate(loud, timeout=30)
            logged = [r for r in caplog.records if r.name == "binbatch.prompts"]
            assert [r.levelno for r in logged] == [logging.INFO, logging.INFO]
            assert logged[0].getMessage() == "request r1 prompt: loud-prompt"
            assert logged[1].getMessage() == f"request r1 completion: {resp.text}"


async def test_stats_report_hint_and_learned_accuracy_apart(tmp_path):
    async with running_emulator(FAST) as url, running_sidecar(sidecar_config(url), tmp_path) as sc:
        await sc.inference.Generate(prompt_request(1, 20, expected_output_tokens=20), timeout=30)
        await sc.inference.Generate(prompt_request(2, 20), timeout=30)
        predictor = (await sc.stats()).predictor
        assert predictor.name == "learned" and predictor.samples == 2  # the default predictor
        by_source = {s.source: s for s in predictor.sources}
        assert set(by_source) == {"hint", "max_tokens"}
        assert by_source["hint"].samples == 1 and by_source["hint"].bin_accuracy == 1.0
        fams = await sc.scrape()
        gauge = {s.labels["source"]: s.value for s in fams["binbatch_predictor_source_bin_accuracy_ratio"].samples}
        assert set(gauge) == {"hint", "max_tokens"} and gauge["hint"] == 1.0
        overall = {name: fams[name].samples[0].value for name in ("binbatch_predictor_bin_accuracy_ratio",
                                                                  "binbatch_predictor_within_one_bin_accuracy_ratio")}
        assert overall == {"binbatch_predictor_bin_accuracy_ratio": pytest.approx(predictor.bin_accuracy),
                           "binbatch_predictor_within_one_bin_accuracy_ratio":
                               pytest.approx(predictor.within_one_bin_accuracy)}  # fmt: skip


async def test_a_warm_started_learned_predictor_is_ranked_in_stats_and_metrics(tmp_path):
    prompts = [f"{'write a long essay' if i % 2 else 'yes or no'} about thing {i}" for i in range(20)]
    model = length_model.fit([length_model.featurize(p) for p in prompts], [60.0 if i % 2 else 2.0 for i in range(20)])
    save_model(tmp_path / "m.npz", model)
    warm = {"kind": "Learned", "warmStart": str(tmp_path / "m.npz")}
    async with running_emulator(FAST) as url, running_sidecar(sidecar_config(url, predictor=warm), tmp_path) as sc:
        for i in range(10):  # the answer's length follows what is asked, as the model learned
            long = i % 2 == 1
            req = pb.GenerateRequest(prompt=f"{'write a long essay' if long else 'yes or no'} about item {i}",
                                     max_tokens=40 + i if long else 2, ignore_eos=True)  # fmt: skip
            await sc.inference.Generate(req, timeout=30)
        predictor = (await sc.stats()).predictor
        assert predictor.name == "learned"
        [learned] = predictor.sources
        assert (learned.source, learned.samples) == ("learned", 10)
        assert learned.kendall_tau > 0.5
        fams = await sc.scrape()
        tau = {s.labels["source"]: s.value for s in fams["binbatch_predictor_source_kendall_tau"].samples}
        assert tau == {"learned": pytest.approx(learned.kendall_tau)}
        assert fams["binbatch_predictor_model_version"].samples[0].value == 1
