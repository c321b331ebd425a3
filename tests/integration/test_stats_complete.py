"""Every field of ``Stats`` means something after real traffic (issue 10 §2).

A sidecar serves requests over real gRPC on 127.0.0.1 in front of the engine
emulator; then the test walks the ``Stats`` descriptor recursively and fails on
any field still at its default.  ``Stats.throughput`` was never set (the
operator's ``status.throughputRequestsPerSecond`` always read "0"), which this
walk is here to catch for every field added later.
"""

from __future__ import annotations

import asyncio

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from sidecar_harness import prompt_request, running_sidecar, sidecar_config

from binbatch_operator.status import PodReport, aggregate
from binbatch_sidecar.emulator import EmulatorConfig, running_emulator

FAST = EmulatorConfig(step_a=0.001, step_c=0.0001, num_gpu_blocks=512, block_size=16)

# Fields legitimately at their default once the traffic below has been served,
# each with why.  Paths are dotted; a repeated message's items use "[]".
ALLOWED_DEFAULT = {
    "draining": "no SIGTERM was sent",
    "inflight_batches": "continuous mode holds no gang batches, and every call ended",
    "inflight_requests": "every request has been answered",
    "pending_requests": "every request has been answered",
    "totals.rejected": "nothing was refused (the queue never filled)",
    "totals.expired": "no deadline passed while queued",
    "totals.cancelled": "no caller left",
    "totals.failed": "the emulator answered every call",
    "metrics_source.last_error": "the last scrape succeeded",
    "engine_breaker.open_seconds": "the breaker is closed",
    "engine_breaker.reason": "the breaker never opened",
    "engine_breaker.opens": "the breaker never opened",
    "bins[].index": "bin 0 is index 0",
    "bins[].lower_tokens": "bin 0 starts at 0 tokens",
    "bins[].queue_depth": "every bin is empty after the traffic",
    "bins[].oldest_wait_seconds": "every bin is empty after the traffic",
}


def unset_fields(msg: Message, prefix: str = "") -> list[str]:
    """Dotted paths of the fields of ``msg`` (recursively) left at their default."""
    out = []
    for field in msg.DESCRIPTOR.fields:
        path = prefix + field.name
        value = getattr(msg, field.name)
        if field.is_repeated:
            if not len(value):
                out.append(path)
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                for item in value:
                    out += unset_fields(item, path + "[].")
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if not msg.HasField(field.name):
                out.append(path)
            else:
                out += unset_fields(value, path + ".")
        elif field.has_presence and not msg.HasField(field.name):
            out.append(path)
        elif not field.has_presence and value == field.default_value:
            out.append(path)
    return sorted(set(out))


async def test_every_stats_field_is_set_after_serving_traffic(tmp_path):
    doc = sidecar_config(
        "",
        bins={"count": 2, "maxOutputTokens": 64},
        batch={"sizing": "Combined", "staticSize": 4, "maxWaitMilliseconds": 5},
        latency={"tpotMilliseconds": 200},
        memory={"admission": "BatchSize"},  # b_mem is the BatchSize bound's (the default plans per request)
    )
    async with running_emulator(FAST) as url:
        doc["engine"]["url"], doc["metrics"]["url"] = url, url + "/metrics"
        async with running_sidecar(doc, tmp_path) as sc:
            await sc.sidecar.feed.poll_once()
            calls = [
                sc.inference.Generate(prompt_request(i, 8 + 40 * (i % 2), expected_output_tokens=8 + 40 * (i % 2)), timeout=60)
                for i in range(40)
            ]
            await asyncio.gather(*calls)
            await sc.sidecar.feed.poll_once()
            stats = await sc.stats()

    unset = [p for p in unset_fields(stats) if p not in ALLOWED_DEFAULT]
    assert unset == [], f"Stats fields never set after serving traffic: {unset}"
    assert stats.throughput.requests_per_second > 0 and stats.throughput.output_tokens_per_second > 0
    assert 0 < stats.throughput.window_seconds <= 60
    # The operator's status shows the sidecar's real figure, not a hand-filled one.
    _, fields = aggregate([PodReport("p", True, stats=stats)], [], children_ready=True)
    assert fields["throughputRequestsPerSecond"] == f"{stats.throughput.requests_per_second:.3g}"
    assert float(fields["throughputRequestsPerSecond"]) > 0
