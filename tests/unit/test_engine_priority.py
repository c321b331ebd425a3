"""``batch.order: EnginePriority`` needs vLLM's ``--scheduling-policy priority``: the take-over adds it,
every other pod without it is reported (status, Event, admission warning), and nothing is refused."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_operator import builders
from binbatch_operator.reconcile import Context, admit, reconcile
from binbatch_operator.vllm_args import Finding, Given, check, given

IMAGE = "registry.example/binbatch:test"
ORDERED: dict[str, Any] = {
    "selector": {"matchLabels": {"app": "vllm"}},
    "batch": {"mode": "Continuous", "order": "EnginePriority", "followEngineQueue": False},
}
TAKE_OVER: dict[str, Any] = {**ORDERED, "sidecar": {"takeOverServingPort": {"enabled": True}}}


def pod(name: str = "vllm-0", **vllm: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "llm", "labels": {"app": "vllm"}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.11.0", **vllm}]},
    }  # fmt: skip


def admitted(p: dict[str, Any], spec: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The vLLM container as the webhook lets it run, and the warnings for whoever created the pod."""
    patch, warnings = admit(p, [{"name": "fast", "spec": spec, "generation": 1}], IMAGE)
    (engine,) = [c for c in patch["spec"]["containers"] if c["name"] == "vllm"]
    return engine, warnings


# -- the take-over adds the flag where it rewrites vLLM's command line ---------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"args": ["--model", "m", "--port", "8000"]},
         {"args": ["--model", "m", "--port", "8001", "--host", "127.0.0.1", "--scheduling-policy", "priority"]}),
        ({"command": ["vllm", "serve", "m"]},
         {"command": ["vllm", "serve", "m", "--host", "127.0.0.1", "--port", "8001", "--scheduling-policy", "priority"]}),
    ],
    ids=["in args", "in command"],
)  # fmt: skip
def test_the_take_over_adds_the_priority_policy_vllm_needs(fields, expected):
    engine, warnings = admitted(pod(**fields), TAKE_OVER)
    assert {k: engine.get(k) for k in expected} == expected and warnings == []


@pytest.mark.parametrize(
    "spelling",
    [["--scheduling-policy", "priority"], ["--scheduling-policy=priority"], ["--scheduling_policy", "priority"],
     ["--scheduling_policy=priority"], ["--scheduling", "priority"], ["--scheduling-policy", "fcfs", "--scheduling-policy=priority"]],
    ids=["separate", "joined", "underscores", "underscores joined", "a prefix argparse takes", "the last wins"],
)  # fmt: skip
def test_a_priority_policy_the_pod_gives_in_any_spelling_is_left_as_it_is(spelling):
    engine, warnings = admitted(pod(args=["--model", "m", *spelling]), TAKE_OVER)
    assert engine["args"] == ["--model", "m", *spelling, "--host", "127.0.0.1", "--port", "8001"] and warnings == []


def test_another_policy_the_pod_states_is_kept_and_the_creator_is_told():
    """The pod author's explicit value is not overridden: the mismatch is said, at admission and in status."""
    engine, warnings = admitted(pod(args=["--model", "m", "--scheduling-policy=fcfs"]), TAKE_OVER)
    assert "--scheduling-policy=fcfs" in engine["args"] and "priority" not in engine["args"]
    (warning,) = warnings
    assert "batch.order EnginePriority" in warning and "spec.containers[0].args[2]: --scheduling-policy fcfs" in warning


def test_without_engine_priority_the_command_line_gets_no_scheduling_policy():
    spec = copy.deepcopy(TAKE_OVER)
    spec["batch"] = {"mode": "Continuous"}
    engine, warnings = admitted(pod(args=["--model", "m"]), spec)
    assert not any("scheduling" in a for a in engine["args"]) and warnings == []


# -- elsewhere: reported, never refused ------------------------------------------------------------


def test_a_pod_without_the_flag_is_injected_with_a_warning_naming_where_to_add_it():
    engine, warnings = admitted(pod(args=["--model", "m"]), ORDERED)
    assert engine["args"] == ["--model", "m"]  # not rewritten: only the take-over touches vLLM's command line
    (warning,) = warnings
    assert "spec.containers[0].args: no --scheduling-policy (vLLM's default is fcfs)" in warning


@pytest.mark.parametrize(
    ("fields", "finding"),
    [
        ({"args": ["--model", "m", "--scheduling-policy", "priority"]}, None),
        ({"command": ["sh", "-c", "exec vllm serve m --scheduling-policy priority"]}, None),
        ({"args": ["--model", "m"]}, Finding("spec.containers[0].args: no --scheduling-policy (vLLM's default is fcfs)")),
        ({"args": ["--scheduling-policy"]}, Finding("spec.containers[0].args[0]: --scheduling-policy (no value)")),
        ({"command": ["sh", "-c", "exec vllm serve m"]},
         Finding("spec.containers[0].command: vLLM starts through a shell, whose arguments the operator cannot follow", False)),
        ({}, Finding("spec.containers[0]: vLLM's arguments come from the image, which the operator cannot read", False)),
        ({"args": ["--config", "/etc/vllm.yaml"]},
         Finding("spec.containers[0].args: no --scheduling-policy, and the --config file vLLM reads may set it", False)),
        ({"args": ["--scheduling-policy", "$(POLICY)"]},
         Finding("spec.containers[0].args[0]: --scheduling-policy $(POLICY) comes from a variable the operator cannot read", False)),
    ],
    ids=["given", "in a shell script", "missing", "no value", "shell without it", "image's arguments", "--config", "variable"],
)  # fmt: skip
def test_what_a_command_line_says_about_the_scheduling_policy(fields, finding):
    assert check(pod(**fields)["spec"], 0) == finding


def test_the_last_spelling_is_the_one_vllm_takes():
    c = {"command": ["vllm", "serve"], "args": ["--scheduling_policy=priority", "--scheduling-policy", "fcfs"]}
    assert given(c, "spec.containers[0]") == Given("fcfs", "spec.containers[0].args[1]")


class Kube:
    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods

    async def ensure(self, obj):
        return "unchanged"

    async def read(self, kind, name, namespace):
        return None

    async def delete(self, kind, name, namespace):
        return False

    async def list_pods(self, namespace, match_labels):
        return self.pods


def injected(name: str, **vllm: Any) -> dict[str, Any]:
    """A pod as the webhook left it: labelled, with the sidecar container last."""
    p = pod(name, **vllm)
    patch = builders.build_pod_patch(p, "fast", 1, ORDERED, IMAGE)
    return {**p, "metadata": {**p["metadata"], **patch["metadata"], "labels": {**p["metadata"]["labels"], **patch["metadata"]["labels"]}},
            "spec": {**p["spec"], **patch["spec"]}, "status": {"phase": "Running", "podIP": "10.0.0.1"}}  # fmt: skip


async def fresh_stats(address: str) -> pb.Stats:
    return pb.Stats()  # a sidecar that answers: nothing but the engine's flag keeps the policy from Ready


async def status_of(pods: list[dict[str, Any]], spec: dict[str, Any] = ORDERED, before: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {"apiVersion": "binbatch.io/v1alpha1", "kind": "BatchingPolicy",
            "metadata": {"name": "fast", "namespace": "llm", "uid": "u1", "generation": 1}, "spec": spec, "status": before or {}}  # fmt: skip
    ctx = Context(kube=Kube(pods), sidecar_image=IMAGE, stats=fresh_stats)
    outcome = await reconcile(ctx, body, [], logging.getLogger("t"))
    return outcome.status


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


async def test_pods_whose_vllm_lacks_the_flag_are_in_status_and_one_event(caplog):
    pods = [injected("good", args=["--model", "m", "--scheduling-policy", "priority"]),
            injected("plain", args=["--model", "m"]), injected("fcfs", args=["--model", "m", "--scheduling-policy=fcfs"])]  # fmt: skip
    with caplog.at_level(logging.WARNING):
        status = await status_of(pods)
        again = await status_of(pods, before=status)  # the next tick: nothing new to say
    c = conditions(status)["EnginePriorityEnabled"]
    assert (c["status"], c["reason"]) == ("False", "SchedulingPolicyNotPriority")
    assert "recreate 2 pod(s)" in c["message"] and "good" not in c["message"]
    assert "fcfs (spec.containers[0].args[2]: --scheduling-policy fcfs)" in c["message"]
    assert "plain (spec.containers[0].args: no --scheduling-policy (vLLM's default is fcfs))" in c["message"]
    assert conditions(status)["Ready"]["reason"] == "SchedulingPolicyNotPriority"
    assert conditions(again)["EnginePriorityEnabled"] == c
    assert [r.getMessage() for r in caplog.records] == [c["message"]]  # posted as an Event once, not every tick


async def test_every_pod_with_the_flag_makes_the_condition_true_and_an_unreadable_one_unknown():
    good = injected("good", args=["--model", "m", "--scheduling-policy", "priority"])
    c = conditions(await status_of([good]))["EnginePriorityEnabled"]
    assert (c["status"], c["reason"]) == ("True", "SchedulingPolicyPriority")
    shell = injected("shell", command=["bash", "-c", "exec vllm serve m"])
    status = await status_of([good, shell])
    c = conditions(status)["EnginePriorityEnabled"]
    assert (c["status"], c["reason"]) == ("Unknown", "SchedulingPolicyUnknown") and "shell (spec.containers[0].command" in c["message"]
    assert conditions(status)["Ready"]["status"] == "True"  # what cannot be told does not block


async def test_a_policy_that_keeps_the_order_itself_has_no_engine_priority_condition():
    spec = {**ORDERED, "batch": {"mode": "Continuous"}}
    assert "EnginePriorityEnabled" not in conditions(await status_of([injected("plain", args=["--model", "m"])], spec))
