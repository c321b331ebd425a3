"""The operator's Admin credential: a short-lived JWT, signed EdDSA (Ed25519), for one sidecar's audience.

The operator signs one per Admin call (``sign``: ``aud`` the policy's ``<namespace>/<policy>``,
``exp`` a minute ahead) with the private key it keeps in a Secret of its own namespace; every
policy's config carries the public key (``auth.operatorPublicKeys``) and its audience
(``auth.audience``), and the sidecar checks a token with ``verify``.  Only EdDSA is accepted (no
``none``, no HMAC with a public key for a secret), ``aud`` must be the sidecar's own (a token for
one policy opens no other), ``exp`` is required and at most ``MAX_LIFETIME_SECONDS`` ahead (a
stolen token is worth minutes, not years).

PEM helpers (``new_private_pem``, ``public_pem``) are here so the operator and the tests make keys
one way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ALGORITHM = "EdDSA"
MAX_LIFETIME_SECONDS = 600  # exp at most this far ahead of the sidecar's clock
LEEWAY_SECONDS = 30  # clock skew between the operator's node and the sidecar's
CALL_LIFETIME_SECONDS = 60  # what the operator signs each call for


class TokenRefused(ValueError):
    """The token is not an operator token for this sidecar; the message says why (never the token)."""


def new_private_pem() -> bytes:
    """A new Ed25519 private key, PEM (PKCS#8, unencrypted: it lives in a Secret)."""
    return Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_private_pem(pem: bytes) -> Ed25519PrivateKey:
    """The key in ``pem``; ValueError if it is not an Ed25519 private key."""
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("not an Ed25519 private key")
    return key


def public_pem(private: Ed25519PrivateKey) -> str:
    """The public half of ``private``, PEM (SubjectPublicKeyInfo), as ``auth.operatorPublicKeys`` holds it."""
    return private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


def sign(private: Ed25519PrivateKey, audience: str, *, lifetime: float = CALL_LIFETIME_SECONDS,
         now: Callable[[], float] = time.time) -> str:  # fmt: skip
    """A token for the sidecars of ``audience`` (``<namespace>/<policy>``), valid ``lifetime`` seconds."""
    issued = int(now())
    claims = {"aud": audience, "iat": issued, "exp": issued + int(lifetime), "iss": "binbatch-operator"}
    return jwt.encode(claims, private, algorithm=ALGORITHM)


def verify(token: str, public_pems: Sequence[str], audience: str, *, now: Callable[[], float] = time.time) -> None:
    """Accept ``token`` if one of ``public_pems`` signed it (EdDSA) for ``audience``, with an ``exp`` still
    ahead and at most ``MAX_LIFETIME_SECONDS`` away; else raise ``TokenRefused`` saying why."""
    if not public_pems or not audience:
        raise TokenRefused("this sidecar trusts no operator key (auth.operatorPublicKeys and auth.audience are unset)")
    try:
        header = jwt.get_unverified_header(token)
    except jwt.InvalidTokenError:
        raise TokenRefused("not a JWT") from None
    if header.get("alg") != ALGORITHM:
        raise TokenRefused(f"a JWT signed with {str(header.get('alg'))[:16]!r}; only {ALGORITHM} is accepted")
    keys = [serialization.load_pem_public_key(pem.encode()) for pem in public_pems]
    reason = ""
    for key in keys:
        if not isinstance(key, Ed25519PublicKey):
            continue
        try:
            claims = jwt.decode(
                token, key, algorithms=[ALGORITHM], audience=audience, leeway=LEEWAY_SECONDS,
                options={"require": ["exp", "aud"], "verify_iat": False},
            )  # fmt: skip
        except jwt.InvalidSignatureError:
            reason = "a JWT signed by a key not in auth.operatorPublicKeys"
            continue
        except jwt.ExpiredSignatureError:
            raise TokenRefused("a JWT that has expired") from None
        except jwt.InvalidAudienceError:
            raise TokenRefused(f"a JWT for another audience (this sidecar's is {audience!r})") from None
        except jwt.MissingRequiredClaimError as exc:
            raise TokenRefused(f"a JWT without the {exc.claim!r} claim") from None
        except jwt.InvalidTokenError as exc:
            raise TokenRefused(f"an invalid JWT ({type(exc).__name__})") from None
        exp = claims["exp"]
        if not isinstance(exp, int | float) or exp > now() + MAX_LIFETIME_SECONDS + LEEWAY_SECONDS:
            raise TokenRefused(f"a JWT whose exp is more than {MAX_LIFETIME_SECONDS} s ahead")
        return
    raise TokenRefused(reason or "a JWT no configured key can check")
