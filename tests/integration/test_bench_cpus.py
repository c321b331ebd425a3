"""``bench e2e --sidecar-cpus``: the sidecars on their own CPUs, the bench and its engines on the rest.

Real processes: a child of this interpreter pinned from its start, and a quick
e2e run whose sidecar is read in /proc while it serves."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import psutil
import pytest

from binbatch_sidecar.bench import e2e
from binbatch_sidecar.bench.chaos_processes import ChildProcess

CPUS = frozenset(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="pinning apart needs two CPUs this process may use")

# a child with a second thread before its ready line; it waits for SIGTERM
CHILD = """
import signal, sys, threading
threading.Thread(target=threading.Event().wait, daemon=True).start()
print("ready on 127.0.0.1:1", file=sys.stderr, flush=True)
signal.pause()
"""


def thread_cpus(pid: int) -> dict[int, frozenset[int]]:
    return {int(t): frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


@needs_two
async def test_a_child_given_cpus_has_every_thread_on_them_and_the_bench_keeps_its_own(tmp_path: Path):
    mine = max(CPUS)
    child = ChildProcess("pinned", frozenset({mine}))
    await child._spawn(["-c", CHILD], re.compile(r"ready on 127\.0\.0\.1:(\d+)"), tmp_path)
    try:
        threads = thread_cpus(child.pid)
        assert len(threads) == 2
        assert set(threads.values()) == {frozenset({mine})}
        assert frozenset(os.sched_getaffinity(0)) == CPUS  # pinning a child leaves this process as it was
    finally:
        await child.signal_and_wait(signal.SIGTERM, 15)


@needs_two
async def test_bench_e2e_runs_its_sidecars_on_the_cpus_given_and_the_engines_on_the_rest(tmp_path, monkeypatch):
    theirs = frozenset({max(CPUS)})
    seen = []
    started = e2e.start_sidecar

    async def start_sidecar(doc, path, cwd, cpus=None):
        proc = await started(doc, path, cwd, cpus)
        engines = [c.pid for c in psutil.Process().children() if c.pid != proc.pid]
        seen.append((thread_cpus(proc.pid), frozenset(os.sched_getaffinity(0)),
                     {cpus for pid in engines for cpus in thread_cpus(pid).values()}))  # fmt: skip
        return proc

    monkeypatch.setattr(e2e, "start_sidecar", start_sidecar)
    cfg = e2e.quick(e2e.E2EConfig(only=("short@ample",), clients=("direct", "default"), sidecar_cpus=theirs))
    doc = await e2e.run_async(cfg, lambda line: None)

    assert doc["_setup"]["sidecar_cpus"] == sorted(theirs)
    assert len(seen) == 1
    sidecar_threads, bench_cpus, engine_cpus = seen[0]
    assert len(sidecar_threads) > 1 and set(sidecar_threads.values()) == {theirs}  # grpc and the loop's threads too
    assert bench_cpus == CPUS - theirs  # while the sidecars served, the bench had the rest
    assert engine_cpus == {CPUS - theirs}  # and so had every thread of the engines it started
    assert frozenset(os.sched_getaffinity(0)) == CPUS  # and has every CPU again once the run ended
    assert {r["name"].split(" | ")[1] for r in doc["runs"]} == {"direct", "sidecar, policy default, no hint"}
