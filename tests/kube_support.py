"""What the tests that drive a real Kubernetes API server share: ``tests/e2e`` (kind) and
``tests/apiserver`` (a bare control plane).

``run`` runs a command to completion or fails the test with its output; ``wait_for``
polls until a deadline (an external process is what is awaited, so polling is the
synchronisation, and the deadline bounds it); ``Cluster`` holds a kubeconfig and the
API clients made from it.
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")
FIELD_MANAGER = "binbatch-tests"  # server-side apply's owner of what the tests apply


def run(*cmd: str, timeout: float, stdin: str | None = None) -> str:
    """Run a command to completion; fail the test with its output if it fails."""
    try:
        done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout}s\n{exc.stdout or ''}\n{exc.stderr or ''}")
    if done.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done.stdout


def wait_for(
    what: str, check: Callable[[], T | None], *, timeout: float, diagnose: Callable[[], str], every: float = 1.0
) -> T:
    """Poll ``check`` until it returns something truthy, or fail at the deadline with diagnostics."""
    from kubernetes.client.exceptions import ApiException

    deadline = time.monotonic() + timeout
    last_error = ""
    while True:
        try:
            result = check()
        except ApiException as exc:
            result, last_error = None, f"{exc.status} {exc.reason}"
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what} (last API error: {last_error or 'none'})\n"
                        f"{diagnose()}")  # fmt: skip
        time.sleep(every)  # ok-sleep: the poll interval; the deadline bounds the wait


class Cluster:
    """A cluster's kubeconfig and API clients; ``diagnostics()`` runs ``diagnose`` (kubectl arguments)."""

    def __init__(self, kubeconfig: Path, diagnose: Sequence[Sequence[str]] = ()) -> None:
        from kubernetes import client, config

        self.kubeconfig = kubeconfig
        self.diagnose = list(diagnose)
        self.api = config.new_client_from_config(config_file=str(kubeconfig))
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.admission = client.AdmissionregistrationV1Api(self.api)

    def kubectl(self, *args: str, timeout: float = 120, stdin: str | None = None) -> str:
        return run("kubectl", "--kubeconfig", str(self.kubeconfig), *args, timeout=timeout, stdin=stdin)

    def apply(self, manifest: str | Path, *extra: str) -> str:
        """``kubectl apply --server-side`` of a file or folder (a Path) or of YAML text."""
        source, stdin = (str(manifest), None) if isinstance(manifest, Path) else ("-", manifest)
        return self.kubectl("apply", "--server-side", f"--field-manager={FIELD_MANAGER}", *extra, "-f", source,
                            stdin=stdin)  # fmt: skip

    def diagnostics(self) -> str:
        """What the cluster looks like, for a failure message (never fails itself)."""
        out = []
        for args in self.diagnose:
            done = subprocess.run(["kubectl", "--kubeconfig", str(self.kubeconfig), *args],
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
            out.append(f"$ kubectl {' '.join(args)}\n{done.stdout[-6000:]}{done.stderr[-2000:]}")
        return "\n".join(out)

    def gone(self, read: Callable[..., Any], *args: Any) -> bool:
        from kubernetes.client.exceptions import ApiException

        try:
            read(*args)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False


@contextlib.contextmanager
def temporary_namespace(cluster: Cluster, labels: dict[str, str] | None = None) -> Iterator[str]:
    """A fresh namespace ``bbt-<random>``, deleted at the end (the controller manager then removes what it holds)."""
    from kubernetes import client

    name = f"bbt-{secrets.token_hex(4)}"
    cluster.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels=labels)))
    try:
        yield name
    finally:
        cluster.core.delete_namespace(name)
