"""The operator against a real API server, with the RBAC users get.

The chart is installed by Helm (``helm_release``); the operator runs here as the
chart's Deployment runs it (its command and environment, read back from the
server) with a token of the install's own ServiceAccount, so every request it makes
is one that RBAC allows the real install.  The API server calls the webhook through
its Service: ``ServiceProxy`` plays kube-proxy for the Service's ClusterIP, which the
test server allocates on loopback.  No kubelet runs: pods stay Pending, and the
sidecar is checked on the pod the API server stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_support import Cluster, wait_for

from binbatch_operator import crd
from binbatch_operator.builders import CONFIG_KEY, SIDECAR_CONTAINER, child_name
from binbatch_sidecar.bench.chaos_processes import free_port

pytestmark = pytest.mark.apiserver

INJECT = {"binbatch.io/inject": "enabled"}  # the chart's default webhook.namespaceSelector
POLICY = "llm"
SELECTOR = {"matchLabels": {"app": "vllm"}}
# cpu: 1 unquoted, as a Pod spec allows; the injected container carries it to the pod.
RESOURCES = {"requests": {"cpu": "250m", "memory": "128Mi"}, "limits": {"cpu": 1, "memory": "256Mi"}}


class ServiceProxy:
    """kube-proxy's job for one Service port: connections to ``host:port`` reach 127.0.0.1:``backend``.

    Runs its own event loop in a thread (the test's calls block).  A connection that
    finds no backend is closed, as a Service without ready endpoints refuses it.
    """

    def __init__(self, host: str, port: int, backend: int) -> None:
        self.host, self.port, self.backend = host, port, backend
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    def __enter__(self) -> ServiceProxy:
        self._thread.start()
        self._started.wait(timeout=10)
        if self._error is not None or self._stop is None:
            raise RuntimeError(f"cannot listen on {self.host}:{self.port} (a port below 1024 needs root or "
                               f"CAP_NET_BIND_SERVICE): {self._error}")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=10)

    async def _serve(self) -> None:
        writers: set[asyncio.StreamWriter] = set()

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.add(writer)
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.backend)
            except OSError:
                writer.close()
                return
            writers.add(upstream_writer)
            await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))

        try:
            server = await asyncio.start_server(handle, self.host, self.port)
        except OSError as exc:
            self._error = exc
            self._started.set()
            return
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._started.set()
        async with server:
            await self._stop.wait()
            for writer in writers:
                writer.close()


class Operator:
    """``kopf run`` as the chart's Deployment runs it, as a child process; ``start``, ``kill``, ``stop``."""

    def __init__(self, cluster: Cluster, deployment: dict[str, Any], kubeconfig: Path, webhook_config: str,
                 log: Path) -> None:  # fmt: skip
        self.cluster, self.webhook_config, self.log = cluster, webhook_config, log
        self.health_port, self.webhook_port = free_port(), free_port()
        self.command = operator_command(deployment, self.health_port)
        self.env = operator_environment(deployment, self.webhook_port, kubeconfig)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        """Start it; return once kopf reports healthy and the webhook listens with its CA published."""
        self.starts += 1
        # kopf names this replica by its pod in the peering object: a new process is a new pod.
        env = {**self.env, "POD_ID": f"{self.env['POD_ID']}-{self.starts}"}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.command, env=env, stdout=log, stderr=subprocess.STDOUT)

        def healthy() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                pytest.fail(f"the operator exited {self.proc.returncode}\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as answer:
                    return answer.status == 200
            except (urllib.error.URLError, OSError):
                return False

        def webhook_ready() -> bool:
            config = self.cluster.admission.read_mutating_webhook_configuration(self.webhook_config)
            if not config.webhooks[0].client_config.ca_bundle:
                return False
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.webhook_port), timeout=2):
                return True
            return False

        wait_for("the operator's liveness endpoint", healthy, timeout=60, every=0.2, diagnose=self.tail)
        wait_for("the webhook's CA bundle and listener", webhook_ready, timeout=60, every=0.2, diagnose=self.tail)

    def kill(self) -> None:
        """SIGKILL, as when a node dies: no cleanup, no goodbye to the peering object."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self) -> str:
        return "operator log (tail):\n" + self.log.read_text(errors="replace")[-6000:]


def operator_command(deployment: dict[str, Any], health_port: int) -> list[str]:
    """The Deployment's container command, run by this interpreter; liveness on loopback."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    kopf, *args = container["command"]
    assert kopf == "kopf" and args[:3] == ["run", "-m", "binbatch_operator.main"], args
    assert args[3] == "--all-namespaces" or args[3].startswith("--namespace="), args  # watchNamespaces: namespaced
    liveness = [i for i, a in enumerate(args) if a.startswith("--liveness=")]
    assert len(liveness) == 1, args
    args[liveness[0]] = f"--liveness=http://127.0.0.1:{health_port}/healthz"
    return [sys.executable, "-m", "kopf", *args]


def operator_environment(deployment: dict[str, Any], webhook_port: int, kubeconfig: Path) -> dict[str, str]:
    """The Deployment's container environment, its fieldRefs resolved; the webhook on loopback."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    pod_fields = {"metadata.namespace": deployment["metadata"]["namespace"],
                  "metadata.name": f"{deployment['metadata']['name']}-local"}  # fmt: skip
    env = {}
    for var in container["env"]:
        env[var["name"]] = var["value"] if "value" in var else pod_fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    env |= {"BINBATCH_WEBHOOK_ADDRESS": "127.0.0.1", "BINBATCH_WEBHOOK_PORT": str(webhook_port)}
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "BINBATCH_"))}
    return {**inherited, **env, "KUBECONFIG": str(kubeconfig)}


def service_account_kubeconfig(cluster: Cluster, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig for the API server the tests use, with a token of ``account`` (``kubectl create token``)."""
    admin = json.loads(cluster.kubectl("config", "view", "--raw", "--minify", "--flatten", "-o", "json"))
    token = cluster.kubectl("create", "token", account, "--namespace", namespace, "--duration=2h").strip()
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "operator",
        "clusters": [{"name": "server", "cluster": admin["clusters"][0]["cluster"]}],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "server", "user": account}}],
    }  # fmt: skip
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def release_operator(cluster: Cluster, helm_release: str, folder: Path, env: dict[str, str] | None = None,
                     prepare: Callable[[Operator], None] | None = None) -> Iterator[Operator]:
    """The operator of ``helm_release`` as its chart runs it (the Deployment's command, environment and
    ServiceAccount token), its webhook reachable through the release's Service; ``env`` adds to its
    environment and ``prepare`` sees it just before it starts.  Its ClusterKopfPeering is deleted after."""
    namespace = helm_release
    (deployment,) = cluster.apps.list_namespaced_deployment(namespace).items
    deployment = cluster.api.sanitize_for_serialization(deployment)
    (webhook,) = cluster.admission.list_mutating_webhook_configuration(
        label_selector=f"app.kubernetes.io/instance={helm_release}").items  # fmt: skip
    service_ref = webhook.webhooks[0].client_config.service
    service = cluster.core.read_namespaced_service(service_ref.name, service_ref.namespace)
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    kubeconfig = service_account_kubeconfig(cluster, namespace, account, folder / "kubeconfig")
    process = Operator(cluster, deployment, kubeconfig, webhook.metadata.name, folder / "operator.log")
    process.env.update(env or {})
    if prepare is not None:
        prepare(process)
    cluster.diagnose.append(("--namespace", namespace, "get", "events"))
    peering = [a.removeprefix("--peering=") for a in process.command if a.startswith("--peering=")]
    with ServiceProxy(service.spec.cluster_ip, service_ref.port, process.webhook_port):
        try:
            process.start()
            yield process
        finally:
            process.stop()
            for name in peering:  # the operator creates its ClusterKopfPeering; helm uninstall leaves it
                cluster.kubectl("delete", "clusterkopfpeering", name, "--ignore-not-found")


@pytest.fixture(scope="module")
def operator(cluster: Cluster, helm_release: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    """The operator of ``helm_release``, started, its webhook reachable through the release's Service."""
    with release_operator(cluster, helm_release, tmp_path_factory.mktemp("operator")) as process:
        yield process


@pytest.fixture
def policy_namespace(cluster: Cluster, operator: Operator, namespace: Any) -> Iterator[Any]:
    """``namespace``, whose policies are deleted at the end while the operator runs: a policy keeps the
    operator's finalizer until the operator handles its deletion, and would hold its namespace Terminating."""
    made: list[str] = []

    def make(labels: dict[str, str] | None = None) -> str:
        made.append(namespace(labels))
        return made[-1]

    def policies_left() -> list[Any]:
        return [p for ns in made for p in cluster.custom.list_namespaced_custom_object(
            crd.GROUP, crd.VERSION, ns, crd.PLURAL)["items"]]  # fmt: skip

    yield make
    for ns in made:
        cluster.custom.delete_collection_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL)
    wait_for("the test's policies to be deleted", lambda: not policies_left(), timeout=60, every=0.2,
             diagnose=lambda: f"{cluster.diagnostics()}\n{operator.tail()}")  # fmt: skip


# -- helpers for the tests ----------------------------------------------------------


def create_policy(cluster: Cluster, namespace: str, spec: dict[str, Any]) -> None:
    body = {"apiVersion": f"{crd.GROUP}/{crd.VERSION}", "kind": crd.KIND, "metadata": {"name": POLICY}, "spec": spec}
    cluster.custom.create_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, body)


def reconciled(cluster: Cluster, namespace: str, operator: Operator) -> dict[str, Any]:
    """Wait until the operator acted on the policy's current spec; its ConfigMap's config, parsed."""

    def check() -> dict[str, Any] | None:
        policy = cluster.custom.get_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, POLICY)
        if (policy.get("status") or {}).get("observedGeneration") != policy["metadata"]["generation"]:
            return None
        config_map = cluster.core.read_namespaced_config_map(child_name(POLICY), namespace)
        cluster.core.read_namespaced_service(child_name(POLICY), namespace)
        return yaml.safe_load(config_map.data[CONFIG_KEY])

    return wait_for(f"policy {namespace}/{POLICY}'s status, ConfigMap and Service", check, timeout=60, every=0.2,
                    diagnose=lambda: f"{cluster.diagnostics()}\n{operator.tail()}")  # fmt: skip


def create_pod(cluster: Cluster, namespace: str, name: str, labels: dict[str, str]) -> Any:
    """The pod as the API server stored it, after admission (the webhook's patch included)."""
    from kubernetes import client

    pod = client.V1Pod(metadata=client.V1ObjectMeta(name=name, labels=labels),
                       spec=client.V1PodSpec(containers=[client.V1Container(name="vllm", image="vllm/vllm-openai")]))  # fmt: skip
    return cluster.core.create_namespaced_pod(namespace, pod)


def containers(pod: Any) -> list[str]:
    return [c.name for c in pod.spec.containers]


# -- the tests ----------------------------------------------------------------------


def test_a_selected_pod_in_an_opted_in_namespace_gets_the_sidecar(
    cluster: Cluster, operator: Operator, policy_namespace: Any
) -> None:
    opted_in, other = policy_namespace(INJECT), policy_namespace()
    for ns in (opted_in, other):
        create_policy(cluster, ns, {"selector": SELECTOR, "sidecar": {"resources": RESOURCES}})
    reconciled(cluster, opted_in, operator)
    pod = create_pod(cluster, opted_in, "selected", {"app": "vllm"})
    assert containers(pod) == ["vllm", SIDECAR_CONTAINER], operator.tail()
    assert pod.spec.containers[1].resources.limits == {"cpu": "1", "memory": "256Mi"}
    assert containers(create_pod(cluster, opted_in, "not-selected", {"app": "web"})) == ["vllm"]
    assert containers(create_pod(cluster, other, "not-opted-in", {"app": "vllm"})) == ["vllm"]


def test_deleting_the_policy_garbage_collects_its_children(
    cluster: Cluster, operator: Operator, policy_namespace: Any
) -> None:
    ns = policy_namespace(INJECT)
    create_policy(cluster, ns, {"selector": SELECTOR})
    reconciled(cluster, ns, operator)
    cluster.custom.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, POLICY)

    def all_gone() -> bool:
        return (
            cluster.gone(cluster.custom.get_namespaced_custom_object, crd.GROUP, crd.VERSION, ns, crd.PLURAL, POLICY)
            and cluster.gone(cluster.core.read_namespaced_config_map, child_name(POLICY), ns)
            and cluster.gone(cluster.core.read_namespaced_service, child_name(POLICY), ns)
        )

    wait_for(f"policy {ns}/{POLICY}, its ConfigMap and Service to be deleted", all_gone, timeout=60, every=0.2,
             diagnose=lambda: f"{cluster.diagnostics()}\n{operator.tail()}")  # fmt: skip


def test_the_operator_converges_after_a_restart(cluster: Cluster, operator: Operator, policy_namespace: Any) -> None:
    ns = policy_namespace(INJECT)
    create_policy(cluster, ns, {"selector": SELECTOR, "batch": {"staticSize": 8}})
    assert reconciled(cluster, ns, operator)["batch"]["staticSize"] == 8
    operator.kill()
    cluster.custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, POLICY,
                                                  {"spec": {"batch": {"staticSize": 16}}})  # fmt: skip
    # The webhook is down: failurePolicy Ignore admits the pod as written.
    assert containers(create_pod(cluster, ns, "while-down", {"app": "vllm"})) == ["vllm"]
    operator.start()
    assert reconciled(cluster, ns, operator)["batch"]["staticSize"] == 16
    assert containers(create_pod(cluster, ns, "after-restart", {"app": "vllm"})) == ["vllm", SIDECAR_CONTAINER]


# -- least privilege: what the operator may do, and on what --------------------------------


def policy_condition(cluster: Cluster, namespace: str, kind: str) -> dict[str, Any]:
    policy = cluster.custom.get_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, POLICY)
    return next((c for c in (policy.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def wait_condition(cluster: Cluster, namespace: str, operator: Operator, kind: str, reason: str) -> dict[str, Any]:
    return wait_for(f"{kind} {reason} on policy {namespace}/{POLICY}",
                    lambda: (lambda c: c if c.get("reason") == reason else None)(policy_condition(cluster, namespace, kind)),
                    timeout=60, every=0.2, diagnose=lambda: f"{cluster.diagnostics()}\n{operator.tail()}")  # fmt: skip


def test_a_foreign_configmap_under_the_childs_name_survives_the_policy(
    cluster: Cluster, operator: Operator, policy_namespace: Any
) -> None:
    """No confused deputy: someone's unlabelled `<policy>-binbatch` ConfigMap is never patched or adopted,
    so the garbage collector leaves it when the policy (and its own Service) goes."""
    from kubernetes import client

    ns = policy_namespace(INJECT)
    theirs = client.V1ConfigMap(metadata=client.V1ObjectMeta(name=child_name(POLICY)), data={"owner": "someone"})
    cluster.core.create_namespaced_config_map(ns, theirs)
    create_policy(cluster, ns, {"selector": SELECTOR})
    ready = wait_condition(cluster, ns, operator, "Ready", "ChildConflict")
    assert ready["status"] == "False" and f"ConfigMap {ns}/{child_name(POLICY)}" in ready["message"]
    wait_for("the policy's own Service", lambda: cluster.core.read_namespaced_service(child_name(POLICY), ns),
             timeout=60, every=0.2, diagnose=operator.tail)  # fmt: skip
    assert containers(create_pod(cluster, ns, "not-mounting-theirs", {"app": "vllm"})) == ["vllm"]
    cluster.custom.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, POLICY)
    wait_for("the policy and its own Service to be deleted",
             lambda: cluster.gone(cluster.custom.get_namespaced_custom_object, crd.GROUP, crd.VERSION, ns, crd.PLURAL, POLICY)
             and cluster.gone(cluster.core.read_namespaced_service, child_name(POLICY), ns),
             timeout=60, every=0.2, diagnose=lambda: f"{cluster.diagnostics()}\n{operator.tail()}")  # fmt: skip
    left = cluster.core.read_namespaced_config_map(child_name(POLICY), ns)
    assert left.data == {"owner": "someone"} and not left.metadata.owner_references and not left.metadata.labels


def test_an_image_or_url_the_install_does_not_allow_is_refused_by_field(
    cluster: Cluster, operator: Operator, policy_namespace: Any
) -> None:
    ns = policy_namespace(INJECT)
    create_policy(cluster, ns, {"selector": SELECTOR, "sidecar": {"image": "docker.io/someone/miner:1"},
                                "metrics": {"source": "PromQL", "url": "http://prometheus.monitoring:9090"}})  # fmt: skip
    valid = wait_condition(cluster, ns, operator, "Valid", "InvalidSpec")
    assert "spec.sidecar.image: 'docker.io/someone/miner:1' is not allowed" in valid["message"], valid
    assert "spec.metrics.url: must name the pod's loopback" in valid["message"], valid
    assert cluster.gone(cluster.core.read_namespaced_config_map, child_name(POLICY), ns)
    assert containers(create_pod(cluster, ns, "refused-policy", {"app": "vllm"})) == ["vllm"]


def create_pod_spec(cluster: Cluster, namespace: str, name: str, spec: dict[str, Any]) -> Any:
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "vllm"}}, "spec": spec}
    return cluster.core.create_namespaced_pod(namespace, body)


def test_host_network_pods_are_not_injected_and_the_status_says_so(
    cluster: Cluster, operator: Operator, policy_namespace: Any
) -> None:
    ns = policy_namespace(INJECT)
    create_policy(cluster, ns, {"selector": SELECTOR})
    reconciled(cluster, ns, operator)
    pod = create_pod_spec(cluster, ns, "on-the-node", {"hostNetwork": True,
                                                       "containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]})  # fmt: skip
    assert containers(pod) == ["vllm"]
    injected = wait_condition(cluster, ns, operator, "SidecarsInjected", "HostNetwork")
    assert injected["status"] == "False" and "on-the-node" in injected["message"]


def test_the_sidecar_gets_default_resources_and_keeps_a_guaranteed_pod_guaranteed(
    cluster: Cluster, operator: Operator, policy_namespace: Any
) -> None:
    """The API server computes each pod's QoS class at admission: it is the judge here."""
    ns = policy_namespace(INJECT)
    create_policy(cluster, ns, {"selector": SELECTOR})
    reconciled(cluster, ns, operator)
    vllm = {"name": "vllm", "image": "vllm/vllm-openai"}
    burstable = create_pod_spec(cluster, ns, "burstable", {"containers": [vllm]})
    sidecar = burstable.spec.containers[1]
    assert (sidecar.resources.requests, sidecar.resources.limits) == (
        {"cpu": "250m", "memory": "384Mi"}, {"cpu": "1", "memory": "768Mi"})  # fmt: skip
    exact = {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}}
    guaranteed = create_pod_spec(cluster, ns, "guaranteed", {"containers": [{**vllm, "resources": exact}]})
    assert containers(guaranteed) == ["vllm", SIDECAR_CONTAINER]
    assert guaranteed.status.qos_class == "Guaranteed", guaranteed.spec.containers[1].resources


def test_each_policy_owns_a_network_policy_that_goes_with_it(
    cluster: Cluster, operator: Operator, policy_namespace: Any
) -> None:
    """With the chart's default networkPolicy.enabled, under the install's own RBAC."""
    ns = policy_namespace(INJECT)
    allow = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateway"}}}]
    create_policy(cluster, ns, {"selector": SELECTOR, "sidecar": {"allowFrom": allow}})
    reconciled(cluster, ns, operator)
    networking = client_networking(cluster)

    def named() -> str | None:
        policy = cluster.custom.get_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, POLICY)
        return (policy.get("status") or {}).get("networkPolicy")

    assert wait_for("status.networkPolicy", named, timeout=60, every=0.2, diagnose=operator.tail) == child_name(POLICY)
    made = cluster.api.sanitize_for_serialization(networking.read_namespaced_network_policy(child_name(POLICY), ns))
    assert made["spec"]["podSelector"] == {"matchLabels": {"binbatch.io/policy": POLICY}}
    assert made["spec"]["ingress"][0]["from"] == allow
    assert [p["port"] for p in made["spec"]["ingress"][0]["ports"]] == ["bb-grpc", "bb-http", "bb-metrics"]
    cluster.custom.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, POLICY)
    wait_for("the NetworkPolicy to be garbage-collected with the policy",
             lambda: cluster.gone(networking.read_namespaced_network_policy, child_name(POLICY), ns),
             timeout=60, every=0.2, diagnose=lambda: f"{cluster.diagnostics()}\n{operator.tail()}")  # fmt: skip


def client_networking(cluster: Cluster) -> Any:
    from kubernetes import client

    return client.NetworkingV1Api(cluster.api)


# -- uninstall, in the right order and the wrong one (README "Operate and uninstall") --------


FINALIZER = f"{crd.GROUP}/cleanup"


def get_policy(cluster: Cluster, namespace: str) -> dict[str, Any]:
    return cluster.custom.get_namespaced_custom_object(crd.GROUP, crd.VERSION, namespace, crd.PLURAL, POLICY)


def test_a_policy_deleted_after_the_operator_stopped_stays_terminating_until_its_finalizer_is_cleared(
    cluster: Cluster, operator: Operator, policy_namespace: Any
) -> None:
    """The wrong uninstall order: the operator is gone, so nothing releases the finalizer; the recovery the
    docs give (clear the finalizers by hand) lets the policy go, and the garbage collector its children."""
    ns = policy_namespace(INJECT)
    create_policy(cluster, ns, {"selector": SELECTOR})
    reconciled(cluster, ns, operator)
    assert get_policy(cluster, ns)["metadata"]["finalizers"] == [FINALIZER]
    operator.stop()
    try:
        cluster.custom.delete_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, POLICY)
        stuck = get_policy(cluster, ns)
        assert stuck["metadata"].get("deletionTimestamp") and stuck["metadata"]["finalizers"] == [FINALIZER], stuck
        cluster.core.read_namespaced_config_map(child_name(POLICY), ns)  # its children stay with it
        cluster.kubectl("--namespace", ns, "patch", "batchingpolicy", POLICY, "--type=merge",
                        "-p", '{"metadata":{"finalizers":null}}')  # fmt: skip

        def all_gone() -> bool:
            return (
                cluster.gone(cluster.custom.get_namespaced_custom_object, crd.GROUP, crd.VERSION, ns, crd.PLURAL, POLICY)
                and cluster.gone(cluster.core.read_namespaced_config_map, child_name(POLICY), ns)
                and cluster.gone(cluster.core.read_namespaced_service, child_name(POLICY), ns)
            )

        wait_for(f"policy {ns}/{POLICY} and its children to go once its finalizer is cleared", all_gone,
                 timeout=60, every=0.2, diagnose=cluster.diagnostics)  # fmt: skip
    finally:
        operator.start()


def test_helm_uninstall_leaves_the_peering_object_the_operator_made(
    cluster: Cluster, operator: Operator, helm_release: str
) -> None:
    """helm uninstall deletes what the release's manifest lists; the operator's ClusterKopfPeering is not in
    it, so it stays behind, as the docs say (``kubectl delete clusterkopfpeering <release>``)."""
    import helm_python as helm

    # Named after the chart's full name: the release's name if it contains "binbatch", else <release>-binbatch.
    fullname = helm_release if "binbatch" in helm_release else f"{helm_release}-binbatch"
    peering = [a.removeprefix("--peering=") for a in operator.command if a.startswith("--peering=")]
    assert peering == [fullname], operator.command  # the chart's default: two replicas, kopf peering
    made = cluster.kubectl("get", "clusterkopfpeering", fullname, "-o", "json")
    assert json.loads(made)["metadata"]["name"] == fullname
    with helm.Config(kubeconfig_path=cluster.kubeconfig, namespace=helm_release) as config:
        manifest = config.status(helm_release)["manifest"]
    kinds = {doc["kind"] for doc in yaml.safe_load_all(manifest) if doc}
    assert "MutatingWebhookConfiguration" in kinds and "ClusterKopfPeering" not in kinds, kinds


def test_the_quickstart_sample_runs_with_the_sidecar(
    cluster: Cluster, operator: Operator, policy_namespace: Any
) -> None:
    """The quickstart: label a namespace, apply manifests/samples/cpu-emulator.yaml (policy and Deployment
    at once); the Deployment's pod, made by the controller manager, is stored with the sidecar."""
    ns = policy_namespace()
    cluster.kubectl("label", "namespace", ns, "binbatch.io/inject=enabled")
    sample = Path(__file__).resolve().parents[2] / "manifests" / "samples" / "cpu-emulator.yaml"
    cluster.kubectl("--namespace", ns, "apply", "-f", str(sample))

    def pod() -> Any:
        pods = cluster.core.list_namespaced_pod(ns, label_selector="app.kubernetes.io/name=vllm-emulator").items
        return pods[0] if pods else None

    made = wait_for("the sample Deployment's pod", pod, timeout=60, every=0.2,
                    diagnose=lambda: f"{cluster.diagnostics()}\n{operator.tail()}")  # fmt: skip
    assert SIDECAR_CONTAINER in containers(made), f"{containers(made)}\n{operator.tail()}"


# -- the Admin credential ------------------------------------------------------------------


def test_the_operator_keeps_its_admin_key_in_its_secret_and_every_config_names_it(
    cluster: Cluster, operator: Operator, policy_namespace: Any
) -> None:
    """Made at start under the chart's Role (create, then get by name), the same after a restart (loaded,
    not made again); each policy's config trusts its public key for that policy's audience; spec.auth's
    Secrets are mounted into the pod the API server stores."""
    import base64

    from binbatch_sidecar.engine.admin_token import load_private_pem, public_pem

    name, home = operator.env["BINBATCH_ADMIN_SIGNING_SECRET"], operator.env["POD_NAMESPACE"]
    stored = cluster.core.read_namespaced_secret(name, home)
    public = public_pem(load_private_pem(base64.b64decode(stored.data["ed25519.pem"])))
    ns = policy_namespace(INJECT)
    auth = {"callerTokensSecretRef": {"name": "callers"}, "adminTokenSecretRef": {"name": "dash", "key": "token"}}
    create_policy(cluster, ns, {"selector": SELECTOR, "auth": auth})
    config = reconciled(cluster, ns, operator)
    assert config["auth"]["operatorPublicKeys"] == [public] and config["auth"]["audience"] == f"{ns}/{POLICY}"
    assert config["auth"]["callerTokensDir"] == "/var/run/binbatch/caller-tokens"
    pod = create_pod(cluster, ns, "locked", {"app": "vllm"})
    volumes = {v.name: v for v in pod.spec.volumes}
    assert volumes["binbatch-caller-tokens"].secret.secret_name == "callers"
    assert volumes["binbatch-admin-token"].secret.items[0].key == "token"
    operator.stop()
    operator.start()
    assert cluster.core.read_namespaced_secret(name, home).metadata.resource_version == stored.metadata.resource_version
    cluster.custom.patch_namespaced_custom_object(crd.GROUP, crd.VERSION, ns, crd.PLURAL, POLICY,
                                                  {"spec": {"batch": {"staticSize": 12}}})  # fmt: skip

    def rewritten() -> dict[str, Any] | None:
        config = reconciled(cluster, ns, operator)
        return config if config.get("batch", {}).get("staticSize") == 12 else None

    config = wait_for("the ConfigMap after the restart", rewritten, timeout=60, every=0.2,
                      diagnose=lambda: f"{cluster.diagnostics()}\n{operator.tail()}")  # fmt: skip
    assert config["auth"]["operatorPublicKeys"] == [public]  # the restarted operator signs with the same key
