"""The bench's runs go with its heap collected and frozen (bench_clients.steady_heap):
a full collection of the bench process must not stall one client's run and not another's."""

from __future__ import annotations

import gc

import pytest

from binbatch_sidecar.bench import bench_clients, workloads
from binbatch_sidecar.bench.bench_clients import Sample, closed_loop, ideal_gang, replay, steady_heap


@pytest.fixture(autouse=True)
def _thawed():
    gc.unfreeze()  # whatever an earlier test or plugin froze: each test starts from an unfrozen heap
    yield
    gc.unfreeze()


def test_steady_heap_freezes_what_the_process_holds_and_thaws_it_after():
    held = [object() for _ in range(10)]  # noqa: F841 - alive across the block
    assert gc.get_freeze_count() == 0
    with steady_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 1000  # the modules, the test's objects: everything alive when it began
        made = [[i] for i in range(100)]  # what the run makes is not frozen: a collection walks it
        assert gc.get_freeze_count() == frozen and gc.is_tracked(made[0])
    assert gc.get_freeze_count() == 0


def test_steady_heap_thaws_the_heap_when_the_run_fails():
    with pytest.raises(RuntimeError, match="run failed"), steady_heap():
        raise RuntimeError("run failed")
    assert gc.get_freeze_count() == 0


def test_steady_heap_collects_garbage_cycles_before_it_freezes():
    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle only the collector frees
    del a, b
    with steady_heap():
        assert not any(type(o) is Node for o in gc.get_objects())  # collected, not frozen for the process's life


@pytest.mark.parametrize("runner", ["replay", "closed_loop"])
async def test_every_call_of_a_run_goes_with_the_heap_frozen(runner):
    reqs = workloads.build("chat", 6, rate=None, seed=1)
    seen: list[int] = []

    async def call(req: workloads.BenchRequest) -> Sample:
        seen.append(gc.get_freeze_count())
        return Sample(ttft_s=0.0, e2e_s=0.0, tokens=req.output_tokens)

    result = await replay(reqs, call) if runner == "replay" else (await closed_loop(reqs, call, 2))[0]
    assert len(result.samples) == 6 and len(seen) == 6 and min(seen) > 1000
    assert gc.get_freeze_count() == 0


async def test_the_ideal_gang_clients_list_calls_go_with_the_heap_frozen(monkeypatch):
    reqs = workloads.build("mixed", 8, rate=None, seed=1)
    seen: list[int] = []

    async def list_call(session, url, model, batch) -> None:
        seen.append(gc.get_freeze_count())

    monkeypatch.setattr(bench_clients, "_list_call", list_call)
    result = await ideal_gang(None, "http://127.0.0.1:1", "m", reqs, k=2, batch=4)
    assert len(result.samples) == 8 and seen and min(seen) > 1000
    assert gc.get_freeze_count() == 0
