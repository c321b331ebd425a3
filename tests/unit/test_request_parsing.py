"""The servicer's request parsing, without a network: classes and priorities,
the engine's max_tokens cap, strict metadata numbers (binbatch_sidecar.server.servicer)."""

from __future__ import annotations

import pytest

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar.config import parse_config
from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.former import BatchFormer
from binbatch_sidecar.server.servicer import InferenceServicer, InvalidRequest, decode_request

CONFIG = parse_config({
    "engine": {"model": "m"},
    "bins": {"maxOutputTokens": 300},
    "classes": {"classes": [{"name": "interactive", "priority": 10}, {"name": "batch", "priority": -10}]},
})  # fmt: skip


class Context:
    def __init__(self, metadata=()) -> None:
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata

    def time_remaining(self):
        return None


def build(msg: pb.GenerateRequest, metadata=()):
    servicer = InferenceServicer(None, ManualClock(), config=lambda: CONFIG, default_model=lambda: "m")  # type: ignore[arg-type]
    return servicer._build(msg, Context(metadata), stream=False)  # type: ignore[arg-type]


async def test_a_class_ranks_before_the_requests_own_priority_in_the_former():
    urgent_batch = build(pb.GenerateRequest(prompt="a", request_class="batch", priority=1000))[0]
    plain = build(pb.GenerateRequest(prompt="b", priority=0))[0]
    lazy_interactive = build(pb.GenerateRequest(prompt="c", request_class="interactive", priority=-1000))[0]
    clock = ManualClock()
    former = BatchFormer(FixedBinner([1000.0]), clock, target_size=3)
    for r in (urgent_batch, plain, lazy_interactive):
        r.predicted_tokens = 10.0
        former.submit(r)
    batch = former.take()
    assert batch is not None
    assert [r.request_class for r in batch.requests] == ["interactive", "", "batch"]


async def test_an_unknown_class_is_refused_naming_request_class():
    with pytest.raises(InvalidRequest, match=r"^request_class: unknown class 'offline'"):
        build(pb.GenerateRequest(prompt="a", request_class="offline"))


async def test_unset_max_tokens_sends_the_policy_cap_to_the_engine():
    req, call = build(pb.GenerateRequest(prompt="a"))
    assert call.engine_request.params.max_tokens == 300
    assert req.max_tokens == 0  # the predictor still sees "no max_tokens given"
    _, call = build(pb.GenerateRequest(prompt="a", max_tokens=7))
    assert call.engine_request.params.max_tokens == 7


@pytest.mark.parametrize("value", ["7 ", " 7", "1_000", "٣", "0x10", "10" * 10])
async def test_slo_metadata_takes_plain_ascii_digits_only(value):
    with pytest.raises(InvalidRequest, match="^x-slo-ttft-ms: "):
        build(pb.GenerateRequest(prompt="a"), metadata=(("x-slo-ttft-ms", value),))


async def test_a_valid_slo_sets_the_send_by_time():
    req, _ = build(pb.GenerateRequest(prompt="a"), metadata=(("x-slo-ttft-ms", "0400"),))
    assert req.send_by == pytest.approx(0.2)  # 50% of 400 ms


def test_a_corrupt_body_decodes_to_an_undecodable_marker():
    assert decode_request(pb.GenerateRequest(prompt="ok").SerializeToString()).prompt == "ok"
    bad = decode_request(b"\x0a\x02\xff\xfe")
    assert not isinstance(bad, pb.GenerateRequest)
    with pytest.raises(InvalidRequest, match="^request: "):
        build(bad)  # type: ignore[arg-type]



def test_an_unset_max_tokens_is_the_cap_within_the_engines_context():
    from binbatch_sidecar.server.servicer import TEMPLATE_TOKENS, unset_max_tokens

    assert unset_max_tokens(2048, None, "hi") == 2048  # context unknown: the cap
    assert unset_max_tokens(2048, 8192, "hi") == 2048  # room for the cap
    assert unset_max_tokens(2048, 256, "hi") == 256 - 2 - TEMPLATE_TOKENS  # the context is the limit
    long = "x" * 800  # 800 bytes: no room by bytes in a 512 context, room by ~4 bytes/token
    assert unset_max_tokens(2048, 512, long) == 512 - 200 - TEMPLATE_TOKENS
    assert unset_max_tokens(2048, 64, long) == 2048  # no room at all: the engine refuses, naming the context


async def test_a_request_counts_its_message_size_for_the_queued_bytes_bound():
    msg = pb.GenerateRequest(prompt="x" * 1000, max_tokens=3)
    req, _ = build(msg)
    assert req.body_bytes == msg.ByteSize() > 1000


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"prompt": "a\ud800"}, "prompt"),
        ({"messages": (("user", "fine"), ("user", "b\udc00"))}, "chat.messages[1].content"),
        ({"messages": (("us\udbff", "fine"),)}, "chat.messages[0].role"),
        ({"prompt": "ok", "stop": ("\ud800",)}, "stop[0]"),
        ({"prompt": "ok", "model": "m\udfff"}, "model"),
    ],
)
async def test_a_lone_surrogate_in_any_text_is_invalid_naming_the_field(fields, named):
    """The door-neutral intake: before the prompt-token estimate encodes it (which raised, a 500)."""
    from binbatch_sidecar.server.front import Fields
    from binbatch_sidecar.server.servicer import GRPC_NAMES

    servicer = InferenceServicer(None, ManualClock(), config=lambda: CONFIG, default_model=lambda: "m")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest) as err:
        servicer.front.build(Fields(**fields), False, GRPC_NAMES)
    assert str(err.value).startswith(f"{named}: ") and "surrogate" in str(err.value)
    assert err.value.param == named
