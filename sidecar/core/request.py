"""The request record that flows through the scheduling core.

It carries only what scheduling needs; a driver keeps its own per-call handle
(the dispatcher maps each Request to its caller's future) keyed by the record,
which hashes by identity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from .length_dist import LengthDist

if TYPE_CHECKING:
    from .length_model import Features


@dataclass(eq=False, slots=True)
class Request:
    """One inference request as the scheduler sees it.

    Lengths are in output tokens.  The simulator uses the same fields with
    service-time units, which is why they are floats.
    """

    id: str
    arrival: float  # clock time at which the request was accepted
    prompt_tokens: int = 0
    max_tokens: int = 0
    hint_tokens: float | None = None  # the client's expected_output_tokens, if given
    priority: int = 0  # larger is more urgent
    deadline: float | None = None  # absolute clock time; None = no deadline
    send_by: float | None = None  # leave the bin by this clock time (a TTFT SLO's queue share)
    tpot_slo: float | None = None  # x-slo-tpot-ms in seconds; a tight one waits for the engine (TpotGate)
    request_class: str = ""
    tenant: str = ""  # who it is served for (fair_share.py); "": the shared tenant
    # what the request asks, for a predictor that reads it; kept only while the request is in flight
    prompt_text: str = ""
    body_bytes: int = 0  # the size of the request as it came (HTTP body, gRPC message): batch.maxQueuedBytes counts it
    # an external predictor service's answer, asked by the server before the request is queued
    external_length: LengthDist | None = None
    # the learned predictor's features of the prompt, computed once: predict reads them, observe keeps them
    features: Features | None = None
    predicted_tokens: float | None = None  # set by the length predictor: the median of ``length``
    length: LengthDist | None = None  # set by the length predictor: the whole predicted distribution
    prediction_source: str = ""  # set by the length predictor: one of predictor.SOURCES
    actual_tokens: float | None = None  # set when the engine reports completion
    bin: int | None = None  # set by the batch former
    cancelled: bool = False  # set by cancel(); such a request is never dispatched
    # what the engine's stream said so far, while the request is in flight (the KV plan's exact progress)
    engine_generated: int | None = None  # tokens generated
    engine_prompt_tokens: int | None = None  # the prompt's tokens as the engine counted them
    prompt_counted: bool = False  # the KV plan has learned from the engine's count of its prompt (once a request)
    # its engine call streams for the KV plan (Scheduler.reads_progress), though its caller asked for one answer
    progress_read: bool = True
    kv_held: tuple[tuple[Any, ...], Any] | None = None  # the KV plan's last Seq of it, and its inputs (scheduler._held)
    # the KV it holds at its planned end if it went in on the drain's packed share (scheduler.PACKED_SHARE), else 0
    packed_tokens: float = 0.0
    kv_planned: bool = False  # it went in under the KV plan, the engine's cache known (not sent blind)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline


def chat_text(messages: Iterable[tuple[str, str]]) -> str:
    """A chat's text as a predictor reads it (``Request.prompt_text``): each message's content, one per line."""
    return "\n".join(content for _, content in messages)


def expected_tokens(req: Request) -> float:
    """The output tokens ``req`` is expected to generate: its prediction, within its max_tokens."""
    predicted = req.predicted_tokens if req.predicted_tokens is not None else float(req.max_tokens or 1)
    return min(predicted, float(req.max_tokens)) if req.max_tokens else predicted


def predicted_length(req: Request) -> LengthDist:
    """The distribution of ``req``'s output length: its predictor's, or -- a predictor
    that gave only a number -- that number (``expected_tokens``) said to be exact."""
    if req.length is not None:
        return req.length
    return LengthDist.exact(expected_tokens(req), float(req.max_tokens) if req.max_tokens else math.inf)
