"""``binbatch bench e2e``'s capacity and goodput load (no processes started).

Two defects of the capacity the Poisson loads are fractions of.  First it was
requests / elapsed of one all-at-once burst, whose tail runs its longest answers
alone -- well below the engine's saturated throughput, so "0.95" was really
~0.75 of saturation.  Then completions counted inside a closed loop's steady
window: on the bench's own chat workload (long-tailed, 32 outstanding) that
read 0.91 of the long-run rate on seed 1 (the bench's default), because a long
answer counts wholly on whichever side of the window's edge it ends.  Here the
estimator (:func:`steady_rate`, the tokens generated in the window) runs on the
simulator's vLLM-like engine shaped as the bench's KV-limited one, prefill cost
included, against that engine's long-run saturated rate; and the goodput load
says when direct never missed the SLO instead of silently using the top load.
"""

from __future__ import annotations

import asyncio
import statistics

import pytest

from binbatch_sidecar.bench import e2e, workloads
from binbatch_sidecar.bench.bench_clients import Sample, Span, closed_loop, steady_rate
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.sim.engine_model import ContinuousEngine

SHAPE = e2e.KV_LIMITED


def _engine() -> ContinuousEngine:
    kv = SHAPE.num_gpu_blocks * SHAPE.block_size
    return ContinuousEngine(a=SHAPE.step_a, c=SHAPE.step_c, kv_tokens=kv, max_num_seqs=SHAPE.max_num_seqs,
                            prefill_per_token=SHAPE.prefill_per_token)  # fmt: skip


def _chat(seed: int) -> list[workloads.BenchRequest]:
    """The chat requests the bench's loads replay (and its capacity loop cycles)."""
    return workloads.build("chat", e2e.E2EConfig().load_requests, rate=None, seed=seed)


def _requests(n: int, seed: int = 1) -> list[Request]:
    """``n`` requests cycling through the bench's chat workload (as e2e measures capacity)."""
    reqs = workloads.repeated(_chat(seed), n)
    return [Request(id=str(i), arrival=0.0, prompt_tokens=3 + len(r.prompt.split()), actual_tokens=r.output_tokens)
            for i, r in enumerate(reqs)]  # fmt: skip


def _sim(requests: list[Request], concurrency: int) -> list[Span]:
    """Each request's span on the simulated engine with ``concurrency`` outstanding,
    each completion replaced by the next request (a burst: concurrency = all)."""
    eng = _engine()
    pending = iter(requests)
    sent: dict[Request, float] = {}

    def send(t: float, k: int) -> None:
        batch = [r for _, r in zip(range(k), pending, strict=False)]
        sent.update((r, t) for r in batch)
        eng.submit(t, batch)
        eng.kick(t)

    send(0.0, concurrency)
    spans: list[Span] = []
    while (t := eng.next_time()) is not None:
        finished = eng.advance(t)
        for r in finished:
            start = sent[r]
            first = eng.stats.first_token[r] - start
            spans.append(Span(start, Sample(ttft_s=first, e2e_s=t - start, tokens=int(r.actual_tokens))))
        send(t, len(finished))
    return spans


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_steady_rate_finds_the_saturated_rate_where_one_burst_reads_low(seed):
    cfg = e2e.E2EConfig()
    mean_tokens = statistics.fmean(r.output_tokens for r in _chat(seed))
    long_run = _sim(_requests(20 * cfg.load_requests, seed), cfg.capacity_concurrency)
    saturated = len(long_run) / max(s.end_s for s in long_run)  # 20 passes: warm-up and drain negligible
    steady = steady_rate(_sim(_requests(cfg.capacity_requests, seed), cfg.capacity_concurrency),
                         cfg.capacity_concurrency, mean_tokens)  # fmt: skip
    burst_done = _sim(_requests(e2e.E2EConfig().requests, seed), cfg.requests)
    burst = len(burst_done) / max(s.end_s for s in burst_done)  # the old figure: requests / elapsed of one burst

    assert steady == pytest.approx(saturated, rel=0.025)  # completions in the window: 0.91x on seed 1
    assert burst < 0.95 * saturated


def test_steady_rate_counts_the_tokens_generated_inside_the_window():
    # 2 outstanding: the window runs from the 2nd end (1.0 s) to the 2nd last (3.0 s)
    spans = [
        Span(0.0, Sample(ttft_s=0.0, e2e_s=0.5, tokens=5)),  # before the window: nothing
        Span(0.0, Sample(ttft_s=0.0, e2e_s=1.0, tokens=10)),  # ends on its edge: nothing inside
        Span(0.5, Sample(ttft_s=0.5, e2e_s=2.0, tokens=30)),  # 1.0-2.5: 30 tokens, all inside
        Span(1.0, Sample(ttft_s=0.0, e2e_s=2.0, tokens=20)),  # 1.0-3.0: 20 inside
        Span(2.0, Sample(ttft_s=0.0, e2e_s=2.0, tokens=40)),  # 2.0-4.0: half inside, 20
        Span(2.0, Sample(ttft_s=0.0, e2e_s=4.0, tokens=80)),  # 2.0-6.0: a quarter inside, 20
    ]
    # 90 tokens in 2 s at 15 tokens a request: 3 requests/s
    assert steady_rate(spans, 2, mean_tokens=15.0) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="completions"):
        steady_rate(spans[:5], 2, mean_tokens=15.0)
    with pytest.raises(ValueError, match="mean_tokens"):
        steady_rate(spans, 2, mean_tokens=0.0)


def test_repeated_cycles_the_lengths_with_unique_prompts():
    base = workloads.build("chat", 5, rate=None, seed=2)
    reqs = workloads.repeated(base, 12)
    assert [r.output_tokens for r in reqs] == [base[i % 5].output_tokens for i in range(12)]
    assert len({r.prompt for r in reqs}) == 12 and {r.arrival_s for r in reqs} == {0.0}


async def test_closed_loop_keeps_the_count_outstanding_and_sends_each_request_once():
    reqs = workloads.build("chat", 20, rate=None, seed=3)
    outstanding, most, seen = 0, 0, []

    async def call(req: workloads.BenchRequest) -> Sample:
        nonlocal outstanding, most
        outstanding += 1
        most = max(most, outstanding)
        seen.append(req.prompt)
        for _ in range(len(seen) % 3 + 1):
            await asyncio.sleep(0)  # ok-sleep: one turn only, so completions interleave out of order
        outstanding -= 1
        return Sample(ttft_s=0.0, e2e_s=0.0, tokens=req.output_tokens)

    result, spans = await closed_loop(reqs, call, 4)
    assert most == 4 and sorted(seen) == sorted(r.prompt for r in reqs)
    assert len(result.samples) == len(spans) == 20 and [s.sample for s in spans] == result.samples
    assert all(0 <= s.start_s <= result.elapsed_s for s in spans)


def _direct(rps: float, good: float) -> dict[str, float]:
    return {"requests_per_s": rps, "goodput_per_s": good}


def test_goodput_load_is_the_lowest_load_where_direct_misses():
    rows = {0.5: _direct(10, 10), 0.8: _direct(10, 8), 0.95: _direct(10, 5)}
    assert e2e.goodput_load(rows) == (0.8, True)


def test_goodput_load_says_when_direct_never_missed():
    rows = {0.5: _direct(10, 10), 0.95: _direct(10, 9.5)}
    assert e2e.goodput_load(rows) == (0.95, False)
    note = e2e.goodput_note({"goodput_load": 0.95, "goodput_direct_missed_slo": False})
    assert "met the SLO at every planned load" in note
    assert "where direct misses" in e2e.goodput_note({"goodput_load": 0.8, "goodput_direct_missed_slo": True})


def test_an_slo_direct_meets_for_almost_no_request_is_called_out_with_the_flags_to_change_it():
    cfg = e2e.E2EConfig(slo_tpot_s=0.020)
    slow = {x: {**_direct(2, 0.1), "ttft_p50_s": 0.9, "tpot_p50_s": 0.041} for x in (0.8, 0.95)}
    warning = e2e.slo_warning(slow, cfg)
    assert warning is not None and "5% of its requests even at load 0.8" in warning
    assert "TPOT p50 41 ms" in warning and "TPOT <= 20 ms" in warning and "--slo-tpot-ms" in warning
    assert e2e.slo_warning({0.8: _direct(10, 1.0), 0.95: _direct(10, 0)}, cfg) is None  # 10% at the lowest load
    assert e2e.slo_warning({}, cfg) is None


def test_goodput_ceiling_is_what_serving_every_request_within_the_slo_would_reach():
    assert e2e.goodput_ceiling(_direct(10, 8)) == pytest.approx(1.25)
    assert e2e.goodput_ceiling(_direct(10, 0)) is None  # direct met it for none: no finite ceiling


def test_ordering_bound_is_the_share_of_direct_e2e_that_is_not_waiting():
    from binbatch_sidecar.bench.bench_clients import RunResult

    run = RunResult(samples=[Sample(ttft_s=0.1, e2e_s=0.5, tokens=10), Sample(ttft_s=0.3, e2e_s=1.5, tokens=30)])
    acc = e2e._Acc(e2e.scenarios(e2e.E2EConfig())[0], e2e.DIRECT, [run])
    assert e2e.ordering_bound(acc) == pytest.approx(1 - 0.2 / 1.0)
    assert e2e.ordering_bound(e2e._Acc(acc.scenario, e2e.DIRECT, [])) is None
