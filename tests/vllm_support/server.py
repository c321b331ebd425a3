"""Start and stop a REAL vLLM CPU server for tests (DESIGN.md §4, engine 3).

Importable from the sidecar's own venv: it needs only the standard library (no
vllm, no aiohttp). vLLM runs from a venv of its own, built by
``build_vllm_env.sh``; the model is a tiny random-weight Llama built locally by
``build_tiny_model.py`` (no hub downloads exist here). Both are cached under
``~/.cache/binbatch`` and rebuilt only when their pinned parameters change.

    with VllmServer.from_profile("small_kv") as srv:   # or VllmServer(extra_args=[...])
        srv.base_url     # http://127.0.0.1:PORT
        srv.metrics_url  # http://127.0.0.1:PORT/metrics
        srv.model        # "tiny" (the served model name)
        srv.log_path     # the server's stdout+stderr

Environment knobs (all optional):
  BINBATCH_CACHE_DIR       root of all of the below (default ~/.cache/binbatch)
  BINBATCH_VLLM_VENV       the vLLM venv (default ~/.cache/binbatch/vllm-venv)
  BINBATCH_VLLM_MODELS     where tiny models are built (default ~/.cache/binbatch/models)
  BINBATCH_VLLM_LOG_DIR    where server logs go (default ~/.cache/binbatch/logs, last 20 kept)
  BINBATCH_VLLM_STARTUP_TIMEOUT  seconds to wait for /health (default 300)
  BINBATCH_VLLM_DTYPE      the model's --dtype (default: ``cpu_dtype()``)

Only one vLLM should run at a time on a 2-core machine; this helper does not
enforce it, the pytest fixtures do (see tests/integration/conftest.py).
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD_ENV_SCRIPT = HERE / "build_vllm_env.sh"
BUILD_MODEL_SCRIPT = HERE / "build_tiny_model.py"

CACHE_ROOT = Path(os.environ.get("BINBATCH_CACHE_DIR", Path.home() / ".cache" / "binbatch"))
SERVED_MODEL_NAME = "tiny"
API_KEY = "binbatch-test-engine-key"  # the "api_key" profile's --api-key (a test value, not a secret)


DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def cpu_dtype(cpuinfo: str | None = None) -> str:
    """The --dtype this CPU runs fast: bfloat16 where it has native bf16 vector
    instructions (AVX512_BF16 or AMX), else float32.  Without them PyTorch's CPU
    matmul falls back to a scalar bf16 loop: on a 2-core AVX2-only EPYC the large
    model generated 22 tokens/s in bfloat16 and 71 in float32 (8 streams of 128),
    and every real-vLLM test and bench ran ~3x slower.  ``BINBATCH_VLLM_DTYPE``
    overrides it."""
    if os.environ.get("BINBATCH_VLLM_DTYPE"):
        return os.environ["BINBATCH_VLLM_DTYPE"]
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "bfloat16"  # not Linux/x86 as we know it: vLLM's own default for CPUs
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.partition(":")[2].split())
    return "bfloat16" if flags & {"avx512_bf16", "amx_bf16", "bf16"} else "float32"


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the random-weight Llama. The default is the fast one the tests use."""

    layers: int = 2
    hidden: int = 256
    vocab: int = 4096
    seed: int = 0
    positions: int = 2048  # max_position_embeddings: the longest context vLLM may serve

    @property
    def dirname(self) -> str:
        longer = f"-p{self.positions}" if self.positions != 2048 else ""
        return f"tiny-llama-l{self.layers}-h{self.hidden}-v{self.vocab}-s{self.seed}{longer}"


SMALL_MODEL = TinyModelSpec()
# 138 M parameters (44x SMALL_MODEL): inter-token latency ~35 ms instead of ~7 ms,
# in the range vLLM's ITL histogram resolves (its first bucket bound is 10 ms).
LARGE_MODEL = TinyModelSpec(layers=8, hidden=1024, vocab=4096, seed=0)


# Named server configurations for the tests. Only one vLLM runs at a time on a
# 2-core machine, so the pytest fixture takes a profile name as its parameter and
# pytest tears one profile's server down before it starts the next.
PROFILES: dict[str, dict[str, object]] = {
    # Ample KV cache (1024 blocks of 128 tokens = 131072 tokens): nothing queues
    # for memory (vLLM's CPU default caps running requests at max_num_seqs=128).
    "default": {},
    # The default server started with --api-key: /v1/* wants "Authorization: Bearer
    # API_KEY" (/health, which the start-up polls, and /metrics stay open).
    "api_key": {"extra_args": ("--api-key", API_KEY)},
    # 16 blocks of 32 tokens (15 usable, 480 tokens): 32 concurrent requests of
    # 16 prompt + 160 output tokens (6 blocks each at the end) must queue
    # (num_requests_waiting > 0) and get preempted (num_preemptions_total grows).
    # --max-model-len must fit in the blocks (vLLM refuses to start otherwise).
    "small_kv": {
        "extra_args": ("--num-gpu-blocks-override", "16", "--block-size", "32"),
        "max_model_len": 256,
    },
    # 8 layers, hidden 1024 (138 M parameters): inter-token latency ~35 ms alone,
    # ~50 ms at 32 concurrent, so vLLM's ITL histogram (first bucket 10 ms) resolves
    # it. Not used by default; for TPOT-SLA experiments.
    "large": {"model_spec": LARGE_MODEL, "kv_cache_bytes": 2**30},
    # The large model with the small_kv cache (15 usable blocks of 32 tokens): a
    # GPU-like step cost and KV-limited concurrency, so a burst is preempted. The
    # CI smoke run of `binbatch bench e2e --engine` (test_bench_e2e_vllm.py).
    "large_small_kv": {
        "model_spec": LARGE_MODEL,
        "extra_args": ("--num-gpu-blocks-override", "16", "--block-size", "32"),
        "max_model_len": 256,
    },
    # The large model with 24 blocks of 32 tokens (768, the embedded engine's
    # KV_LIMITED budget): the full bench's chat scenarios (docs/results-vllm-cpu.md).
    "large_kv_limited": {
        "model_spec": LARGE_MODEL,
        "extra_args": ("--num-gpu-blocks-override", "24", "--block-size", "32"),
        "max_model_len": 512,
    },
    # The large model for the ShareGPT replay (`bench e2e --only sharegpt
    # --sharegpt-scale 0.25`): replayed prompts reach 2,901 of this tokenizer's tokens
    # (mean 286), so the context is 4,096: the large model built with 4,096 positions
    # (the same weights; RoPE has none). 129 blocks of 32 tokens (one is vLLM's null block: 4,096 usable, the least
    # it accepts for that context) hold about 11 of the replay's mean sequences.
    "large_sharegpt": {
        "model_spec": replace(LARGE_MODEL, positions=4096),
        "extra_args": ("--num-gpu-blocks-override", "129", "--block-size", "32"),
        "max_model_len": 4096,
    },
}


class VllmStartError(RuntimeError):
    """vLLM (or its environment, or its model) could not be brought up."""


def vllm_venv() -> Path:
    return Path(os.environ.get("BINBATCH_VLLM_VENV", CACHE_ROOT / "vllm-venv"))


def vllm_python() -> Path:
    return vllm_venv() / "bin" / "python"


def _neutral_cwd() -> Path:
    # `python -m …` puts the working directory first on sys.path; in the repo root
    # the top-level operator/ folder would shadow the stdlib module of that name.
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    return CACHE_ROOT


def _run_logged(cmd: Sequence[str | Path], what: str, timeout: float) -> None:
    """Run a build step, then echo its output to stderr (pytest shows it on failure).

    Raises VllmStartError with the output's tail if it fails or overruns.
    """
    print(f"[vllm_support] {what}: {' '.join(map(str, cmd))}", file=sys.stderr, flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(
            list(map(str, cmd)),
            cwd=_neutral_cwd(),
            env={**_clean_env(), "BINBATCH_VLLM_VENV": str(vllm_venv())},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.output.decode(errors="replace") if isinstance(exc.output, bytes) else ""
        tail = "\n".join((out or "").splitlines()[-40:])
        raise VllmStartError(f"{what} did not finish in {timeout:.0f} s:\n{tail}") from None
    for line in proc.stdout.splitlines():
        if "is ignored: it is neither a file nor a directory" not in line:
            print(f"    {line}", file=sys.stderr)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-40:])
        raise VllmStartError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    print(
        f"[vllm_support] {what}: ok in {time.monotonic() - start:.1f} s",
        file=sys.stderr,
        flush=True,
    )


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    # The vLLM venv is self-contained: never let the caller's interpreter settings in.
    for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"):
        env.pop(key, None)
    return env


def ensure_vllm_env(timeout: float = 1800) -> Path:
    """Build or reuse the vLLM venv; return its python."""
    _run_logged(["bash", BUILD_ENV_SCRIPT], "vLLM venv", timeout)
    python = vllm_python()
    if not python.exists():
        raise VllmStartError(f"{BUILD_ENV_SCRIPT} succeeded but {python} does not exist")
    return python


def ensure_tiny_model(spec: TinyModelSpec = SMALL_MODEL, timeout: float = 900) -> Path:
    """Build or reuse the tiny model for ``spec``; return its folder."""
    root = Path(os.environ.get("BINBATCH_VLLM_MODELS", CACHE_ROOT / "models"))
    out = root / spec.dirname
    _run_logged(
        [
            vllm_python(),
            BUILD_MODEL_SCRIPT,
            "--out",
            out,
            "--layers",
            str(spec.layers),
            "--hidden",
            str(spec.hidden),
            "--vocab",
            str(spec.vocab),
            "--seed",
            str(spec.seed),
            "--positions",
            str(spec.positions),
        ],
        f"tiny model {spec.dirname}",
        timeout,
    )
    return out


def _prune_logs(log_dir: Path, keep: int) -> None:
    logs = sorted(log_dir.glob("vllm-*.log"), key=lambda p: p.stat().st_mtime)
    for old in logs[:-keep] if keep else logs:
        with contextlib.suppress(OSError):
            old.unlink()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# Talk to 127.0.0.1 directly even when the environment sets an HTTP proxy.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with _NO_PROXY_OPENER.open(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def server_env() -> dict[str, str]:
    """The environment the vLLM CPU build needs here (2 cores, no network, no GPU)."""
    env = _clean_env()
    # The legacy KV-size variable (GiB) would override --kv-cache-memory-bytes.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    env.update(
        {
            # No hub: the model is a local folder; never try to reach huggingface.
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            # vLLM would report usage statistics over the network.
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "DO_NOT_TRACK": "1",
            # Keep vLLM's internal sockets on loopback (it otherwise asks the
            # routing table for the outward interface's address).
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_LOOPBACK_IP": "127.0.0.1",
            # "auto" binds the model's OpenMP threads to one core and keeps the
            # other for the API server and engine-core processes (and our test
            # client), which is what a 2-core machine wants.
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            # Trace the model with dynamo but skip inductor code generation:
            # start-up ~25 s faster, and the tiny model is not compute-bound anyway.
            "VLLM_CPU_CI_ENV": os.environ.get("VLLM_CPU_CI_ENV", "1"),
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    return env


@dataclass(eq=False)
class VllmServer:
    """One vLLM OpenAI-compatible server process serving a tiny local model."""

    extra_args: Sequence[str] = ()
    model_spec: TinyModelSpec = SMALL_MODEL
    dtype: str = field(default_factory=cpu_dtype)
    max_model_len: int = 1024
    # Explicit KV cache size. Without it the CPU backend takes 92% of the machine's
    # memory. In bfloat16 terms: the small model needs 2 KiB per token, so 256 MiB =
    # 131072 tokens (1024 blocks of 128); the large one 32 KiB (8192 tokens). A
    # float32 server (``cpu_dtype``) is given twice the bytes (``kv_bytes``), so every
    # profile holds the same tokens whatever the CPU.
    kv_cache_bytes: int = 256 * 2**20
    startup_timeout: float = field(
        default_factory=lambda: float(os.environ.get("BINBATCH_VLLM_STARTUP_TIMEOUT", "300"))
    )
    host: str = "127.0.0.1"
    log_dir: Path | None = None

    port: int = 0
    model_dir: Path | None = None
    log_path: Path | None = None
    startup_seconds: float | None = None
    _proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    model: str = SERVED_MODEL_NAME

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"

    @property
    def health_url(self) -> str:
        return f"{self.base_url}/health"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @classmethod
    def from_profile(cls, name: str, **overrides: object) -> VllmServer:
        """A server configured by one of PROFILES (keyword arguments override it)."""
        try:
            settings = dict(PROFILES[name])
        except KeyError:
            raise KeyError(f"unknown vLLM profile {name!r}; known: {sorted(PROFILES)}") from None
        settings.update(overrides)
        return cls(**settings)  # type: ignore[arg-type]

    # -- lifecycle ---------------------------------------------------------

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def kv_bytes(self) -> int:
        """``kv_cache_bytes`` (sized for bfloat16) scaled to this server's dtype's element size."""
        return self.kv_cache_bytes * DTYPE_BYTES.get(self.dtype, 2) // 2

    def command(self) -> list[str]:
        assert self.model_dir is not None
        return [
            str(vllm_python()),
            "-m",
            "vllm.entrypoints.openai.api_server",  # the `vllm` console script fails here
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--seed",
            "0",
            "--kv-cache-memory-bytes",
            str(self.kv_bytes),
            # /health is polled; keep the log readable.
            "--disable-uvicorn-access-log",
            *map(str, self.extra_args),
        ]

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("already started")
        ensure_vllm_env()
        self.model_dir = ensure_tiny_model(self.model_spec)
        log_dir = self.log_dir or Path(
            os.environ.get("BINBATCH_VLLM_LOG_DIR") or CACHE_ROOT / "logs"
        )
        log_dir.mkdir(parents=True, exist_ok=True)
        _prune_logs(log_dir, keep=20)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        # A port picked here may be taken before vLLM binds it; retry that case.
        for attempt in range(3):
            self.port = free_port(self.host)
            self.log_path = log_dir / f"vllm-{stamp}-{self.model_spec.dirname}-{self.port}.log"
            try:
                self._launch_and_wait()
                return
            except VllmStartError as exc:
                self.stop()
                if "address already in use" in str(exc).lower() and attempt < 2:
                    continue
                raise
            except BaseException:  # Ctrl-C while waiting: the server has its own session
                self.stop()
                raise

    def _launch_and_wait(self) -> None:
        assert self.log_path is not None
        cmd = self.command()
        start = time.monotonic()
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            self._proc = subprocess.Popen(
                cmd,
                cwd=_neutral_cwd(),
                env=server_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Own process group, so stop() reaches the engine-core and worker
                # processes vLLM forks, and Ctrl-C in pytest does not hit them first.
                start_new_session=True,
            )
        _RUNNING.add(self)
        print(
            f"[vllm_support] started vLLM pid {self._proc.pid} on {self.base_url}, "
            f"log {self.log_path}",
            file=sys.stderr,
            flush=True,
        )
        deadline = start + self.startup_timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                raise VllmStartError(
                    f"vLLM exited with code {code} during start-up; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                status, _ = http_get(self.health_url, timeout=2.0)
            except (OSError, http.client.HTTPException):
                status = 0  # not listening yet
            if status == 200:
                break
            if time.monotonic() > deadline:
                raise VllmStartError(
                    f"vLLM not healthy after {self.startup_timeout:.0f} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.25)  # ok-sleep: the poll interval of a readiness check
        self.startup_seconds = time.monotonic() - start
        print(
            f"[vllm_support] vLLM healthy after {self.startup_seconds:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after ``grace`` s; wait."""
        proc, self._proc = self._proc, None
        _RUNNING.discard(self)
        if proc is None:
            return None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # The engine-core and worker processes shut down after the API server; let
        # them (bounded), then kill whatever the group still holds.
        deadline = time.monotonic() + 10.0
        while _group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)  # ok-sleep: bounded poll for the children to exit
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def rss_bytes(self) -> int:
        """Resident memory of the server's whole process group (Linux /proc)."""
        if self._proc is None:
            return 0
        total = 0
        for pid in _group_members(self._proc.pid):
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        return total


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, from Linux /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


# Last resort: a server left running (an interrupted session, a forgotten stop())
# must not outlive the interpreter that started it.
_RUNNING: weakref.WeakSet[VllmServer] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop(grace=10.0)


def main(argv: list[str] | None = None) -> int:
    """Start a server by hand: python tests/vllm_support/server.py [--large | --profile NAME] [-- vLLM args]."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--large", action="store_true", help="8 layers, hidden 1024")
    parser.add_argument("--profile", choices=sorted(PROFILES), help="one of the tests' PROFILES (overrides --large)")
    parser.add_argument("--dtype", default=cpu_dtype(), help="default: bfloat16 on CPUs with native bf16, else float32")
    parser.add_argument("vllm_args", nargs="*", help="extra vLLM arguments (after --)")
    args = parser.parse_args(argv)
    if args.profile:
        base = PROFILES[args.profile]
        srv = VllmServer.from_profile(
            args.profile, dtype=args.dtype, extra_args=(*base.get("extra_args", ()), *args.vllm_args)
        )
    else:
        srv = VllmServer(
            extra_args=args.vllm_args,
            model_spec=LARGE_MODEL if args.large else SMALL_MODEL,
            dtype=args.dtype,
        )
    # a background job ignores SIGINT: let SIGTERM stop the server the same way
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with srv:
        print(f"base_url={srv.base_url} log={srv.log_path} rss={srv.rss_bytes() / 2**30:.2f} GiB", flush=True)
        print("Ctrl-C or SIGTERM stops it.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            srv._proc.wait()  # type: ignore[union-attr]
    return 0


if __name__ == "__main__":
    sys.exit(main())
