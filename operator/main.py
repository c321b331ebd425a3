"""The binbatch operator: ``kopf run -m binbatch_operator.main --all-namespaces``.

Wiring only; the logic is in ``reconcile.py`` (policies), ``webhook.py`` (the
admission server) and ``builders.py`` (the objects).  Settings come from the
environment the Helm chart sets:

  BINBATCH_SIDECAR_IMAGE           image of injected sidecars (a policy may override it)
  BINBATCH_SIDECAR_NATIVE          "true": inject a native sidecar (init container, restartPolicy Always)
  BINBATCH_WEBHOOK_SERVICE         the webhook's Service; unset = no admission webhook
  BINBATCH_WEBHOOK_ADDRESS         address the webhook listens on (default 0.0.0.0)
  BINBATCH_WEBHOOK_PORT            port the webhook listens on (default 9443)
  BINBATCH_WEBHOOK_HOSTNAMES       comma-separated names for the certificate (default: the Service's)
  BINBATCH_WEBHOOK_CERT_SECRET     built-in certificate: the Secret all replicas share (unset: one per start)
  BINBATCH_WEBHOOK_CONFIG          the install's MutatingWebhookConfiguration: its namespaceSelector tells a policy
                                   whether its namespace is opted in; the built-in certificate's CA goes into it
  BINBATCH_WEBHOOK_CERT_DIR        cert-manager: the mounted Secret (tls.crt, tls.key, ca.crt); no CA patching
  POD_NAMESPACE                    the operator's namespace (the Service's)
  BINBATCH_STATS_INTERVAL_SECONDS  how often status is refreshed from the sidecars (default 15)

With ``kopf run --peering=NAME`` (the chart, replicas > 1) one replica handles
the policies and the others stay paused, while every replica serves the webhook.
A paused kopf stops all its watch streams, so its ``policies`` index would go
stale; the webhook therefore reads the pod's namespace's policies from the API
on every replica when peering is on (one namespaced list per pod CREATE in an
opted-in namespace), and from the index when standalone.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import kopf

from .crd import GROUP, PLURAL, VERSION
from .kube import KubeApi
from .builders import as_native_sidecar
from .reconcile import Context, admit, candidate, cleanup, deleting, reconcile
from .status import changed_fields
from .webhook import WEBHOOK_PATH_ID, WebhookServer, service_hostnames, shared_certificate

DEFAULT_IMAGE = "ghcr.io/binbatch/binbatch:0.1.0"
STATS_INTERVAL = float(os.environ.get("BINBATCH_STATS_INTERVAL_SECONDS", "15"))
MAX_RETRY_DELAY = 300.0  # seconds: a failing policy is retried at least every 5 minutes
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

    if not settings.peering.standalone:
        # Equal priorities would pause every replica; the newest pod leads (a rollout hands over).
        settings.peering.priority = peering_priority()
    kube = KubeApi.from_environment()
    if not settings.peering.standalone and settings.peering.name:
        if await kube.ensure_cluster_peering(settings.peering.name):
            logger.info("created ClusterKopfPeering %s", settings.peering.name)
    memo.ctx = Context(kube=kube, sidecar_image=os.environ.get("BINBATCH_SIDECAR_IMAGE") or DEFAULT_IMAGE,
                       webhook_config=os.environ.get("BINBATCH_WEBHOOK_CONFIG", ""))
    memo.native_sidecar = os.environ.get("BINBATCH_SIDECAR_NATIVE", "false").lower() == "true"

    service = os.environ.get("BINBATCH_WEBHOOK_SERVICE")
    if not service:
        logger.warning("BINBATCH_WEBHOOK_SERVICE is unset: no admission webhook, pods get no sidecar")
        return
    settings.admission.server = await webhook_server(kube, service, logger)
    settings.admission.managed = None  # the install owns the configuration (service-based)


def peering_priority() -> int:
    """A priority unique to this replica: its start time in microseconds."""
    return time.time_ns() // 1000


async def webhook_server(kube: KubeApi, service: str, logger: Any) -> WebhookServer:
    """The webhook server the environment asks for (see the module docstring)."""
    namespace = os.environ.get("POD_NAMESPACE", "default")
    config_name = os.environ.get("BINBATCH_WEBHOOK_CONFIG", "")
    extra = [h.strip() for h in os.environ.get("BINBATCH_WEBHOOK_HOSTNAMES", "").split(",") if h.strip()]
    hosts = list(dict.fromkeys(service_hostnames(service, namespace) + extra))
    listen = {"addr": os.environ.get("BINBATCH_WEBHOOK_ADDRESS") or "0.0.0.0",
              "port": int(os.environ.get("BINBATCH_WEBHOOK_PORT", "9443")), "host": hosts[0]}  # fmt: skip

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

    secret = os.environ.get("BINBATCH_WEBHOOK_CERT_SECRET")
    if not secret:  # a fresh self-signed certificate for this start only (one replica)
        return WebhookServer(**listen, extra_sans=hosts[1:], on_ca=publish_ca)
    cert_pem, key_pem = await shared_certificate(kube, secret, namespace, hosts)
    folder = Path(tempfile.mkdtemp(prefix="binbatch-webhook-"))
    (folder / "tls.crt").write_bytes(cert_pem)
    key_file = folder / "tls.key"
    key_file.touch(mode=0o600)
    key_file.write_bytes(key_pem)
    logger.info("serving the webhook certificate of Secret %s/%s", namespace, secret)
    return WebhookServer(**listen, certfile=folder / "tls.crt", pkeyfile=key_file, on_ca=publish_ca)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    if "ctx" in memo:
        memo.ctx.kube.close()


def _not_deleting(meta: kopf.Meta, **_: Any) -> bool:
    return not deleting(meta)


# A policy being deleted leaves the index at once (kopf drops an object's entry
# when the filter stops matching): the rollout restart its deletion starts must
# bring pods back without its sidecar.
@kopf.index(*POLICY, when=_not_deleting)
def policies(namespace: str, body: kopf.Body, **_: Any) -> dict[str, Any]:
    """Policies by namespace, for the conflict check of ``reconcile`` (which runs where the watch is live)."""
    return {namespace: candidate(body)}


def retry_delay(retry: int) -> float:
    """Backoff for a reconcile whose API calls failed: the status interval, doubling, capped."""
    return float(min(MAX_RETRY_DELAY, STATS_INTERVAL * 2 ** min(retry, 16)))


@kopf.on.resume(*POLICY)
@kopf.on.create(*POLICY)
@kopf.on.update(*POLICY, field="spec")
@kopf.timer(*POLICY, interval=STATS_INTERVAL, initial_delay=STATS_INTERVAL)
async def reconcile_policy(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, policies: kopf.Index, retry: int, logger: Any, **_: Any
) -> None:
    """Writes only the status fields that changed (an idle policy's status is not patched);
    API failures are in that status and the handler is retried with backoff."""
    others = list(policies.get(body["metadata"]["namespace"], []))
    outcome = await reconcile(memo.ctx, body, others, logger)
    for key, value in changed_fields(body.get("status") or {}, outcome.status).items():
        patch.status[key] = value
    if outcome.failures:
        raise kopf.TemporaryError("; ".join(str(f) for f in outcome.failures), delay=retry_delay(retry))


@kopf.on.delete(*POLICY)
async def delete_policy(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    restarted = await cleanup(memo.ctx, body, logger)
    if restarted:
        logger.info("restarted %s so their pods come back without the sidecar", ", ".join(restarted))


@kopf.on.mutate("v1", "pods", id=WEBHOOK_PATH_ID, operations=["CREATE"], ignore_failures=True, side_effects=False)
async def inject_sidecar(
    body: kopf.Body, patch: kopf.Patch, warnings: list[str], memo: kopf.Memo, logger: Any, **_: Any
) -> None:
    """Decides from the namespace's policies as the API server has them now, not from the
    index: every replica serves the webhook, but kopf pauses the watch streams of the
    replicas that do not hold the lead (peering), so their index is empty or frozen (a
    frozen one would still hold a deleted policy).  One namespaced list per pod CREATE.

    Fails open: kopf would answer an exception with allowed=false and so block the
    pod, which failurePolicy Ignore does not cover; a pod without a sidecar is better."""
    try:
        namespace = body.get("metadata", {}).get("namespace")
        candidates = [candidate(p) for p in await memo.ctx.kube.list_policies(namespace)]
        merge, notes = admit(dict(body), candidates, memo.ctx.sidecar_image)
        if memo.get("native_sidecar"):
            merge = as_native_sidecar(merge, body)
    except Exception as exc:  # noqa: BLE001
        logger.exception("sidecar injection failed; the pod is admitted without it")
        warnings.append(f"binbatch: sidecar injection failed ({type(exc).__name__}); pod admitted without it")
        return
    patch.update(merge)
    warnings.extend(notes)

