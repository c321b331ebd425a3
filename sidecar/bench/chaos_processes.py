"""The chaos bench's processes: the engine emulator and the sidecar, each its own
child process on 127.0.0.1 so the bench can SIGKILL the engine, SIGTERM the
sidecar, rewrite its config file and read its memory and descriptors in /proc.

Both are started with this interpreter (``python -m ...``); readiness is the line
each prints when it serves, never a sleep.  Their stderr is read to the end in
the background (a full pipe would block the child); the sidecar's JSON log
records are kept for the bench to count and quote.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import yaml

STARTUP_SECONDS = 60.0
_EMULATOR_READY = re.compile(r"binbatch emulate-engine: .* on http://127\.0\.0\.1:(\d+)")
SIDECAR_READY = re.compile(r"serving gRPC on 127\.0\.0\.1:(\d+)")
_HTTP_PORT = re.compile(r"HTTP on :(\d+)")  # in the sidecar's "serving gRPC on ..." line
_METRICS_PORT = re.compile(r"metrics on :(\d+)")  # likewise


T = TypeVar("T")


def run_to_end(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``, except that SIGTERM (``kill``, a CI job's timeout)
    cancels ``main`` the way Ctrl-C does, so its exit stacks stop every child
    process it started (the engine, the sidecars) instead of leaving them running
    after the bench is gone; the bench then exits with 143 (128 + SIGTERM)."""
    terminated = False

    async def guarded() -> T:
        task = asyncio.current_task()
        assert task is not None

        def stop() -> None:
            nonlocal terminated
            terminated = True
            task.cancel()

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop)
        return await main

    try:
        return asyncio.run(guarded())
    except asyncio.CancelledError:
        if terminated:
            raise SystemExit(128 + signal.SIGTERM) from None
        raise


# free_port's ports: from here up to the kernel's ephemeral range (Linux's default start below)
PORT_FLOOR, EPHEMERAL_START = 10000, 32768
_GIVEN: set[int] = set()


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_START


def free_port() -> int:
    """A port free on 127.0.0.1 a moment ago, for a server told its port before it
    binds (a process restarted on the same port, the operator's webhook): port 0 will
    not do.  It lies below the kernel's ephemeral range, so no outgoing connection
    and no bind to port 0 can take it in the meantime; one taken from that range
    (bind to 0, close, hand on) was once taken so before the operator's webhook
    bound it.  Never the same port twice in a process."""
    start = ephemeral_start()
    ports = [p for p in random.sample(range(PORT_FLOOR, max(start, PORT_FLOOR + 1000)), 64) if p not in _GIVEN]
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port on 127.0.0.1 among {len(ports)} tried below {start}")


def rss_and_fds(pid: int) -> tuple[int, int] | None:
    """Resident memory in bytes and open file descriptors of ``pid``, from /proc."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return (int(match.group(1)) * 1024 if match else 0), fds


def read_receipts(*paths: Path) -> Counter[str]:
    """Prompts the engine(s) accepted, with how often each arrived."""
    counts: Counter[str] = Counter()
    for path in paths:
        if path.exists():
            counts.update(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return counts


def pin(pid: int, cpus: frozenset[int]) -> None:
    """Every thread of process ``pid`` onto ``cpus`` (``sched_setaffinity`` sets one
    thread's mask; threads started after inherit their starter's)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


def cpus_left(sidecar: frozenset[int], available: frozenset[int]) -> frozenset[int]:
    """The CPUs left to the bench and its engines once the sidecars have ``sidecar``
    (``bench e2e --sidecar-cpus``): both non-empty, ``sidecar`` among ``available``."""
    if not sidecar:
        raise ValueError("no CPU given")
    if not sidecar <= available:
        raise ValueError(f"CPU {min(sidecar - available)} is not one this process may use "
                         f"({', '.join(map(str, sorted(available)))})")  # fmt: skip
    if sidecar == available:
        raise ValueError(f"that is every CPU this process may use ({len(available)}): the engine and the client "
                         "need one of their own")  # fmt: skip
    return available - sidecar


class ChildProcess:
    """A child process whose stderr is read line by line until it ends; on ``cpus``
    when given (every thread, from its start)."""

    def __init__(self, name: str, cpus: frozenset[int] | None = None) -> None:
        self.name = name
        self.cpus = cpus
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []
        self._reader: asyncio.Task[None] | None = None
        self.exited_at: float | None = None

    async def _spawn(self, args: list[str], ready: re.Pattern[str], cwd: Path) -> int:
        """Start ``args``; returns the port from the first stderr line matching ``ready``."""
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, *args, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        if self.cpus:
            pin(self.proc.pid, self.cpus)  # the interpreter has one thread yet
        assert self.proc.stderr is not None
        async with asyncio.timeout(STARTUP_SECONDS):
            while True:
                raw = await self.proc.stderr.readline()
                if not raw:
                    raise RuntimeError(f"{self.name} exited before serving:\n" + "".join(self.lines[-20:]))
                line = raw.decode(errors="replace")
                self.lines.append(line)
                if match := ready.search(line):
                    break
        if self.cpus:
            pin(self.proc.pid, self.cpus)  # and any thread started before the first pin took
        self._reader = asyncio.create_task(self._read_rest())
        return int(match.group(1))

    async def _read_rest(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while raw := await self.proc.stderr.readline():
            self.lines.append(raw.decode(errors="replace"))
            del self.lines[:-5000]  # bounded: the bench keeps the recent tail

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def signal_and_wait(self, sig: int, timeout: float) -> int | None:
        """Send ``sig``; the exit status, or None if it did not exit in ``timeout``
        seconds (it is then killed)."""
        if not self.running:
            return self.proc.returncode if self.proc else None
        assert self.proc is not None
        self.proc.send_signal(sig)
        try:
            async with asyncio.timeout(timeout):
                code = await self.proc.wait()
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            code = None
        self.exited_at = time.monotonic()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, 5)
        return code

    async def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up."""
        await self.signal_and_wait(signal.SIGKILL, STARTUP_SECONDS)


class EmulatorProcess(ChildProcess):
    """``binbatch emulate-engine`` on a fixed port, logging its receipts to a file."""

    def __init__(self, port: int, receipts: Path, engine_args: list[str], cwd: Path) -> None:
        super().__init__(f"engine emulator :{port}")
        self.port = port
        self.receipts = receipts
        self.engine_args = engine_args
        self.cwd = cwd

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        args = ["-m", "binbatch_sidecar.emulator", "--host", "127.0.0.1", "--port", str(self.port),
                "--receipts-file", str(self.receipts), *self.engine_args]  # fmt: skip
        await self._spawn(args, _EMULATOR_READY, self.cwd)

    async def stop(self) -> None:
        await self.signal_and_wait(signal.SIGTERM, 15)


def _named_port(lines: list[str], pattern: re.Pattern[str], what: str) -> int:
    """The port ``pattern`` finds first in the sidecar's start-up ``lines``."""
    for line in lines:
        if match := pattern.search(line):
            return int(match.group(1))
    raise RuntimeError(f"the sidecar named no {what} port:\n" + "".join(lines[-20:]))


def http_port(lines: list[str]) -> int:
    """The HTTP door's port from the sidecar's start-up lines (the process was
    started with ``--http-port 0``; ``serving gRPC on ...`` names both ports)."""
    return _named_port(lines, _HTTP_PORT, "HTTP")


def metrics_port(lines: list[str]) -> int:
    """The sidecar's metrics port from its start-up lines (as ``http_port``)."""
    return _named_port(lines, _METRICS_PORT, "metrics")


class SidecarProcess(ChildProcess):
    """``binbatch sidecar --config FILE`` on free ports; JSON logs on stderr."""

    def __init__(self, config_path: Path, cwd: Path, cpus: frozenset[int] | None = None) -> None:
        super().__init__("sidecar", cpus)
        self.config_path = config_path
        self.cwd = cwd
        self.grpc_port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible HTTP door, as its start-up line named it."""
        return f"http://127.0.0.1:{http_port(self.lines)}"

    async def start(self) -> None:
        args = ["-m", "binbatch_sidecar.cli", "sidecar", "--config", str(self.config_path),
                "--host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "0"]  # fmt: skip
        self.grpc_port = await self._spawn(args, SIDECAR_READY, self.cwd)

    def write_config(self, doc: dict[str, Any] | None, raw: bytes | None = None) -> bytes:
        """Replace the config file atomically (as a ConfigMap swap does); returns its bytes."""
        data = raw if raw is not None else yaml.safe_dump(doc, sort_keys=False).encode()
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.config_path)
        return data

    def records(self) -> list[dict[str, Any]]:
        """The sidecar's log records (lines that are not JSON are kept as messages)."""
        out = []
        for line in self.lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = {"level": "RAW", "msg": line.rstrip()}
            out.append(record if isinstance(record, dict) else {"level": "RAW", "msg": line.rstrip()})
        return out

    def log_levels(self) -> dict[str, int]:
        return dict(Counter(str(r.get("level", "?")).upper() for r in self.records()))

    def error_messages(self, limit: int = 3) -> list[str]:
        """The first few distinct ERROR messages, each with its exception's last line."""
        out: dict[str, None] = {}
        for r in self.records():
            if str(r.get("level", "")).upper() in ("ERROR", "CRITICAL"):
                exc = str(r.get("exc", "")).strip().splitlines()
                out[f"{r.get('msg', '')}{': ' + exc[-1] if exc else ''}"[:200]] = None
            if len(out) >= limit:
                break
        return list(out)

    def cut_off_reported(self) -> int | None:
        """N from the sidecar's last words, "sidecar stopped (N requests cut off ...)"."""
        for record in reversed(self.records()):
            match = re.search(r"sidecar stopped \((\d+) requests cut off", str(record.get("msg", "")))
            if match:
                return int(match.group(1))
        return None
