"""The admission webhook's server: kopf's, with a certificate from ``cryptography``.

Sidecar injection is a mutating admission webhook on pod CREATE (how Istio and
Linkerd inject theirs): it changes only pods created after a policy, never
restarts a workload by itself, and works for any controller (Deployment,
StatefulSet, Job, bare pods).  The ``MutatingWebhookConfiguration`` ships with
the install (Helm chart or plain manifests) with a service-based client config;
the certificate comes from one of two places:

- built in: the first replica to start makes a self-signed certificate for the
  Service's DNS names and keeps it in a Secret of its namespace; every replica
  (and every restart) serves that same certificate and patches its CA into the
  configuration, so replicas never overwrite each other's caBundle.  A start
  within ``RENEW_DAYS`` of its expiry (or after the names changed) replaces it.
  No key is ever committed or rendered into a chart.
- cert-manager: the operator serves the mounted Secret (kopf reloads it when its
  files change) and cert-manager's CA injector fills the caBundle.

Two adjustments to kopf's ``WebhookServer``:
- the certificate is built with ``cryptography`` (kopf's default needs
  ``certbuilder``/``oscrypto``, unmaintained and broken with OpenSSL 3);
- pods created by a controller reach admission without ``metadata.namespace``
  (the namespace is in the AdmissionReview request); it is filled in before the
  handlers run, so they can match the pod against the policies of its namespace.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

import kopf
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

WEBHOOK_PATH_ID = "inject-sidecar"  # the handler id = the URL path the configuration calls
CERT_DAYS = 365
RENEW_DAYS = 30  # a start this close to the shared certificate's expiry replaces it


def self_signed_certificate(hostnames: Iterable[str], password: str | None = None) -> tuple[bytes, bytes]:
    """A self-signed serving certificate (PEM) for ``hostnames`` (DNS names or IPs), and its key."""
    names = list(dict.fromkeys(h for h in hostnames if h))
    sans: list[x509.GeneralName] = []
    for name in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            sans.append(x509.DNSName(name))
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        # Its own CA: the API server trusts it through the caBundle.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, crl_sign=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(password.encode()) if password else serialization.NoEncryption()
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def service_hostnames(service: str, namespace: str) -> list[str]:
    """The names the API server may use for ``service`` in ``namespace``."""
    return [f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local", f"{service}.{namespace}", service]


def certificate_usable(cert_pem: bytes, hostnames: Iterable[str], now: datetime.datetime | None = None) -> bool:
    """True if the certificate names every host and is not within ``RENEW_DAYS`` of expiry."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    names = {str(n) for n in sans.get_values_for_type(x509.DNSName)}
    names |= {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    now = now or datetime.datetime.now(datetime.UTC)
    fresh = cert.not_valid_after_utc - now > datetime.timedelta(days=RENEW_DAYS)
    return fresh and set(h for h in hostnames if h) <= names


def certificate_secret(name: str, namespace: str, cert_pem: bytes, key_pem: bytes) -> dict[str, Any]:
    """The Secret (type kubernetes.io/tls) that carries the shared serving certificate."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/managed-by": "binbatch-operator"}},
        "data": {"tls.crt": base64.b64encode(cert_pem).decode(), "tls.key": base64.b64encode(key_pem).decode()},
    }


class SecretStore(Protocol):
    """The three Secret calls ``shared_certificate`` makes (``KubeApi`` has them)."""

    async def read_secret(self, name: str, namespace: str) -> dict[str, Any] | None: ...
    async def create_secret(self, obj: Mapping[str, Any]) -> dict[str, Any] | None: ...
    async def replace_secret(self, obj: Mapping[str, Any]) -> dict[str, Any] | None: ...


async def shared_certificate(store: SecretStore, name: str, namespace: str, hostnames: list[str]) -> tuple[bytes, bytes]:
    """The serving certificate and key every replica shares, made once and kept in a Secret.

    Create is first-writer-wins (409 → ``create_secret`` returns None) and a
    replacement carries the ``resourceVersion`` it read (409 → None), so two
    replicas starting together end up serving the one certificate that was stored.
    """
    for _ in range(3):
        current = await store.read_secret(name, namespace)
        data = (current or {}).get("data") or {}
        if data.get("tls.crt") and data.get("tls.key"):
            cert_pem, key_pem = base64.b64decode(data["tls.crt"]), base64.b64decode(data["tls.key"])
            if certificate_usable(cert_pem, hostnames):
                return cert_pem, key_pem
        cert_pem, key_pem = self_signed_certificate(hostnames)
        fresh = certificate_secret(name, namespace, cert_pem, key_pem)
        if current is None:
            stored = await store.create_secret(fresh)
        else:
            fresh["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            stored = await store.replace_secret(fresh)
        if stored is not None:
            return cert_pem, key_pem
        # Another replica wrote it first: read and serve theirs.
    raise RuntimeError(f"Secret {namespace}/{name}: the webhook certificate kept changing under us")


def fill_namespace(review: dict[str, Any]) -> dict[str, Any]:
    """Copy ``request.namespace`` into the object when the object lacks it."""
    request = review.get("request") or {}
    obj, namespace = request.get("object"), request.get("namespace")
    if isinstance(obj, dict) and namespace:
        meta = obj.setdefault("metadata", {})
        if not meta.get("namespace"):
            meta["namespace"] = namespace
    return review


CaCallback = Callable[[bytes], Awaitable[None]]


class WebhookServer(kopf.WebhookServer):
    """kopf's HTTPS webhook server with our certificate and namespace fix.

    ``on_ca`` is awaited with the CA bundle (PEM) each time the server starts
    serving with a certificate: the operator patches it into the configuration.
    """

    build_certificate = staticmethod(self_signed_certificate)

    def __init__(self, *args: Any, on_ca: CaCallback | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_ca = on_ca

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        async def handle(review: dict[str, Any], **kwargs: Any) -> Any:
            return await fn(fill_namespace(review), **kwargs)

        async for client_config in super().__call__(handle):
            bundle = client_config.get("caBundle")
            if self.on_ca is not None and bundle:
                await self.on_ca(base64.b64decode(bundle))
            yield client_config
