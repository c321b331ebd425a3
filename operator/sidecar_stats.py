"""Ask the sidecars for their stats over gRPC (``binbatch.v1.Admin/GetStats``), bounded.

``SidecarStats`` is the one way the operator asks: an answer younger than
``max_age`` is reused (however many reconciles want it: the create handler, the
policy's own re-check), at most ``concurrency`` calls run at once across the
whole fleet, and two reconciles asking for one pod at the same time share one
call.  Each call opens a channel to a new pod (~1 ms of CPU), so the fleet's
calls are also held to about ``rate`` a second: past ``rate * max_age`` pods an
answer is reused for longer, in proportion (5,000 pods: each is asked about
every 50 s instead of 7.5).  Each policy re-checks at its own jittered moment (``main.py``), so the
calls spread over the interval instead of arriving together.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import grpc

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc

TIMEOUT_SECONDS = 3.0
CONCURRENCY = 32  # GetStats calls in flight at once, whatever the fleet's size
RATE = 100.0  # GetStats calls a second the fleet's answers are renewed at, at most (on average)
KEPT_AGES = 4  # an answer not renewed for this many max_ages belongs to a pod that is gone

StatsFn = Callable[[str], Awaitable[pb.Stats]]


async def get_stats(address: str, timeout: float = TIMEOUT_SECONDS, *, token: str = "") -> pb.Stats:
    """``address`` is ``host:port``; ``token`` the operator's signed Admin token (``authorization: Bearer``:
    the sidecar answers Admin off loopback only with one); raises grpc.aio.AioRpcError on failure or timeout."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    async with grpc.aio.insecure_channel(address) as channel:
        return await pb_grpc.AdminStub(channel).GetStats(pb.GetStatsRequest(), timeout=timeout, metadata=metadata)


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class Answer:
    """One sidecar's answer: its stats, or why there are none."""

    stats: pb.Stats | None
    error: str
    at: float  # clock time it came


class SidecarStats:
    def __init__(
        self, fetch: StatsFn = get_stats, concurrency: int = CONCURRENCY, rate: float = RATE,
        clock: Callable[[], float] = time.monotonic, signer: Callable[[str], str] | None = None,
    ) -> None:  # fmt: skip
        self._fetch, self._clock, self._rate = fetch, clock, rate
        self.signer = signer  # audience -> the operator's signed Admin token for it (admin_signing.AdminSigner.token)
        self._slots = asyncio.Semaphore(concurrency)
        self._answers: dict[str, Answer] = {}
        self._asking: dict[str, asyncio.Task[Answer]] = {}
        self._pruned = clock()
        self.calls = 0  # GetStats calls made

    async def ask(self, addresses: Mapping[str, str], max_age: float, audience: str = "") -> dict[str, Answer]:
        """Answers for ``{pod: "ip:port"}`` (pods as "namespace/name"); only those older than ``max_age`` seconds (or, in a
        large fleet, than it takes to renew every known answer at ``rate``) are asked again.  ``audience``: the
        policy's (``<namespace>/<policy>``), which the signed token of each call names."""
        now = self._clock()
        max_age = max(max_age, len(self._answers) / self._rate)
        self._prune(now, max_age)
        for key, address in addresses.items():
            known = self._answers.get(key)
            if (known is None or now - known.at >= max_age) and key not in self._asking:
                self._asking[key] = asyncio.ensure_future(self._call(key, address, audience))
        pending = [self._asking[key] for key in addresses if key in self._asking]
        if pending:  # shielded: an asker that gives up (cancelled) leaves the calls others share
            await asyncio.shield(asyncio.gather(*pending))
        return {key: self._answers[key] for key in addresses}

    def _prune(self, now: float, max_age: float) -> None:
        """Drop answers nobody asked to renew for a while (their pods are gone), once per ``max_age``."""
        if now - self._pruned >= max_age:
            self._pruned = now
            self._answers = {k: a for k, a in self._answers.items() if now - a.at < KEPT_AGES * max_age}

    async def _call(self, key: str, address: str, audience: str = "") -> Answer:
        try:
            async with self._slots:
                self.calls += 1
                try:
                    signed = {"token": self.signer(audience)} if self.signer is not None and audience else {}
                    answer = Answer(await self._fetch(address, **signed), "", self._clock())
                except Exception as exc:  # noqa: BLE001 - any failure is reported in status, never raised
                    answer = Answer(None, describe_error(exc), self._clock())
            self._answers[key] = answer
            return answer
        finally:
            del self._asking[key]
