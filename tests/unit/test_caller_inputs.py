"""What a caller sends to steer its place in the queue is earned (binbatch_sidecar.server.front):
a hint its own request contradicts is refused naming the header or field; a hint, priority or SLO
header its class may not send is ignored and counted; a class whose hints run long loses them."""

from __future__ import annotations

import logging

import pytest

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar.config import parse_config
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.hint_trust import MIN_SAMPLES, WINDOW
from binbatch_sidecar.engine.dispatcher import Completion
from binbatch_sidecar.engine.engine_client import EngineResult
from binbatch_sidecar.engine.sidecar_metrics import SidecarMetrics
from binbatch_sidecar.server.front import PRIORITY_SPAN, Fields, Front, InvalidRequest
from binbatch_sidecar.server.openai_http import HEADER_NAMES
from binbatch_sidecar.server.servicer import GRPC_NAMES, InferenceServicer

CONFIG = parse_config({
    "engine": {"model": "m"},
    "bins": {"maxOutputTokens": 4096},
    "latency": {"ttftMilliseconds": 10_000},
    "classes": {"classes": [
        {"name": "trusted", "priority": 5, "allowPriority": True, "allowSloHeaders": True},
        {"name": "batch", "priority": -5},  # the defaults: hints only
        {"name": "free", "allowHints": False},
    ]},
})  # fmt: skip


class Dispatcher:
    def __init__(self) -> None:
        self.submitted = []

    def submit(self, req, call) -> None:
        self.submitted.append(req)

    def cancel(self, req) -> None:
        pass


def front(config=CONFIG, metrics=None) -> Front:
    return Front(Dispatcher(), ManualClock(), config=lambda: config, default_model=lambda: "m", metrics=metrics)  # type: ignore[arg-type]


def ignored(metrics: SidecarMetrics, what: str) -> float:
    return metrics.registry.get_sample_value("binbatch_ignored_inputs_total", {"input": what})


def done(tokens: int) -> Completion:
    return Completion(EngineResult("", "length", 1, tokens), 0.0, 0.0, 0, 1, 0.0)


# -- 1. a hint the request itself contradicts ----------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (Fields(prompt="p", max_tokens=2048, min_tokens=2000, expected_output_tokens=1), "1 is below min_tokens 2000"),
        (Fields(prompt="p", max_tokens=2000, ignore_eos=True, expected_output_tokens=1),
         "1 is below max_tokens 2000: with ignore_eos and no stop sequence the answer runs to max_tokens"),
        (Fields(prompt="p", ignore_eos=True, expected_output_tokens=100),  # no max_tokens: it runs to the cap
         "100 is below max_tokens 4096"),
    ],
)  # fmt: skip
async def test_a_hint_the_request_contradicts_is_refused_naming_the_header(fields, words):
    with pytest.raises(InvalidRequest) as err:
        front().build(fields, stream=False, names=HEADER_NAMES)
    assert err.value.param == "x-expected-output-tokens"
    assert str(err.value).startswith("x-expected-output-tokens: ") and words in str(err.value)


async def test_a_hint_the_request_contradicts_is_refused_naming_the_grpc_field():
    servicer = InferenceServicer(None, ManualClock(), config=lambda: CONFIG, default_model=lambda: "m")  # type: ignore[arg-type]

    class Context:
        def invocation_metadata(self):
            return ()

        def time_remaining(self):
            return None

    msg = pb.GenerateRequest(prompt="p", max_tokens=2048, min_tokens=2000, expected_output_tokens=1)
    with pytest.raises(InvalidRequest, match=r"^expected_output_tokens: 1 is below min_tokens 2000"):
        servicer._build(msg, Context(), stream=False)  # type: ignore[arg-type]
    msg = pb.GenerateRequest(prompt="p", max_tokens=300, ignore_eos=True, expected_output_tokens=299)
    with pytest.raises(InvalidRequest, match=r"^expected_output_tokens: 299 is below max_tokens 300"):
        servicer._build(msg, Context(), stream=False)  # type: ignore[arg-type]
    assert GRPC_NAMES.get("expected_output_tokens", "expected_output_tokens") == "expected_output_tokens"


@pytest.mark.parametrize(
    "fields",
    [
        Fields(prompt="p", max_tokens=2048, min_tokens=2000, expected_output_tokens=2000),  # at min_tokens
        Fields(prompt="p", max_tokens=300, ignore_eos=True, expected_output_tokens=300),  # runs to max_tokens
        Fields(prompt="p", max_tokens=300, ignore_eos=True, expected_output_tokens=4000),  # above: capped
        Fields(prompt="p", max_tokens=300, ignore_eos=True, stop=("\n\n",), expected_output_tokens=20),  # may stop
        Fields(prompt="p", max_tokens=300, min_tokens=10, expected_output_tokens=20),
    ],
)
async def test_a_hint_the_request_leaves_possible_places_it(fields):
    req = front().build(fields, stream=False, names=HEADER_NAMES).req
    assert req.hint_tokens == float(fields.expected_output_tokens)


# -- 2. what a class may send ---------------------------------------------------------------------------


async def test_inputs_a_class_may_not_send_are_ignored_and_counted_and_the_request_is_served():
    metrics = SidecarMetrics()
    door = front(metrics=metrics)
    slo = {"x-slo-ttft-ms": 100, "x-slo-tpot-ms": 20}
    ticket = await door.submit(Fields(prompt="p", request_class="batch", priority=1000, slo=dict(slo),
                                      expected_output_tokens=7), stream=False)  # fmt: skip
    req = ticket.req
    assert door.dispatcher.submitted == [req]  # served
    assert req.priority == -5 * PRIORITY_SPAN  # the class's rank only, as if no priority was sent
    assert req.tpot_slo is None and req.send_by == pytest.approx(5.0)  # the policy's TTFT target's share, not 100 ms
    assert req.hint_tokens == 7.0  # hints are allowed by default
    assert (ignored(metrics, "priority"), ignored(metrics, "slo"), ignored(metrics, "hint")) == (1.0, 1.0, 0.0)

    ticket = await door.submit(Fields(prompt="p", request_class="free", expected_output_tokens=1, min_tokens=50,
                                      max_tokens=60), stream=False)  # fmt: skip
    # an ignored hint is not sent: its request is served as without it, not refused for contradicting it
    assert ticket.req.hint_tokens is None and ticket.judged_hint is None
    assert ignored(metrics, "hint") == 1.0


async def test_a_class_that_says_so_steers_with_all_three():
    metrics = SidecarMetrics()
    door = front(metrics=metrics)
    ticket = await door.submit(Fields(prompt="p", request_class="trusted", priority=1000, expected_output_tokens=7,
                                      slo={"x-slo-ttft-ms": 100, "x-slo-tpot-ms": 20}), stream=False)  # fmt: skip
    req = ticket.req
    assert req.priority == 5 * PRIORITY_SPAN + 1000
    assert req.tpot_slo == pytest.approx(0.02) and req.send_by == pytest.approx(0.05)
    assert req.hint_tokens == 7.0 and ticket.ignored == ()
    assert [ignored(metrics, w) for w in ("hint", "priority", "slo")] == [0.0, 0.0, 0.0]


async def test_a_policy_without_classes_honours_everything_as_before_until_it_says_otherwise():
    plain = front(parse_config({"engine": {"model": "m"}}))
    req = plain.build(Fields(prompt="p", priority=-3, expected_output_tokens=9, slo={"x-slo-tpot-ms": 20}), False).req
    assert (req.priority, req.hint_tokens, req.tpot_slo) == (-3, 9.0, pytest.approx(0.02))
    strict = parse_config({"engine": {"model": "m"}, "classes": {"default": {
        "allowHints": False, "allowPriority": False, "allowSloHeaders": False}}})  # fmt: skip
    ticket = front(strict).build(Fields(prompt="p", priority=-3, expected_output_tokens=9,
                                        slo={"x-slo-tpot-ms": 20}), False)  # fmt: skip
    assert (ticket.req.priority, ticket.req.hint_tokens, ticket.req.tpot_slo) == (0, None, None)
    assert ticket.ignored == ("hint", "priority", "slo")


async def test_a_refused_request_counts_no_ignored_input():
    metrics = SidecarMetrics()
    with pytest.raises(InvalidRequest, match="^temperature"):
        await front(metrics=metrics).submit(Fields(prompt="p", request_class="batch", priority=5, temperature=-1.0),
                                            stream=False)  # fmt: skip
    assert ignored(metrics, "priority") == 0.0


# -- 3. a class whose hints run long loses them ----------------------------------------------------------


async def test_a_lying_class_loses_its_hints_and_regains_them_after_honest_completions(caplog):
    caplog.set_level(logging.WARNING, logger="binbatch.api")
    metrics = SidecarMetrics()
    door = front(metrics=metrics)

    def distrusted(name: str) -> float | None:
        return metrics.registry.get_sample_value("binbatch_hints_distrusted", {"request_class": name, "caller": ""})

    async def served(hint: int, actual: int, request_class: str = "batch"):
        ticket = await door.submit(Fields(prompt="p", request_class=request_class, expected_output_tokens=hint),
                                   stream=False)  # fmt: skip
        door.finished(ticket, done(actual))
        return ticket

    for _ in range(MIN_SAMPLES):
        ticket = await served(hint=1, actual=2000)
        assert ticket.req.hint_tokens == 1.0  # believed until the evidence is in
    assert distrusted("batch") == 1.0
    [lost] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "request class 'batch': length hints ignored" in lost.getMessage()
    assert "2000.0x the hint" in lost.getMessage()

    ticket = await served(hint=1, actual=2000)
    assert ticket.req.hint_tokens is None  # the predictor places it
    assert ticket.judged_hint == 1 and ignored(metrics, "hint") == 1.0
    other = await served(hint=1, actual=1, request_class="")  # other classes keep theirs
    assert other.req.hint_tokens == 1.0

    honest = 0
    while distrusted("batch") == 1.0:
        ticket = await served(hint=500, actual=450)
        assert ticket.req.hint_tokens is None
        honest += 1
        assert honest <= WINDOW
    assert honest == MIN_SAMPLES + 2  # its window holds MIN_SAMPLES + 1 lies: the median needs one honest more
    assert (await served(hint=500, actual=450)).req.hint_tokens == 500.0
    lost_, back = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "request class 'batch': length hints honoured again" in back and "0.90x the hint" in back
    assert distrusted("batch") == 0.0


@pytest.mark.parametrize(("caller", "header", "tenant"),
                         [("team-a", "flow-7", "team-a"), ("", "flow-7", "flow-7"), ("", "", "")])  # fmt: skip
async def test_the_authenticated_caller_is_the_tenant_else_the_fairness_header(caller, header, tenant):
    """A caller who proved who it is cannot claim another tenant's share by a header; without
    caller authentication the header (as the llm-d router sends it) names the tenant."""
    fr = front()
    await fr.submit(Fields(prompt="hello", max_tokens=8, caller=caller, tenant=header), stream=False)
    assert fr.dispatcher.submitted[-1].tenant == tenant
