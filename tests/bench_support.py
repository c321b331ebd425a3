"""Running a ``binbatch`` bench command as a child process, for the bench tests.

The bench starts its own children (the embedded engine, the sidecars).  It runs
in a session of its own, so whatever happens -- a timeout, a failed assertion --
the whole group is stopped afterwards: first SIGTERM (the bench stops its
children and exits 143), then SIGKILL for anything still there.  A timed-out
bench once left six sidecars running for the rest of a CI job.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

TERM_GRACE_SECONDS = 30.0


async def run_binbatch(cwd: Path, *args: str, timeout: float) -> tuple[int, bytes, bytes]:
    """``python -m binbatch_sidecar.cli *args`` in ``cwd``: (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "binbatch_sidecar.cli", *args, cwd=cwd, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    finally:
        await stop_group(proc)
    assert proc.returncode is not None
    return proc.returncode, out, err


async def stop_group(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM the process's group (it leads a session), then SIGKILL what remains."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        if proc.returncode is None:
            try:
                async with asyncio.timeout(TERM_GRACE_SECONDS):
                    await proc.wait()
            except TimeoutError:
                continue
