"""The scrape parses only the families the sizer reads, with the same result as a
full parse (issue 11: the full parse cost ~16 ms per scrape on a real vLLM)."""

from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from binbatch_sidecar.emulator.config import EmulatorConfig
from binbatch_sidecar.emulator.metrics import EmulatorMetrics
from binbatch_sidecar.engine import vllm_metrics


def _exposition(*, legacy: bool) -> str:
    """A vLLM-format /metrics: the vLLM families (the emulator renders vLLM's
    names, labels, buckets and ``_created`` samples) with observations, vLLM
    families the sizer does not read, and the Python process/GC collectors a
    real vLLM server exports."""
    m = EmulatorMetrics(EmulatorConfig(legacy_names=legacy))
    m.running.set(7)
    m.waiting.set(2)
    m.kv_usage.set(0.75)
    m.preemptions.inc(14)
    for x in (0.02, 0.03, 0.045, 0.02, 0.03, 0.045):
        m.itl.observe(x)
    m.ttft.observe(0.15)
    m.e2e.observe(1.5)
    texts = [m.render().decode()]
    other = CollectorRegistry()
    ProcessCollector(registry=other)
    PlatformCollector(registry=other)
    GCCollector(registry=other)
    Counter("vllm:iteration_tokens", "Tokens per engine step.", ["model_name"], registry=other).labels("m").inc(5)
    Histogram("vllm:request_prompt_tokens", "Prompt tokens.", ["model_name"], registry=other).labels("m").observe(9)
    texts.append(generate_latest(other).decode())
    return "".join(texts)


def _full_parse(text: str, monkeypatch: pytest.MonkeyPatch) -> vllm_metrics.EngineMetrics:
    """``parse`` as it was: every line handed to prometheus-client's parser."""
    with monkeypatch.context() as m:
        m.setattr(vllm_metrics, "relevant_lines", lambda t: t)
        return vllm_metrics.parse(text)


@pytest.mark.parametrize("legacy", [False, True])
def test_filtered_parse_equals_the_full_parse_of_a_vllm_exposition(legacy: bool, monkeypatch) -> None:
    text = _exposition(legacy=legacy)
    full = _full_parse(text, monkeypatch)
    fast = vllm_metrics.parse(text)
    assert full.itl is not None and full.itl.count == 6 and full.preemptions == 14  # the sample has data
    assert dataclasses.replace(fast, names_seen=frozenset()) == dataclasses.replace(full, names_seen=frozenset())
    wanted = {name for names in vllm_metrics.ALIASES.values() for name in names}
    assert fast.names_seen == full.names_seen & wanted


def test_parser_is_handed_no_bucket_and_no_foreign_family() -> None:
    kept = vllm_metrics.relevant_lines(_exposition(legacy=False))
    assert "_bucket" not in kept and "process_" not in kept and "python_gc" not in kept
    assert "vllm:e2e_request_latency_seconds" not in kept and "vllm:iteration_tokens" not in kept
    assert "vllm:inter_token_latency_seconds_sum" in kept and "# TYPE vllm:num_requests_running gauge" in kept


def test_a_malformed_family_the_sizer_does_not_read_fails_no_scrape() -> None:
    text = _exposition(legacy=False) + "vllm:some_new_metric{broken 1\n"
    assert vllm_metrics.parse(text).running == 7


def test_a_malformed_family_the_sizer_reads_still_fails_the_parse() -> None:
    with pytest.raises(ValueError):
        vllm_metrics.parse("vllm:num_requests_running{broken 1\n")


def test_exposes_vllm_sees_a_sample_of_any_vllm_family() -> None:
    assert vllm_metrics.exposes_vllm("# HELP x y\nvllm:whatever 1\n")
    assert not vllm_metrics.exposes_vllm("process_cpu_seconds_total 1\n# TYPE vllm:x gauge\n")


def test_the_filtered_scrape_keeps_the_engines_waiting_by_model() -> None:
    """binbatch_requests_waiting adds vLLM's own waiting, per model_name, from the
    pre-filtered scrape; a series without model_name counts under ""."""
    text = _exposition(legacy=False).replace(
        'vllm:num_requests_waiting{engine="0",model_name="emulated"} 2.0\n',
        'vllm:num_requests_waiting{engine="0",model_name="emulated"} 2.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="other-model"} 5.0\n'
        'vllm:num_requests_waiting{engine="2",model_name="other-model"} 1.0\n'
        'vllm:num_requests_waiting{engine="3"} 4.0\n',
    )
    m = vllm_metrics.parse(text)
    assert m.waiting_by_model == {"emulated": 2.0, "other-model": 6.0, "": 4.0}
    assert m.waiting == 12.0
    assert vllm_metrics.parse("vllm:num_requests_running 1\n").waiting_by_model is None


def test_kv_capacity_leaves_out_vllms_null_block():
    """vLLM's v1 block pool keeps one block back (its null block), so the cache
    holds (num_gpu_blocks - 1) x block_size tokens of requests."""
    text = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="32",num_gpu_blocks="24"} 1.0\n')  # fmt: skip
    metrics = vllm_metrics.parse(text)
    assert (metrics.num_gpu_blocks, metrics.block_size) == (24, 32)
    assert metrics.kv_capacity_tokens == 23 * 32
