"""Both doors under generated bad input, at CI scale: the generators of ``binbatch bench
fuzz`` (sidecar/bench/fuzz.py), seeded by hypothesis, against an in-process sidecar in
front of the engine emulator with zero step time, all on 127.0.0.1.  Every input gets
a status below 500 (HTTP) or one other than INTERNAL/UNKNOWN (gRPC), nothing in an
answer shows a traceback, a source path or a loopback address, and the sidecar logs no
ERROR.  Then the regressions of what the bench found, one test each."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sidecar_harness import Running, running_sidecar, sidecar_config

from binbatch_sidecar.bench import fuzz
from binbatch_sidecar.emulator import Emulator, EmulatorConfig

INSTANT = EmulatorConfig(step_a=0.0, step_c=0.0, num_gpu_blocks=65536, block_size=16, max_num_seqs=1024,
                         max_model_len=512)  # fmt: skip
WAIT = 30.0
SEEDS = st.integers(0, 2**64 - 1)


def errors(caplog) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]


@contextlib.asynccontextmanager
async def sidecar(tmp_path) -> AsyncIterator[tuple[Running, str]]:
    async with Emulator(INSTANT) as emulator:
        doc = sidecar_config(emulator.base_url, server={"httpRequestReadTimeoutMilliseconds": 1000})
        async with running_sidecar(doc, tmp_path) as sc:
            yield sc, emulator.config.model


def drive(loop: asyncio.AbstractEventLoop, coro_of_seed, examples: int) -> list[fuzz.Answer]:
    """Run hypothesis (in this worker thread) with each example's coroutine on the sidecar's loop."""
    answers: list[fuzz.Answer] = []

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(seed=SEEDS)
    def check(seed: int) -> None:
        answer = asyncio.run_coroutine_threadsafe(coro_of_seed(seed), loop).result(WAIT + 10)
        answers.append(answer)
        assert answer.failure is None, (seed, answer.status, answer.failure, answer.text[:500])

    check()
    return answers


async def test_generated_http_requests_get_an_answer_below_500_and_no_error_log(tmp_path, caplog):
    async with sidecar(tmp_path) as (sc, model):
        port = sc.sidecar.http_port
        answers = await asyncio.to_thread(drive, asyncio.get_running_loop(),
                                          lambda seed: fuzz.send_http(port, fuzz.http_case(fuzz.case_rng(seed, "http", 0), model), WAIT),
                                          600)  # fmt: skip
    statuses = {a.status for a in answers}
    assert "200" in statuses and "400" in statuses and "404" in statuses  # the valid, the refused, the unrouted
    assert errors(caplog) == []


async def test_generated_grpc_calls_get_no_internal_or_unknown_and_no_error_log(tmp_path, caplog):
    async with sidecar(tmp_path) as (sc, model):
        answers = await asyncio.to_thread(drive, asyncio.get_running_loop(),
                                          lambda seed: fuzz.send_grpc(sc.channel, fuzz.grpc_case(fuzz.case_rng(seed, "grpc", 0), model)),
                                          1000)  # fmt: skip
    statuses = {a.status for a in answers}
    assert {"OK", "INVALID_ARGUMENT", "UNIMPLEMENTED"} <= statuses
    assert errors(caplog) == []


# ----------------------------------------------------------------- what the bench found


@pytest.mark.parametrize("method", ["Check", "Watch"])
async def test_a_corrupt_health_request_is_invalid_argument_without_an_error_log(tmp_path, caplog, method):
    async with sidecar(tmp_path) as (sc, _):
        path = f"/grpc.health.v1.Health/{method}"
        call = sc.channel.unary_stream(path) if method == "Watch" else sc.channel.unary_unary(path)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            result = call(b"\xff\xff\xff", timeout=WAIT)
            if method == "Watch":
                async for _ in result:
                    pass
            else:
                await result
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "HealthCheckRequest" in info.value.details()
        ok = await sc.channel.unary_unary(path)(b"", timeout=WAIT) if method == "Check" else None
        if ok is not None:
            assert ok == b"\x08\x01"  # SERVING: a valid (empty) request is still answered
    assert errors(caplog) == []


async def test_an_expect_value_that_is_not_utf8_is_417_naming_the_header(tmp_path, caplog):
    async with sidecar(tmp_path) as (sc, model):
        body = json.dumps({"model": model, "prompt": "x", "max_tokens": 1}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Expect: \xed\xa0\x80\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s") % (len(body), body)  # fmt: skip
        answer = await fuzz.send_http(sc.sidecar.http_port, fuzz.HttpCase("headers", request, False), WAIT)
        assert answer.status == "417" and answer.failure is None
        continued = request.replace(b"Expect: \xed\xa0\x80", b"Expect: 100-continue")
        answer = await fuzz.send_http(sc.sidecar.http_port, fuzz.HttpCase("headers", continued, False), WAIT)
        assert answer.status == "200"  # past the interim 100 Continue
    assert errors(caplog) == []


@pytest.mark.parametrize(
    "head",
    [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: \x7f\r\nContent-Length: 2\r\n\r\n{}",
     b"CONNECT /\xef\xbb\xbf HTTP/1.1\r\nHost: x\r\n\r\n",
     b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n{}"],
)  # fmt: skip
async def test_a_request_http_cannot_parse_is_400_and_logs_no_error(tmp_path, caplog, head: bytes):
    async with sidecar(tmp_path) as (sc, _):
        answer = await fuzz.send_http(sc.sidecar.http_port, fuzz.HttpCase("bytes", head, False), WAIT)
        assert answer.status == "400"
    assert errors(caplog) == []


def test_a_record_of_a_client_gone_before_grpc_answered_is_demoted_to_debug(caplog):
    from binbatch_sidecar.server import servicer

    class ExecuteBatchError(Exception):  # grpc's core raises one of this name
        pass

    logger = logging.getLogger("grpc._cython.cygrpc")
    logger.addFilter(servicer._GONE_CLIENTS_FILTER)
    try:
        try:
            raise ExecuteBatchError("Failed execute_batch")
        except ExecuteBatchError:
            logger.exception("ExecuteBatchError raised in core by servicer method [/x/Nope]")
        try:
            raise RuntimeError("a real fault")
        except RuntimeError:
            logger.exception("Unexpected error")
    finally:
        logger.removeFilter(servicer._GONE_CLIENTS_FILTER)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == ["Unexpected error"]


def test_only_requests_http_cannot_parse_are_demoted_on_the_aiohttp_server_logger(caplog):
    from aiohttp.http_exceptions import BadHttpMessage

    from binbatch_sidecar.server import openai_http

    logger = logging.getLogger("aiohttp.server")
    openai_http.quiet_bad_requests()
    for exc in (BadHttpMessage("Invalid header value char"), RuntimeError("a handler's own fault")):
        try:
            raise exc
        except Exception:
            logger.exception("Error handling request from %s", "127.0.0.1")
    assert [(r.levelno, r.exc_info is not None) for r in caplog.records if r.levelno >= logging.ERROR] == [
        (logging.ERROR, True)]  # the RuntimeError, with its traceback  # fmt: skip
