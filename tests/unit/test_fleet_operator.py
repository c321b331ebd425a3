"""What lets the operator hold a fleet: its watched store's entries and look-ups, the bounded stats
client, the namespace-termination refusal, and the leader's priority."""

from __future__ import annotations

import asyncio
import json

import pytest
from kubernetes.client.exceptions import ApiException

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_operator import main
from binbatch_operator.builders import INJECTED_ANNOTATION, POLICY_LABEL, SIDECAR_CONTAINER
from binbatch_operator.indexes import Watched, child_entry, pod_entry
from binbatch_operator.reconcile import candidate
from binbatch_operator.kube import namespace_is_terminating
from binbatch_operator.leadership import gate_entry
from binbatch_operator.sidecar_stats import SidecarStats


def pod(name, labels, containers=("vllm",), phase="Running"):
    return {
        "metadata": {"name": name, "namespace": "llm", "uid": f"uid-{name}", "labels": labels,
                     "annotations": {INJECTED_ANNOTATION: "fast@1", "other.example/huge": "x" * 1000},
                     "managedFields": [{"manager": "kubelet"}]},
        "spec": {"containers": [{"name": c, "image": "i", "env": [{"name": "A", "value": "b"}]} for c in containers]},
        "status": {"phase": phase, "podIP": "10.0.0.1", "conditions": [{"type": "Ready"}]},
    }  # fmt: skip


def test_a_pod_entry_keeps_what_a_reconcile_reads_and_drops_the_rest():
    entry = pod_entry(pod("a", {"app": "vllm"}, containers=("vllm", SIDECAR_CONTAINER)))
    assert entry["metadata"]["annotations"] == {INJECTED_ANNOTATION: "fast@1"}  # ours only
    assert "managedFields" not in entry["metadata"] and entry["status"] == {"phase": "Running", "podIP": "10.0.0.1"}
    assert entry["spec"]["containers"][0]["env"] == [{"name": "A", "value": "b"}]  # the take-over and engine-order checks


def test_the_store_finds_a_policys_pods_children_and_neighbours_and_follows_events_and_relists():
    watched = Watched(candidate)
    a, b, c = pod("a", {"app": "vllm", "tier": "gpu"}), pod("b", {"app": "vllm"}), pod("c", {"app": "web", "tier": "gpu"})
    watched.replace("Pod", [a, b, c])
    names = lambda found: [p["metadata"]["name"] for p in found]  # noqa: E731
    assert names(watched.pods("llm", {"app": "vllm", "tier": "gpu"})) == ["a"]
    assert names(watched.pods("llm", {"app": "vllm"})) == ["a", "b"]
    assert watched.pods("other", {"app": "vllm"}) == [] and watched.pods("llm", {}) == []
    watched.apply("Pod", "MODIFIED", {**b, "metadata": {**b["metadata"], "labels": {"app": "web"}}})  # relabelled
    assert names(watched.pods("llm", {"app": "vllm"})) == ["a"] and names(watched.pods("llm", {"app": "web"})) == ["b", "c"]
    watched.apply("Pod", "DELETED", a)
    watched.replace("Pod", [c])  # a relist: what is not listed is gone
    assert watched.pods("llm", {"app": "web"}) == [pod_entry(c)]

    ours = {"metadata": {"name": "fast-binbatch", "namespace": "llm", "uid": "cm1", "labels": {POLICY_LABEL: "fast"}}, "data": {}}
    theirs = {"metadata": {"name": "other", "namespace": "llm", "uid": "cm2"}, "data": {}}
    watched.replace("ConfigMap", [ours, theirs])
    assert watched.children("llm", [("ConfigMap", "fast-binbatch"), ("ConfigMap", "other"), ("Service", "fast-binbatch")]) == {
        ("ConfigMap", "fast-binbatch"): child_entry(ours, "ConfigMap")}  # fmt: skip
    policy = {"metadata": {"name": "fast", "namespace": "llm", "uid": "p1", "generation": 2}, "spec": {}}
    going = {"metadata": {"name": "slow", "namespace": "llm", "uid": "p2", "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    watched.replace("BatchingPolicy", [policy, going])
    assert [p["name"] for p in watched.policies("llm")] == ["fast"] and watched.policies("other") == []


async def test_the_store_is_synced_once_every_kind_was_listed():
    watched = Watched(candidate)
    waiting = asyncio.ensure_future(watched.synced())
    for kind in ("Pod", "ConfigMap", "Service", "NetworkPolicy"):
        watched.replace(kind, [])
        await asyncio.sleep(0)  # ok-sleep: one turn of the loop, no wait
        assert not waiting.done()
    watched.replace("BatchingPolicy", [])
    await asyncio.wait_for(waiting, 1)


def test_a_child_entry_compares_as_the_built_child():
    body = {"metadata": {"name": "x", "namespace": "llm", "uid": "u", "resourceVersion": "9", "managedFields": [{}],
                         "labels": {POLICY_LABEL: "fast"}}, "data": {"k": "v"}}  # fmt: skip
    assert child_entry(body, "ConfigMap") == {"apiVersion": "v1", "kind": "ConfigMap", "data": {"k": "v"},
                                              "metadata": {"name": "x", "namespace": "llm", "uid": "u",
                                                           "labels": {POLICY_LABEL: "fast"}}}  # fmt: skip


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


async def test_stats_are_reused_within_max_age_and_asked_again_after():
    clock, asked = Clock(), []

    async def fetch(address):
        asked.append(address)
        return pb.Stats(target_batch_size=len(asked))

    stats = SidecarStats(fetch, clock=clock)
    first = await stats.ask({"u1": "10.0.0.1:1", "u2": "10.0.0.2:1"}, max_age=7.5)
    clock.now += 5
    again = await stats.ask({"u1": "10.0.0.1:1"}, max_age=7.5)
    assert asked == ["10.0.0.1:1", "10.0.0.2:1"] and again["u1"] is first["u1"]
    clock.now += 3
    await stats.ask({"u1": "10.0.0.1:1"}, max_age=7.5)
    assert asked[-1] == "10.0.0.1:1" and len(asked) == 3


async def test_in_a_large_fleet_answers_are_reused_longer_to_hold_the_call_rate():
    clock, asked = Clock(), []

    async def fetch(address):
        asked.append(address)
        return pb.Stats()

    stats = SidecarStats(fetch, rate=10.0, clock=clock)
    fleet = {f"u{i}": f"10.0.0.{i}:1" for i in range(100)}  # 100 pods at 10 calls a second: each every 10 s
    await stats.ask(fleet, max_age=1)
    clock.now += 5
    await stats.ask(fleet, max_age=1)
    assert len(asked) == 100  # 5 s old: still fresh at this size
    clock.now += 5
    await stats.ask(fleet, max_age=1)
    assert len(asked) == 200


async def test_stats_calls_are_bounded_shared_and_failures_reported():
    running, most, gate = 0, 0, asyncio.Event()

    async def fetch(address):
        nonlocal running, most
        running += 1
        most = max(most, running)
        await gate.wait()
        running -= 1
        if address.startswith("bad"):
            raise ConnectionError("refused")
        return pb.Stats()

    stats = SidecarStats(fetch, concurrency=3, clock=Clock())
    targets = {f"u{i}": f"10.0.0.{i}:1" for i in range(10)} | {"ux": "bad:1"}
    one = asyncio.ensure_future(stats.ask(targets, max_age=1))
    two = asyncio.ensure_future(stats.ask({"u0": "10.0.0.0:1"}, max_age=1))  # the same pod meanwhile: no second call
    for _ in range(5):
        await asyncio.sleep(0)  # ok-sleep: one turn of the loop, no wait
    assert running == 3
    gate.set()
    answers, shared = await one, await two
    assert most == 3 and stats.calls == 11
    assert shared["u0"] is answers["u0"] and answers["ux"].stats is None and "refused" in answers["ux"].error


def test_the_namespace_terminating_refusal_is_told_from_other_403s():
    def refusal(code, causes):
        exc = ApiException(status=code, reason="Forbidden")
        exc.body = json.dumps({"kind": "Status", "code": code, "details": {"causes": causes}})
        return exc

    assert namespace_is_terminating(refusal(403, [{"reason": "NamespaceTerminating"}]))
    assert not namespace_is_terminating(refusal(403, []))  # RBAC, quota: a real failure
    assert not namespace_is_terminating(refusal(409, [{"reason": "NamespaceTerminating"}]))
    assert not namespace_is_terminating(ConnectionError())


def test_a_follower_priority_is_unique_and_below_the_leases_gate(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(main.time, "time_ns", lambda: 1_700_000_000_000_000_000)
    older = main.follower_priority()
    monkeypatch.setattr(main.time, "time_ns", lambda: 1_700_000_000_000_001_000)
    assert main.follower_priority() < older < gate_entry()["priority"]


async def test_a_namespaced_store_relists_one_namespace_and_syncs_once_each_was_listed():
    """watchNamespaces: one informer per kind and namespace; a relist of one namespace keeps the others."""
    from binbatch_operator.indexes import KINDS

    watched = Watched(candidate, ["a", "b"])
    waiting = asyncio.ensure_future(watched.synced())

    def cm(name: str, namespace: str) -> dict:
        return {"metadata": {"name": name, "namespace": namespace, "uid": f"{namespace}/{name}",
                             "labels": {POLICY_LABEL: "p"}}, "data": {}}  # fmt: skip

    for kind in KINDS:
        watched.replace(kind, [cm("x-binbatch", "a")] if kind == "ConfigMap" else [], "a")
    await asyncio.sleep(0)  # ok-sleep: one turn of the loop, no wait
    assert not waiting.done()  # namespace b not listed yet
    for kind in KINDS:
        watched.replace(kind, [cm("x-binbatch", "b")] if kind == "ConfigMap" else [], "b")
    await asyncio.wait_for(waiting, 1)
    watched.replace("ConfigMap", [], "b")  # b's relist: its ConfigMap is gone, a's stays
    assert watched.children("a", [("ConfigMap", "x-binbatch")]) and not watched.children("b", [("ConfigMap", "x-binbatch")])
