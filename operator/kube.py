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
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from .builders import covers, owned_by
from .crd import GROUP, PLURAL, VERSION
from .leadership import LEASE_GATE

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
RESTART_ANNOTATION = f"{GROUP}/restartedAt"


def namespace_is_terminating(exc: BaseException) -> bool:
    """The API server refused to create an object because its namespace is being deleted.

    Its 403 carries the cause ``{"reason": "NamespaceTerminating"}`` ("unable to
    create new content in namespace ... because it is being terminated"), as a
    real API server answered.
    """
    if not isinstance(exc, ApiException) or exc.status != 403:
        return False
    try:
        causes = (json.loads(exc.body or "{}").get("details") or {}).get("causes") or []
    except (ValueError, AttributeError):
        return False
    return any(c.get("reason") == "NamespaceTerminating" for c in causes)  # a StatusCause's type is "reason"


def api_error_message(exc: ApiException) -> str:
    """The API server's own words for a failed call (its Status ``message``), with the code."""
    try:
        message = json.loads(exc.body or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return f"{exc.status} {message or exc.reason or 'error'}"


class ChildConflict(Exception):
    """A ConfigMap, Service or NetworkPolicy with a child's name exists and is not the policy's own: left untouched."""

    def __init__(self, desired: Mapping[str, Any], found: Mapping[str, Any] | None = None) -> None:
        meta = desired["metadata"]
        self.kind, self.name, self.namespace = desired["kind"], meta["name"], meta["namespace"]
        owners = ((found or {}).get("metadata") or {}).get("ownerReferences") or []
        whose = ", ".join(f"{o.get('kind')}/{o.get('name')}" for o in owners)
        self.owner = f"owned by {whose}" if whose else "not made by this policy"
        super().__init__(f"{self.kind} {self.namespace}/{self.name} already exists and is {self.owner}")


class KubeApi:
    def __init__(self, client: kubernetes.client.ApiClient) -> None:
        self.client = client
        self.core = kubernetes.client.CoreV1Api(client)
        self.apps = kubernetes.client.AppsV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.admission = kubernetes.client.AdmissionregistrationV1Api(client)
        self.networking = kubernetes.client.NetworkingV1Api(client)
        # Called with (kind, object as the server returned it) after each child ``ensure`` wrote: the operator
        # puts it into its watched store at once, so a re-check before the watch's event does not write again.
        self.wrote: Callable[[str, Mapping[str, Any]], None] | None = None

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

    async def ensure(self, obj: Mapping[str, Any], current: Mapping[str, Any] | None) -> str:
        """Make the ConfigMap, Service or NetworkPolicy ``obj`` exist as built: ``"created"``, ``"updated"`` or ``"unchanged"``.

        ``current`` is the object as the operator's watch last saw it (None:
        not there), so nothing is read: a write is sent only when it is missing
        or differs from what the builder says (``covers``).  What the server
        answers a write goes to ``wrote`` (the operator's store), so the next
        check compares with it before the watch's event for it comes.  The
        watch may still lag another write (a replica's, a deletion): a create
        that meets the object (409) reads it and patches it if it is the
        policy's own (``owned_by``), a patch that misses it (404) creates it.
        An object of that name that is not the policy's is never written:
        ``ChildConflict``.  A merge patch replaces lists
        whole (a Service's ports), so after an update the object is exactly what
        the builder said.
        """
        if current is not None and not owned_by(current, obj):
            raise ChildConflict(obj, current)
        if current is not None and covers(current, obj):
            return "unchanged"
        kind, meta = obj["kind"], obj["metadata"]
        create, patch, read = {
            "ConfigMap": (self.core.create_namespaced_config_map, self.core.patch_namespaced_config_map,
                          self.core.read_namespaced_config_map),
            "Service": (self.core.create_namespaced_service, self.core.patch_namespaced_service,
                        self.core.read_namespaced_service),
            "NetworkPolicy": (self.networking.create_namespaced_network_policy,
                              self.networking.patch_namespaced_network_policy,
                              self.networking.read_namespaced_network_policy),
        }[kind]  # fmt: skip
        if current is not None:
            try:
                self._written(kind, await self._call(patch, meta["name"], meta["namespace"], dict(obj),
                                                     _content_type=MERGE_PATCH))  # fmt: skip
                return "updated"
            except ApiException as exc:
                if exc.status != 404:  # 404: deleted meanwhile; create it below
                    raise
        try:
            self._written(kind, await self._call(create, meta["namespace"], dict(obj)))
            return "created"
        except ApiException as exc:
            if exc.status != 409:  # 409: it exists after all; ours to patch only if it is the policy's
                raise
        found = await self._call(read, meta["name"], meta["namespace"])
        if not owned_by(found, obj):
            raise ChildConflict(obj, found)
        if covers(found, obj):
            self._written(kind, found)
            return "unchanged"
        self._written(kind, await self._call(patch, meta["name"], meta["namespace"], dict(obj), _content_type=MERGE_PATCH))
        return "updated"

    def _written(self, kind: str, body: Any) -> None:
        """Hand what the server answered to ``wrote`` (the watch's event for it may come a moment later)."""
        if self.wrote is not None and isinstance(body, Mapping) and (body.get("metadata") or {}).get("uid"):
            self.wrote(kind, body)

    async def delete(self, kind: str, name: str, namespace: str) -> bool:
        """Delete a child the spec no longer asks for: True if it was there (404 is success)."""
        delete = {"Service": self.core.delete_namespaced_service,
                  "NetworkPolicy": self.networking.delete_namespaced_network_policy}[kind]  # fmt: skip
        try:
            await self._call(delete, name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    # -- policies and namespaces -----------------------------------------------

    async def patch_policy_status(self, name: str, namespace: str, fields: Mapping[str, Any]) -> None:
        """Merge ``fields`` into a policy's status (``None`` deletes a field)."""
        await self._call(self.custom.patch_namespaced_custom_object_status, GROUP, VERSION, namespace, PLURAL, name,
                         {"status": dict(fields)}, _content_type=MERGE_PATCH)  # fmt: skip

    async def namespace_terminating(self, name: str) -> bool:
        """Whether the namespace is being deleted: its workloads go with it."""
        try:
            found = await self._call(self.core.read_namespace, name)
        except ApiException as exc:
            if exc.status == 404:  # not to be seen (a namespace holding a policy exists)
                return False
            raise
        return bool(found["metadata"].get("deletionTimestamp")) or (found.get("status") or {}).get("phase") == "Terminating"

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

    async def read_configmap(self, name: str, namespace: str) -> dict[str, Any] | None:
        """A ConfigMap (``spec.predictor.model``'s); None if it does not exist."""
        try:
            return await self._call(self.core.read_namespaced_config_map, name, namespace)  # type: ignore[no-any-return]
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

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

    # -- leadership (several replicas) ---------------------------------------------

    async def ensure_cluster_peering(self, name: str, gate: Mapping[str, Any], namespaces: Sequence[str] = ()) -> bool:
        """Create the ClusterKopfPeering ``name`` unless it exists, and set its entry ``LEASE_GATE``
        to ``gate`` (see leadership.py); True if this call made the object.

        kopf does not create its peering object, and without it every replica
        stays paused; shipping it beside its CRD in one ``kubectl apply`` fails on
        a fresh cluster (the CRD is not served yet), so the operator makes it.
        Writing the entry is also what makes every replica's kopf look at the
        peering again (a watch event), e.g. once a new holder's priority is up.
        A namespaced operator (``namespaces``: kopf ``--namespace`` each) peers
        through a KopfPeering of that name in each of them instead.
        """
        if namespaces:
            made = [await self._ensure_namespaced_peering(name, gate, ns) for ns in namespaces]
            return any(made)
        body = {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}
        created = True
        try:
            await self._call(self.custom.create_cluster_custom_object, "kopf.dev", "v1", "clusterkopfpeerings", body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            created = False
        # The status is the object's own (kopf's CRD has no status subresource).
        await self._call(self.custom.patch_cluster_custom_object, "kopf.dev", "v1", "clusterkopfpeerings", name,
                         {"status": {LEASE_GATE: dict(gate)}}, _content_type=MERGE_PATCH)  # fmt: skip
        return created

    async def _ensure_namespaced_peering(self, name: str, gate: Mapping[str, Any], namespace: str) -> bool:
        body = {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": name, "namespace": namespace}}
        created = True
        try:
            await self._call(self.custom.create_namespaced_custom_object, "kopf.dev", "v1", namespace, "kopfpeerings", body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            created = False
        await self._call(self.custom.patch_namespaced_custom_object, "kopf.dev", "v1", namespace, "kopfpeerings", name,
                         {"status": {LEASE_GATE: dict(gate)}}, _content_type=MERGE_PATCH)  # fmt: skip
        return created

    def leases(self) -> kubernetes.client.CoordinationV1Api:
        """The Lease API on a client of its own (its own connections), for the elector's thread."""
        return kubernetes.client.CoordinationV1Api(kubernetes.client.ApiClient(self.client.configuration))

    # -- watches -------------------------------------------------------------------

    def informers(self, on_list: Callable[[str, list[Any], str | None], None], on_event: Callable[[str, str, Any], None],
                  children: str, namespaces: Sequence[str] = ()) -> list[Informer]:  # fmt: skip
        """One informer per kind the operator reads: pods, policies, and its children (label selector ``children``);
        with ``namespaces`` (a namespaced install, whose RBAC holds only there), one per kind and namespace."""
        if namespaces:
            return [informer for ns in namespaces for informer in (
                Informer("Pod", self.core.list_namespaced_pod, (ns,), "", on_list, on_event, ns),
                Informer("BatchingPolicy", self.custom.list_namespaced_custom_object, (GROUP, VERSION, ns, PLURAL), "",
                         on_list, on_event, ns),
                Informer("ConfigMap", self.core.list_namespaced_config_map, (ns,), children, on_list, on_event, ns),
                Informer("Service", self.core.list_namespaced_service, (ns,), children, on_list, on_event, ns),
                Informer("NetworkPolicy", self.networking.list_namespaced_network_policy, (ns,), children, on_list,
                         on_event, ns),
            )]  # fmt: skip
        return [
            Informer("Pod", self.core.list_pod_for_all_namespaces, (), "", on_list, on_event),
            Informer("BatchingPolicy", self.custom.list_cluster_custom_object, (GROUP, VERSION, PLURAL), "", on_list, on_event),
            Informer("ConfigMap", self.core.list_config_map_for_all_namespaces, (), children, on_list, on_event),
            Informer("Service", self.core.list_service_for_all_namespaces, (), children, on_list, on_event),
            Informer("NetworkPolicy", self.networking.list_network_policy_for_all_namespaces, (), children, on_list, on_event),
        ]  # fmt: skip



class Informer:
    """List one kind across all namespaces (or in ``namespace``), then watch it, in a thread of its own.

    The list goes to ``on_list(kind, items, namespace)`` and each change to
    ``on_event(kind, type, object)``, both called in the event loop that
    ``start`` ran in.  A watch that times out resumes from the last
    resourceVersion it saw; one that breaks (410 Gone, an error) lists again,
    so nothing deleted meanwhile stays behind.  Objects arrive as plain JSON.
    """

    PAGE = 500
    WATCH_SECONDS = 300  # the server ends each watch after this long; it is resumed at once
    RETRY_SECONDS = 2.0

    def __init__(
        self, kind: str, list_fn: Any, args: tuple[str, ...], label_selector: str,
        on_list: Callable[[str, list[Any], str | None], None], on_event: Callable[[str, str, Any], None],
        namespace: str | None = None,
    ) -> None:  # fmt: skip
        self.kind, self._list_fn, self._args, self._selector = kind, list_fn, args, label_selector
        self.namespace = namespace  # None: every namespace
        self._on_list, self._on_event = on_list, on_event
        self._stopped = threading.Event()
        self._log = logging.getLogger(__name__)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        threading.Thread(target=self._run, args=(loop,), name=f"watch {self.kind}", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _list(self) -> tuple[list[Any], str]:
        items: list[Any] = []
        token = None
        while True:
            resp = self._list_fn(*self._args, label_selector=self._selector, limit=self.PAGE, _continue=token,
                                 _preload_content=False)  # fmt: skip
            page = json.loads(resp.data)
            items += page["items"]
            token = page["metadata"].get("continue")
            if not token:
                return items, page["metadata"]["resourceVersion"]

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._stopped.is_set():
            try:
                items, version = self._list()
                loop.call_soon_threadsafe(self._on_list, self.kind, items, self.namespace)
                while not self._stopped.is_set():
                    stream = kubernetes.watch.Watch().stream(
                        self._list_fn, *self._args, label_selector=self._selector, resource_version=version,
                        timeout_seconds=self.WATCH_SECONDS, allow_watch_bookmarks=True, deserialize=False,
                    )  # fmt: skip
                    for event in stream:
                        if event["type"] == "ERROR":  # 410 Gone and the like: list again
                            raise RuntimeError(event["object"].get("message", "watch error"))
                        version = event["object"]["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            loop.call_soon_threadsafe(self._on_event, self.kind, event["type"], event["object"])
            except Exception as exc:  # noqa: BLE001 - the watch must outlive any failure; it lists again
                if loop.is_closed():
                    return
                self._log.warning("watching %ss failed (%s); listing them again", self.kind, exc)
                self._stopped.wait(self.RETRY_SECONDS)
