"""The webhook's production settings: the shared built-in certificate, cert-manager's
files, the listen address and names from the environment, native sidecars, and
the admission path of replicas that kopf peering keeps paused.

No cluster: the Secret calls go to an in-memory store with the API server's
create (409 if it exists) and optimistic-concurrency replace (409 on a stale
resourceVersion) semantics.
"""

from __future__ import annotations

import base64
import datetime
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import kopf
import kubernetes_validate
import pytest
from cryptography import x509

import binbatch_operator.main as main
from binbatch_operator.builders import SIDECAR_CONTAINER, build_pod_patch, sidecar_hash
from binbatch_operator.webhook import (
    certificate_usable,
    renewal_time,
    self_signed_certificate,
    shared_certificate,
)
from test_leadership import FakeLeases

NS, SECRET = "binbatch-system", "binbatch-webhook-cert"
HOSTS = [f"binbatch-webhook.{NS}.svc", f"binbatch-webhook.{NS}.svc.cluster.local", f"binbatch-webhook.{NS}",
         "binbatch-webhook"]  # fmt: skip
KUBE_VERSION = "1.30"  # knows restartPolicy on init containers (native sidecars, beta since 1.29)


class SecretStore:
    """Secrets in memory, with the API server's conflict rules; ``before_write`` simulates a racing replica."""

    def __init__(self) -> None:
        self.secrets: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.writes = 0
        self.before_write: Any = None

    async def read_secret(self, name: str, namespace: str) -> dict[str, Any] | None:
        found = self.secrets.get(name)
        return None if found is None else {**found, "metadata": dict(found["metadata"])}

    def _store(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        self.version += 1
        self.writes += 1
        stored = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.version)}}
        self.secrets[obj["metadata"]["name"]] = stored
        return stored

    async def create_secret(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        if self.before_write:
            await self.before_write()
        if obj["metadata"]["name"] in self.secrets:
            return None  # 409 AlreadyExists
        return self._store(obj)

    async def replace_secret(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        if self.before_write:
            await self.before_write()
        current = self.secrets[obj["metadata"]["name"]]
        if current["metadata"]["resourceVersion"] != obj["metadata"]["resourceVersion"]:
            return None  # 409 Conflict
        return self._store(obj)


def _served(store: SecretStore) -> bytes:
    return base64.b64decode(store.secrets[SECRET]["data"]["tls.crt"])


async def test_replicas_and_restarts_serve_the_one_certificate_stored_once():
    """Before: each start made its own CA and patched it over the other replicas' caBundle."""
    store = SecretStore()
    first = await shared_certificate(store, SECRET, NS, HOSTS)
    second = await shared_certificate(store, SECRET, NS, HOSTS)
    assert first == second and store.writes == 1
    assert store.secrets[SECRET]["type"] == "kubernetes.io/tls"
    assert certificate_usable(first[0], HOSTS)


async def test_two_replicas_starting_together_end_up_with_the_winners_certificate():
    store = SecretStore()
    winner = self_signed_certificate(HOSTS)

    async def other_replica_creates_first() -> None:
        store.before_write = None
        store._store({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": SECRET, "namespace": NS},
                      "data": {"tls.crt": base64.b64encode(winner[0]).decode(),
                               "tls.key": base64.b64encode(winner[1]).decode()}})  # fmt: skip

    store.before_write = other_replica_creates_first
    assert await shared_certificate(store, SECRET, NS, HOSTS) == winner


async def test_a_certificate_near_its_expiry_or_missing_a_name_is_replaced_once():
    store = SecretStore()
    cert, key = await shared_certificate(store, SECRET, NS, HOSTS)
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=340)
    assert not certificate_usable(cert, HOSTS, now=later)  # within 30 days of its 365
    renamed = [*HOSTS, "hook.example.org"]
    new_cert, _ = await shared_certificate(store, SECRET, NS, renamed)
    assert new_cert != cert and _served(store) == new_cert and store.writes == 2
    sans = x509.load_pem_x509_certificate(new_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert "hook.example.org" in sans.value.get_values_for_type(x509.DNSName)


def test_garbage_in_the_secret_is_not_usable():
    assert not certificate_usable(b"not a certificate", HOSTS)


# ------------------------------------------------------------------ the environment → WebhookServer


class FakeKube:
    def __init__(self, store: SecretStore | None = None) -> None:
        self.store = store or SecretStore()
        self.read_secret, self.create_secret, self.replace_secret = (
            self.store.read_secret, self.store.create_secret, self.store.replace_secret)
        self.peerings: set[str] = set()

    def informers(self, *_: Any, **__: Any) -> list[Any]:
        return []  # configure() starts the watches; these tests watch nothing

    async def ensure_cluster_peering(self, name: str, gate: dict[str, Any]) -> bool:
        made = name not in self.peerings
        self.peerings.add(name)
        self.gate = gate
        return made

    def leases(self) -> FakeLeases:
        return FakeLeases(held_by="another-replica")  # these replicas stay followers


@pytest.fixture
def webhook_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("POD_NAMESPACE", NS)
    for name in ("BINBATCH_WEBHOOK_CERT_DIR", "BINBATCH_WEBHOOK_CERT_SECRET", "BINBATCH_WEBHOOK_CONFIG",
                 "BINBATCH_WEBHOOK_ADDRESS", "BINBATCH_WEBHOOK_PORT", "BINBATCH_WEBHOOK_HOSTNAMES"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


async def test_listen_address_port_and_extra_names_come_from_the_environment(webhook_env):
    webhook_env.setenv("BINBATCH_WEBHOOK_ADDRESS", "::")
    webhook_env.setenv("BINBATCH_WEBHOOK_PORT", "10443")
    webhook_env.setenv("BINBATCH_WEBHOOK_HOSTNAMES", ",".join([*HOSTS, "hook.example.org", "10.0.0.9"]))
    webhook_env.setenv("BINBATCH_WEBHOOK_CERT_SECRET", SECRET)
    kube = FakeKube()
    server = await main.webhook_server(kube, "binbatch-webhook", logging.getLogger("test"))
    assert (server.addr, server.port, server.host) == ("::", 10443, HOSTS[0])
    served = Path(server.certfile).read_bytes()
    assert served == _served(kube.store)  # the shared one, from the Secret
    assert certificate_usable(served, [*HOSTS, "hook.example.org", "10.0.0.9"])
    assert server.on_ca is not None  # the built-in CA is patched into the configuration


async def test_cert_manager_files_are_served_as_they_are_and_no_ca_is_patched(webhook_env, tmp_path):
    folder = tmp_path / "tls"
    folder.mkdir()
    cert, key = self_signed_certificate(HOSTS)
    (folder / "tls.crt").write_bytes(cert)
    (folder / "tls.key").write_bytes(key)
    (folder / "ca.crt").write_bytes(cert)
    webhook_env.setenv("BINBATCH_WEBHOOK_CERT_DIR", str(folder))
    webhook_env.setenv("BINBATCH_WEBHOOK_CONFIG", "must-not-be-patched")
    kube = FakeKube()
    server = await main.webhook_server(kube, "binbatch-webhook", logging.getLogger("test"))
    assert (Path(server.certfile), Path(server.pkeyfile), Path(server.cafile)) == (
        folder / "tls.crt", folder / "tls.key", folder / "ca.crt")
    assert server.on_ca is None and kube.store.writes == 0
    cadata, context = server._build_ssl()  # kopf's own loading: the files are a valid pair
    assert cadata == cert and context is not None


# ------------------------------------------------------------------ native sidecars


def _pod(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "vllm-0", "namespace": "ml", "labels": {"app": "vllm"}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}], **spec}}  # fmt: skip


POLICY_SPEC = {"selector": {"matchLabels": {"app": "vllm"}}}


def _apply(pod: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = {**pod, "metadata": {**pod["metadata"], **patch["metadata"]}, "spec": {**pod["spec"], **patch["spec"]}}
    return out


def test_native_sidecar_is_an_init_container_that_always_restarts_after_the_pods_own():
    pod = _pod(initContainers=[{"name": "fetch-model", "image": "busybox"}])
    patch = build_pod_patch(pod, "fast", 1, POLICY_SPEC, "registry.test/binbatch:1", native=True)
    injected = _apply(pod, patch)
    assert [c["name"] for c in injected["spec"]["containers"]] == ["vllm"]
    assert [c["name"] for c in injected["spec"]["initContainers"]] == ["fetch-model", SIDECAR_CONTAINER]
    sidecar = injected["spec"]["initContainers"][1]
    assert sidecar["restartPolicy"] == "Always" and "readinessProbe" in sidecar
    kubernetes_validate.validate(injected, KUBE_VERSION, strict=True)
    # The container is the plain one plus restartPolicy: outdated-pod detection still compares.
    plain = build_pod_patch(pod, "fast", 1, POLICY_SPEC, "registry.test/binbatch:1")
    assert {k: v for k, v in sidecar.items() if k != "restartPolicy"} == plain["spec"]["containers"][-1]
    assert patch["metadata"] == plain["metadata"]
    assert sidecar_hash(POLICY_SPEC, "registry.test/binbatch:1") in str(patch["metadata"])


def test_a_pod_that_already_has_the_native_sidecar_gets_nothing():
    pod = _pod()
    injected = _apply(pod, build_pod_patch(pod, "fast", 1, POLICY_SPEC, "img", native=True))
    assert build_pod_patch(injected, "fast", 1, POLICY_SPEC, "img", native=True) == {}
    assert build_pod_patch(injected, "fast", 1, POLICY_SPEC, "img") == {}


def _policy(name: str, namespace: str = "ml") -> dict[str, Any]:
    return {"apiVersion": "binbatch.io/v1alpha1", "kind": "BatchingPolicy",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "generation": 3}, "spec": POLICY_SPEC}  # fmt: skip


def _watching(*policies: dict[str, Any]) -> main.Watched:
    watched = main.Watched(main.candidate)
    watched.replace("BatchingPolicy", policies)
    return watched


async def _inject(memo: kopf.Memo) -> dict[str, Any]:
    patch: kopf.Patch = kopf.Patch()
    warnings: list[str] = []
    await main.inject_sidecar(body=kopf.Body(_pod()), patch=patch, warnings=warnings, memo=memo,
                              logger=logging.getLogger("test"))  # fmt: skip
    assert warnings == []
    return dict(patch)


async def test_the_webhook_injects_a_native_sidecar_when_the_chart_asks():
    memo = kopf.Memo(ctx=main.Context(kube=FakeKube(), sidecar_image="img"), watched=_watching(_policy("fast")),
                     native_sidecar=True)  # fmt: skip
    patch = await _inject(memo)
    assert [c["name"] for c in patch["spec"]["initContainers"]] == [SIDECAR_CONTAINER]


# ------------------------------------------------------------------ the namespace's policies


async def test_the_webhook_answers_from_the_watched_policies_of_the_pods_namespace():
    """Every replica watches the policies itself (kopf pauses its own watches on a follower)."""
    memo = kopf.Memo(ctx=main.Context(kube=FakeKube(), sidecar_image="img"),
                     watched=_watching(_policy("fast"), _policy("other", namespace="web")))  # fmt: skip
    patch = await _inject(memo)
    assert patch["metadata"]["annotations"]["binbatch.io/injected"] == "fast@3"


async def test_each_peering_replica_gets_its_own_priority(monkeypatch):
    """Equal priorities make kopf pause every replica ("possibly conflicting operators")."""
    monkeypatch.delenv("BINBATCH_WEBHOOK_SERVICE", raising=False)
    kube = FakeKube()
    monkeypatch.setattr(main.KubeApi, "from_environment", classmethod(lambda cls: kube))
    stamps = iter([1_000_000_000, 1_000_001_000])
    monkeypatch.setattr(main.time, "time_ns", lambda: next(stamps))
    replicas = []
    for _ in range(2):
        settings, memo = kopf.OperatorSettings(), kopf.Memo()
        settings.peering.standalone, settings.peering.name = False, "binbatch"
        await main.configure(settings=settings, memo=memo, logger=logging.getLogger("test"))
        memo.elector.stop()
        replicas.append(settings.peering.priority)
    assert replicas[0] != replicas[1]
    assert kube.peerings == {"binbatch"}  # kopf would wait paused forever without its peering object
    assert max(replicas) < kube.gate["priority"]  # paused behind the Lease's gate until holding the Lease
    settings, memo = kopf.OperatorSettings(), kopf.Memo()
    settings.peering.standalone = True
    await main.configure(settings=settings, memo=memo, logger=logging.getLogger("test"))
    assert settings.peering.priority == 0


# ------------------------------------------------------------------ renewal while running


def test_renewal_time_is_at_a_third_of_the_lifetime_left():
    cert, _ = self_signed_certificate(HOSTS, lifetime_seconds=3000)
    parsed = x509.load_pem_x509_certificate(cert)
    lifetime = parsed.not_valid_after_utc - parsed.not_valid_before_utc
    assert renewal_time(cert) == parsed.not_valid_after_utc - lifetime / 3
    assert certificate_usable(cert, HOSTS, now=renewal_time(cert) - datetime.timedelta(seconds=1))
    assert not certificate_usable(cert, HOSTS, now=renewal_time(cert))


@pytest.mark.parametrize("raw", ["ten", "29", "-5", "1.5"])
def test_a_bad_certificate_lifetime_is_refused_naming_the_variable(webhook_env, raw):
    webhook_env.setenv("BINBATCH_WEBHOOK_CERT_SECONDS", raw)
    with pytest.raises(kopf.PermanentError, match="BINBATCH_WEBHOOK_CERT_SECONDS"):
        main.cert_lifetime_seconds()


async def test_the_certificate_lifetime_setting_reaches_the_served_certificate(webhook_env):
    webhook_env.setenv("BINBATCH_WEBHOOK_CERT_SECONDS", "120")
    server = await main.webhook_server(FakeKube(), "binbatch-webhook", logging.getLogger("test"))
    cert = x509.load_pem_x509_certificate(Path(server.certfile).read_bytes())
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert lifetime == datetime.timedelta(seconds=132)  # 120 s and a tenth of it backdated for clock skew
    assert server.renew is not None
    renewed, _ = await server.renew()  # one replica's own: a fresh pair
    assert renewed != Path(server.certfile).read_bytes()
