"""A minimal external length predictor for binbatch (README "Bring your own predictor").

    python docs/examples/length_service.py --port 9000

and in the sidecar's config::

    predictor:
      external:
        url: http://127.0.0.1:9000/predict
        feedbackUrl: http://127.0.0.1:9000/completions   # optional: learn from completions

``POST /predict`` answers the output length as quantiles; ``POST /completions``
takes the lengths the answers came out at.  The model is a stand-in for yours: per
request class, the median and 0.9 quantile of the latest lengths it was told
about, and until it has seen ``MIN_SEEN`` of a class, a quarter and a half of the
request's ``max_tokens``.  It needs only aiohttp (which binbatch installs); the
test suite serves it (tests/integration/test_external_predictor_service.py).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections import OrderedDict, defaultdict, deque
from typing import Any

from aiohttp import web

MIN_SEEN = 8  # lengths of a class before they, not the prior, give the answer
KEEP = 1000  # latest lengths kept per class
ASKED = 100_000  # request ids remembered, to learn each completion's class


class RecentLengths:
    """The model: recent output lengths per request class."""

    def __init__(self) -> None:
        self.lengths: defaultdict[str, deque[int]] = defaultdict(lambda: deque(maxlen=KEEP))
        self.asked: OrderedDict[str, str] = OrderedDict()  # request id -> class, oldest first

    def predict(self, query: dict[str, Any]) -> dict[str, Any]:
        request_class = str(query.get("request_class", ""))
        self.asked[str(query["id"])] = request_class
        while len(self.asked) > ASKED:
            self.asked.popitem(last=False)
        seen = self.lengths[request_class]
        if len(seen) < MIN_SEEN:
            cap = int(query["max_tokens"])
            median, p90 = max(1, cap // 4), max(1, cap // 2)
        else:
            deciles = statistics.quantiles(seen, n=10)  # the 0.1, 0.2, ..., 0.9 quantiles
            median, p90 = deciles[4], deciles[8]
        return {"quantiles": [{"level": 0.5, "tokens": median}, {"level": 0.9, "tokens": p90}]}

    def learn(self, completions: list[dict[str, Any]]) -> None:
        for c in completions:
            request_class = self.asked.pop(str(c["id"]), None)
            if request_class is not None:
                self.lengths[request_class].append(int(c["output_tokens"]))


def make_app(model: RecentLengths | None = None) -> web.Application:
    model = model or RecentLengths()

    async def predict(request: web.Request) -> web.Response:
        return web.json_response(model.predict(await request.json()))

    async def completions(request: web.Request) -> web.Response:
        model.learn((await request.json())["completions"])
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/predict", predict)
    app.router.add_post("/completions", completions)
    return app


async def serve(host: str, port: int) -> None:
    runner = web.AppRunner(make_app())
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_host, bound_port = runner.addresses[0][:2]
    print(f"length predictor on http://{bound_host}:{bound_port}/predict", flush=True)
    try:
        await asyncio.Event().wait()  # until interrupted
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000, help="0 picks a free port (printed)")
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve(args.host, args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
