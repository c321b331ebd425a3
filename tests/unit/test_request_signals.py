"""The per-request signals of issue 12 with a fake engine and a manual clock:
``binbatch_request_e2e_seconds`` / ``binbatch_request_ttft_seconds`` from the
dispatcher (the path both doors share), ``binbatch_requests_waiting`` (the
sidecar's held requests plus the engine's own waiting), and the bounded
``model_name`` label."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.former import BatchFormer
from binbatch_sidecar.core.predictor import HintPredictor
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.core.sizer import BatchSizer
from binbatch_sidecar.engine.dispatcher import Call, Core, Dispatcher
from binbatch_sidecar.engine.engine_client import EngineError, EngineRequest, EngineResult, SamplingParams, StreamDelta
from binbatch_sidecar.engine.sidecar_metrics import OTHER_MODEL, ModelLabels, SidecarMetrics


class Engine:
    """Engine calls that wait for the test: ``complete_batch`` until ``answer``; a
    stream yields one delta when ``first`` is set, then its result on ``answer``."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[EngineRequest], asyncio.Future]] = []
        self.first = asyncio.Event()
        self.delta_sent = asyncio.Event()

    async def complete_batch(self, requests, *, timeout=None):
        fut = asyncio.get_running_loop().create_future()
        self.calls.append((list(requests), fut))
        return await fut

    async def stream(self, request, *, timeout=None, on_progress=None):
        await self.first.wait()
        if on_progress is not None:
            on_progress(1, 9)  # the chunk's usage: 1 token generated, 9 in the prompt
        yield StreamDelta("x")
        self.delta_sent.set()
        (result,) = await self.complete_batch([request])
        if isinstance(result, EngineError):
            raise result
        yield result

    def answer(self, i: int, error: EngineError | None = None) -> None:
        reqs, fut = self.calls[i]
        fut.set_result([error or EngineResult("xyz", "length", 5, r.params.max_tokens) for r in reqs])


def make(mode: str = "gang", size: int = 1, inflight: int = 4, served=("m",)):
    clock = ManualClock()
    binner = FixedBinner(())
    former = BatchFormer(binner, clock, target_size=size, max_wait=0.0, max_queue=100)
    core = Core(HintPredictor(), binner, former, BatchSizer(mode="static", static_size=size))
    engine = Engine()
    metrics = SidecarMetrics()
    metrics.model_label.watch(served=lambda: served, default=lambda: served[0] if served else "")
    d = Dispatcher(core, engine, clock, metrics, mode=mode, max_inflight_batches=inflight)  # type: ignore[arg-type]
    return d, engine, clock, metrics


def submit(d: Dispatcher, i: int, model: str = "m", stream: bool = False) -> tuple[Request, Call]:
    req = Request(id=str(i), arrival=d.clock.now(), max_tokens=10)
    call = Call(EngineRequest(SamplingParams(model=model, max_tokens=10), prompt=f"p{i}"),
                asyncio.get_running_loop().create_future(), asyncio.Queue() if stream else None)  # fmt: skip
    d.submit(req, call)
    return req, call


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)  # ok-sleep: a bare yield so engine tasks reach their next await


def observed(metrics: SidecarMetrics, name: str, model: str = "m") -> tuple[float | None, float | None]:
    """(count, sum) of a per-request histogram for one model."""
    get = metrics.registry.get_sample_value
    return get(f"{name}_count", {"model_name": model}), get(f"{name}_sum", {"model_name": model})


async def test_a_request_not_streamed_has_its_ttft_equal_to_its_e2e_from_acceptance():
    d, engine, clock, metrics = make(mode="gang")
    _, call = submit(d, 1)
    clock.advance(0.25)  # queued
    d._step()
    await settle()
    clock.advance(1.0)  # in the engine
    engine.answer(0)
    await call.future
    assert observed(metrics, "binbatch_request_e2e_seconds") == (1, pytest.approx(1.25))
    assert observed(metrics, "binbatch_request_ttft_seconds") == (1, pytest.approx(1.25))


async def test_a_stream_has_its_ttft_at_its_first_delta_and_its_e2e_at_the_end():
    d, engine, clock, metrics = make(mode="continuous")
    _, call = submit(d, 1, stream=True)
    clock.advance(0.1)
    d._step()
    await settle()
    clock.advance(0.2)
    engine.first.set()
    await engine.delta_sent.wait()
    assert observed(metrics, "binbatch_request_ttft_seconds") == (1, pytest.approx(0.3))
    assert observed(metrics, "binbatch_request_e2e_seconds") == (None, None)  # not done yet
    await settle()
    clock.advance(0.7)
    engine.answer(0)
    await call.future
    assert observed(metrics, "binbatch_request_e2e_seconds") == (1, pytest.approx(1.0))
    assert observed(metrics, "binbatch_request_ttft_seconds") == (1, pytest.approx(0.3))  # once, not again


async def test_a_streams_progress_reaches_the_request_for_the_kv_plan_and_a_retry_starts_it_over():
    d, engine, clock, _ = make(mode="continuous")
    req, call = submit(d, 1, stream=True)
    req.engine_generated, req.engine_prompt_tokens = 40, 30  # left from an earlier try
    d._step()
    await settle()
    assert (req.engine_generated, req.engine_prompt_tokens) == (None, None)  # in flight again: nothing known yet
    engine.first.set()
    await engine.delta_sent.wait()
    assert (req.engine_generated, req.engine_prompt_tokens) == (1, 9)
    engine.answer(0)
    await call.future


async def test_failed_requests_are_not_in_the_latency_histograms():
    d, engine, clock, metrics = make(mode="gang")
    _, call = submit(d, 1)
    d._step()
    await settle()
    engine.answer(0, EngineError("invalid", 400, "refused"))
    with pytest.raises(EngineError):
        await call.future
    assert observed(metrics, "binbatch_request_e2e_seconds") == (None, None)


async def test_a_model_the_engine_does_not_serve_is_labelled_other():
    d, engine, _, metrics = make(mode="gang", served=("m",))
    calls = [submit(d, 1, model="m")[1], submit(d, 2, model="client-chosen-name")[1]]
    d._step()
    await settle()
    for i in range(len(engine.calls)):
        engine.answer(i)
    await asyncio.gather(*(c.future for c in calls))
    assert observed(metrics, "binbatch_request_e2e_seconds", "m")[0] == 1
    assert observed(metrics, "binbatch_request_e2e_seconds", OTHER_MODEL)[0] == 1
    assert observed(metrics, "binbatch_request_e2e_seconds", "client-chosen-name") == (None, None)


def test_model_labels_keep_served_and_default_names_only():
    served: list[str] = []
    labels = ModelLabels()
    assert labels("m") == OTHER_MODEL and labels.known() == []  # not wired yet
    labels.watch(served=lambda: served, default=lambda: "configured")
    served[:] = ["a", "b"]  # the engine came up: read live
    assert [labels(m) for m in ("a", "b", "configured", "zzz", "")] == ["a", "b", "configured", OTHER_MODEL,
                                                                         "configured"]  # fmt: skip
    assert labels.known() == ["configured", "a", "b"]


def waiting(metrics: SidecarMetrics) -> dict[str, float]:
    """binbatch_requests_waiting as the /metrics text shows it, by model_name."""
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    return {s.labels["model_name"]: s.value for s in families["binbatch_requests_waiting"].samples}


async def test_requests_waiting_is_the_sidecars_held_requests_plus_the_engines_waiting():
    d, engine, _, metrics = make(mode="gang", size=2, inflight=1, served=("m", "idle-model"))
    for i in range(5):
        submit(d, i, model="m")
    submit(d, 9, model="unknown")
    d._step()
    await settle()
    assert len(engine.calls) == 1  # one batch of two in the engine, the rest held
    assert d.waiting_by_model() == {"m": 3, "unknown": 1}
    assert sum(d.waiting_by_model().values()) == sum(d.core.former.bin_depths()) + d.pending_requests()
    assert waiting(metrics) == {"m": 3, "idle-model": 0, OTHER_MODEL: 1}  # sidecar only: no engine part yet
    engine_part: dict[str, float] | None = {"m": 4, "": 2}  # a series without model_name is the default's
    metrics.requests_waiting.engine = lambda: engine_part
    assert waiting(metrics) == {"m": 3 + 4 + 2, "idle-model": 0, OTHER_MODEL: 1}
    engine_part = None  # the engine's metrics went stale: the sidecar's part alone
    assert waiting(metrics) == {"m": 3, "idle-model": 0, OTHER_MODEL: 1}


async def test_a_requeued_request_counts_as_waiting_again():
    """A request the engine never received (connection refused) goes back to its
    bin: it is waiting again, not in the engine."""
    d, engine, _, metrics = make(mode="gang", size=1, inflight=1)
    _, call = submit(d, 1)
    d._step()
    await settle()
    assert d.waiting_by_model() == {}
    engine.answer(0, EngineError("unavailable", None, "connection refused", sent=False))
    await settle()
    assert metrics.registry.get_sample_value("binbatch_requests_requeued_total") == 1
    assert not call.future.done()
    assert d.waiting_by_model() == {"m": 1} and sum(d.core.former.bin_depths()) + d.pending_requests() == 1
    assert waiting(metrics)["m"] == 1


async def test_with_the_order_in_the_engine_each_request_carries_its_ideal_end_at_the_engines_pace():
    """batch.order EnginePriority: the dispatcher sets vLLM's priority from the
    time per token of the last fresh snapshot, in ms since it started."""
    from dataclasses import replace

    from binbatch_sidecar.core.admission import AdmissionOrder
    from binbatch_sidecar.core.sizer import EngineSnapshot

    d, engine, clock, _ = make(mode="continuous", size=4)
    d.scheduler.core = replace(d.scheduler.core, admission=AdmissionOrder("shortest_first", engine_priority=True))
    d.on_snapshot(EngineSnapshot(tpot_seconds=0.01, fresh=True))
    clock.advance(0.5)
    _, first = submit(d, 1)  # no hint: its max_tokens (10) is its prediction
    d.on_snapshot(EngineSnapshot(tpot_seconds=0.5, fresh=False))  # stale: not the engine's pace now
    d._step()
    await settle()
    assert engine.calls[0][0][0].params.priority == 600  # (0.5 s + 10 x 10 ms) in ms
    assert '"priority": 600' in json.dumps(engine.calls[0][0][0].params.body())
    engine.answer(0)
    await first.future
    make_fifo, fifo_engine, _, _ = make(mode="continuous")
    _, call = submit(make_fifo, 2)
    make_fifo._step()
    await settle()
    assert fifo_engine.calls[0][0][0].params.priority is None  # the default order sends none
    fifo_engine.answer(0)
    await call.future
