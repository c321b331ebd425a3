"""The predictor's model in the cluster, against a real API server: ``spec.predictor.model`` and
``spec.predictor.fleet``.

The operator of ``helm_release`` runs as in test_operator_against_apiserver.py (the chart's command
and environment, the ServiceAccount's token, the webhook's Service played by ``ServiceProxy``), with
a short re-check interval so that a policy's status follows the world within seconds.  No kubelet
runs: pods stay Pending and injection is checked on the pod the API server stored.

For the fleet, the operator must find a Running sidecar to gather from: the test marks the stored
pod Running with podIP 127.0.0.1 (its status subresource, as admin, as a kubelet would) and runs a
real ``binbatch sidecar`` process on 127.0.0.1 with the very config the operator wrote into the
policy's ConfigMap, in front of ``binbatch emulate-engine``.  The audit log of the API server
(``logs/audit.log`` beside the kubeconfig that start.sh prints, or ``BINBATCH_APISERVER_AUDIT_LOG``)
shows who wrote the published model.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from conftest import KUBECONFIG_ENV
from kube_support import Cluster, wait_for
from test_operator_against_apiserver import (  # noqa: F401 -- policy_namespace is a fixture used here
    INJECT,
    POLICY,
    SELECTOR,
    Operator,
    create_pod,
    create_policy,
    free_port,
    policy_namespace,
    reconciled,
    release_operator,
)

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc
from binbatch_operator import crd
from binbatch_operator.builders import (
    FLEET_MODEL_KEY,
    MODEL_DIR,
    MODEL_PATH,
    MODEL_VOLUME,
    SIDECAR_CONTAINER,
    fleet_model_name,
)
from binbatch_operator.fleet_model import MIN_FIT_RECORDS, PENDING_RETRY_SECONDS, VERSION_ANNOTATION
from binbatch_sidecar.config import parse_config
from binbatch_sidecar.engine.model_file import load_model, model_bytes
from binbatch_sidecar.engine.training_records import Record, train

pytestmark = pytest.mark.apiserver

STATS_INTERVAL_SECONDS = 2  # the operator's re-check of each policy (the chart's default is 15)
MODEL_CHECK_SECONDS = 60  # reconcile.Context.model_check_seconds: a model ConfigMap is re-read at most this often
AUDIT_LOG_ENV = "BINBATCH_APISERVER_AUDIT_LOG"
MODEL_KEY = "model.npz"
REFIT_SECONDS = 60  # spec.predictor.fleet.refitIntervalSeconds: its minimum
LONG, SHORT = 300, 3  # output tokens of the two kinds of prompt the fleet's sidecar serves


# -- the operator -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def operator(cluster: Cluster, helm_release: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    """The operator of ``helm_release`` re-checking its policies every STATS_INTERVAL_SECONDS (this module's)."""
    with release_operator(cluster, helm_release, tmp_path_factory.mktemp("model-operator"),
                          env={"BINBATCH_STATS_INTERVAL_SECONDS": str(STATS_INTERVAL_SECONDS)}) as process:
        yield process


@pytest.fixture(scope="module")
def operator_user(cluster: Cluster, helm_release: str) -> str:
    """The user the operator's requests are made as (its ServiceAccount), as the audit log names it."""
    (deployment,) = cluster.apps.list_namespaced_deployment(helm_release).items
    return f"system:serviceaccount:{helm_release}:{deployment.spec.template.spec.service_account_name}"


# -- helpers ------------------------------------------------------------------------------------


def prompt(i: int) -> str:
    return f"write a long essay about thing {i}" if i % 2 else f"yes or no: is thing {i} blue?"


def tiny_model() -> bytes:
    """A model file as ``binbatch predictor train`` writes it, fitted on two kinds of prompt."""
    return model_bytes(train([Record(prompt(i), LONG if i % 2 else SHORT) for i in range(200)]))


def create_model_configmap(cluster: Cluster, namespace: str, name: str, *, binary: dict[str, bytes] | None = None,
                           text: dict[str, str] | None = None) -> None:  # fmt: skip
    from kubernetes import client

    body = client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name=name), data=text,
        binary_data={k: base64.b64encode(v).decode() for k, v in (binary or {}).items()} or None)  # fmt: skip
    cluster.core.create_namespaced_config_map(namespace, body)


def get_policy(cluster: Cluster, namespace: str) -> dict[str, Any]:
    return cluster.custom.get_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, POLICY)


def condition_of(policy: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (policy.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def watch_policy(cluster: Cluster, namespace: str, operator: Operator, what: str,
                 check: Callable[[dict[str, Any]], Any], timeout: float) -> Any:  # fmt: skip
    """Follow the policy through the API server's watch until ``check(policy)`` is truthy (its value is
    returned); fail at ``timeout`` seconds with the last policy seen and the operator's log.

    Each watch starts from the current object (its first event), so one that the server ends early
    (its timeout, or a resource version its cache has not reached yet) is simply opened again."""
    from kubernetes import watch
    from kubernetes.client.exceptions import ApiException

    deadline, last = time.monotonic() + timeout, None
    while (left := deadline - time.monotonic()) > 0:
        stream = watch.Watch()
        try:
            for event in stream.stream(cluster.custom.list_namespaced_custom_object, crd.GROUP, crd.VERSION, namespace,
                                       crd.PLURAL, field_selector=f"metadata.name={POLICY}",
                                       timeout_seconds=max(1, int(left)), _request_timeout=left + 10):  # fmt: skip
                last = event["object"]
                found = check(last)
                if found:
                    stream.stop()
                    return found
        except ApiException as exc:  # 410 Gone, 504 a resource version the watch cache has not reached
            if exc.status not in (410, 504):
                raise
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} on policy {namespace}/{POLICY}; last seen:\n"
                f"{json.dumps((last or {}).get('status'), indent=1)}\n{operator.tail()}")  # fmt: skip


def wait_model_ready(cluster: Cluster, namespace: str, operator: Operator, reason: str, timeout: float = 60) -> dict[str, Any]:
    return watch_policy(cluster, namespace, operator, f"ModelReady {reason}",
                        lambda p: (lambda c: c if c.get("reason") == reason else None)(condition_of(p, "ModelReady")),
                        timeout)  # fmt: skip


def sidecar_of(pod: Any) -> Any:
    """The injected sidecar container (a plain or a native sidecar)."""
    return next(c for c in [*pod.spec.containers, *(pod.spec.init_containers or [])] if c.name == SIDECAR_CONTAINER)


def model_volume_of(pod: Any) -> Any:
    return next(v for v in pod.spec.volumes or [] if v.name == MODEL_VOLUME)


def assert_mounts_the_model(pod: Any) -> str:
    """The sidecar mounts the model volume read-only at the model folder; the file it holds there."""
    (mount,) = [m for m in sidecar_of(pod).volume_mounts if m.name == MODEL_VOLUME]
    assert (mount.mount_path, mount.read_only, mount.sub_path) == (MODEL_DIR, True, None), mount
    source = model_volume_of(pod).config_map or model_volume_of(pod).secret
    (item_path,) = [i.path for i in source.items]
    return f"{mount.mount_path}/{item_path}"


# -- spec.predictor.model ------------------------------------------------------------------------------


@pytest.mark.parametrize("ref", ["configMapKeyRef", "secretKeyRef"])
def test_a_policy_naming_a_model_mounts_it_into_its_pods_as_the_sidecars_warm_start(
    cluster: Cluster, operator: Operator, policy_namespace: Any, ref: str, tmp_path: Path
) -> None:
    from kubernetes import client

    ns = policy_namespace(INJECT)
    data = tiny_model()
    if ref == "configMapKeyRef":
        create_model_configmap(cluster, ns, "chat-model", binary={"weights": data})
    else:
        secret = client.V1Secret(metadata=client.V1ObjectMeta(name="chat-model"),
                                 data={"weights": base64.b64encode(data).decode()})  # fmt: skip
        cluster.core.create_namespaced_secret(ns, secret)
    create_policy(cluster, ns, {"selector": SELECTOR, "predictor": {"model": {ref: {"name": "chat-model", "key": "weights"}}}})
    config = parse_config(reconciled(cluster, ns, operator))
    assert (config.predictor.kind, config.predictor.warm_start, config.predictor.warm_start_optional) == (
        "Learned", MODEL_PATH, True)  # fmt: skip

    pod = create_pod(cluster, ns, "with-model", {"app": "vllm"})
    volume = model_volume_of(pod)
    if ref == "configMapKeyRef":
        assert (volume.secret, volume.config_map.name, volume.config_map.optional) == (None, "chat-model", True)
        items = volume.config_map.items
    else:
        assert (volume.config_map, volume.secret.secret_name, volume.secret.optional) == (None, "chat-model", True)
        items = volume.secret.items
    assert [(i.key, i.path) for i in items] == [("weights", MODEL_KEY)]
    # The file the volume puts at the sidecar's mount is the one its config warm-starts from.
    assert assert_mounts_the_model(pod) == config.predictor.warm_start

    if ref == "configMapKeyRef":
        found = wait_model_ready(cluster, ns, operator, "ModelFound")
        assert found["status"] == "True" and "ConfigMap chat-model key weights" in found["message"], found
        # what the API server stored is a model the sidecar's loader reads
        stored = cluster.core.read_namespaced_config_map("chat-model", ns).binary_data["weights"]
        (tmp_path / MODEL_KEY).write_bytes(base64.b64decode(stored))
        assert load_model(tmp_path / MODEL_KEY).records == 200
    else:  # the operator does not read Secrets: each sidecar's binbatch_predictor_model_loaded tells
        unknown = wait_model_ready(cluster, ns, operator, "SecretNotChecked")
        assert unknown["status"] == "Unknown" and "Secret chat-model key weights" in unknown["message"], unknown


def test_an_unreadable_model_sets_model_ready_naming_the_field_until_it_is_fixed(
    cluster: Cluster, operator: Operator, policy_namespace: Any
) -> None:
    """A missing ConfigMap, a model in ``data`` (text), a missing key: each a ModelReady False whose
    message names spec.predictor.model and what is wrong; fixing the ConfigMaps flips them to ModelFound
    (within the operator's once-a-minute re-read of a model ConfigMap, then one re-check)."""
    data = tiny_model()
    missing, text, keyless = policy_namespace(INJECT), policy_namespace(INJECT), policy_namespace(INJECT)
    create_model_configmap(cluster, text, "chat-model", text={MODEL_KEY: "not a model"})
    create_model_configmap(cluster, keyless, "chat-model", binary={"other.npz": data})
    for ns in (missing, text, keyless):
        create_policy(cluster, ns, {"selector": SELECTOR,
                                    "predictor": {"model": {"configMapKeyRef": {"name": "chat-model", "key": MODEL_KEY}}}})  # fmt: skip

    not_found = wait_model_ready(cluster, missing, operator, "ModelNotFound")
    assert not_found["status"] == "False", not_found
    assert not_found["message"].startswith(f"spec.predictor.model: ConfigMap chat-model not found in namespace {missing}")
    not_binary = wait_model_ready(cluster, text, operator, "ModelNotBinary")
    assert not_binary["status"] == "False", not_binary
    assert not_binary["message"].startswith(f"spec.predictor.model: ConfigMap chat-model key {MODEL_KEY} is text (data)")
    no_key = wait_model_ready(cluster, keyless, operator, "ModelNotFound")
    assert no_key["status"] == "False", no_key
    assert no_key["message"].startswith(f"spec.predictor.model: ConfigMap chat-model has no key {MODEL_KEY} (its keys: "
                                        "other.npz)")  # fmt: skip
    # The warnings are Events on the policy too (kubectl describe).
    events = cluster.core.list_namespaced_event(missing, field_selector=f"involvedObject.name={POLICY}").items
    assert any(e.type == "Warning" and "ConfigMap chat-model not found" in e.message for e in events), events

    create_model_configmap(cluster, missing, "chat-model", binary={MODEL_KEY: data})
    cluster.core.replace_namespaced_config_map("chat-model", text, {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "chat-model"},
        "binaryData": {MODEL_KEY: base64.b64encode(data).decode()}})  # fmt: skip
    for ns in (missing, text):
        fixed = wait_model_ready(cluster, ns, operator, "ModelFound", timeout=MODEL_CHECK_SECONDS + 60)
        assert fixed["status"] == "True" and f"ConfigMap chat-model key {MODEL_KEY} holds" in fixed["message"], fixed
    assert condition_of(get_policy(cluster, keyless), "ModelReady")["reason"] == "ModelNotFound"


# -- spec.predictor.fleet ---------------------------------------------------------------------------


def audit_log_path() -> Path:
    explicit = os.environ.get(AUDIT_LOG_ENV)
    return Path(explicit) if explicit else Path(os.environ[KUBECONFIG_ENV]).parent / "logs" / "audit.log"


def audit_events(path: Path, since: int) -> Iterator[dict[str, Any]]:
    """The audit log's events written after byte ``since`` (ResponseComplete: one per finished request)."""
    with path.open("rb") as log:
        log.seek(since)
        for line in log:
            with contextlib.suppress(ValueError):  # a line being written as we read
                event = json.loads(line)
                if event.get("stage") == "ResponseComplete":
                    yield event


class Process:
    """A child process, its output in a log file; stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, name: str, command: list[str], log: Path) -> None:
        self.name, self.log = name, log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def tail(self) -> str:
        return f"{self.name} log (tail):\n" + self.log.read_text(errors="replace")[-3000:]

    def check(self) -> None:
        if self.proc.poll() is not None:
            pytest.fail(f"{self.name} exited {self.proc.returncode}\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@contextlib.contextmanager
def processes() -> Iterator[list[Process]]:
    started: list[Process] = []
    try:
        yield started
    finally:
        for process in reversed(started):
            process.stop()


def listening(port: int, process: Process) -> bool:
    process.check()
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def serve(stub: pb_grpc.InferenceStub, first: int, count: int) -> None:
    """``count`` completions through the sidecar, long and short prompts in turn, 64 at a time."""
    for start in range(first, first + count, 64):
        calls = [stub.Generate.future(pb.GenerateRequest(prompt=prompt(i), max_tokens=LONG if i % 2 else SHORT,
                                                         ignore_eos=True), timeout=120)
                 for i in range(start, min(start + 64, first + count))]  # fmt: skip
        for call in calls:  # each bounded by its own deadline
            assert call.result().completion_tokens in (LONG, SHORT)


def test_the_fleet_gathers_from_a_running_sidecar_and_publishes_its_model_under_the_operators_account(
    cluster: Cluster, operator: Operator, operator_user: str, policy_namespace: Any, tmp_path: Path
) -> None:
    audit = audit_log_path()
    if not audit.is_file():
        pytest.skip(f"no audit log at {audit}: set {AUDIT_LOG_ENV} to the API server's --audit-log-path")
    mark = audit.stat().st_size
    ns = policy_namespace(INJECT)
    engine_port, grpc_port, http_port, metrics_port = free_port(), free_port(), free_port(), free_port()
    create_policy(cluster, ns, {
        "selector": SELECTOR,
        "sidecar": {"grpcPort": grpc_port, "httpPort": http_port, "metricsPort": metrics_port},
        "engine": {"url": f"http://127.0.0.1:{engine_port}", "model": "emulated"},
        "metrics": {"url": f"http://127.0.0.1:{engine_port}/metrics"},
        "predictor": {"fleet": {"enabled": True, "refitIntervalSeconds": REFIT_SECONDS, "maxRecords": 1000}},
    })  # fmt: skip
    config = reconciled(cluster, ns, operator)
    assert (config["predictor"]["warmStart"], config["predictor"]["warmStartOptional"]) == (MODEL_PATH, True)
    pod = create_pod(cluster, ns, "fleet-member", {"app": "vllm"})
    assert model_volume_of(pod).config_map.name == fleet_model_name(POLICY)
    assert assert_mounts_the_model(pod) == MODEL_PATH
    config_file = tmp_path / "sidecar.yaml"
    config_file.write_text(yaml.safe_dump(config))  # what kubelet would mount: the policy's own config

    with processes() as started, grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        engine = Process("emulate-engine", [sys.executable, "-m", "binbatch_sidecar.cli", "emulate-engine",
                                            "--port", str(engine_port), "--model", "emulated", "--step-a", "0.0002",
                                            "--step-c", "0.0001", "--num-gpu-blocks", "1024", "--block-size", "16"],
                         tmp_path / "engine.log")  # fmt: skip
        started.append(engine)
        wait_for("the engine emulator", lambda: listening(engine_port, engine), timeout=60, every=0.2, diagnose=engine.tail)
        sidecar = Process("sidecar", [sys.executable, "-m", "binbatch_sidecar.cli", "sidecar", "--config",
                                      str(config_file), "--host", "127.0.0.1"], tmp_path / "sidecar.log")  # fmt: skip
        started.append(sidecar)
        try:
            grpc.channel_ready_future(channel).result(timeout=60)
        except grpc.FutureTimeoutError:
            pytest.fail(f"the sidecar did not listen on 127.0.0.1:{grpc_port}\n{sidecar.tail()}")
        stub = pb_grpc.InferenceStub(channel)
        first = MIN_FIT_RECORDS * 3 // 2  # a tenth is held out: enough left to fit
        serve(stub, 0, first)

        # What a kubelet would report: the pod runs, at an address the operator can dial.
        cluster.core.patch_namespaced_pod_status("fleet-member", ns, {"status": {
            "phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}})  # fmt: skip

        def published(version: int) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
            def check(policy: dict[str, Any]) -> dict[str, Any] | None:
                model = (policy.get("status") or {}).get("model") or {}
                return model if model.get("version", 0) >= version else None

            return check

        # The policy's first round, before the pod ran, asked no sidecar: the next is due a minute after it.
        one = watch_policy(cluster, ns, operator, "status.model version 1", published(1),
                           timeout=PENDING_RETRY_SECONDS + 90)  # fmt: skip
        diagnose = f"{sidecar.tail()}\n{operator.tail()}"
        assert one["version"] == 1 and MIN_FIT_RECORDS <= one["records"] <= first, (one, diagnose)
        assert -1 <= float(one["kendallTau"]) <= 1 and one["publishedAt"].endswith("Z"), one
        ready = condition_of(get_policy(cluster, ns), "ModelReady")
        assert (ready["status"], ready["reason"]) == ("True", "FleetModelPublished"), ready
        assert f"version 1 fitted on {one['records']} records" in ready["message"], ready

        made = cluster.core.read_namespaced_config_map(fleet_model_name(POLICY), ns)
        policy = get_policy(cluster, ns)
        assert made.metadata.annotations[VERSION_ANNOTATION] == "1"
        (owner,) = made.metadata.owner_references
        assert (owner.kind, owner.name, owner.uid) == (crd.KIND, POLICY, policy["metadata"]["uid"])
        model_file = tmp_path / MODEL_KEY
        model_file.write_bytes(base64.b64decode(made.binary_data[FLEET_MODEL_KEY]))
        model = load_model(model_file)  # the sidecar's own loader: what a new pod warm-starts from
        assert model.records == one["records"]

        # The next round, a refit interval later, gathers only what the sidecar saw since and updates it.
        more = 64
        serve(stub, first, more)
        two = watch_policy(cluster, ns, operator, "status.model version 2", published(2), timeout=REFIT_SECONDS + 60)
        assert two["version"] == 2 and one["records"] < two["records"] <= first + more, (one, two)
        updated = cluster.core.read_namespaced_config_map(fleet_model_name(POLICY), ns)
        assert updated.metadata.annotations[VERSION_ANNOTATION] == "2"
        assert updated.binary_data[FLEET_MODEL_KEY] != made.binary_data[FLEET_MODEL_KEY]
        for process in started:
            process.check()

    writes = [(e["verb"], e["responseStatus"]["code"]) for e in audit_events(audit, mark)
              if e["user"]["username"] == operator_user and e["objectRef"].get("resource") == "configmaps"
              and e["objectRef"].get("namespace") == ns and e["objectRef"].get("name") == fleet_model_name(POLICY)
              and e["verb"] in ("create", "patch", "update")]  # fmt: skip
    assert writes == [("create", 201), ("patch", 200)], writes
    status_writes = [e for e in audit_events(audit, mark)
                     if e["user"]["username"] == operator_user and e["verb"] == "patch"
                     and e["objectRef"].get("resource") == crd.PLURAL and e["objectRef"].get("subresource") == "status"
                     and e["objectRef"].get("namespace") == ns]  # fmt: skip
    assert status_writes, "the operator's status patches of the policy are not in the audit log"
