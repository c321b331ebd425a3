"""The binbatch operator: ``kopf run -m binbatch_operator.main --all-namespaces``.

Wiring only; the logic is in ``reconcile.py`` (policies), ``webhook.py`` (the
admission server) and ``builders.py`` (the objects).  Settings come from the
environment the Helm chart sets:

  BINBATCH_SIDECAR_IMAGE           image of injected sidecars (a policy may override it; default: the
                                   binbatch image of this package's own version, DEFAULT_IMAGE)
  BINBATCH_SIDECAR_NATIVE          "true": inject a native sidecar (init container, restartPolicy Always)
  BINBATCH_WEBHOOK_SERVICE         the webhook's Service; unset = no admission webhook
  BINBATCH_WEBHOOK_ADDRESS         address the webhook listens on (default 0.0.0.0)
  BINBATCH_WEBHOOK_PORT            port the webhook listens on (default 9443)
  BINBATCH_WEBHOOK_HOSTNAMES       comma-separated names for the certificate (default: the Service's)
  BINBATCH_WEBHOOK_CERT_SECRET     built-in certificate: the Secret all replicas share (unset: one per start)
  BINBATCH_WEBHOOK_CERT_SECONDS    built-in certificate: its lifetime (default a year; renewed while running
                                   when a third of it is left)
  BINBATCH_WEBHOOK_CONFIG          the install's MutatingWebhookConfiguration: its namespaceSelector tells a policy
                                   whether its namespace is opted in; the built-in certificate's CA goes into it
  BINBATCH_WEBHOOK_CERT_DIR        cert-manager: the mounted Secret (tls.crt, tls.key, ca.crt); no CA patching
  BINBATCH_ADMIN_SIGNING_SECRET    the Secret of the operator's namespace holding its Admin signing key (Ed25519;
                                   made when absent, shared by every replica: admin_signing.py); unset: one per start
  POD_NAMESPACE                    the operator's namespace (the Service's)
  BINBATCH_ALLOWED_IMAGES          comma-separated images a policy's spec.sidecar.image may name (allowlist.py;
                                   unset: the sidecar image's repository)
  BINBATCH_ALLOW_REMOTE_URLS       "true": a policy's engine/metrics/predictor URLs may leave the pod's loopback
  BINBATCH_NETWORK_POLICY          "true" (default): a NetworkPolicy per policy limits who reaches its sidecars
  BINBATCH_NETWORK_POLICY_METRICS_FROM  JSON list of NetworkPolicyPeers that may also reach the metrics port (Prometheus)
  BINBATCH_WATCH_NAMESPACES        comma-separated: a namespaced install (kopf --namespace each); unset: every namespace
  BINBATCH_STATS_INTERVAL_SECONDS  how often each policy re-checks its pods and asks their sidecars (default 15)

The operator watches what it reads, on every replica: the policies, every pod,
and the ConfigMaps, Services and NetworkPolicies it made (a server-side label selector), into
``indexes.Watched``.  A policy's reconcile reads all of those from there, so an
idle policy makes no API request; each policy's daemon re-checks it every
interval, quietly, and writes only what differs.

With ``kopf run --peering=NAME`` (the chart, replicas > 1) one replica handles
the policies and the others stay paused, while every replica serves the webhook.
The watches are the operator's own, not kopf's, so they run on every replica,
leader or not: every replica's webhook answers from a current view of the
policies (no API request per pod CREATE), and a follower takes over with one.
The replica holding the Lease NAME in POD_NAMESPACE leads (``leadership.py``):
one that stops renewing it is replaced within about ``LEASE_DURATION`` seconds,
and a leader that cannot renew it in time exits before that.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import shutil
import random
import socket
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import kopf

from .admin_signing import AdminSigner, shared_signer
from .allowlist import Allowlist
from .builders import POLICY_LABEL, as_native_sidecar, child_name, fleet_model_name, headless_name, policy_label
from .crd import GROUP, PLURAL, VERSION
from .fleet_model import FleetModels
from .indexes import Seen, Watched
from .k8s_rules import allow_from_problems
from .kube import KubeApi
from .leadership import LeaseElector, gate_entry, holder_priority
from .reconcile import Context, Outcome, admit, candidate, cleanup, deleting, reconcile
from .sidecar_stats import SidecarStats
from .status import changed_fields
from .webhook import (
    CERT_SECONDS,
    WEBHOOK_PATH_ID,
    WebhookServer,
    self_signed_certificate,
    service_hostnames,
    shared_certificate,
)

# The image this operator was released in: the installed package's version is its tag (pyproject.toml
# is the one source; the chart's version, appVersion and the samples carry the same, checked by a test).
IMAGE_REPOSITORY = "ghcr.io/binbatch/binbatch"
DEFAULT_IMAGE = f"{IMAGE_REPOSITORY}:{metadata.version('binbatch')}"
STATS_INTERVAL = float(os.environ.get("BINBATCH_STATS_INTERVAL_SECONDS", "15"))
MAX_RETRY_DELAY = 300.0  # seconds: a failing policy is retried at least every 5 minutes
MIN_CERT_SECONDS = 30  # a renewal (a third of it) must leave room for the CA to reach the API server
WEBHOOK_WAIT_SECONDS = 5.0  # the API server calls the webhook with a 10 s timeout
POLICY = (GROUP, VERSION, PLURAL)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    # The status schema is typed (no room for kopf's bookkeeping), so kopf keeps
    # its progress and last-handled spec in annotations under our domain.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.persistence.finalizer = f"{GROUP}/cleanup"
    settings.posting.level = 30  # events for warnings and errors only (logging.WARNING)
    settings.posting.loggers = True  # handlers' log warnings/errors become Events (`kubectl describe bp`)

    kube = KubeApi.from_environment()
    memo.namespaces = namespaces = watch_namespaces()
    if not settings.peering.standalone:
        settings.peering.priority = follower_priority()
        if await kube.ensure_cluster_peering(settings.peering.name, gate_entry(), *([namespaces] if namespaces else [])):
            logger.info("created the kopf peering object %s", settings.peering.name)
        memo.elector = elector(kube, settings, logger, namespaces)
        memo.elector.start()
    image = os.environ.get("BINBATCH_SIDECAR_IMAGE") or DEFAULT_IMAGE
    signer = await admin_signer(kube, logger)
    memo.ctx = Context(kube=kube, sidecar_image=image, stats=SidecarStats(signer=signer.token),
                       stats_max_age=STATS_INTERVAL / 2, admin_signer=signer, fleet=FleetModels(signer=signer.token),
                       webhook_config=os.environ.get("BINBATCH_WEBHOOK_CONFIG", ""),
                       allowlist=Allowlist.from_environment(image),
                       network_policy=os.environ.get("BINBATCH_NETWORK_POLICY", "true").lower() == "true",
                       metrics_from=metrics_peers(os.environ.get("BINBATCH_NETWORK_POLICY_METRICS_FROM", "")))  # fmt: skip
    memo.native_sidecar = os.environ.get("BINBATCH_SIDECAR_NATIVE", "false").lower() == "true"
    # Pods, policies and our children, listed once and then watched on every replica (see indexes.py).
    memo.watched = watched = Watched(candidate, namespaces)
    kube.wrote = watched.written  # what the operator wrote is in its store before the watch brings it
    memo.informers = kube.informers(watched.replace, watched.apply, children=POLICY_LABEL,
                                    **({"namespaces": namespaces} if namespaces else {}))  # fmt: skip
    for informer in memo.informers:
        informer.start(asyncio.get_running_loop())
    service = os.environ.get("BINBATCH_WEBHOOK_SERVICE")
    if not service:
        logger.warning("BINBATCH_WEBHOOK_SERVICE is unset: no admission webhook, pods get no sidecar")
        return
    settings.admission.server = await webhook_server(kube, service, logger)
    settings.admission.managed = None  # the install owns the configuration (service-based)


async def admin_signer(kube: KubeApi, logger: Any) -> AdminSigner:
    """The operator's Admin signing key (admin_signing.py): the shared Secret's, or one of this start's own."""
    secret = os.environ.get("BINBATCH_ADMIN_SIGNING_SECRET", "")
    if not secret:
        logger.info("BINBATCH_ADMIN_SIGNING_SECRET is unset: an Admin signing key of this start's own")
        return AdminSigner.generate()
    return await shared_signer(kube, secret, os.environ.get("POD_NAMESPACE", "default"))


def metrics_peers(text: str) -> list[dict[str, Any]]:
    """``BINBATCH_NETWORK_POLICY_METRICS_FROM``: a JSON list of NetworkPolicyPeers (the chart's
    networkPolicy.metricsFrom), checked as a policy's allowFrom is; a bad one stops the start, named."""
    if not text.strip():
        return []
    try:
        peers = json.loads(text)
    except ValueError as exc:
        raise kopf.PermanentError(f"networkPolicy.metricsFrom (BINBATCH_NETWORK_POLICY_METRICS_FROM) is not JSON: {exc}") from None
    if peers == []:
        return []
    problems = allow_from_problems(peers, "networkPolicy.metricsFrom")
    if problems:
        raise kopf.PermanentError("; ".join(f"{path}: {message}" for path, message in problems))
    return [dict(p) for p in peers]


def follower_priority() -> int:
    """A kopf priority unique to this replica and below the Lease's gate (0): paused until it holds the Lease.

    Unique, since equal priorities make kopf warn of a conflict; it falls as the
    start time rises, so that kopf's log of the peers reads oldest first.
    """
    return -(time.time_ns() // 1000)


def watch_namespaces() -> list[str]:
    """BINBATCH_WATCH_NAMESPACES: the namespaces of a namespaced install (kopf runs with ``--namespace`` each;
    the chart's watchNamespaces); empty: every namespace (``--all-namespaces``)."""
    return [n.strip() for n in os.environ.get("BINBATCH_WATCH_NAMESPACES", "").split(",") if n.strip()]


def elector(kube: KubeApi, settings: kopf.OperatorSettings, logger: Any, namespaces: list[str] | None = None) -> LeaseElector:
    """This replica's candidacy for the Lease named like the peering, in POD_NAMESPACE (see leadership.py)."""
    loop, name = asyncio.get_running_loop(), settings.peering.name
    scoped = [namespaces] if namespaces else []

    def on_leading(transitions: int) -> None:
        # kopf reads its priority at each peering event; the gate's write makes one on every replica.
        settings.peering.priority = holder_priority(transitions)
        asyncio.run_coroutine_threadsafe(kube.ensure_cluster_peering(name, gate_entry(), *scoped), loop)

    def on_lost(reason: str) -> None:
        # Stop at once, whatever the event loop is doing: a follower may take the Lease soon.
        logger.error("%s: exiting so that only one replica acts (it restarts as a follower)", reason)
        _remove_folders()  # os._exit runs no atexit hook
        os._exit(1)

    identity = os.environ.get("POD_ID") or f"{socket.gethostname()}/{os.getpid()}"
    namespace = os.environ.get("POD_NAMESPACE", "default")
    return LeaseElector(kube.leases(), name, namespace, identity, on_leading, on_lost)


_FOLDERS: list[Path] = []  # written by this process, removed when it exits


def remove_at_exit(folder: Path) -> None:
    if not _FOLDERS:
        atexit.register(_remove_folders)
    _FOLDERS.append(folder)


def _remove_folders() -> None:
    while _FOLDERS:
        shutil.rmtree(_FOLDERS.pop(), ignore_errors=True)


async def webhook_server(kube: KubeApi, service: str, logger: Any) -> WebhookServer:
    """The webhook server the environment asks for (see the module docstring)."""
    namespace = os.environ.get("POD_NAMESPACE", "default")
    config_name = os.environ.get("BINBATCH_WEBHOOK_CONFIG", "")
    extra = [h.strip() for h in os.environ.get("BINBATCH_WEBHOOK_HOSTNAMES", "").split(",") if h.strip()]
    hosts = list(dict.fromkeys(service_hostnames(service, namespace) + extra))
    listen = {"addr": os.environ.get("BINBATCH_WEBHOOK_ADDRESS") or "0.0.0.0",
              "port": int(os.environ.get("BINBATCH_WEBHOOK_PORT", "9443")), "host": hosts[0]}  # fmt: skip
    # and the pod's loopback, as kopf's own self-signed certificate had it (a local API server or a test dials it)
    hosts += [h for h in ("localhost", "127.0.0.1") if h not in hosts]

    cert_dir = os.environ.get("BINBATCH_WEBHOOK_CERT_DIR")
    if cert_dir:  # cert-manager: serve its Secret; its injector owns the caBundle
        folder = Path(cert_dir)
        ca = folder / "ca.crt"
        return WebhookServer(**listen, certfile=folder / "tls.crt", pkeyfile=folder / "tls.key",
                             cafile=ca if ca.exists() else None)  # fmt: skip

    async def publish_ca(ca_pem: bytes) -> None:
        if config_name:
            await kube.set_webhook_ca_bundle(config_name, ca_pem)
            logger.info("CA bundle set on MutatingWebhookConfiguration %s", config_name)

    lifetime = cert_lifetime_seconds()
    secret = os.environ.get("BINBATCH_WEBHOOK_CERT_SECRET")

    async def renew() -> tuple[bytes, bytes]:
        if not secret:  # one replica's own certificate
            return self_signed_certificate(hosts, lifetime_seconds=lifetime)
        # The Secret's, renewed by whichever replica gets there first (the others read it).
        return await shared_certificate(kube, secret, namespace, hosts, lifetime)

    cert_pem, key_pem = await renew()
    folder = Path(tempfile.mkdtemp(prefix="binbatch-webhook-"))
    # kopf's server loads the files when it starts and watches them after: the private key
    # stays on disk while the operator runs and goes when it exits (``remove_at_exit``).
    remove_at_exit(folder)
    (folder / "tls.crt").write_bytes(cert_pem)
    key_file = folder / "tls.key"
    key_file.touch(mode=0o600)
    key_file.write_bytes(key_pem)
    if secret:
        logger.info("serving the webhook certificate of Secret %s/%s", namespace, secret)
    return WebhookServer(**listen, certfile=folder / "tls.crt", pkeyfile=key_file, on_ca=publish_ca, renew=renew)


def cert_lifetime_seconds() -> int:
    """BINBATCH_WEBHOOK_CERT_SECONDS: the built-in certificate's lifetime (renewed at a third left)."""
    raw = os.environ.get("BINBATCH_WEBHOOK_CERT_SECONDS", "").strip()
    if not raw:
        return CERT_SECONDS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < MIN_CERT_SECONDS:
        raise kopf.PermanentError(
            f"BINBATCH_WEBHOOK_CERT_SECONDS={raw!r}: a whole number of seconds, at least {MIN_CERT_SECONDS}")
    return value


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    closing(memo).set()  # policy daemons kopf spawns while it stops end too (follow_policy)
    for informer in memo.get("informers", ()):
        informer.stop()
    if "elector" in memo:
        memo.elector.stop()
    if "ctx" in memo:
        memo.ctx.fleet.close()  # fleet model rounds still running
        memo.ctx.kube.close()


def closing(memo: kopf.Memo) -> asyncio.Event:
    """Set once the operator stops.  kopf stops every policy daemon when it exits, but an event it
    was still processing may spawn one after that, which nothing would stop: the exit then waited
    5 s for it, cancelled it and failed with a TimeoutError."""
    if "closing" not in memo:
        memo.closing = asyncio.Event()
    return memo.closing


async def _rest(stopped: kopf.DaemonStopped, memo: kopf.Memo, delay: float) -> bool:
    """Wait ``delay`` seconds or until the daemon is stopped or the operator closes; True: stop.

    Not ``stopped.wait(delay)``: its time limit runs in a task of kopf's own, which a daemon
    cancelled at the operator's exit could leave finished with a TimeoutError, and kopf's exit
    re-raises what its leftover tasks raised (``kopf run`` then exits 1)."""
    ending = closing(memo)
    if not ending.is_set():
        waits = [asyncio.ensure_future(stopped.wait()), asyncio.ensure_future(ending.wait())]
        try:
            await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
    return stopped.is_set() or ending.is_set()


def _not_deleting(meta: kopf.Meta, **_: Any) -> bool:
    return not deleting(meta)


def seen(watched: Watched, body: kopf.Body) -> Seen:
    """A policy's world from the watches: its pods, its children, its namespace's policies."""
    meta, spec = body["metadata"], body.get("spec") or {}
    namespace, name = meta["namespace"], meta["name"]
    wanted = [("ConfigMap", child_name(name)), ("Service", child_name(name)), ("Service", headless_name(name)),
              ("NetworkPolicy", child_name(name)), ("ConfigMap", fleet_model_name(name))]  # fmt: skip
    match_labels = (spec.get("selector") or {}).get("matchLabels") or {}
    return Seen(watched.pods(namespace, match_labels), watched.children(namespace, wanted), watched.policies(namespace))


def retry_delay(retry: int) -> float:
    """Backoff for a reconcile whose API calls failed: the status interval, doubling, capped."""
    return float(min(MAX_RETRY_DELAY, STATS_INTERVAL * 2 ** min(retry, 16)))


async def reconcile_once(memo: kopf.Memo, body: kopf.Body, logger: Any) -> Outcome:
    """One reconcile of the policy at a time: its handlers and its daemon share a lock (its memo is its own).

    It waits for the watches' first lists (at start-up), and once the namespace is
    seen being deleted, nothing is tried again: the policy goes with it."""
    await memo.watched.synced()
    lock = memo.setdefault("reconciling", asyncio.Lock())
    async with lock:
        if memo.get("terminating"):
            return Outcome({}, terminating=True)
        outcome = await reconcile(memo.ctx, body, seen(memo.watched, body), logger)
        memo["terminating"] = outcome.terminating
        return outcome


@kopf.on.resume(*POLICY)
@kopf.on.create(*POLICY)
@kopf.on.update(*POLICY, field="spec")
async def reconcile_policy(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, retry: int, logger: Any, **_: Any) -> None:
    """Writes only the status fields that changed; API failures are in that status and the
    handler is retried with backoff.  In a namespace being deleted it does nothing."""
    outcome = await reconcile_once(memo, body, logger)
    for key, value in changed_fields(body.get("status") or {}, outcome.status).items():
        patch.status[key] = value
    if outcome.failures:
        raise kopf.TemporaryError("; ".join(str(f) for f in outcome.failures), delay=retry_delay(retry))


@kopf.daemon(*POLICY, when=_not_deleting, cancellation_backoff=1, cancellation_timeout=2)  # within kopf's 5 s at exit
async def follow_policy(stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """Re-checks the policy every STATS_INTERVAL: children against their watched copies, status
    from the watched pods and their sidecars' stats, written only where it differs.

    A daemon, not a kopf timer: a timer logs a line per tick, and 1,000 idle
    policies would fill the log.  The first check falls at a random point of
    the interval and each next one within 10% of it, so a fleet's policies (and
    their GetStats calls) spread out instead of ticking together.
    """
    delay, failing = random.uniform(0, STATS_INTERVAL), 0
    while not await _rest(stopped, memo, delay):
        # A re-check can wait behind the fleet's stats calls; deleting the policy must not wait for
        # it (kopf would cancel the daemon after a while and log that as a warning, an Event).
        checking, stopping = asyncio.ensure_future(reconcile_once(memo, body, logger)), asyncio.ensure_future(stopped.wait())
        try:
            await asyncio.wait([checking, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Cancelled here too (kopf cancels a daemon that outlives the operator's exit): leave
            # no task behind, or the exit waits for them and fails with a TimeoutError.
            stopping.cancel()
            checked = checking.done()
            if not checked:
                checking.cancel()
        if not checked:
            return
        outcome = checking.result()
        if outcome.terminating:
            return
        changed = changed_fields(body.get("status") or {}, outcome.status)
        if changed:
            await memo.ctx.kube.patch_policy_status(body["metadata"]["name"], body["metadata"]["namespace"], changed)
        failing = failing + 1 if outcome.failures else 0
        delay = retry_delay(failing - 1) if failing else STATS_INTERVAL * random.uniform(0.9, 1.1)


@kopf.on.delete(*POLICY)
async def delete_policy(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    meta = body["metadata"]
    memo.ctx.fleet.forget(meta["namespace"], meta["name"])  # its model's ConfigMap goes with it (owner reference)
    carriers = memo.watched.pods(meta["namespace"], {POLICY_LABEL: policy_label(meta["name"])})
    restarted = await cleanup(memo.ctx, body, carriers, logger)
    if restarted:
        logger.info("restarted %s so their pods come back without the sidecar", ", ".join(restarted))


@kopf.on.mutate("v1", "pods", id=WEBHOOK_PATH_ID, operations=["CREATE"], ignore_failures=True, side_effects=False)
async def inject_sidecar(
    body: kopf.Body, patch: kopf.Patch, warnings: list[str], memo: kopf.Memo, logger: Any, **_: Any
) -> None:
    """Decides from the namespace's policies as this replica's watch has them (every replica
    watches, leader or not): no API request per pod CREATE.  Until the first list of the
    policies is in (a few seconds after a start) it waits, at most WEBHOOK_WAIT_SECONDS.

    Fails open: kopf would answer an exception with allowed=false and so block the
    pod, which failurePolicy Ignore does not cover; a pod without a sidecar is better."""
    try:
        namespace = body.get("metadata", {}).get("namespace")
        await asyncio.wait_for(memo.watched.synced(["BatchingPolicy"]), WEBHOOK_WAIT_SECONDS)
        candidates = memo.watched.policies(namespace)
        merge, notes = admit(dict(body), candidates, memo.ctx.sidecar_image, memo.ctx.allowlist)
        if memo.get("native_sidecar"):
            merge = as_native_sidecar(merge, body)
    except Exception as exc:  # noqa: BLE001
        logger.exception("sidecar injection failed; the pod is admitted without it")
        warnings.append(f"binbatch: sidecar injection failed ({type(exc).__name__}); pod admitted without it")
        return
    patch.update(merge)
    warnings.extend(notes)

