"""Start and stop a REAL Prometheus server for tests (issue 12: the PromQL metrics
source is proven on the real query engine, not only on a table-driven fake).

Like the vLLM venv (``vllm_support.server.ensure_vllm_env``), the test session
installs what it needs itself: ``ensure_prometheus`` runs Debian's
``apt-get install prometheus`` when no ``prometheus`` binary is on PATH (CI runs
as root on a fresh Debian machine with the package registry reachable). A failed
install raises ``PrometheusStartError`` with apt's output: the test fails, it is
never skipped.

    with PrometheusServer(targets={"fast": "127.0.0.1:8000"}, tmp=tmp_path) as prom:
        prom.url                       # http://127.0.0.1:PORT
        prom.wait_until_scraped("fast")  # polls /api/v1/targets, bounded

Standard library only (it runs before and beside the async tests' event loop).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

APT_PACKAGE = "prometheus"
INSTALL_TIMEOUT_SECONDS = 600
START_TIMEOUT_SECONDS = 30.0
POLL_SECONDS = 0.1


class PrometheusStartError(RuntimeError):
    """Prometheus could not be installed, started, or did not scrape its targets."""


def ensure_prometheus(timeout: float = INSTALL_TIMEOUT_SECONDS) -> str:
    """The ``prometheus`` binary, installed from Debian's package if missing."""
    found = shutil.which("prometheus")
    if found:
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    steps = (
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends", APT_PACKAGE],
    )
    for cmd in steps:
        try:
            proc = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout, check=False)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise PrometheusStartError(f"{' '.join(cmd)} could not run: {exc}") from None
        if proc.returncode != 0:
            out = (proc.stdout + proc.stderr).strip().splitlines()
            raise PrometheusStartError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n" + "\n".join(out[-40:]))
    # Debian installs it as /usr/bin/prometheus and starts a system service we do not use.
    found = shutil.which("prometheus")
    if not found:
        raise PrometheusStartError(f"apt-get installed {APT_PACKAGE} but no prometheus binary is on PATH")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def scrape_config(targets: dict[str, str], interval_seconds: int) -> str:
    """A prometheus.yml: one job per target (``job`` label = its key), scraped every
    ``interval_seconds``; JSON is YAML, so no YAML writer is needed."""
    doc = {
        "global": {"scrape_interval": f"{interval_seconds}s", "scrape_timeout": f"{interval_seconds}s"},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [address]}]}
                           for job, address in targets.items()],
    }  # fmt: skip
    return json.dumps(doc, indent=2)


class PrometheusServer:
    """One Prometheus on 127.0.0.1 (a free port) scraping ``targets`` (job -> host:port,
    path /metrics) every ``interval_seconds``, its TSDB and log under ``tmp``."""

    def __init__(self, targets: dict[str, str], tmp: Path, *, interval_seconds: int = 1) -> None:
        self.targets = targets
        self.tmp = Path(tmp)
        self.interval_seconds = interval_seconds
        self.port = 0
        self.log_path = self.tmp / "prometheus.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = ensure_prometheus()
        self.tmp.mkdir(parents=True, exist_ok=True)
        config = self.tmp / "prometheus.yml"
        config.write_text(scrape_config(self.targets, self.interval_seconds))
        (self.tmp / "tsdb").mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{self.port}",
                 f"--storage.tsdb.path={self.tmp / 'tsdb'}"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp,
            )  # fmt: skip
        self._until(lambda: self._get("/-/ready", raw=True) is not None, "ready")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def __enter__(self) -> PrometheusServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # -- the HTTP API ------------------------------------------------------------------

    def wait_until_scraped(self, *jobs: str) -> None:
        """Until every job's target is up (scraped successfully at least once)."""

        def up() -> bool:
            body = self._get("/api/v1/targets")
            if body is None:
                return False
            health = {t["labels"].get("job"): t.get("health") for t in body["data"]["activeTargets"]}
            return all(health.get(job) == "up" for job in jobs)

        self._until(up, f"targets {', '.join(jobs)} up")

    def wait_for_scrape_after(self, job: str, wall_time: float) -> None:
        """Until ``job``'s target was scraped after ``wall_time`` (``time.time()``):
        the timestamp of its ``up`` sample is when that scrape started."""

        def scraped() -> bool:
            rows = self.query(f'timestamp(up{{job="{job}"}})')
            return bool(rows) and float(rows[0]["value"][1]) > wall_time

        self._until(scraped, f"{job} scraped after {wall_time:.3f}")

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result vector."""
        body = self._get("/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        if body is None:
            raise PrometheusStartError(f"Prometheus did not answer the query {promql!r}")
        return body["data"]["result"]

    def _get(self, path: str, *, raw: bool = False) -> Any:
        """GET ``path``: the JSON body (or the text, ``raw``), None if not answering yet."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as resp:  # noqa: S310 - loopback only
                text = resp.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None
        return text if raw else json.loads(text)

    def _until(self, condition, what: str, timeout: float = START_TIMEOUT_SECONDS) -> None:
        """Poll ``condition`` until it holds, for at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self._proc is not None and self._proc.poll() is not None:
                raise PrometheusStartError(f"prometheus exited ({self._proc.returncode}):\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise PrometheusStartError(f"prometheus: not {what} within {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(POLL_SECONDS)  # ok-sleep: polls an external process's HTTP API, bounded by the deadline
