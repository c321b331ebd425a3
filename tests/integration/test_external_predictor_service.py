"""Bring your own predictor: a sidecar on the emulator asks a real length service on
127.0.0.1 (the documented example, docs/examples/length_service.py, or a broken
one) before it queues each request without a hint.

Nothing sleeps to synchronise: a slow service waits on an event the test never
sets, and the sidecar's own deadline ends the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from sidecar_harness import Running, prompt_request, running_sidecar, sidecar_config

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar.config import ExternalPredictorConfig
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.emulator import Emulator, EmulatorConfig
from binbatch_sidecar.engine.engine_client import EngineRequest, SamplingParams
from binbatch_sidecar.engine.external_predictor import ExternalPredictor
from binbatch_sidecar.engine.sidecar_metrics import SidecarMetrics

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "length_service.py"
FAST = EmulatorConfig(step_a=0.001, step_c=0.0001, num_gpu_blocks=512, block_size=16)
WAIT = 20.0
LOG = "binbatch.predictor.external"


def load_example():
    spec = importlib.util.spec_from_file_location("length_service", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Service:
    """A length service on 127.0.0.1: its base URL and every request it received."""

    def __init__(self, base: str, received: list[tuple[str, Any]]) -> None:
        self.base = base
        self.received = received
        self.feedback = asyncio.Event()  # set when /completions is posted to

    def bodies(self, path: str) -> list[Any]:
        return [body for p, body in self.received if p == path]


@contextlib.asynccontextmanager
async def service(app: web.Application) -> AsyncIterator[Service]:
    received: list[tuple[str, Any]] = []
    svc: Service

    @web.middleware
    async def record(request: web.Request, handler):
        received.append((request.path, json.loads(await request.read())))
        if request.path == "/completions":
            svc.feedback.set()
        return await handler(request)

    app.middlewares.append(record)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    svc = Service(f"http://{host}:{port}", received)
    try:
        yield svc
    finally:
        await runner.cleanup()


def answering(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.Application:
    app = web.Application()
    app.router.add_post("/predict", handler)
    return app


def external(url: str, **more: Any) -> dict[str, Any]:
    return {"external": {"url": url, "timeoutMilliseconds": 200, "breakerOpenMilliseconds": 600_000, **more}}


@contextlib.asynccontextmanager
async def sidecar(tmp_path: Path, predictor: dict[str, Any]) -> AsyncIterator[Running]:
    async with Emulator(FAST) as emulator, running_sidecar(
        sidecar_config(emulator.base_url, predictor=predictor), tmp_path
    ) as sc:  # fmt: skip
        yield sc


async def http_completion(sc: Running, max_tokens: int, **headers: str) -> aiohttp.ClientResponse:
    """An OpenAI completion through the HTTP door; its response (body read)."""
    url = f"http://127.0.0.1:{sc.sidecar.http_port}/v1/completions"
    body = {"model": "", "prompt": "tell me something", "max_tokens": max_tokens, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as http:
        async with http.post(url, json={k: v for k, v in body.items() if v != ""}, headers=headers) as resp:
            await resp.read()
            assert resp.status == 200, await resp.text()
            return resp


def calls(families: dict[str, Any]) -> dict[str, float]:
    """binbatch_external_predictor_calls_total by outcome."""
    family = families["binbatch_external_predictor_calls"]
    return {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")}


def counter(families: dict[str, Any], name: str, **labels: str) -> float:
    return sum(s.value for s in families[name].samples
               if s.name == f"{name}_total" and all(s.labels.get(k) == v for k, v in labels.items()))  # fmt: skip


# --------------------------------------------------------------------------- answered


async def test_the_services_median_places_a_request_and_it_learns_from_completions(tmp_path):
    example = load_example()
    async with service(example.make_app()) as svc, sidecar(
        tmp_path, external(f"{svc.base}/predict", feedbackUrl=f"{svc.base}/completions")
    ) as sc:  # fmt: skip
        # the example's prior: a quarter of max_tokens; the built-in predictor would say max_tokens (64)
        resp = await http_completion(sc, 64, **{"x-request-id": "http-1"})
        assert resp.headers["x-binbatch-predicted-tokens"] == "16"
        done = await sc.inference.Generate(prompt_request(2, 40, request_id="grpc-2"), timeout=WAIT)
        assert done.predicted_output_tokens == pytest.approx(10)
        chat = pb.GenerateRequest(chat={"messages": [{"role": "user", "content": "hi"}]}, max_tokens=8,
                                  ignore_eos=True, request_id="chat-3")  # fmt: skip
        chat = await sc.inference.Generate(chat, timeout=WAIT)
        assert chat.predicted_output_tokens == pytest.approx(2)
        asked = svc.bodies("/predict")
        assert asked[0] == {"id": "http-1", "model": FAST.model, "prompt": "tell me something", "request_class": "",
                            "max_tokens": 64}  # fmt: skip
        assert asked[2]["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in asked[2]
        stats = await sc.stats()
        assert {s.source: s.samples for s in stats.predictor.sources} == {"external": 3}
        # the completions are reported off the request path, in batches
        async with asyncio.timeout(WAIT):
            while sum(len(b["completions"]) for b in svc.bodies("/completions")) < 3:
                svc.feedback.clear()
                await svc.feedback.wait()
        reported = {c["id"]: c["output_tokens"] for b in svc.bodies("/completions") for c in b["completions"]}
        assert reported == {"http-1": 64, "grpc-2": 40, "chat-3": 8}
        families = await sc.scrape()
        assert calls(families)["answered"] == 3
        assert counter(families, "binbatch_external_predictor_feedback", outcome="sent") == 3
        assert "external" in {s.labels["source"] for s in families["binbatch_predictor_source_bin_accuracy_ratio"].samples}


async def test_the_clients_hint_wins_and_the_service_is_not_asked(tmp_path):
    async with service(load_example().make_app()) as svc, sidecar(tmp_path, external(f"{svc.base}/predict")) as sc:
        resp = await http_completion(sc, 7, **{"x-expected-output-tokens": "7"})  # below: refused (ignore_eos)
        assert resp.headers["x-binbatch-predicted-tokens"] == "7"
        assert svc.bodies("/predict") == []
        assert sum(calls(await sc.scrape()).values()) == 0


# --------------------------------------------------------------------------- fallbacks


async def test_a_slow_service_costs_one_deadline_then_the_breaker_skips_it(tmp_path):
    never = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await never.wait()  # never set: only the sidecar's deadline ends the call
        raise AssertionError("unreachable")

    async with service(answering(slow)) as svc, sidecar(tmp_path, external(f"{svc.base}/predict")) as sc:
        first = await http_completion(sc, 64)
        second = await http_completion(sc, 48)
        # the built-in predictor placed both: with nothing learned, max_tokens
        assert first.headers["x-binbatch-predicted-tokens"] == "64"
        assert second.headers["x-binbatch-predicted-tokens"] == "48"
        assert len(svc.bodies("/predict")) == 1  # the breaker opened: the second was never sent
        families = await sc.scrape()
        assert calls(families) == {"answered": 0, "timeout": 1, "error": 0, "invalid": 0, "skipped": 1}
        assert counter(families, "binbatch_external_predictor_breaker_opens") == 1
        stats = await sc.stats()
        assert {s.source for s in stats.predictor.sources} == {"max_tokens"}


async def test_a_service_that_is_down_falls_back_and_opens_the_breaker(tmp_path, caplog):
    caplog.set_level(logging.INFO, LOG)
    # a port nothing listens on, held bound (not listening) for the whole test: closed at once, the
    # sidecar's own HTTP door, started next on port 0, once got the same number and answered its 404s
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        async with sidecar(tmp_path, external(f"http://127.0.0.1:{port}/predict")) as sc:
            for n in (64, 48, 32):
                done = await sc.inference.Generate(prompt_request(n, n), timeout=WAIT)
                assert done.predicted_output_tokens == n  # the built-in predictor: max_tokens
            families = await sc.scrape()
            assert calls(families) == {"answered": 0, "timeout": 0, "error": 1, "invalid": 0, "skipped": 2}
            assert counter(families, "binbatch_external_predictor_breaker_opens") == 1
    warned = [r for r in caplog.records if r.name == LOG and r.levelno == logging.WARNING]
    assert len(warned) == 1 and "tried again in 600 s" in warned[0].getMessage()


MALFORMED = [
    (b"not json", "Invalid JSON"),
    (b'{"quantiles": [{"level": 0.9, "tokens": 30}]}', "quantiles: Value error, must include level 0.5 (the median)"),
    (b'{"quantiles": [{"level": 0.9, "tokens": 10}, {"level": 0.5, "tokens": 30}]}', "levels must rise strictly"),
    (b'{"quantiles": [{"level": 0.5, "tokens": -3}]}', "quantiles[0].tokens: Input should be greater than or equal to 0"),
    (b'{"quantiles": [{"level": 0.5, "tokens": "12"}]}', "quantiles[0].tokens: Input should be a valid number"),
    (b'{"tokens": 12}', "quantiles: Field required"),
]


async def test_a_malformed_answer_falls_back_is_counted_and_logged_once_with_what_was_wrong(tmp_path, caplog):
    answers = iter([body for body, _ in MALFORMED] + [MALFORMED[0][0]])  # the first kind comes twice

    async def malformed(request: web.Request) -> web.Response:
        return web.Response(body=next(answers), content_type="application/json")

    caplog.set_level(logging.DEBUG, LOG)
    async with service(answering(malformed)) as svc, sidecar(tmp_path, external(f"{svc.base}/predict")) as sc:
        for i in range(len(MALFORMED) + 1):
            resp = await http_completion(sc, 64)
            assert resp.headers["x-binbatch-predicted-tokens"] == "64", i  # the built-in predictor
        assert len(svc.bodies("/predict")) == len(MALFORMED) + 1  # the service answers: the breaker stays closed
        families = await sc.scrape()
        assert calls(families)["invalid"] == len(MALFORMED) + 1
        assert counter(families, "binbatch_external_predictor_breaker_opens") == 0
    warned = [r.getMessage() for r in caplog.records if r.name == LOG and r.levelno == logging.WARNING]
    assert len(warned) == len(MALFORMED)  # once per kind of problem; the repeat only at debug
    for message, (_, what) in zip(warned, MALFORMED):
        assert what in message, message


# --------------------------------------------------------------------------- the breaker's recovery


def a_request(i: int) -> tuple[Request, EngineRequest]:
    params = SamplingParams(model="m", max_tokens=100)
    return Request(id=f"r{i}", arrival=0.0, max_tokens=100), EngineRequest(params=params, prompt="hi")


async def test_after_its_pause_one_request_tries_the_service_and_an_answer_closes_the_breaker():
    state = {"up": False}

    async def flaky(request: web.Request) -> web.Response:
        if not state["up"]:
            return web.Response(status=503)
        return web.json_response({"quantiles": [{"level": 0.5, "tokens": 20}, {"level": 0.9, "tokens": 60}]})

    clock, metrics = ManualClock(), SidecarMetrics()
    async with service(answering(flaky)) as svc:
        cfg = ExternalPredictorConfig(url=f"{svc.base}/predict", timeout_milliseconds=5000, breaker_open_milliseconds=1000)
        client = ExternalPredictor(lambda: cfg, clock, metrics)
        try:
            assert await client.predict(*a_request(1), None) is None  # 503: an outage
            assert client.breaker.state == "open"
            clock.advance(0.999)
            assert await client.predict(*a_request(2), None) is None  # still paused: not sent
            assert len(svc.bodies("/predict")) == 1
            clock.advance(0.001)
            assert await client.predict(*a_request(3), None) is None  # the trial: down again, paused again
            assert client.breaker.state == "open" and len(svc.bodies("/predict")) == 2
            state["up"] = True
            clock.advance(1.0)
            length = await client.predict(*a_request(4), None)  # the trial answers: closed
            assert client.breaker.state == "closed"
            assert length is not None and length.median == pytest.approx(20) and length.plan == pytest.approx(60)
            opens = metrics.registry.get_sample_value("binbatch_external_predictor_breaker_opens_total")
            assert opens == 1  # one outage, however long
        finally:
            await client.close()


async def test_a_call_cut_short_by_the_callers_deadline_leaves_the_breaker_closed():
    never = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await never.wait()
        raise AssertionError("unreachable")

    metrics = SidecarMetrics()
    async with service(answering(slow)) as svc:
        cfg = ExternalPredictorConfig(url=f"{svc.base}/predict", timeout_milliseconds=10_000)
        client = ExternalPredictor(lambda: cfg, ManualClock(), metrics)
        try:
            assert await client.predict(*a_request(1), 0.05) is None  # the caller waits 50 ms, not 10 s
        finally:
            await client.close()
    assert metrics.registry.get_sample_value("binbatch_external_predictor_calls_total", {"outcome": "timeout"}) == 1
    assert client.breaker.state == "closed"  # the service was not given its own deadline


# --------------------------------------------------------------------------- the documented command


def test_the_example_runs_as_documented(tmp_path):
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "length predictor on http://127.0.0.1:PORT/predict"
        url = line.split()[-1]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/predict"), line

        async def ask() -> dict[str, Any]:
            query = {"id": "a", "model": "m", "prompt": "hi", "request_class": "", "max_tokens": 100}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT)) as http:
                async with http.post(url, json=query) as resp:
                    return await resp.json()

        assert asyncio.run(ask()) == {"quantiles": [{"level": 0.5, "tokens": 25}, {"level": 0.9, "tokens": 50}]}
    finally:
        proc.terminate()
        proc.wait(timeout=WAIT)
        proc.stdout.close()
