"""W3C Trace Context (``traceparent``, ``tracestate``) read from either door.

The sidecar is a hop on the request's way to the engine: it passes the
caller's trace context on to the engine's HTTP request (vLLM continues the trace
when it exports OpenTelemetry spans), and its own log lines carry the trace id.

A ``traceparent`` that does not parse is ignored, with its ``tracestate`` --
what the W3C recommendation asks of every participant (an invalid parent must
not be propagated); it is never a reason to refuse the request.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# version-traceid-parentid-flags, lower-case hex; a later version may append fields
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^\s]*)?")
TRACESTATE_LIMIT = 512  # the length every participant must pass on (W3C §3.3.1.5)


@dataclass(frozen=True, slots=True)
class TraceContext:
    traceparent: str
    tracestate: str | None = None

    @property
    def trace_id(self) -> str:
        return self.traceparent[3:35]

    def headers(self) -> tuple[tuple[str, str], ...]:
        """The HTTP headers that carry it on to the engine."""
        if self.tracestate is None:
            return (("traceparent", self.traceparent),)
        return (("traceparent", self.traceparent), ("tracestate", self.tracestate))


def parse_traceparent(value: str) -> bool:
    """True if ``value`` is a valid ``traceparent`` (W3C §3.2)."""
    m = _TRACEPARENT.fullmatch(value)
    if m is None:
        return False
    version, trace_id, parent_id, _flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return False
    return trace_id != "0" * 32 and parent_id != "0" * 16


def read_trace_context(pairs: Iterable[tuple[str, str]]) -> TraceContext | None:
    """The trace context among request headers or gRPC metadata (keys matched
    without case); None when absent, given twice, or invalid."""
    parents: list[str] = []
    states: list[str] = []
    for key, value in pairs:
        k = key.lower()
        if k == "traceparent" and isinstance(value, str):
            parents.append(value.strip())
        elif k == "tracestate" and isinstance(value, str):
            states.append(value.strip())
    if len(parents) != 1 or not parse_traceparent(parents[0]):
        return None
    # several tracestate headers are one list (RFC 9110 §5.3); too long: dropped, not cut
    state = ",".join(s for s in states if s) or None
    if state is not None and len(state) > TRACESTATE_LIMIT:
        state = None
    return TraceContext(parents[0], state)
