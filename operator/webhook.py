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
  within a third of its lifetime of its expiry (or after the names changed)
  replaces it, and so does each running replica when its certificate reaches
  that point (``WebhookServer.renew``): the new CA joins the old one in the
  caBundle first, then the running server swaps its certificate in place
  (no restart, no refused connection), so no admission call fails meanwhile.
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

import asyncio
import base64
import datetime
import ipaddress
import logging
import ssl
import tempfile
from pathlib import Path
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

import kopf
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

WEBHOOK_PATH_ID = "inject-sidecar"  # the handler id = the URL path the configuration calls
CERT_SECONDS = 365 * 86400  # a built-in certificate's lifetime (BINBATCH_WEBHOOK_CERT_SECONDS)
RENEW_FRACTION = 1 / 3  # a certificate with less than this part of its lifetime left is replaced
SWAP_GRACE_SECONDS = 5.0  # between publishing the new CA and serving the new certificate

log = logging.getLogger(__name__)


def self_signed_certificate(
    hostnames: Iterable[str], password: str | None = None, lifetime_seconds: int = CERT_SECONDS
) -> tuple[bytes, bytes]:
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
    lifetime = datetime.timedelta(seconds=lifetime_seconds)
    backdate = min(datetime.timedelta(minutes=5), lifetime / 10)  # a little clock skew between the servers
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - backdate)
        .not_valid_after(now + lifetime)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        # Key identifiers: while a renewal keeps two of these CAs (one subject) in the caBundle, the
        # client picks the right one by them (OpenSSL does not fall back to trying both).
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), critical=False)
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


def renewal_time(cert_pem: bytes) -> datetime.datetime:
    """When the certificate has ``RENEW_FRACTION`` of its lifetime left: the moment to replace it."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    return cert.not_valid_after_utc - lifetime * RENEW_FRACTION


def certificate_usable(cert_pem: bytes, hostnames: Iterable[str], now: datetime.datetime | None = None) -> bool:
    """True if the certificate names every host and has not reached its ``renewal_time``."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    names = {str(n) for n in sans.get_values_for_type(x509.DNSName)}
    names |= {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    now = now or datetime.datetime.now(datetime.UTC)
    fresh = now < renewal_time(cert_pem)
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


async def shared_certificate(
    store: SecretStore, name: str, namespace: str, hostnames: list[str], lifetime_seconds: int = CERT_SECONDS
) -> tuple[bytes, bytes]:
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
        cert_pem, key_pem = self_signed_certificate(hostnames, lifetime_seconds=lifetime_seconds)
        if await write_secret(store, certificate_secret(name, namespace, cert_pem, key_pem), current):
            return cert_pem, key_pem
        # Another replica wrote it first: read and serve theirs.
    raise RuntimeError(f"Secret {namespace}/{name}: the webhook certificate kept changing under us")


async def write_secret(store: SecretStore, fresh: dict[str, Any], current: dict[str, Any] | None) -> bool:
    """Create ``fresh``, or replace ``current`` with it (at ``current``'s resourceVersion): False
    when another replica wrote first (the caller reads and uses theirs)."""
    if current is None:
        return await store.create_secret(fresh) is not None
    fresh["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    return await store.replace_secret(fresh) is not None


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


Renew = Callable[[], Awaitable[tuple[bytes, bytes]]]


class WebhookServer(kopf.WebhookServer):
    """kopf's HTTPS webhook server with our certificate, its renewal, and the namespace fix.

    ``on_ca`` is awaited with the CA bundle (PEM) each time the server starts
    serving with a certificate: the operator patches it into the configuration.
    ``renew``, given with ``certfile``/``pkeyfile`` and ``on_ca``, returns the next
    certificate and key; it is called when the served one reaches its
    ``renewal_time``.  The old and the new CA are then published together, and
    after ``swap_grace`` seconds (the API server's view of the configuration
    catches up) the running server's TLS context loads the new pair: connections
    from then on get the new certificate; none is refused.  The old CA stays in
    the bundle until the next renewal.
    """

    build_certificate = staticmethod(self_signed_certificate)

    def __init__(self, *args: Any, on_ca: CaCallback | None = None, renew: Renew | None = None,
                 swap_grace: float = SWAP_GRACE_SECONDS, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.on_ca = on_ca
        self.renew = renew
        self.swap_grace = swap_grace
        self.renewals = 0
        self._context: ssl.SSLContext | None = None

    def _build_ssl(self) -> tuple[bytes | None, ssl.SSLContext | None]:
        cadata, context = super()._build_ssl()
        self._context = context  # the live one: the renewal loads the new pair into it
        return cadata, context

    async def __call__(self, fn: Any) -> AsyncIterator[Any]:
        async def handle(review: dict[str, Any], **kwargs: Any) -> Any:
            return await fn(fill_namespace(review), **kwargs)

        renewing: asyncio.Task[None] | None = None
        try:
            async for client_config in super().__call__(handle):
                bundle = client_config.get("caBundle")
                if self.on_ca is not None and bundle:
                    await self.on_ca(base64.b64decode(bundle))
                if renewing is None and self.renew is not None and self.certfile and self.on_ca is not None:
                    renewing = asyncio.create_task(self._renew_forever(), name="webhook certificate renewal")
                yield client_config
        finally:
            if renewing is not None:
                renewing.cancel()
                await asyncio.gather(renewing, return_exceptions=True)

    async def _renew_forever(self) -> None:
        assert self.renew is not None and self.on_ca is not None and self.certfile is not None
        # inside the first certificate's folder: an exit that runs no finally (the lost-Lease os._exit) removes that
        # folder, and with it every renewed private key
        folder = Path(tempfile.mkdtemp(prefix="renewed-", dir=Path(self.certfile).parent))
        try:
            while True:
                current = Path(self.certfile).read_bytes()
                delay = (renewal_time(current) - datetime.datetime.now(datetime.UTC)).total_seconds()
                await asyncio.sleep(max(delay, 0.0))  # an armed timer: the served certificate's renewal time
                try:
                    await self.rotate(folder, current)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the old certificate still serves: try again shortly
                    log.warning("renewing the webhook certificate failed (retrying in 10 s): %s", exc)
                    await asyncio.sleep(10)
        finally:
            for path in folder.iterdir():
                path.unlink(missing_ok=True)
            folder.rmdir()

    async def rotate(self, folder: Path, current: bytes) -> None:
        """One renewal: new pair, both CAs published, the live TLS context swapped."""
        assert self.renew is not None and self.on_ca is not None
        cert_pem, key_pem = await self.renew()
        if cert_pem == current:
            raise RuntimeError("the renewal returned the certificate being served")
        self.renewals += 1
        # Fresh file names (kopf watches the original ones and would restart the server on a change).
        cert_file, key_file = folder / f"tls-{self.renewals}.crt", folder / f"tls-{self.renewals}.key"
        key_file.touch(mode=0o600)
        key_file.write_bytes(key_pem)
        cert_file.write_bytes(cert_pem)
        await self.on_ca(cert_pem + current)  # the API server trusts both while it catches up
        await asyncio.sleep(self.swap_grace)
        assert self._context is not None
        self._context.load_cert_chain(cert_file, key_file)  # new handshakes get the new certificate
        old = Path(self.certfile) if self.certfile else None
        self.certfile, self.pkeyfile = cert_file, key_file
        if old is not None and old.parent == folder:
            old.unlink(missing_ok=True)
            old.with_suffix(".key").unlink(missing_ok=True)
        log.info("the webhook now serves a renewed certificate (valid until %s)",
                 x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc.isoformat())
