"""The operator's Admin credential: an Ed25519 key pair, the private half in a Secret of its own namespace.

The sidecars' Admin service answers off loopback only a caller with a credential
(``binbatch_sidecar.server.caller_auth``).  The operator's is a JWT it signs per call
(``binbatch_sidecar.engine.admin_token.sign``: EdDSA, ``aud`` the policy's
``<namespace>/<policy>``, a minute to live); every policy's ConfigMap carries the public key
(``auth.operatorPublicKeys``) and the audience (``auth.audience``).

The key pair is kept like the webhook's built-in certificate (``webhook.shared_certificate``):
in the Secret ``BINBATCH_ADMIN_SIGNING_SECRET`` names (the chart's ``<fullname>-admin-signing``),
read at start and created when absent.  Create is first-writer-wins: two replicas starting
together both end with the key the first stored (409 on create: read theirs).  A Secret holding
no usable key (edited by hand) is replaced at the ``resourceVersion`` read.  Without the variable
(a test, ``kopf run`` by hand) each start makes a key of its own, which the policies' ConfigMaps
then carry.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from binbatch_sidecar.engine.admin_token import load_private_pem, new_private_pem, public_pem, sign

from .webhook import SecretStore, write_secret

KEY = "ed25519.pem"  # the Secret's one data key: the private key, PEM (PKCS#8)


@dataclass(frozen=True)
class AdminSigner:
    """The operator's signing key: ``token(audience)`` for each Admin call, ``public_pem`` for the ConfigMaps."""

    private: Ed25519PrivateKey

    @property
    def public_pem(self) -> str:
        return public_pem(self.private)

    def token(self, audience: str) -> str:
        return sign(self.private, audience)

    @classmethod
    def generate(cls) -> AdminSigner:
        return cls(load_private_pem(new_private_pem()))


def signing_secret(name: str, namespace: str, pem: bytes) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "binbatch-operator"}},  # fmt: skip
        "data": {KEY: base64.b64encode(pem).decode()},
    }


def _usable(secret: dict[str, Any] | None) -> Ed25519PrivateKey | None:
    data = (secret or {}).get("data") or {}
    try:
        return load_private_pem(base64.b64decode(data[KEY]))
    except (KeyError, ValueError, TypeError):
        return None


async def shared_signer(store: SecretStore, name: str, namespace: str) -> AdminSigner:
    """The key every replica shares: the one in Secret ``namespace/name``, made and stored if absent."""
    for _ in range(3):
        current = await store.read_secret(name, namespace)
        key = _usable(current)
        if key is not None:
            return AdminSigner(key)
        pem = new_private_pem()
        if await write_secret(store, signing_secret(name, namespace, pem), current):
            return AdminSigner(load_private_pem(pem))
        # another replica wrote it first: read and use theirs
    raise RuntimeError(f"Secret {namespace}/{name}: the Admin signing key kept changing under us")
