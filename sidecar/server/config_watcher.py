"""Reload without restart: watch the config file and apply a changed valid one.

The schema (``config.py``) is shared with the operator and does no asyncio; the
watching is the sidecar process's business, so it lives here.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from ..config import ConfigError, LoadedConfig, parse_config_bytes

log = logging.getLogger("binbatch.config")


class ConfigWatcher:
    """Reloads the config file when its content changes; a bad file is refused.

    It polls by content hash, not mtime or inotify, on purpose: Kubernetes updates
    a ConfigMap volume by atomically swapping the ``..data`` symlink, which an
    inotify watch on the file itself misses (and mtimes of the swapped-in files
    are not reliable). Hashing a small file every poll is cheap and sees every
    swap. A file that is missing for a moment during the swap is an error that
    keeps the old config, like an invalid one.

    ``on_change`` (sync or async) is called with the new ``LoadedConfig`` before
    it becomes ``current``; if it raises, the new file is refused the same way.
    ``on_refused`` (optional) is called once per refused file with the error, so
    a counter counts files, not polls.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        initial: LoadedConfig,
        on_change: Callable[[LoadedConfig], Awaitable[None] | None],
        poll_seconds: float,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.current = initial
        self.on_change = on_change
        self.poll_seconds = poll_seconds
        self.on_refused = on_refused
        self.last_error: str | None = None
        self._refused: str | None = None  # sha256 (or error text) of the last refused file: logged once
        # One check at a time: the poll loop and an explicit check() (tests, the admin path) may
        # overlap while on_change awaits (an engine swap); without this, a slower apply of an
        # older file could finish last and put the older config back.
        self._lock = asyncio.Lock()

    async def check(self) -> bool:
        """Apply the file if its content changed and is valid; True if applied."""
        async with self._lock:
            return await self._check()

    async def _check(self) -> bool:
        try:
            raw = Path(self.path).read_bytes()
        except OSError as exc:
            return self._refuse(str(exc), key=str(exc))
        digest = hashlib.sha256(raw).hexdigest()
        if digest == self.current.sha256:
            self.last_error, self._refused = None, None  # back to the running config
            return False
        if digest == self._refused:
            return False
        try:
            new = LoadedConfig(parse_config_bytes(raw, self.path), digest, self.path, generation=self.current.generation + 1)
        except ConfigError as exc:
            return self._refuse(str(exc), key=digest)
        try:
            result = self.on_change(new)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:  # noqa: BLE001 - a config the server cannot apply is refused like an invalid one
            return self._refuse(f"{self.path}: cannot apply: {exc}", key=digest)
        self.current, self.last_error, self._refused = new, None, None
        log.info("config %s: generation %d applied (sha256 %s)", self.path, new.generation, digest[:12])
        return True

    def _refuse(self, error: str, *, key: str) -> bool:
        self.last_error = error
        if key != self._refused:
            self._refused = key
            log.warning("config %s refused, keeping generation %d:\n%s", self.path, self.current.generation, error)
        return False

    async def run(self) -> None:
        """Check every ``poll_seconds`` (read at each turn: a reload may change it) until cancelled."""
        reported: str | None = None
        while True:
            await asyncio.sleep(self.poll_seconds)
            try:
                changed = await self.check()
            except Exception:  # noqa: BLE001 - a reload must never stop the watcher
                log.exception("config check failed")
                continue
            error = self.last_error
            if not changed and error and error != reported and self.on_refused is not None:
                self.on_refused(error)
            reported = error
