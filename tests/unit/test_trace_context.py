"""W3C trace context read from request headers or gRPC metadata (binbatch_sidecar.server.trace_context)."""

from __future__ import annotations

import pytest

from binbatch_sidecar.server.trace_context import TraceContext, parse_traceparent, read_trace_context

PARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        (PARENT, True),
        ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later-fields", True),  # a later version may grow
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x", False),  # version 00 has four fields
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),  # version ff is invalid
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", False),  # all-zero trace id
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", False),  # all-zero parent id
        ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", False),  # upper-case hex
        ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", False),  # short trace id
        ("", False),
    ],
)
def test_traceparent_is_parsed_as_w3c_writes_it(value, valid):
    assert parse_traceparent(value) is valid


def test_the_context_goes_on_with_its_tracestate_and_names_its_trace_id():
    ctx = read_trace_context([("Traceparent", PARENT), ("tracestate", "a=1"), ("tracestate", "b=2"), ("x", "y")])
    assert ctx == TraceContext(PARENT, "a=1,b=2")
    assert ctx.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert ctx.headers() == (("traceparent", PARENT), ("tracestate", "a=1,b=2"))


@pytest.mark.parametrize(
    "pairs",
    [
        [],
        [("tracestate", "a=1")],  # a state without a parent
        [("traceparent", "00-bogus"), ("tracestate", "a=1")],
        [("traceparent", PARENT), ("traceparent", PARENT)],  # given twice: ambiguous
    ],
)
def test_no_valid_parent_means_no_context(pairs):
    assert read_trace_context(pairs) is None


def test_a_tracestate_over_the_limit_is_dropped_not_cut():
    ctx = read_trace_context([("traceparent", PARENT), ("tracestate", "a=" + "x" * 600)])
    assert ctx == TraceContext(PARENT, None)
