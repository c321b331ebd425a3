"""The benches' clients: the same workload sent direct to the engine, through a
sidecar, or by an ideal gang client, each timed the same way.

TTFT is the time from sending a request to its first non-empty text piece, E2E
the time to its last byte, TPOT = (E2E - TTFT) / (tokens - 1).  Direct and
sidecar calls both stream (SSE from the engine, ``GenerateStream`` from the
sidecar), so the two paths are measured alike.  Calls answered in one piece (a
gang list call) have TTFT = E2E, as the caller sees it.

A workload is replayed open-loop: each request is sent at its arrival time
whether or not earlier ones have finished (Poisson load is not throttled by the
system under test).  :func:`closed_loop` is the other way, for measuring
capacity: a fixed number of requests outstanding, each answer immediately
replaced by the next request, and :func:`steady_rate` reads the saturated
throughput off the tokens generated while the engine was full.

Every run goes inside :func:`steady_heap`: the bench's own garbage collector
must not stall one client's run and not another's (see there).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc

from .workloads import BenchRequest, equal_mass_bins

CALL_TIMEOUT_S = 600.0
# A replay of recorded answers on a real vLLM (``recorded=True``): min_tokens holds the
# answer to its recorded length, then the first token whose text holds one of these
# ends it.  vLLM takes at most four stop strings (OpenAI's limit; 0.32 answers 400
# "too_long" to more); of the test model's 4,096 byte-level BPE tokens
# (tests/vllm_support/build_tiny_model.py) 81% hold a space, an "i", an "e" or a "u"
# (the four characters that cover most).  vLLM 0.32 checks stop strings from the token
# after min_tokens: of 60 replayed answers (the 2-layer test model) 51 ended one token
# past their recorded length, 5 two, 2 three, 1 five, 1 at it -- ``RECORDED_SLACK``
# allows for that.
RECORDED_STOPS = (" ", "i", "e", "u")
RECORDED_SLACK = 8


@dataclass(slots=True)
class Sample:
    """One request as its caller saw it (seconds from its own send time);
    ``index``: its position in the workload replayed (the same request in every
    client's run), set by the replay that sent it."""

    ttft_s: float
    e2e_s: float
    tokens: int
    index: int | None = None

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass(slots=True)
class RunResult:
    """One replay of a workload: every answered request, failures, wall time."""

    samples: list[Sample] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    preemptions: float | None = None


class CallFailed(RuntimeError):
    """A request the system under test did not answer with its full length."""


async def _answer(
    req: BenchRequest, call: Callable[[BenchRequest], Awaitable[Sample]], result: RunResult, index: int
) -> bool:
    """Send one request (``index``: its position in the workload); its sample or its
    failure goes into ``result``.  A replayed answer (``req.max_tokens`` set) may end
    up to ``RECORDED_SLACK`` tokens past its recorded length (min_tokens and stop
    strings on a real vLLM), never before it."""
    try:
        sample = await call(req)
    except (CallFailed, aiohttp.ClientError, grpc.aio.AioRpcError, TimeoutError) as exc:
        result.failures.append(f"{type(exc).__name__}: {exc}"[:300])
        return False
    most = req.output_tokens if req.max_tokens is None else min(req.output_tokens + RECORDED_SLACK, req.max_tokens)
    if not req.output_tokens <= sample.tokens <= most:
        result.failures.append(f"asked for {req.output_tokens} tokens, got {sample.tokens}")
        return False
    sample.index = index
    result.samples.append(sample)
    return True


@contextlib.contextmanager
def steady_heap() -> Iterator[None]:
    """A measured run with the bench's heap collected and frozen first (``gc.freeze``), as
    vLLM's own ``vllm bench serve`` freezes its heap before it measures.  A full collection
    walks every object the process holds (workloads, earlier runs' samples, the libraries):
    in a bench process it stalled the event loop ~50-60 ms, at a point set by allocation
    counts.  Landing inside one client's burst, it delayed that client's sends and reads
    alone: a 64-request burst through a sidecar read 0.88-0.91x direct's throughput in that
    run and 0.96-0.98x in the runs around it.  Frozen, a collection walks only what the run made."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def replay(requests: Sequence[BenchRequest], call: Callable[[BenchRequest], Awaitable[Sample]]) -> RunResult:
    """Send every request at its arrival time (open loop); wait for all answers."""
    result = RunResult()
    loop = asyncio.get_running_loop()

    async def one(index: int, req: BenchRequest) -> None:
        delay = t0 + req.arrival_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)  # the arrival process itself, not synchronisation
        await _answer(req, call, result, index)

    with steady_heap():
        t0 = loop.time()
        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        result.elapsed_s = loop.time() - t0
    return result


async def closed_loop(
    requests: Sequence[BenchRequest], call: Callable[[BenchRequest], Awaitable[Sample]], concurrency: int
) -> tuple[RunResult, list[Span]]:
    """Keep ``concurrency`` requests outstanding (arrival times ignored): each
    answer, or failure, is immediately replaced by the next request in order,
    until every request was sent.  Returns the run and a :class:`Span` (when it
    was sent, how it went) per answered request, in the order they were answered."""
    if concurrency < 1:
        raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
    result = RunResult()
    spans: list[Span] = []
    loop = asyncio.get_running_loop()
    pending = iter(enumerate(requests))

    async def worker() -> None:
        for index, req in pending:  # a shared iterator: each request goes out once
            sent = loop.time() - t0
            if await _answer(req, call, result, index):
                spans.append(Span(sent, result.samples[-1]))

    with steady_heap():
        t0 = loop.time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.elapsed_s = loop.time() - t0
    return result, spans


@dataclass(frozen=True, slots=True)
class Span:
    """One answered request of a :func:`closed_loop`: sent ``start_s`` seconds
    after the loop began; its tokens came between its first token and its end."""

    start_s: float
    sample: Sample

    @property
    def end_s(self) -> float:
        return self.start_s + self.sample.e2e_s

    def tokens_between(self, a: float, b: float) -> float:
        """Its tokens generated in [a, b], spread evenly from its first token to its end."""
        first, end, n = self.start_s + self.sample.ttft_s, self.end_s, self.sample.tokens
        if end <= first:
            return float(n) if a <= end <= b else 0.0
        return n * max(0.0, min(end, b) - max(first, a)) / (end - first)


def steady_rate(spans: Sequence[Span], concurrency: int, mean_tokens: float) -> float:
    """Saturated throughput (requests per second) of a :func:`closed_loop` run
    over a workload whose answers are ``mean_tokens`` long on average.

    The window runs from the ``concurrency``-th completion to the
    ``concurrency``-th last: before it every request started at once (a burst's
    head), after it nothing replaces the answers (a burst's tail, the longest
    answers alone); inside it the engine always had ``concurrency`` requests.
    What it generated in the window -- each request's tokens spread evenly from
    its first token to its end, so work on the answers that straddle an edge
    counts for its share -- divided by the window and by ``mean_tokens`` is the
    rate it answers this workload at.  Counting the completions inside the
    window instead credits a long answer wholly to whichever side its end falls:
    on the bench's chat workload (long-tailed, 32 outstanding, 256 requests)
    that read 0.91 of the engine's long-run rate on one seed and 1.00 on
    another; this reads 0.98-1.01 over 512 (tests/unit/test_bench_capacity.py)."""
    n = len(spans)
    if concurrency < 1 or n < 3 * concurrency:
        raise ValueError(f"completions: need >= 3 x concurrency ({3 * concurrency}) for a steady window, got {n}")
    if not mean_tokens > 0:
        raise ValueError(f"mean_tokens: must be > 0, got {mean_tokens}")
    ends = sorted(s.end_s for s in spans)
    first, last = ends[concurrency - 1], ends[n - concurrency - 1]
    if not last > first:
        raise ValueError("completions: the steady window has zero length")
    tokens = sum(s.tokens_between(first, last) for s in spans)
    return tokens / (last - first) / mean_tokens


def completion_body(model: str, prompt: str | list[str], length: dict[str, Any], stream: bool) -> dict[str, object]:
    """An OpenAI ``/v1/completions`` body whose length is set by ``length``'s fields
    (``exactly``, ``length_fields``)."""
    body: dict[str, object] = {"model": model, "prompt": prompt, **length}
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def exactly(tokens: int) -> dict[str, Any]:
    """Sampling fields of an answer exactly ``tokens`` long, as vLLM's serving benchmark sets it."""
    return {"max_tokens": tokens, "ignore_eos": True}


def length_fields(req: BenchRequest, recorded: bool) -> dict[str, Any]:
    """How ``req``'s length is set, as sampling fields: ``exactly`` its length; or,
    replaying a recorded answer (``req.max_tokens`` set), the client's cap alone --
    the engine knows the length (the embedded one's ``--answer-lengths``) -- or with
    ``recorded``, for an engine that does not, ``min_tokens`` = its length and
    ``RECORDED_STOPS``."""
    if req.max_tokens is None:
        return exactly(req.output_tokens)
    if recorded:
        return {"max_tokens": req.max_tokens, "min_tokens": req.output_tokens, "stop": list(RECORDED_STOPS)}
    return {"max_tokens": req.max_tokens}


def completions_caller(
    session: aiohttp.ClientSession, url: str, model: str, *, priority: bool = False, recorded: bool = False
) -> Callable[[BenchRequest], Awaitable[Sample]]:
    """Streams each request to ``url``'s ``/v1/completions``: the engine called
    directly, or a sidecar's OpenAI-compatible HTTP door (the same client, so the
    two compare only the hop between); with
    ``priority`` its true length is its vLLM ``priority`` (shortest first: an
    engine started with ``--scheduling-policy priority``, told the hints);
    ``recorded``: see ``length_fields``."""

    async def call(req: BenchRequest) -> Sample:
        t0 = time.perf_counter()
        ttft = None
        tokens = 0
        body = completion_body(model, req.prompt, length_fields(req, recorded), stream=True)
        if priority:
            body["priority"] = req.output_tokens
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                raise CallFailed(f"engine answered HTTP {resp.status}: {(await resp.text())[:200]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if ttft is None and any(c.get("text") for c in chunk.get("choices") or ()):
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = int(chunk["usage"]["completion_tokens"])
        e2e = time.perf_counter() - t0
        return Sample(ttft_s=e2e if ttft is None else ttft, e2e_s=e2e, tokens=tokens)

    return call


def sidecar_caller(
    channel: grpc.aio.Channel, *, hint: bool, recorded: bool = False
) -> Callable[[BenchRequest], Awaitable[Sample]]:
    """Streams each request through the sidecar's ``GenerateStream``; with
    ``hint`` it carries the true length as ``expected_output_tokens`` (an oracle);
    ``recorded``: see ``length_fields``."""
    stub = pb_grpc.InferenceStub(channel)

    async def call(req: BenchRequest) -> Sample:
        msg = pb.GenerateRequest(prompt=req.prompt, **length_fields(req, recorded))
        if hint:
            msg.expected_output_tokens = req.output_tokens
        return await streamed_sample(stub, msg)

    return call


async def streamed_sample(stub: pb_grpc.InferenceStub, msg: pb.GenerateRequest) -> Sample:
    """``msg`` through the sidecar's ``GenerateStream``: time to its first text, to its end, and its tokens."""
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    async for chunk in stub.GenerateStream(msg, timeout=CALL_TIMEOUT_S):
        if ttft is None and chunk.text:
            ttft = time.perf_counter() - t0
        if chunk.HasField("final"):
            tokens = chunk.final.completion_tokens
    e2e = time.perf_counter() - t0
    return Sample(ttft_s=e2e if ttft is None else ttft, e2e_s=e2e, tokens=tokens)


async def ideal_gang(
    session: aiohttp.ClientSession, url: str, model: str, requests: Sequence[BenchRequest], *, k: int, batch: int
) -> RunResult:
    """The gang client that knows every true length: all requests are there at
    once; it sorts them into ``k`` equal-mass bins and sends full batches of
    ``batch`` prompts, one batch in the engine at a time (the sidecar's gang
    setting ``maxInflightBatches: 1``).  A batch goes as one list call per
    distinct length (one ``max_tokens`` per call, as the sidecar groups them),
    and holds the engine until its longest member is done."""
    result = RunResult()
    lengths = [r.output_tokens for r in requests]
    with steady_heap():
        t0 = time.perf_counter()
        for members in equal_mass_bins(lengths, k):
            for start in range(0, len(members), batch):
                groups: dict[int, list[int]] = {}  # the chunk's requests (their indices) by length
                for i in members[start : start + batch]:
                    groups.setdefault(requests[i].output_tokens, []).append(i)
                outcomes = await asyncio.gather(
                    *(_list_call(session, url, model, [requests[i] for i in ids]) for ids in groups.values()),
                    return_exceptions=True,
                )
                done = time.perf_counter() - t0  # every request of the batch arrived at t0
                for ids, outcome in zip(groups.values(), outcomes, strict=True):
                    if isinstance(outcome, BaseException):
                        result.failures.extend(f"{type(outcome).__name__}: {outcome}"[:300] for _ in ids)
                    else:
                        result.samples.extend(Sample(done, done, requests[i].output_tokens, i) for i in ids)
        result.elapsed_s = time.perf_counter() - t0
    return result


async def _list_call(session: aiohttp.ClientSession, url: str, model: str, reqs: list[BenchRequest]) -> None:
    body = completion_body(model, [r.prompt for r in reqs], exactly(reqs[0].output_tokens), stream=False)
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise CallFailed(f"engine answered HTTP {resp.status}: {(await resp.text())[:200]}")
        data = await resp.json()
    want = reqs[0].output_tokens * len(reqs)
    got = int(data["usage"]["completion_tokens"])
    if got != want or len(data["choices"]) != len(reqs):
        raise CallFailed(f"list call of {len(reqs)} x {reqs[0].output_tokens} tokens came back with {got}")

