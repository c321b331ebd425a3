"""The chaos bench's load generator: asyncio gRPC calls with per-call deadlines,
counted by the status each caller ends with.

Every call carries a unique prompt (also its ``request_id``), so the engine's
receipt log can tell a prompt sent twice from two prompts.  A call has a gRPC
deadline and, on top, a hard bound of deadline + margin.  The bound is enforced
once the load has stopped (``wait_all``), not by a timer per call: under 10x
overload this process's own event loop lags, and a per-call timer would fire
before the loop got round to the answer gRPC already had.  A call still
unfinished at its bound then is cancelled and counted ``HUNG``.  A status that
came from the transport rather than from the sidecar (a dropped connection) is
counted as ``dropped``: the caller never got the sidecar's answer.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import re
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc

HUNG = "HUNG"

# What grpc's transport says when a connection or stream broke, as opposed to a
# status the sidecar set (the sidecar's own messages never read like these).
_TRANSPORT = re.compile(
    r"socket closed|connection reset|failed to connect|connection refused|rst_stream|goaway|broken pipe|"
    r"stream removed|transport closed|endpoint closing|recvmsg|sendmsg",
    re.IGNORECASE,
)


@dataclass(slots=True)
class Outcome:
    """One call: its prompt, when it ran, and the one status it ended with."""

    key: str
    tag: str
    deadline: float
    started: float
    ended: float | None = None
    code: str = ""
    details: str = ""

    @property
    def latency(self) -> float | None:
        return None if self.ended is None else self.ended - self.started

    @property
    def dropped(self) -> bool:
        """Ended by the transport, not by the sidecar."""
        if self.code in ("OK", "DEADLINE_EXCEEDED", HUNG) or self.details.startswith("engine: "):
            return False  # the sidecar passes engine errors on as "engine: ..."
        return bool(_TRANSPORT.search(self.details))


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-quantile (0..1) by the nearest-rank method; None for no values."""
    data = sorted(values)
    if not data:
        return None
    return data[min(len(data) - 1, max(0, math.ceil(q * len(data)) - 1))]


class LoadGenerator:
    """Calls ``Inference.Generate`` on one channel and keeps every outcome."""

    def __init__(self, channel: grpc.aio.Channel, prefix: str, *, max_tokens: int, margin: float) -> None:
        self.stub = pb_grpc.InferenceStub(channel)
        self.prefix = prefix
        self.max_tokens = max_tokens
        self.margin = margin
        self.outcomes: list[Outcome] = []
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task[Outcome]] = set()

    async def call(self, deadline: float, tag: str = "", max_tokens: int | None = None) -> Outcome:
        """One call, awaited; its outcome is also kept."""
        return await self._run(self._outcome(deadline, tag), max_tokens)

    def spawn(self, deadline: float, tag: str = "", max_tokens: int | None = None) -> asyncio.Task[Outcome]:
        """Start a call in the background (``wait_all`` collects it)."""
        task = asyncio.get_running_loop().create_task(self._run(self._outcome(deadline, tag), max_tokens))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _outcome(self, deadline: float, tag: str) -> Outcome:
        key = f"{self.prefix} {tag or 'call'} {next(self._ids)} please write something"
        out = Outcome(key=key, tag=tag, deadline=deadline, started=time.monotonic())
        self.outcomes.append(out)
        return out

    async def _run(self, out: Outcome, max_tokens: int | None) -> Outcome:
        request = pb.GenerateRequest(prompt=out.key, max_tokens=max_tokens or self.max_tokens, ignore_eos=True,
                                     request_id=out.key[-100:])  # fmt: skip
        try:
            await self.stub.Generate(request, timeout=out.deadline)
            out.code = "OK"
        except grpc.aio.AioRpcError as exc:
            out.code, out.details = exc.code().name, exc.details() or ""
        except asyncio.CancelledError:
            out.code = HUNG  # only wait_all cancels a call: it outlived its bound
            raise
        finally:
            out.ended = time.monotonic()
        return out

    async def open_loop(self, rate: float, seconds: float, deadline: float, tag: str = "") -> int:
        """Start ``rate`` calls a second for ``seconds``, whatever the answers; returns
        how many were started (fewer than rate x seconds if this process lagged)."""
        start = time.monotonic()
        sent = 0
        while (elapsed := time.monotonic() - start) < seconds:
            due = int(rate * elapsed) + 1
            for _ in range(due - sent):
                self.spawn(deadline, tag)
            sent = due
            await asyncio.sleep(0.005)  # ok-sleep: the pace of an open-loop generator
        return sent

    async def closed_loop(self, concurrency: int, stop: asyncio.Event, deadline: float, tag: str = "") -> None:
        """Keep ``concurrency`` calls outstanding until ``stop`` is set."""

        async def worker() -> None:
            while not stop.is_set():
                await asyncio.wait([self.spawn(deadline, tag)])  # a hung call ends by wait_all's bound

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    async def wait_all(self) -> None:
        """Wait for every spawned call until its hard bound (deadline + margin from
        its start); cancel those still running then (counted ``HUNG``)."""
        while self._tasks:
            pending = [o for o in self.outcomes if o.ended is None]  # spawned calls all have an outcome
            bound = max((o.started + o.deadline + self.margin for o in pending), default=time.monotonic())
            _, late = await asyncio.wait(list(self._tasks), timeout=max(0.0, bound - time.monotonic()))
            if late and time.monotonic() >= bound:
                for task in late:
                    task.cancel()
                await asyncio.wait(late)

    # -- tallies

    def select(self, tag: str | None = None) -> list[Outcome]:
        return [o for o in self.outcomes if tag is None or o.tag == tag]

    def codes(self, tag: str | None = None) -> dict[str, int]:
        return dict(Counter(o.code for o in self.select(tag) if o.ended is not None).most_common())

    async def lag_monitor(self, out: list[float], every: float = 0.1) -> None:
        """Record how late this process's event loop wakes up (its own overload)."""
        while True:
            t = time.monotonic()
            await asyncio.sleep(every)  # ok-sleep: the lag probe's period
            out.append(time.monotonic() - t - every)

    def hung(self, tag: str | None = None) -> int:
        return sum(o.code == HUNG for o in self.select(tag))

    def dropped(self, tag: str | None = None) -> int:
        return sum(o.dropped for o in self.select(tag))

    def ok_since(self, since: float) -> int:
        return sum(o.code == "OK" and o.ended is not None and o.ended >= since for o in self.outcomes)
