"""Fixtures that bring up a REAL vLLM CPU server (DESIGN.md §4, engine 3).

``vllm_server`` is session-scoped and parametrised by a *profile* name from
``vllm_support.server.PROFILES``. Its default parameter is ``"default"`` (ample
KV cache); a test that needs another configuration asks for it with indirect
parametrisation::

    @pytest.mark.parametrize("vllm_server", ["small_kv"], indirect=True)
    async def test_queueing(vllm_server): ...

Why this shape: only ONE vLLM may run at a time on this 2-core machine (each takes
~2 GB RAM and a core, and start-up is 20-60 s). A session-scoped parametrised
fixture gives exactly that: pytest keeps one cached instance, finalises it before
it creates the instance for another parameter, and reorders the tests so that all
tests of one profile run together (one start per profile per session, across
modules). Separate fixtures per profile would let two servers live at once.

The first use builds the vLLM venv (~90 s, cached in ~/.cache/binbatch) and the
tiny model (~5 s). If anything fails the fixture errors loudly with the log tail:
CI must not skip these tests. ``BINBATCH_SKIP_VLLM=1`` skips them, with a reason,
for quick local runs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator, Iterator

import pytest

from vllm_support.server import PROFILES, VllmServer, VllmStartError

_STASH_KEY = pytest.StashKey["VllmServer"]()


@pytest.fixture(scope="session", params=["default"])
def vllm_server(request: pytest.FixtureRequest) -> Iterator[VllmServer]:
    """A running vLLM server: ``.base_url``, ``.model``, ``.metrics_url``, ``.log_path``."""
    if os.environ.get("BINBATCH_SKIP_VLLM") == "1":
        pytest.skip("BINBATCH_SKIP_VLLM=1: real-vLLM tests skipped on request")
    profile = request.param
    if profile not in PROFILES:
        pytest.fail(f"unknown vLLM profile {profile!r}; known: {sorted(PROFILES)}")
    server = VllmServer.from_profile(profile)
    error = None
    try:
        server.start()
    except VllmStartError as exc:
        error = str(exc)
    if error is not None:
        pytest.fail(f"could not start vLLM (profile {profile!r}): {error}", pytrace=False)
    request.config.stash[_STASH_KEY] = server
    try:
        yield server
    finally:
        with contextlib.suppress(KeyError):
            del request.config.stash[_STASH_KEY]
        server.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """On a failing test that used vLLM, attach the server's log tail to the report."""
    report = yield
    if report.failed and "vllm_server" in getattr(item, "fixturenames", ()):
        server = item.config.stash.get(_STASH_KEY, None)
        if server is not None:
            alive = "running" if server.is_running() else "NOT running"
            report.sections.append(
                (f"vLLM log tail ({server.log_path}, {alive})", server.log_tail(40))
            )
    return report
