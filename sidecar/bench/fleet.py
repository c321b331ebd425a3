"""``binbatch bench operator``: what the operator costs while it holds a fleet of policies.

For each fleet size (100 and 1,000 policies by default, five pods each, a
hundred policies a namespace) the bench makes the policies and their pods, runs
the operator as the chart does (``kopf run -m binbatch_operator.main``, one
replica) and measures:

* **idle API requests per policy per minute** (``idle_requests_per_policy_minute``):
  every request the operator sends while nothing changes, over a window, after
  the statuses settled.  On kmock they are counted as kmock serves them (by the
  operator's clients' User-Agent); on a real API server from its audit log
  (``--audit-log``), by the operator's user;
* **spec change → ConfigMap**: one policy's spec changed at a time, until its
  ConfigMap (watched) carries the change, p50 and p99;
* **webhook admission**: AdmissionReviews for pod CREATEs posted to the
  operator's webhook at 20 a second, as the API server sends them, p50 and p99;
* **the operator's RSS and CPU** (idle window), and the sidecar GetStats calls
  per pod per minute.

Pods are objects only: injected already (the labels and the container the
webhook adds), Running on 127.0.0.1, where one fake sidecar answers GetStats
for all.  The default API server is kmock in this process (the ``bench``
extra); ``--kubeconfig`` points the bench at a real one with the CRD and the
install applied, and ``--operator-kubeconfig`` gives the operator its own
credentials (the install's ServiceAccount token, so RBAC is the one users get).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import ssl
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import kubernetes
import yaml

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_api.v1 import binbatch_pb2_grpc as pb_grpc
from binbatch_operator.builders import INJECTED_ANNOTATION, POLICY_LABEL, SIDECAR_CONTAINER
from binbatch_operator.crd import GROUP, KIND, PLURAL, VERSION

from .chaos_load import percentile
from .chaos_processes import free_port

POLICIES_PER_NAMESPACE = 100
PEERING = "binbatch"  # the chart's peering, and so its Lease's name (in binbatch-system)
OPERATOR_USER_AGENT_PREFIXES = ("kopf/", "OpenAPI-Generator/")  # kopf's own client and the kubernetes client's


@dataclass(frozen=True)
class FleetConfig:
    policies: tuple[int, ...] = (100, 1000)
    pods_per_policy: int = 5
    idle_seconds: float = 120.0
    stats_interval: float = 15.0
    spec_changes: int = 50
    admission_rate: float = 20.0  # pod CREATEs a second
    admission_seconds: float = 15.0
    kubeconfig: str | None = None  # None: kmock in this process
    operator_kubeconfig: str | None = None  # None: the same as the bench's
    audit_log: str | None = None  # the real API server's, to count the operator's requests
    operator_user: str = "system:serviceaccount:binbatch-system:binbatch"
    failover_kills: int = 0  # > 0: measure failover instead (replicas with peering, the leader killed this often)
    failover_settle_seconds: float = 30.0  # a new follower runs this long before the leader is killed


def quick() -> FleetConfig:
    """The seconds-long version (the test suite's)."""
    return FleetConfig(policies=(4,), pods_per_policy=2, idle_seconds=3.0, stats_interval=0.5, spec_changes=4,
                       admission_seconds=1.0, failover_settle_seconds=3.0)  # fmt: skip


# -- the API server ------------------------------------------------------------------


def kmock_emulator(history: int | None = None) -> Any:
    """kmock with the resources the operator uses, and two things a real API server does that kopf relies on.

    Each created object gets a uid and a resourceVersion (kopf keys its indexes
    by namespace, name and uid, so without one a ConfigMap and a Service of one
    name collide; kopf's JSON patches test the resourceVersion).  A create that
    a test's reaction refuses leaves nothing behind (kmock stores it before the
    reaction answers; the watch then says it is gone), so the operator's watch
    never shows an object the server refused.

    kmock matches each request against every request it has logged, so a fleet's
    thousands of requests slow it quadratically: with ``history`` it forgets
    those served once it logged that many (the bench's; tests keep all, to
    inspect them).  ``operator_requests`` counts the requests of the operator's
    two clients either way.
    """
    import kmock

    class Emulator(kmock.KubernetesEmulator):  # type: ignore[misc]
        operator_requests = 0
        serving: list[Any] = []  # noqa: RUF012 - one emulator per call

        async def _handle(self, request: Any) -> Any:
            if request.headers.get("User-Agent", "").startswith(OPERATOR_USER_AGENT_PREFIXES):
                self.operator_requests += 1
            self.serving.append(request)
            try:
                if history is not None and len(self._requests) > history:  # kmock's log: keep what is in flight
                    self._requests[:] = [r for r in self._requests if any(r is f for f in self.serving)]
                return await self._serve(request)
            finally:
                del self.serving[next(i for i, r in enumerate(self.serving) if r is request)]

        async def _serve(self, request: Any) -> Any:
            creating = request.action == kmock.action.CREATE and isinstance(request.data, dict)
            if creating:
                meta = request.data.setdefault("metadata", {})
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("resourceVersion", "1")
            response = await super()._handle(request)
            if creating and response.status >= 400 and response.status != 409:
                key = (request.resource, request.namespace or meta.get("namespace"), meta.get("name"))
                async with self._lock:  # kmock's own store and event bus (no public way to undo a create)
                    stored = self._objects[key] if key in self._objects else None
                    if stored is not None and not stored.deleted:
                        stored.delete()
                        await self._buses[request.resource].put({"type": "DELETED", "object": stored.last.raw})
            return response

    api = Emulator()
    verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
    for key, kind, namespaced, sub in [
        (f"{GROUP}/{VERSION}/{PLURAL}", KIND, True, {"status"}),
        ("v1/pods", "Pod", True, set()), ("v1/configmaps", "ConfigMap", True, set()),
        ("v1/services", "Service", True, set()), ("v1/events", "Event", True, set()),
        ("v1/namespaces", "Namespace", False, set()),
        ("apps/v1/deployments", "Deployment", True, set()), ("apps/v1/replicasets", "ReplicaSet", True, set()),
        ("admissionregistration.k8s.io/v1/mutatingwebhookconfigurations", "MutatingWebhookConfiguration", False, set()),
        ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False, set()),
        ("v1/secrets", "Secret", True, set()),
        ("kopf.dev/v1/clusterkopfpeerings", "ClusterKopfPeering", False, set()),
        ("coordination.k8s.io/v1/leases", "Lease", True, set()),
        ("networking.k8s.io/v1/networkpolicies", "NetworkPolicy", True, set()),
    ]:  # fmt: skip
        api.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, subresources=sub, verbs=verbs)
    return api


class Api:
    """The few HTTP calls the bench makes, against kmock or a real API server (its kubeconfig's credentials)."""

    def __init__(self, kubeconfig: str) -> None:
        cfg = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        self.base = cfg.host.rstrip("/")
        self.headers = {"Authorization": cfg.api_key["authorization"]} if cfg.api_key.get("authorization") else {}
        self.ssl: ssl.SSLContext | bool = False
        if self.base.startswith("https"):
            self.ssl = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
            if cfg.cert_file:
                self.ssl.load_cert_chain(cfg.cert_file, cfg.key_file)
        self.http = aiohttp.ClientSession(headers=self.headers, connector=aiohttp.TCPConnector(limit=32, ssl=self.ssl))

    async def close(self) -> None:
        await self.http.close()

    async def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body)
        async with self.http.request(method, self.base + path, data=data, headers={"Content-Type": content_type}) as resp:
            text = await resp.text()
            if resp.status >= 400 and not (method == "POST" and resp.status == 409):
                raise RuntimeError(f"{method} {path}: {resp.status} {text[:300]}")
            return json.loads(text) if text else None

    async def patch(self, path: str, body: Any) -> Any:
        return await self.call("PATCH", path, body, "application/merge-patch+json")

    async def watch(self, path: str) -> AsyncIterator[dict[str, Any]]:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        async with self.http.get(self.base + path, params={"watch": "true"}, timeout=timeout) as resp:
            async for line in resp.content:
                if line.strip():
                    yield json.loads(line)


def kubeconfig_for(url: str, folder: Path) -> str:
    path = folder / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "bench",
        "clusters": [{"name": "bench", "cluster": {"server": url}}],
        "users": [{"name": "bench", "user": {"token": "bench"}}],
        "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "bench"}}],
    }))  # fmt: skip
    return str(path)


# -- the fleet -----------------------------------------------------------------------


def namespaces(policies: int) -> list[str]:
    return [f"bench-fleet-{i}" for i in range((policies + POLICIES_PER_NAMESPACE - 1) // POLICIES_PER_NAMESPACE)]


def policy_doc(index: int, namespace: str, grpc_port: int, boundary: int = 256) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": f"p{index}", "namespace": namespace},
        "spec": {"selector": {"matchLabels": {"app": f"p{index}"}}, "sidecar": {"grpcPort": grpc_port},
                 "bins": {"mode": "Fixed", "count": 2, "boundaries": [boundary]}},
    }  # fmt: skip


def pod_doc(index: int, replica: int, namespace: str) -> dict[str, Any]:
    """A pod as the webhook leaves it (label, annotation, sidecar container), Running on 127.0.0.1."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"p{index}-{replica}", "namespace": namespace,
                     "labels": {"app": f"p{index}", POLICY_LABEL: f"p{index}"},
                     "annotations": {INJECTED_ANNOTATION: f"p{index}@1"}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"},
                                {"name": SIDECAR_CONTAINER, "image": "ghcr.io/binbatch/binbatch:0.1.0"}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]},
    }  # fmt: skip


async def bounded(calls: list[Callable[[], Any]], limit: int = 16) -> None:
    slots = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Any]) -> None:
        async with slots:
            await call()

    await asyncio.gather(*(one(c) for c in calls))


async def make_fleet(api: Api, policies: int, pods_per_policy: int, grpc_port: int, real: bool) -> list[tuple[str, str]]:
    """Namespaces, policies and their Running pods; returns (namespace, policy) pairs.

    The namespaces are not opted in to injection: the pods are made injected already, and
    the admission measure posts its reviews to the webhook itself."""
    spaces = namespaces(policies)
    for ns in spaces if real else ():  # kmock serves no namespaces (nor needs them)
        await api.call("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        await until_exists(api, f"/api/v1/namespaces/{ns}/serviceaccounts/default")  # pods are refused before it
    where = [(spaces[i // POLICIES_PER_NAMESPACE], f"p{i}") for i in range(policies)]
    base = f"/apis/{GROUP}/{VERSION}/namespaces"
    await bounded([lambda i=i, ns=ns: api.call("POST", f"{base}/{ns}/{PLURAL}", policy_doc(i, ns, grpc_port))
                   for i, (ns, _) in enumerate(where)])  # fmt: skip

    async def pod(i: int, r: int, ns: str) -> None:
        doc = pod_doc(i, r, ns)
        await api.call("POST", f"/api/v1/namespaces/{ns}/pods", doc)
        if real:  # the API server drops status on create; kubelet would set it
            await api.patch(f"/api/v1/namespaces/{ns}/pods/{doc['metadata']['name']}/status", {"status": doc["status"]})

    await bounded([lambda i=i, r=r, ns=ns: pod(i, r, ns) for i, (ns, _) in enumerate(where) for r in range(pods_per_policy)])
    return where


async def until_exists(api: Api, path: str, timeout: float = 60.0) -> None:
    start = time.monotonic()
    while True:
        try:
            await api.call("GET", path)
            return
        except RuntimeError:
            if time.monotonic() - start > timeout:
                raise
            await asyncio.sleep(0.5)  # ok-sleep: waiting for a controller, bounded


async def remove_fleet(api: Api, policies: int, timeout: float = 600.0) -> None:
    """Delete the namespaces (the operator still runs, to release its finalizers) and wait until they are gone."""
    spaces = namespaces(policies)
    for ns in spaces:
        await api.call("DELETE", f"/api/v1/namespaces/{ns}")
    start = time.monotonic()
    while set(spaces) & {n["metadata"]["name"] for n in (await api.call("GET", "/api/v1/namespaces"))["items"]}:
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"namespaces {spaces} not gone after {timeout:.0f} s")
        await asyncio.sleep(2.0)  # ok-sleep: waiting for the namespace controller, bounded


# -- the fake sidecar and the operator -----------------------------------------------


class FakeSidecar(pb_grpc.AdminServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.calls = 0

    async def GetStats(self, request: pb.GetStatsRequest, context: Any) -> pb.Stats:  # noqa: N802 - gRPC's name
        self.calls += 1
        return pb.Stats(target_batch_size=16, bin_boundaries=[256.0])


@contextlib.asynccontextmanager
async def fake_sidecar() -> AsyncIterator[tuple[FakeSidecar, int]]:
    server = grpc.aio.server()
    servicer = FakeSidecar()
    pb_grpc.add_AdminServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, port
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def running_operator(kubeconfig: str, webhook_port: int, stats_interval: float, folder: Path,
                           replica: str | None = None) -> AsyncIterator[Any]:  # fmt: skip
    """The operator as the chart starts it (the built-in certificate), as a process: the only replica
    (``--standalone``), or with ``replica`` one of several (``--peering``, that POD_ID)."""
    import psutil

    env = {**os.environ, "KUBECONFIG": kubeconfig, "HOME": str(folder), "POD_NAMESPACE": "binbatch-system",
           "POD_ID": replica or "operator",
           "BINBATCH_WEBHOOK_SERVICE": "binbatch-webhook", "BINBATCH_WEBHOOK_ADDRESS": "127.0.0.1",
           "BINBATCH_WEBHOOK_PORT": str(webhook_port), "BINBATCH_WEBHOOK_HOSTNAMES": "127.0.0.1",
           "BINBATCH_STATS_INTERVAL_SECONDS": str(stats_interval)}  # fmt: skip
    for name in ("BINBATCH_WEBHOOK_CONFIG", "BINBATCH_WEBHOOK_CERT_SECRET"):
        env.pop(name, None)
    kopf = str(Path(sys.executable).with_name("kopf"))
    log = open(folder / f"{replica or 'operator'}.log", "wb")  # noqa: SIM115 - closed below
    peering = f"--peering={PEERING}" if replica else "--standalone"
    proc = await asyncio.create_subprocess_exec(kopf, "run", "-m", "binbatch_operator.main", "--all-namespaces",
                                                peering, "--log-format=json", cwd=folder, env=env,
                                                stdout=log, stderr=log)  # fmt: skip
    try:
        yield psutil.Process(proc.pid)
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # killed by the failover measure
                proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 60)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()


# -- the measures --------------------------------------------------------------------


async def statuses(api: Api, where: list[tuple[str, str]]) -> dict[tuple[str, str], dict[str, Any]]:
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for ns in sorted({ns for ns, _ in where}):
        for item in (await api.call("GET", f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}"))["items"]:
            found[(ns, item["metadata"]["name"])] = item.get("status") or {}
    return found


async def until_ready(api: Api, where: list[tuple[str, str]], timeout: float, say: Callable[[str], None]) -> float:
    """Seconds until every policy says Ready=True (polled every 2 s)."""
    start = time.monotonic()
    while True:
        found = await statuses(api, where)
        ready = sum(any(c.get("type") == "Ready" and c.get("status") == "True" for c in s.get("conditions") or [])
                    for s in found.values())  # fmt: skip
        if ready == len(where):
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"only {ready} of {len(where)} policies Ready after {timeout:.0f} s")
        say(f"{ready}/{len(where)} policies Ready")
        await asyncio.sleep(2.0)  # ok-sleep: polling a cluster, bounded by the timeout


class RequestCount:
    """The operator's API requests between two moments: kmock's request log, or the audit log."""

    def __init__(self, cfg: FleetConfig, kmock_api: Any) -> None:
        self.cfg, self.kmock = cfg, kmock_api
        self.source = "kmock requests" if kmock_api is not None else ("audit log" if cfg.audit_log else None)

    def mark(self) -> Any:
        if self.kmock is not None:
            return self.kmock.operator_requests
        return os.path.getsize(self.cfg.audit_log) if self.cfg.audit_log else None

    def since(self, mark: Any) -> int | None:
        if self.kmock is not None:
            return int(self.kmock.operator_requests - mark)
        if not self.cfg.audit_log:
            return None
        ids = set()
        with open(self.cfg.audit_log, "rb") as log:
            log.seek(mark)
            for line in log:
                event = json.loads(line)
                if (event.get("user") or {}).get("username") == self.cfg.operator_user:
                    ids.add(event["auditID"])  # one per request (a watch logs two stages)
        return len(ids)


async def settle(count: RequestCount, quiet: float, tries: int = 20) -> float:
    """Seconds until the operator sent nothing for ``quiet`` seconds (the first statuses are written once)."""
    start = time.monotonic()
    for _ in range(tries):
        mark = count.mark()
        await asyncio.sleep(quiet)  # ok-sleep: a window in which the operator should send nothing
        if not count.since(mark):
            break
    return time.monotonic() - start


async def idle_window(cfg: FleetConfig, count: RequestCount, proc: Any, sidecar: FakeSidecar, policies: int, pods: int) -> dict[str, Any]:
    mark, calls = count.mark(), sidecar.calls
    cpu0, start = proc.cpu_times(), time.monotonic()
    await asyncio.sleep(cfg.idle_seconds)  # ok-sleep: the idle window being measured
    elapsed, cpu1 = time.monotonic() - start, proc.cpu_times()
    requests = count.since(mark)
    minutes = elapsed / 60
    return {
        "idle_window_seconds": round(elapsed, 1),
        "idle_requests": requests,
        "idle_requests_counted_from": count.source,
        "idle_requests_per_policy_minute": None if requests is None else round(requests / policies / minutes, 4),
        "operator_cpu_percent_idle": round(100 * (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / elapsed, 2),
        "operator_rss_bytes": proc.memory_info().rss,
        "stats_calls_per_pod_minute": round((sidecar.calls - calls) / pods / minutes, 3),
    }


async def spec_changes(api: Api, where: list[tuple[str, str]], changes: int, grpc_port: int) -> dict[str, Any]:
    """One policy's spec at a time (each a new boundary), until its ConfigMap carries it: seconds."""
    seen: dict[tuple[str, str], tuple[str, asyncio.Event]] = {}

    async def follow(ns: str) -> None:
        async for event in api.watch(f"/api/v1/namespaces/{ns}/configmaps"):
            meta = event["object"]["metadata"]
            wanted = seen.get((ns, meta["name"]))
            if wanted and wanted[0] in ((event["object"].get("data") or {}).get("sidecar.yaml") or ""):
                wanted[1].set()

    picked = [where[(i * 7919) % len(where)] for i in range(changes)]
    watchers = [asyncio.create_task(follow(ns)) for ns in sorted({ns for ns, _ in picked})]
    latencies = []
    try:
        for i, (ns, name) in enumerate(picked):
            boundary = 1000 + i
            done = asyncio.Event()
            seen[(ns, f"{name}-binbatch")] = (f"- {boundary}\n", done)
            start = time.monotonic()
            await api.patch(f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}/{name}",
                            {"spec": {"bins": {"boundaries": [boundary]}}})
            await asyncio.wait_for(done.wait(), 120)
            latencies.append(time.monotonic() - start)
    finally:
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
    return {"p50": round(percentile(latencies, 0.5), 3), "p99": round(percentile(latencies, 0.99), 3),
            "n": len(latencies)}  # fmt: skip


async def admissions(webhook_port: int, namespace: str, rate: float, seconds: float) -> dict[str, Any]:
    """AdmissionReviews for pod CREATEs (a selected pod) posted at ``rate`` a second: seconds to each answer."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "p0-", "labels": {"app": "p0"}},
           "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]}}  # fmt: skip
    latencies: list[float] = []
    failures = 0
    tls = ssl.create_default_context()
    tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE  # the operator's own self-signed certificate
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as http:

        async def one(i: int) -> None:
            nonlocal failures
            review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                      "request": {"uid": f"bench-{i}", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                                  "resource": {"group": "", "version": "v1", "resource": "pods"},
                                  "namespace": namespace, "operation": "CREATE", "object": pod, "dryRun": False,
                                  "userInfo": {"username": "bench"}}}  # fmt: skip
            start = time.monotonic()
            async with http.post(f"https://127.0.0.1:{webhook_port}/inject-sidecar", json=review) as resp:
                answer = await resp.json()
            latencies.append(time.monotonic() - start)
            failures += not (answer.get("response") or {}).get("patch")

        tasks, start = [], time.monotonic()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))  # ok-sleep: the arrival schedule
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return {"p50": round(percentile(latencies, 0.5), 4), "p99": round(percentile(latencies, 0.99), 4),
            "n": len(latencies), "not_injected": failures, "rate_per_second": rate}  # fmt: skip


async def until_webhook(port: int, timeout: float = 120.0) -> None:
    start = time.monotonic()
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"the operator's webhook never listened on 127.0.0.1:{port}") from None
            await asyncio.sleep(0.2)  # ok-sleep: waiting for a process to listen, bounded


@dataclass
class Fleet:
    """A fleet made for one measure: the bench's API client and the operator's kubeconfig, where the policies are."""

    api: Api
    kubeconfig: str
    kmock_api: Any  # None on a real API server
    sidecar: FakeSidecar
    grpc_port: int
    where: list[tuple[str, str]]
    made_seconds: float


async def made_fleet(stack: contextlib.AsyncExitStack, cfg: FleetConfig, policies: int, folder: Path,
                     say: Callable[[str], None]) -> Fleet:  # fmt: skip
    """The API server (kmock, or cfg's), the fake sidecar and the fleet.  ``stack`` closes the first two;
    on a real server the caller removes the fleet (``remove_fleet``) while an operator still runs."""
    kmock_api = None
    if cfg.kubeconfig is None:
        import kmock

        kmock_api = kmock_emulator(history=0)
        await stack.enter_async_context(kmock_api)
        await stack.enter_async_context(kmock.Server(kmock_api))
        bench_config = kubeconfig_for(str(kmock_api.url).rstrip("/"), folder)
    else:
        bench_config = cfg.kubeconfig
    api = Api(bench_config)
    stack.push_async_callback(api.close)
    sidecar, grpc_port = await stack.enter_async_context(fake_sidecar())
    say(f"{policies} policies, {policies * cfg.pods_per_policy} pods: making them")
    started = time.monotonic()
    where = await make_fleet(api, policies, cfg.pods_per_policy, grpc_port, real=kmock_api is None)
    made = time.monotonic() - started
    return Fleet(api, cfg.operator_kubeconfig or bench_config, kmock_api, sidecar, grpc_port, where, made)


async def one_fleet(cfg: FleetConfig, policies: int, say: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="binbatch-fleet-") as tmp:
        folder = Path(tmp)
        async with contextlib.AsyncExitStack() as stack:
            fleet = await made_fleet(stack, cfg, policies, folder, say)
            api, where, pods = fleet.api, fleet.where, policies * cfg.pods_per_policy
            webhook_port = free_port()
            proc = await stack.enter_async_context(
                running_operator(fleet.kubeconfig, webhook_port, cfg.stats_interval, folder))
            if fleet.kmock_api is None:  # a real server keeps them: removed while the operator still runs
                stack.push_async_callback(remove_fleet, api, policies)
            ready = await until_ready(api, where, timeout=max(300.0, policies * 1.0), say=say)
            count = RequestCount(cfg, fleet.kmock_api)
            settled = await settle(count, 2 * cfg.stats_interval)
            say(f"all Ready after {ready:.1f} s, quiet after {settled:.0f} s more; idle window of {cfg.idle_seconds:.0f} s")
            idle = await idle_window(cfg, count, proc, fleet.sidecar, policies, pods)
            say(f"{cfg.spec_changes} spec changes")
            changes = await spec_changes(api, where, cfg.spec_changes, fleet.grpc_port)
            await until_webhook(webhook_port)
            say(f"admission at {cfg.admission_rate:g}/s for {cfg.admission_seconds:g} s")
            admission = await admissions(webhook_port, where[0][0], cfg.admission_rate, cfg.admission_seconds)
            return {"policies": policies, "pods": pods, "api_server": "kmock" if fleet.kmock_api is not None else "real",
                    "made_seconds": round(fleet.made_seconds, 1), "ready_seconds": round(ready, 1), **idle,
                    "spec_to_configmap_seconds": changes, "admission_seconds": admission,
                    "stats_interval_seconds": cfg.stats_interval}  # fmt: skip


async def one_failover(cfg: FleetConfig, policies: int, say: Callable[[str], None]) -> dict[str, Any]:
    """Replicas with peering: ``cfg.failover_kills`` times a new follower starts, runs a while, and the leader is
    killed (SIGKILL) with one policy's spec changed right after; until its ConfigMap carries the change."""
    with tempfile.TemporaryDirectory(prefix="binbatch-fleet-") as tmp:
        folder = Path(tmp)
        async with contextlib.AsyncExitStack() as stack:
            fleet = await made_fleet(stack, cfg, policies, folder, say)
            api, where = fleet.api, fleet.where

            replicas = await stack.enter_async_context(contextlib.AsyncExitStack())
            if fleet.kmock_api is None:  # a real server keeps them: removed while the last leader still runs
                stack.push_async_callback(remove_fleet, api, policies)

            async def replica(index: int) -> Any:
                return await replicas.enter_async_context(
                    running_operator(fleet.kubeconfig, free_port(), cfg.stats_interval, folder, replica=f"op-{index}"))

            leader = await replica(0)
            running, gone = [leader], set()  # replicas not killed; those of them that exited on their own
            ready = await until_ready(api, where, timeout=max(300.0, policies * 1.0), say=say)
            kills = []
            for index in range(1, cfg.failover_kills + 1):
                follower = await replica(index)
                running.append(follower)
                say(f"kill {index}: follower op-{index} started; the leader is killed in {cfg.failover_settle_seconds:g} s")
                await asyncio.sleep(cfg.failover_settle_seconds)  # ok-sleep: the follower's watches list the fleet
                ns, name = where[(index * 37) % len(where)]
                path = f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}/{name}"
                boundary = (await api.call("GET", path))["spec"]["bins"]["boundaries"][0] + 1  # new even on a kept fleet
                gone |= {p for p in running if exited(p)}
                if not exited(leader):
                    leader.kill()
                killed = time.time()
                running.remove(leader)
                await api.patch(path, {"spec": {"bins": {"boundaries": [boundary]}}})
                configmap = await until_configmap(api, ns, name, f"- {boundary}\n")
                lease = await api.call("GET", f"/apis/coordination.k8s.io/v1/namespaces/binbatch-system/leases/{PEERING}")
                if lease["spec"]["holderIdentity"] == f"op-{index - 1}":
                    raise RuntimeError(f"the ConfigMap of {ns}/{name} changed while the killed op-{index - 1} held the Lease")
                gone |= {p for p in running if exited(p)}
                kills.append({"killed": killed, "configmap": configmap, "lease_acquired": lease["spec"]["acquireTime"],
                              "holder": lease["spec"]["holderIdentity"], "self_exits": len(gone)})  # fmt: skip
                say(json.dumps(failover_figures(kills[-1:])))
                leader = follower
            return {"policies": policies, "pods": policies * cfg.pods_per_policy,
                    "api_server": "kmock" if fleet.kmock_api is not None else "real",
                    "ready_seconds": round(ready, 1), "failover": failover_figures(kills)}  # fmt: skip


async def until_configmap(api: Api, namespace: str, policy: str, text: str, timeout: float = 120.0) -> float:
    """The time (time.time()) at which the policy's ConfigMap carries ``text``, polled every 0.1 s."""
    start = time.monotonic()
    while True:
        found = await api.call("GET", f"/api/v1/namespaces/{namespace}/configmaps/{policy}-binbatch")
        if text in ((found or {}).get("data") or {}).get("sidecar.yaml", ""):
            return time.time()
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"the ConfigMap of {namespace}/{policy} lacks {text!r} after {timeout:.0f} s")
        await asyncio.sleep(0.1)  # ok-sleep: polling a cluster, bounded by the timeout


def exited(proc: Any) -> bool:
    """Whether an operator process (psutil's) ended, e.g. a leader that could not renew its Lease."""
    import psutil

    try:
        return bool(proc.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def failover_figures(kills: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kill, seconds from the kill (``killed``, time.time()) to the Lease's new ``acquireTime`` and to the
    changed ConfigMap, and how many replicas had exited on their own by then; the worst of each."""
    rows = [{"kill_to_lease_s": round(datetime.datetime.fromisoformat(k["lease_acquired"]).timestamp() - k["killed"], 2),
             "kill_to_configmap_s": round(k["configmap"] - k["killed"], 2), "holder": k["holder"],
             "self_exits": k["self_exits"]} for k in kills]  # fmt: skip
    return {"kills": rows, "kill_to_lease_max_s": max((r["kill_to_lease_s"] for r in rows), default=None),
            "kill_to_configmap_max_s": max((r["kill_to_configmap_s"] for r in rows), default=None),
            "self_exits": max((r["self_exits"] for r in rows), default=0)}  # fmt: skip


def run(cfg: FleetConfig, say: Callable[[str], None]) -> dict[str, Any]:
    runs = []
    for n in cfg.policies:
        runs.append(asyncio.run((one_failover if cfg.failover_kills else one_fleet)(cfg, n, say)))
        say(json.dumps(runs[-1]))  # each size's figures as soon as it is done
    return {"runs": runs}


def print_table(doc: dict[str, Any]) -> None:
    if any("failover" in r for r in doc["runs"]):
        print_failover_table(doc)
        return
    rows = [("policies", "pods", "API server", "idle req/policy/min", "counted from", "spec→CM p50 s", "spec→CM p99 s",
             "admission p50 ms", "admission p99 ms", "RSS MiB", "CPU % idle", "GetStats/pod/min")]
    for r in doc["runs"]:
        rows.append((str(r["policies"]), str(r["pods"]), r["api_server"], str(r["idle_requests_per_policy_minute"]),
                     str(r["idle_requests_counted_from"]), f"{r['spec_to_configmap_seconds']['p50']:.2f}",
                     f"{r['spec_to_configmap_seconds']['p99']:.2f}", f"{1e3 * r['admission_seconds']['p50']:.1f}",
                     f"{1e3 * r['admission_seconds']['p99']:.1f}", f"{r['operator_rss_bytes'] / 2**20:.0f}",
                     f"{r['operator_cpu_percent_idle']:.1f}", f"{r['stats_calls_per_pod_minute']:.2f}"))  # fmt: skip
    print_rows(rows)


def print_failover_table(doc: dict[str, Any]) -> None:
    rows = [("policies", "pods", "API server", "kill", "kill→Lease s", "kill→ConfigMap s", "new leader", "self-exits")]
    for r in doc["runs"]:
        for i, k in enumerate(r["failover"]["kills"], 1):
            rows.append((str(r["policies"]), str(r["pods"]), r["api_server"], str(i), f"{k['kill_to_lease_s']:.2f}",
                         f"{k['kill_to_configmap_s']:.2f}", k["holder"], str(k["self_exits"])))  # fmt: skip
    print_rows(rows)


def print_rows(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))

