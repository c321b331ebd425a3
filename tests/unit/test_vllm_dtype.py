"""The real-vLLM test server's --dtype follows the CPU (vllm_support.server.cpu_dtype):
bfloat16 only where the CPU has native bf16 vector instructions."""

from __future__ import annotations

import pytest

from vllm_support.server import VllmServer, cpu_dtype

AVX2_EPYC = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma f16c\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ARM_BF16 = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n"


@pytest.fixture(autouse=True)
def _no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BINBATCH_VLLM_DTYPE", raising=False)


@pytest.mark.parametrize(("cpuinfo", "want"), [(AVX2_EPYC, "float32"), (SAPPHIRE, "bfloat16"), (ARM_BF16, "bfloat16"),
                                               ("", "float32")])  # fmt: skip
def test_bfloat16_only_with_native_bf16_instructions(cpuinfo: str, want: str) -> None:
    assert cpu_dtype(cpuinfo) == want


def test_the_environment_overrides_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BINBATCH_VLLM_DTYPE", "bfloat16")
    assert cpu_dtype(AVX2_EPYC) == "bfloat16"


def test_a_server_passes_its_dtype_to_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BINBATCH_VLLM_DTYPE", "float32")
    srv = VllmServer.from_profile("small_kv")
    srv.model_dir = "/m"  # type: ignore[assignment]
    cmd = srv.command()
    assert cmd[cmd.index("--dtype") + 1] == "float32"


@pytest.mark.parametrize(("dtype", "factor"), [("bfloat16", 1), ("float32", 2)])
def test_every_dtype_gets_the_same_tokens_of_kv_cache(monkeypatch: pytest.MonkeyPatch, dtype: str, factor: int) -> None:
    """A profile sized in bytes (the default's 256 MiB = 131072 bfloat16 tokens) is given the
    bytes its dtype needs for the same tokens: the tests' capacity does not depend on the CPU."""
    srv = VllmServer.from_profile("default", dtype=dtype)
    srv.model_dir = "/m"  # type: ignore[assignment]
    cmd = srv.command()
    assert int(cmd[cmd.index("--kv-cache-memory-bytes") + 1]) == 256 * 2**20 * factor
