"""The sidecar's HTTP endpoint: its own Prometheus metrics and a readiness probe.

``/healthz`` answers 200 only while the engine is serving, so a kubelet readiness
probe can use it where gRPC health checks are not available.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web


def metrics_app(render: Callable[[], bytes], engine_serving: Callable[[], bool]) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=render(), content_type="text/plain", charset="utf-8")

    async def healthz(_: web.Request) -> web.Response:
        serving = engine_serving()
        return web.Response(text="ok" if serving else "engine not serving", status=200 if serving else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app
