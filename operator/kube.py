"""The operator's one seam to the Kubernetes API.

Everything the handlers read or write outside kopf's own object goes through
``KubeApi``, built on the official ``kubernetes`` client; its blocking calls run
in a worker thread so the operator's event loop never stalls.  Tests point it at
a fake API server over HTTP (kmock), so the requests are the real ones.

Objects go in and come out as plain dicts (the builders' currency).
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import os
from collections.abc import Mapping
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from .builders import covers, selector_matches
from .crd import GROUP, PLURAL, VERSION

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
RESTART_ANNOTATION = f"{GROUP}/restartedAt"


def api_error_message(exc: ApiException) -> str:
    """The API server's own words for a failed call (its Status ``message``), with the code."""
    try:
        message = json.loads(exc.body or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return f"{exc.status} {message or exc.reason or 'error'}"


class KubeApi:
    def __init__(self, client: kubernetes.client.ApiClient) -> None:
        self.client = client
        self.core = kubernetes.client.CoreV1Api(client)
        self.apps = kubernetes.client.AppsV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.admission = kubernetes.client.AdmissionregistrationV1Api(client)

    @classmethod
    def from_environment(cls) -> KubeApi:
        """In a pod: the service account; elsewhere: the current kubeconfig context."""
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            # KUBECONFIG is read now, not when the client library was imported.
            kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
        return cls(kubernetes.client.ApiClient())

    @classmethod
    def for_host(cls, host: str) -> KubeApi:
        config = kubernetes.client.Configuration()
        config.host = host
        return cls(kubernetes.client.ApiClient(config))

    def close(self) -> None:
        self.client.close()

    def _plain(self, obj: Any) -> Any:
        return self.client.sanitize_for_serialization(obj)

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return self._plain(await asyncio.to_thread(fn, *args, **kwargs))

    # -- the policy's children -------------------------------------------------

    async def ensure(self, obj: Mapping[str, Any]) -> str:
        """Make the ConfigMap or Service ``obj`` exist as built: ``"created"``, ``"updated"`` or ``"unchanged"``.

        One read; a write only when the object is missing or differs from what
        the builder says (``covers``).  Server-side apply would spend the same
        one request, but a full apply (admission, managed-fields merge) on every
        tick for every policy; a read is served cheaply and tells us what drifted.
        A merge patch replaces lists whole (a Service's ports), so after an
        update the object is exactly what the builder said.
        """
        kind, meta = obj["kind"], obj["metadata"]
        create, patch = {
            "ConfigMap": (self.core.create_namespaced_config_map, self.core.patch_namespaced_config_map),
            "Service": (self.core.create_namespaced_service, self.core.patch_namespaced_service),
        }[kind]
        current = await self.read(kind, meta["name"], meta["namespace"])
        if current is None:
            try:
                await self._call(create, meta["namespace"], dict(obj))
                return "created"
            except ApiException as exc:
                if exc.status != 409:  # 409: created meanwhile; patch it below
                    raise
        elif covers(current, obj):
            return "unchanged"
        await self._call(patch, meta["name"], meta["namespace"], dict(obj), _content_type=MERGE_PATCH)
        return "updated"

    async def delete(self, kind: str, name: str, namespace: str) -> bool:
        """Delete a child the spec no longer asks for: True if it was there (404 is success)."""
        delete = {"Service": self.core.delete_namespaced_service}[kind]
        try:
            await self._call(delete, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def read(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        read = {"ConfigMap": self.core.read_namespaced_config_map, "Service": self.core.read_namespaced_service}[kind]
        try:
            return await self._call(read, name, namespace)  # type: ignore[no-any-return]
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    # -- pods and policies -----------------------------------------------------

    async def list_pods(self, namespace: str, match_labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Pods of ``namespace`` that carry every label of ``match_labels``."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
        found = await self._call(self.core.list_namespaced_pod, namespace, label_selector=selector)
        # The server filters by the selector; filtering again costs nothing and
        # keeps the meaning exact even behind an API that ignores it.
        return [p for p in found["items"] if selector_matches(match_labels, p["metadata"].get("labels"))]

    async def list_policies(self, namespace: str) -> list[dict[str, Any]]:
        """The namespace's BatchingPolicies as the API server has them now (the webhook's view, see main)."""
        found = await self._call(
            self.custom.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL, _request_timeout=5
        )
        return list(found["items"])

    async def namespace_labels(self, name: str) -> dict[str, str]:
        found = await self._call(self.core.read_namespace, name)
        return dict(found["metadata"].get("labels") or {})

    # -- webhook and workloads -------------------------------------------------

    async def webhook_namespace_selector(self, name: str) -> dict[str, Any] | None:
        """The ``namespaceSelector`` of the named configuration's webhook (the install has one); None if it is gone."""
        try:
            current = await self._call(self.admission.read_mutating_webhook_configuration, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        webhooks = current.get("webhooks") or [{}]
        return dict(webhooks[0].get("namespaceSelector") or {})

    async def set_webhook_ca_bundle(self, name: str, ca_pem: bytes) -> None:
        """Put the webhook server's CA into every webhook of the named configuration."""
        current = await self._call(self.admission.read_mutating_webhook_configuration, name)
        bundle = base64.b64encode(ca_pem).decode("ascii")
        # A JSON patch addresses each webhook by index, leaving the rest untouched.
        ops = [
            {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle}
            for i in range(len(current.get("webhooks") or []))
        ]
        if ops:
            await self._call(self.admission.patch_mutating_webhook_configuration, name, ops, _content_type=JSON_PATCH)

    async def restart_owner(self, pod: Mapping[str, Any]) -> str | None:
        """Roll the Deployment or StatefulSet that owns ``pod`` (``kubectl rollout restart``).

        Returns ``"Kind/name"`` of what was restarted, or None when the pod has no
        such owner (a bare pod, a Job): it keeps its sidecar until it is recreated.
        """
        meta = pod["metadata"]
        namespace = meta["namespace"]
        owner = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
        if owner is None:
            return None
        kind, name = owner["kind"], owner["name"]
        if kind == "ReplicaSet":
            rs = await self._call(self.apps.read_namespaced_replica_set, name, namespace)
            owner = next((o for o in rs["metadata"].get("ownerReferences") or [] if o.get("controller")), None)
            if owner is None or owner["kind"] != "Deployment":
                return None
            kind, name = "Deployment", owner["name"]
        patch_fn = {"Deployment": self.apps.patch_namespaced_deployment,
                    "StatefulSet": self.apps.patch_namespaced_stateful_set}.get(kind)  # fmt: skip
        if patch_fn is None:
            return None
        stamp = datetime.datetime.now(datetime.UTC).isoformat()
        body = {"spec": {"template": {"metadata": {"annotations": {RESTART_ANNOTATION: stamp}}}}}
        await self._call(patch_fn, name, namespace, body, _content_type=MERGE_PATCH)
        return f"{kind}/{name}"

    # -- the webhook's shared certificate (built-in source) ----------------------

    async def read_secret(self, name: str, namespace: str) -> dict[str, Any] | None:
        try:
            return await self._call(self.core.read_namespaced_secret, name, namespace)  # type: ignore[no-any-return]
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def create_secret(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create ``obj``; None if it already exists (another replica was first)."""
        try:
            return await self._call(self.core.create_namespaced_secret, obj["metadata"]["namespace"], dict(obj))  # type: ignore[no-any-return]
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise

    async def replace_secret(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """Replace ``obj`` at its ``metadata.resourceVersion``; None if it changed meanwhile."""
        meta = obj["metadata"]
        try:
            return await self._call(self.core.replace_namespaced_secret, meta["name"], meta["namespace"], dict(obj))  # type: ignore[no-any-return]
        except ApiException as exc:
            if exc.status == 409:
                return None
            raise

    # -- kopf peering (several replicas) ----------------------------------------

    async def ensure_cluster_peering(self, name: str) -> bool:
        """Create the ClusterKopfPeering ``name`` unless it exists; True if this call made it.

        kopf does not create its peering object, and without it every replica
        stays paused; shipping it beside its CRD in one ``kubectl apply`` fails on
        a fresh cluster (the CRD is not served yet), so the operator makes it.
        """
        body = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}
        try:
            await self._call(self.custom.create_cluster_custom_object, "kopf.dev", "v1", "clusterkopfpeerings", body)
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True
