"""The engine's API key (``engine.apiKeyFile``): read from a file, never shown.

vLLM started with ``--api-key`` refuses every ``/v1`` call without
``Authorization: Bearer <key>``.  The sidecar reads the key from a file (in
Kubernetes a mounted Secret) at start, at every config reload, and whenever
the file's content changes (a rotated Secret: the kubelet swaps the mounted file
in place), and the engine client puts it on every call it makes.

The key itself is in no message, log line, ``repr`` or reply: errors name the
setting and the path only.  ``auth.adminTokenFile`` (the Admin service's token) is
read and watched the same way: an ``EngineKey`` made with that ``field``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from pathlib import Path

from ..config import ConfigError

log = logging.getLogger("binbatch.config")

FIELD = "engine.apiKeyFile"
_VISIBLE_ASCII = frozenset(chr(c) for c in range(0x21, 0x7F))


def read_api_key(path: str, field: str = FIELD) -> str:
    """The key in ``path``, stripped of surrounding whitespace; raises ``ConfigError``
    naming ``field`` (``engine.apiKeyFile``; with the path, never the contents) when the file
    cannot be read, is empty, or holds what cannot be sent in an HTTP header."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ConfigError([(field, f"cannot read the key file {path}: {why}")]) from None
    try:
        key = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ConfigError([(field, f"the key file {path} holds non-ASCII bytes; an API key is one token "
                                   "of visible ASCII characters")]) from None  # fmt: skip
    if not key:
        raise ConfigError([(field, f"the key file {path} is empty (or only whitespace)")])
    if not set(key) <= _VISIBLE_ASCII:
        raise ConfigError([(field, f"the key in {path} has a space or control character inside it; an API key "
                                   "is one token of visible ASCII characters")])  # fmt: skip
    return key


def digest(text: str) -> bytes:
    """A secret's SHA-256, what tokens and keys are compared and looked up by (never the text itself)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class EngineKey:
    """The key the engine client sends, shared by every client the sidecar makes.

    ``load(path)`` reads a new path (start, reload; raises ``ConfigError``),
    ``take(other)`` adopts a key read apart, ``refresh()`` re-reads the current one (the periodic check for a rotated
    file: a failure keeps the key in use and is logged once), ``headers()`` is what
    a call adds."""

    def __init__(self, path: str = "", key: str = "", *, field: str = FIELD) -> None:
        self.field = field  # the setting errors and log lines name
        self.path = path
        self._key = key
        self._failed: str | None = None  # the last refresh error, logged once

    def __repr__(self) -> str:
        return f"{type(self).__name__}(field={self.field!r}, path={self.path!r}, key={'<set>' if self._key else '<none>'})"

    @property
    def is_set(self) -> bool:
        return bool(self._key)

    def load(self, path: str) -> None:
        """Use the key in ``path`` ("": none); raises ``ConfigError`` and keeps the old key."""
        key = read_api_key(path, self.field) if path else ""
        self.path, self._key, self._failed = path, key, None

    def take(self, other: EngineKey) -> None:
        """Use ``other``'s path and key (a reload reads into a new one first, then takes it)."""
        self.path, self._key, self._failed = other.path, other._key, None

    def refresh(self) -> bool:
        """Re-read the current file; True if the key changed.  A file that cannot be
        read now (a Secret being swapped) keeps the key in use."""
        if not self.path:
            return False
        try:
            key = read_api_key(self.path, self.field)
        except ConfigError as exc:
            message = str(exc)
            if message != self._failed:
                self._failed = message
                log.warning("%s; keeping the key in use", message)
            return False
        self._failed = None
        if key == self._key:
            return False
        self._key = key
        log.info("%s: the key in %s changed; it is used from now on", self.field, self.path)
        return True

    def matches(self, presented: str) -> bool:
        """Whether ``presented`` is the key (compared in constant time; False without a key)."""
        return bool(self._key) and hmac.compare_digest(digest(presented), digest(self._key))

    def headers(self) -> dict[str, str]:
        """``{"Authorization": "Bearer <key>"}``, or nothing without a key."""
        return {"Authorization": f"Bearer {self._key}"} if self._key else {}
