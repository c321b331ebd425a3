"""A loopback /metrics endpoint that the chaos bench breaks on purpose.

The sidecar scrapes it instead of the engine.  Modes: ``proxy`` serves the
engine's own /metrics unchanged; ``gone`` closes the listening socket
(connection refused); ``garbage`` answers 200 with text that is not the
Prometheus format; ``nan`` serves the engine's metrics with every gauge the
sizer reads (KV usage, requests running and waiting) set to NaN.
"""

from __future__ import annotations

import re

import aiohttp
from aiohttp import web

MODES = ("proxy", "gone", "garbage", "nan")
GARBAGE = b"<html><body>502 Bad Gateway</body></html>\n\x00\xff{not: prometheus}\nvllm:kv_cache_usage_perc{ 0.5\n"
_NAN_GAUGES = re.compile(
    rb"^((?:vllm:kv_cache_usage_perc|vllm:gpu_cache_usage_perc|vllm:num_requests_running|vllm:num_requests_waiting)"
    rb"(?:\{[^}]*\})?) \S+$",
    re.MULTILINE,
)


def with_nan_gauges(body: bytes) -> bytes:
    """``body`` with the sizer's gauges replaced by NaN (the samples stay parseable)."""
    return _NAN_GAUGES.sub(rb"\1 NaN", body)


class BadMetricsServer:
    """``await start()`` on a fixed port; ``await set_mode(...)``; ``await stop()``."""

    def __init__(self, engine_metrics_url: str, port: int) -> None:
        self.engine_metrics_url = engine_metrics_url
        self.port = port
        self.mode = "proxy"
        self.served = 0
        self._runner = web.AppRunner(self._app(), access_log=None)
        self._site: web.TCPSite | None = None
        self._http: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _metrics(self, _: web.Request) -> web.Response:
        self.served += 1
        if self.mode == "garbage":
            body = GARBAGE
        else:
            assert self._http is not None
            async with self._http.get(self.engine_metrics_url) as resp:
                body = await resp.read()
            if self.mode == "nan":
                body = with_nan_gauges(body)
        response = web.Response(body=body, content_type="text/plain")
        response.force_close()  # no keep-alive: once "gone", no open connection still answers
        return response

    async def start(self) -> None:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
        await self._runner.setup()
        await self._listen()

    async def _listen(self) -> None:
        self._site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await self._site.start()

    async def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "gone" and self._site is not None:
            await self._site.stop()
            self._site = None
        elif mode != "gone" and self._site is None:
            await self._listen()
        self.mode = mode

    async def stop(self) -> None:
        await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()
