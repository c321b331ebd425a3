"""The simulator's engine models: step time, KV budget, recompute preemption, FCFS."""

from __future__ import annotations

import pytest

from binbatch_sidecar.core.request import Request
from binbatch_sidecar.sim.engine_model import BatchServers, ContinuousEngine
from binbatch_sidecar.sim.simulator import Workload, run_direct


def seq(i: int, prompt: int, output: int, t: float = 0.0) -> Request:
    return Request(id=str(i), arrival=t, prompt_tokens=prompt, actual_tokens=float(output))


def run_out(engine: ContinuousEngine) -> dict[str, float]:
    done = {}
    while (t := engine.next_time()) is not None:
        for r in engine.advance(t):
            done[r.id] = t
    return done


def test_a_step_takes_a_plus_c_times_the_running_sequences():
    e = ContinuousEngine(a=0.1, c=0.01, kv_tokens=10_000, max_num_seqs=8, prefill_per_token=0.0)
    e.submit(0.0, [seq(0, 10, 3), seq(1, 10, 1)])
    e.kick(0.0)
    done = run_out(e)
    step2, step1 = 0.1 + 0.01 * 2, 0.1 + 0.01 * 1
    assert done["1"] == pytest.approx(step2)
    assert done["0"] == pytest.approx(step2 + step1 * 2)  # alone after the first step
    assert e.stats.decoded_tokens == 4 and e.stats.preemptions == 0


def test_max_num_seqs_queues_the_rest_first_come_first_served():
    e = ContinuousEngine(a=1.0, c=0.0, kv_tokens=10_000, max_num_seqs=2, prefill_per_token=0.0)
    e.submit(0.0, [seq(i, 1, 2) for i in range(4)])
    e.kick(0.0)
    assert [s.req.id for s in e.running] == ["0", "1"] and len(e.waiting) == 2
    done = run_out(e)
    assert done == {"0": 2.0, "1": 2.0, "2": 4.0, "3": 4.0}


def test_outgrowing_the_kv_budget_preempts_the_newest_and_recomputes_it_later():
    # Two sequences of 10 prompt tokens fit (20 + 2 <= 24) but cannot both grow to 10 outputs.
    e = ContinuousEngine(a=1.0, c=0.0, kv_tokens=24, max_num_seqs=8, prefill_per_token=0.0)
    e.submit(0.0, [seq(0, 10, 10), seq(1, 10, 10)])
    e.kick(0.0)
    assert len(e.running) == 2
    done = run_out(e)
    assert e.stats.preemptions >= 1
    assert done["0"] < done["1"]  # the older one kept running
    assert e.stats.finished == 2 and e.kv_usage() == 0.0


def test_priority_scheduling_takes_the_lowest_key_first_and_preempts_the_highest():
    """vLLM's ``--scheduling-policy priority``: waiting ones by (priority, arrival),
    the running one with the largest key preempted -- here the one that arrived
    first, which FCFS would have kept."""
    e = ContinuousEngine(a=1.0, c=0.0, kv_tokens=24, max_num_seqs=8, prefill_per_token=0.0,
                         priority=lambda r: r.actual_tokens)  # fmt: skip
    e.submit(0.0, [seq(0, 10, 10), seq(1, 10, 8)])
    e.kick(0.0)
    assert len(e.running) == 2
    done = run_out(e)
    assert e.stats.preemptions >= 1
    assert done["1"] < done["0"]  # the shorter kept running
    queued = ContinuousEngine(a=1.0, c=0.0, kv_tokens=10_000, max_num_seqs=1, prefill_per_token=0.0,
                              priority=lambda r: r.actual_tokens)  # fmt: skip
    queued.submit(0.0, [seq(0, 1, 5), seq(1, 1, 9), seq(2, 1, 3), seq(3, 1, 3)])
    queued.kick(0.0)
    order = sorted(run_out(queued).items(), key=lambda kv: kv[1])
    assert [k for k, _ in order] == ["2", "3", "0", "1"]  # by length, a tie by arrival


def test_kv_limited_direct_run_preempts_more_under_more_load_and_ends_every_request():
    def direct(rate: float):
        w = Workload(n=300, lmin=16, lmax=512, rate=rate, seed=3, prompt=(32, 256))
        return run_direct(w, ContinuousEngine(kv_tokens=8192, max_num_seqs=256))

    low, high = direct(0.5), direct(8.0)
    assert low.completed == high.completed == 300
    assert low.preemptions < high.preemptions


def test_batch_servers_end_a_call_after_its_longest_request():
    s = BatchServers()
    assert s.submit(1.0, [seq(0, 0, 3), seq(1, 0, 7)]) == 7.0
    assert s.next_time() == 8.0 and s.advance(7.9) == [] and len(s.advance(8.0)) == 2


def test_calls_made_at_the_same_instant_join_the_same_step():
    e = ContinuousEngine(a=1.0, c=0.0, kv_tokens=10_000, max_num_seqs=8, prefill_per_token=0.0)
    e.submit(0.0, [seq(0, 1, 1)])
    e.submit(0.0, [seq(1, 1, 1)])
    assert e.next_time() is None  # nothing starts before the driver's kick
    e.kick(0.0)
    assert len(e.running) == 2 and run_out(e) == {"0": 1.0, "1": 1.0}
