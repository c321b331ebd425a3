"""An engine outage end to end: the emulator as a real process, killed (SIGKILL)
under load and restarted on the same port, in front of an in-process sidecar.
All on 127.0.0.1; bounded in requests (9) and time (each wait has a timeout)."""

from __future__ import annotations

import asyncio
import re
import signal
import sys
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2
from sidecar_harness import prompt_request, running_sidecar, sidecar_config

WAIT = 30.0  # bound of every wait below
STEP = 0.02  # seconds per engine step: a 1500-token request takes 30 s


async def start_engine(port: int) -> tuple[asyncio.subprocess.Process, int]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "binbatch_sidecar.emulator", "--host", "127.0.0.1", "--port", str(port),
        "--step-a", str(STEP), "--step-c", "0", stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stderr is not None
    async with asyncio.timeout(WAIT):
        line = (await proc.stderr.readline()).decode()
    match = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
    assert match, f"the emulator did not start: {line!r}"
    return proc, int(match.group(1))


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT):
        while not condition():
            await asyncio.sleep(0.01)  # ok-sleep: polls the in-process sidecar's state, bounded by WAIT


async def test_queued_requests_survive_an_engine_restart_and_sent_ones_fail_unavailable(tmp_path):
    """Issue 9: the whole queue used to be flushed into the dead engine and fail in
    half a second; new calls waited 0.3-5 s for UNAVAILABLE."""
    engine, port = await start_engine(0)
    url = f"http://127.0.0.1:{port}"
    doc = sidecar_config(
        url, batch={"mode": "Continuous", "sizing": "Static", "staticSize": 2, "maxWaitMilliseconds": 0},
        bins={"count": 1}, metrics={"source": "None"},
    )  # fmt: skip
    try:
        async with running_sidecar(doc, tmp_path) as sc:
            d = sc.sidecar.dispatcher
            await until(lambda: sc.sidecar.engine_serving)
            long_ones = [asyncio.ensure_future(sc.inference.Generate(prompt_request(i, 1500), timeout=WAIT))
                         for i in range(2)]  # fmt: skip
            await until(lambda: d.inflight_requests == 2)
            queued = [asyncio.ensure_future(sc.inference.Generate(prompt_request(i, 5), timeout=WAIT))
                      for i in range(2, 8)]  # fmt: skip
            await until(lambda: d.backlog() == 6)

            engine.send_signal(signal.SIGKILL)
            await engine.wait()
            for call in long_ones:  # sent before the engine died: UNAVAILABLE, not retried
                try:
                    await call
                    raise AssertionError("a request the dead engine held succeeded")
                except grpc.aio.AioRpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            await until(lambda: d.breaker.state == "open")
            await until(lambda: not sc.sidecar.engine_serving)
            health = await sc.sidecar.health.Check(health_pb2.HealthCheckRequest(), None)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            stats = await sc.stats()
            assert stats.engine_breaker.state == "open" and stats.engine_breaker.opens == 1
            assert not any(call.done() for call in queued)  # held, not flushed into the dead engine
            # a new call without a deadline: UNAVAILABLE at once; one with a deadline waits
            started = time.monotonic()
            try:
                await sc.inference.Generate(prompt_request(99, 5))
                raise AssertionError("a call without a deadline was accepted while the engine is down")
            except grpc.aio.AioRpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE and "engine is unavailable" in (err.details() or "")
            assert time.monotonic() - started < 1.0
            queued.append(asyncio.ensure_future(sc.inference.Generate(prompt_request(100, 5), timeout=WAIT)))

            engine, _ = await start_engine(port)  # the same port: the sidecar's engine.url
            answers = await asyncio.wait_for(asyncio.gather(*queued), WAIT)
            assert [a.completion_tokens for a in answers] == [5] * 7
            assert d.breaker.state == "closed"
            stats = await sc.stats()
            assert stats.engine_breaker.state == "closed"
            assert stats.totals.completed == 7 and stats.totals.failed == 2 and stats.totals.rejected == 1
    finally:
        if engine.returncode is None:
            engine.send_signal(signal.SIGTERM)
            await asyncio.wait_for(engine.wait(), WAIT)
