"""Who may call the sidecar: caller tokens on both doors, credentials for Admin.

**Callers** (``auth.callerTokensDir``): a directory, in Kubernetes a mounted Secret, whose every
file is a caller: the file's name is the caller, its content (whitespace stripped) the caller's
bearer token.  With it set, a generation request on either door (HTTP ``Authorization: Bearer
<token>``, gRPC metadata ``authorization: Bearer <token>``), and a passthrough call, must carry a
known token, else it is refused (401 / UNAUTHENTICATED) before anything is parsed or queued.  The
caller's name then rides on the request (``Fields.caller``): what it may send to steer its place
(``auth.callers``) and whose hints are trusted (``core/hint_trust.py``) are the caller's.  Tokens
are kept only as SHA-256 digests and looked up by digest, so no comparison leaks a token's prefix
through its timing.  The directory is read at start, at every reload (a directory that cannot be
read, holds no token, an empty token or one token twice refuses the config) and whenever its files
change (``CallerTokens.refresh``, on the loop that re-reads ``engine.apiKeyFile``: a rotated Secret
is swapped in by the kubelet without the config changing).

**Admin** (``AdminGate``): ``binbatch.v1.Admin`` answers a peer on loopback (``kubectl
port-forward`` lands there) always; any other peer must present the token of
``auth.adminTokenFile`` or a JWT signed by the operator (``engine/admin_token.py``).  No setting
turns this off.

Refusals are counted in ``binbatch_unauthenticated_total{door}`` and logged at DEBUG each, at INFO
at most once a minute per door; never with the token.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence

from ..config import CALLER_NAME_PATTERN, ConfigError, SidecarConfig
from ..engine.admin_token import TokenRefused, verify
from ..engine.engine_key import EngineKey, digest
from ..engine.sidecar_metrics import SidecarMetrics

log = logging.getLogger("binbatch.auth")

DIR_FIELD = "auth.callerTokensDir"
ADMIN_FIELD = "auth.adminTokenFile"
TOKEN_BYTES_LIMIT = 4096
LOG_EVERY_SECONDS = 60.0
_CALLER_NAME = re.compile(CALLER_NAME_PATTERN)
_VISIBLE_ASCII = re.compile(r"[\x21-\x7e]+")


class Unauthenticated(Exception):
    """The caller did not prove who it is; the message says what is missing (never a token)."""


def bearer(values: Sequence[str], where: str) -> str:
    """The token of the one ``Authorization`` value ``values`` holds; ``Unauthenticated`` naming
    ``where`` (the header or metadata key) when there is none, several, or another scheme."""
    if not values:
        raise Unauthenticated(f"{where}: missing; send 'Bearer <token>'")
    if len(values) > 1:
        raise Unauthenticated(f"{where}: given more than once")
    scheme, _, token = values[0].strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise Unauthenticated(f"{where}: not a bearer token; send 'Bearer <token>'")
    return token


def read_caller_tokens(directory: str) -> dict[bytes, str]:
    """``{sha256(token): caller}`` of every file in ``directory``; ``ConfigError`` naming
    ``auth.callerTokensDir`` (and the file, never its content) when it cannot be used."""

    def refuse(problem: str) -> ConfigError:
        return ConfigError([(DIR_FIELD, problem)])

    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError as exc:
        raise refuse(f"cannot read the directory {directory}: {exc.strerror or type(exc).__name__}") from None
    tokens: dict[bytes, str] = {}
    for entry in entries:
        if entry.name.startswith(".."):  # the kubelet's own: ..data and the timestamped folder it points at
            continue
        try:
            if not entry.is_file():  # follows the Secret volume's symlinks; a folder is no caller
                continue
            with open(entry.path, "rb") as f:
                raw = f.read(TOKEN_BYTES_LIMIT + 1)
        except OSError as exc:
            raise refuse(f"cannot read the token file {entry.path}: {exc.strerror or type(exc).__name__}") from None
        if not _CALLER_NAME.fullmatch(entry.name) or len(entry.name) > 253:
            raise refuse(f"the file {entry.path}: a caller's name is a Secret key (letters, digits, '-', '_', '.'; "
                         "at most 253)")  # fmt: skip
        if len(raw) > TOKEN_BYTES_LIMIT:
            raise refuse(f"the token file {entry.path} is larger than {TOKEN_BYTES_LIMIT} bytes")
        try:
            token = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            raise refuse(f"the token file {entry.path} holds non-ASCII bytes; a token is visible ASCII") from None
        if not token:
            raise refuse(f"the token file {entry.path} is empty (or only whitespace)")
        if not _VISIBLE_ASCII.fullmatch(token):
            raise refuse(f"the token in {entry.path} has a space or control character inside it")
        key = digest(token)
        if key in tokens:
            raise refuse(f"callers {tokens[key]!r} and {entry.name!r} have the same token; each caller needs its own")  # fmt: skip
        tokens[key] = entry.name
    if not tokens:
        raise refuse(f"the directory {directory} holds no token file (caller authentication needs at least one caller)")  # fmt: skip
    return tokens


class CallerTokens:
    """The callers' tokens in use.  ``load(dir)`` reads a new directory (start, reload; raises
    ``ConfigError``), ``take(other)`` adopts one read apart, ``refresh()`` re-reads the current one
    (the periodic check for a rotated Secret: a failure keeps the tokens in use, logged once),
    ``caller(token)`` names the caller whose token it is."""

    def __init__(self) -> None:
        self.directory = ""
        self._tokens: dict[bytes, str] = {}
        self._failed: str | None = None

    def __repr__(self) -> str:
        return f"CallerTokens(directory={self.directory!r}, callers={len(self._tokens)})"

    @property
    def names(self) -> list[str]:
        return sorted(self._tokens.values())

    def load(self, directory: str) -> None:
        self._tokens = read_caller_tokens(directory) if directory else {}
        self.directory, self._failed = directory, None

    def take(self, other: CallerTokens) -> None:
        self.directory, self._tokens, self._failed = other.directory, other._tokens, None

    def refresh(self) -> bool:
        """Re-read the directory; True if the tokens changed."""
        if not self.directory:
            return False
        try:
            tokens = read_caller_tokens(self.directory)
        except ConfigError as exc:
            message = str(exc)
            if message != self._failed:
                self._failed = message
                log.warning("%s; keeping the tokens in use", message)
            return False
        self._failed = None
        if tokens == self._tokens:
            return False
        self._tokens = tokens
        log.info("%s: the tokens in %s changed (%d callers); they are used from now on", DIR_FIELD,
                 self.directory, len(tokens))  # fmt: skip
        return True

    def caller(self, token: str) -> str | None:
        return self._tokens.get(digest(token))


def warn_unlisted(cfg: SidecarConfig, tokens: CallerTokens) -> None:
    """A caller ``auth.callers`` lists but no token file names: a warning, not an error (a Secret may be
    rotating); its entry applies once its token appears."""
    if not cfg.auth.callers_on:
        return
    have = set(tokens.names)
    missing = [c.name for c in cfg.auth.callers if c.name not in have]
    if missing:
        log.warning("auth.callers lists %s, with no token file in %s; each applies once its token appears",
                    ", ".join(repr(m) for m in missing), cfg.auth.caller_tokens_dir)  # fmt: skip


class _Refusals:
    """Counts refusals and logs them: each at DEBUG, at INFO at most once a minute per door."""

    def __init__(self, metrics: SidecarMetrics | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics, self.clock = metrics, clock
        self._logged: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def refused(self, door: str, why: str) -> None:
        if self.metrics is not None:
            self.metrics.unauthenticated.labels(door).inc()
        log.debug("%s door: unauthenticated call refused: %s", door, why)
        self._since[door] = self._since.get(door, 0) + 1
        now, last = self.clock(), self._logged.get(door)
        if last is None or now - last >= LOG_EVERY_SECONDS:
            self._logged[door] = now
            count, self._since[door] = self._since[door], 0
            log.info("%s door: refused %d unauthenticated call(s) since the last such line (latest: %s)",
                     door, count, why)  # fmt: skip


class CallerAuth:
    """Both doors ask ``authenticate``: the caller's name ("" with caller authentication off)."""

    def __init__(self, config: Callable[[], SidecarConfig], tokens: CallerTokens, metrics: SidecarMetrics | None,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.config, self.tokens = config, tokens
        self.refusals = _Refusals(metrics, clock)

    @property
    def on(self) -> bool:
        return self.config().auth.callers_on

    def authenticate(self, door: str, values: Sequence[str], where: str) -> str:
        """The caller whose token the ``authorization`` ``values`` carry; raises ``Unauthenticated``."""
        if not self.on:
            return ""
        try:
            token = bearer(values, where)
            name = self.tokens.caller(token)
            if name is None:
                raise Unauthenticated(f"{where}: the bearer token is not a known caller's (auth.callerTokensDir)")
        except Unauthenticated as exc:
            self.refusals.refused(door, str(exc))
            raise
        return name


def is_loopback_peer(peer: str) -> bool:
    """Whether gRPC's ``context.peer()`` (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``ipv6:%5B::1%5D:5000``)
    is on loopback: 127.0.0.0/8, ::1 or an IPv4-mapped loopback.  Anything else (unix sockets too) is not."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        host = rest.rpartition(":")[0]
    elif kind == "ipv6":
        rest = rest.replace("%5B", "[").replace("%5D", "]")
        if not rest.startswith("[") or "]" not in rest:
            return False
        host = rest[1:rest.index("]")].partition("%")[0]  # no zone id
    else:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class AdminGate:
    """``check(peer, metadata)`` before every Admin RPC: loopback passes; elsewhere the bearer token must be
    ``auth.adminTokenFile``'s or an operator-signed JWT for ``auth.audience``.  ``is_loopback`` is a seam
    (tests on a machine with only loopback make a loopback peer look remote)."""

    def __init__(self, config: Callable[[], SidecarConfig], admin_token: EngineKey, metrics: SidecarMetrics | None,
                 *, is_loopback: Callable[[str], bool] = is_loopback_peer, now: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.config, self.admin_token, self.is_loopback, self.now = config, admin_token, is_loopback, now
        self.refusals = _Refusals(metrics, clock)

    def check(self, peer: str, metadata: Iterable[tuple[str, str | bytes]]) -> None:
        if self.is_loopback(peer):
            return
        try:
            self._credential(metadata)
        except Unauthenticated as exc:
            self.refusals.refused("admin", str(exc))
            raise

    def _credential(self, metadata: Iterable[tuple[str, str | bytes]]) -> None:
        auth = self.config().auth
        if not self.admin_token.is_set and not auth.operator_public_keys:
            raise Unauthenticated("binbatch.v1.Admin answers only loopback here: no admin credential is configured "
                                  "(auth.adminTokenFile, auth.operatorPublicKeys)")  # fmt: skip
        values = [v for k, v in metadata if k == "authorization" and isinstance(v, str)]
        try:
            token = bearer(values, "authorization")
        except Unauthenticated as exc:
            raise Unauthenticated(f"binbatch.v1.Admin off loopback needs a credential: {exc} with the token of "
                                  "auth.adminTokenFile or one signed by the operator") from None  # fmt: skip
        if self.admin_token.matches(token):
            return
        if token.count(".") != 2 or not auth.operator_public_keys:
            raise Unauthenticated("authorization: the bearer token is not auth.adminTokenFile's (nor a token signed "
                                  "by the operator)")  # fmt: skip
        try:
            verify(token, auth.operator_public_keys, auth.audience, now=self.now)
        except TokenRefused as exc:
            raise Unauthenticated(f"authorization: {exc}") from None
