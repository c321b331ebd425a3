"""The sidecar's one config file: schema, loading and validation.

The operator renders this YAML from a ``BatchingPolicy`` spec into a ConfigMap
(DESIGN §2 "Config"), so it follows the CRD's conventions (CONVENTIONS.md "CRD"):
camelCase keys, CamelCase enum values, integers whose unit is in the name
(``maxWaitMilliseconds``, ``kvReservePercent``), probabilities as per-mille
integers (``overflowPerMille``), a description and bounds on every field. No
floats: a float in a spec rounds differently in Go, YAML and JSON, and an integer
with its unit in the name cannot be misread. The server converts to SI floats
once, through the properties on ``SidecarConfig`` (``max_wait_seconds``, ``eps_m``…).

Every section and every key is optional; unknown keys and wrong types are errors
(strict: ``"32"`` is not an integer), so a typo never silently falls back to a
default. Cross-field rules mirror the CRD's CEL rules. Every problem is reported
at once, one per line, as ``<dotted.camelCase.path>: <message>`` (``ConfigError``).

    engine:    {url, model, requestTimeoutSeconds, healthPath, maxRequestBodyBytes, apiKeyFile}
    bins:      {mode: Fixed|Auto|Adaptive, count, countMode: Fixed|Auto, latencyTargetMilliseconds,
                boundaries, maxOutputTokens, autoWindow, autoRefreshEvery,
                splitThresholdPercent, maxRequestsPerBin}
    batch:     {mode: Gang|Continuous, sizing: Static|Memory|Sla|Combined, staticSize,
                minBatchSize, maxBatchSize, maxWaitMilliseconds, maxInflightBatches,
                maxQueuedRequests, maxQueuedBytes, dispatch: MaxWait|Smdp, smdpEngineWeight, order: Fifo|ShortestFirst|EnginePriority,
                aging: EnginePace|Fixed, agingTokensPerSecond, maxQueueWaitMilliseconds, followEngineQueue,
                drainOrder: ShortestFirst|LongestFitFirst, shortestBy: OutputTokens|KvFootprint}
    memory:    {admission: BatchSize|Projected, overflowPerMille, kvReservePercent, kvSaturationPercent}
    latency:   {tpotMilliseconds, ttftMilliseconds, tolerancePercent}
    predictor: {kind: Hint|Online|Learned, defaultOutputTokens, warmStart, warmStartOptional, refitEveryRecords,
                trainingBufferRecords, external: {url, timeoutMilliseconds, breakerOpenMilliseconds, feedbackUrl}}
    metrics:   {source: Scrape|PromQL|None, url, intervalMilliseconds,
                staleAfterMilliseconds, promqlSelector}
    server:    {grpcPort, httpPort, metricsPort, drainGraceSeconds, configPollMilliseconds, passthroughPaths,
                maxRequestBytes, httpRequestReadTimeoutMilliseconds, maxConnections, grpcMaxConcurrentStreams,
                grpcMaxConnectionAgeSeconds}
    logging:   {level: Debug|Info|Warning|Error, format: Json|Text, logPrompts}
    classes:   {classes: [{name, priority, allowHints, allowPriority, allowSloHeaders}],
                default: {allowHints, allowPriority, allowSloHeaders}}
    auth:      {callerTokensDir, callers: [{name, allowHints, allowPriority, allowSloHeaders}],
                adminTokenFile, operatorPublicKeys, audience}
    tenants:   {tenants: [{name, weight}], defaultWeight, maxQueuedSharePercent}

An absent file means the defaults (``binbatch sidecar`` without ``--config``), but
a file that exists and holds no document (empty, whitespace or comments only) is
an error, at start-up and on reload: an editor that truncates before it writes
must not flip the engine URL and ports to the defaults for one poll.

The operator imports this module, so it holds no I/O beyond reading a file:
reloading on change is the server's (``server/config_watcher.py``): a changed
valid file is applied live, key by key (``RESTART_KEYS`` lists the only keys
that are not: changing them is refused with a message saying a restart is
needed, and the old config stays in effect), so what ``GetConfig`` shows is
always what runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError


BinMode = Literal["Fixed", "Auto", "Adaptive"]
CountMode = Literal["Fixed", "Auto"]
BatchMode = Literal["Gang", "Continuous"]
Sizing = Literal["Static", "Memory", "Sla", "Combined"]
# Smdp: the control limit of core/smdp.py with engine time as the per-dispatch cost
# (core/smdp_policy.py); gang mode only.
Dispatch = Literal["MaxWait", "Smdp"]
AdmissionOrderName = Literal["Fifo", "ShortestFirst", "EnginePriority"]
Aging = Literal["EnginePace", "Fixed"]
DrainOrder = Literal["ShortestFirst", "LongestFitFirst"]
ShortestBy = Literal["Auto", "OutputTokens", "KvFootprint"]
MemoryAdmission = Literal["Auto", "BatchSize", "Projected"]
PredictorKind = Literal["Hint", "Online", "Learned"]
MetricsSource = Literal["Scrape", "PromQL", "None"]
LogLevel = Literal["Debug", "Info", "Warning", "Error"]
LogFormat = Literal["Json", "Text"]
# what a caller may send to steer its place in the queue (classes.*.allowHints|allowPriority|allowSloHeaders)
CallerInput = Literal["hint", "priority", "slo"]
CALLER_INPUTS: tuple[CallerInput, ...] = ("hint", "priority", "slo")
_ALLOW_KEY = {"hint": "allow_hints", "priority": "allow_priority", "slo": "allow_slo_headers"}
# Keys bound once at start-up (listening sockets). A reload that changes one is
# refused and names the key; everything else is applied live.
RESTART_KEYS = (("server", "grpc_port"), ("server", "http_port"), ("server", "metrics_port"),
                ("server", "max_request_bytes"),  # the gRPC server's receive limit is set when it is built
                ("server", "http_request_read_timeout_milliseconds"),  # the HTTP protocol's timer, set when it is built
                ("server", "grpc_max_concurrent_streams"), ("server", "grpc_max_connection_age_seconds"))
CLASS_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
CLASS_PRIORITY_LIMIT = 1000  # class and request priorities are in [-1000, 1000]
MAX_REQUEST_BYTES_DEFAULT = 4 * 1024 * 1024  # server.maxRequestBytes: one request body (HTTP) or message (gRPC)
HTTP_REQUEST_READ_TIMEOUT_MILLISECONDS_DEFAULT = 30_000  # server.httpRequestReadTimeoutMilliseconds
MAX_CONNECTIONS_DEFAULT = 1024  # server.maxConnections: open HTTP connections
# server.grpcMaxConcurrentStreams: 0, gRPC's own (no cap). A cap makes a client's streams opened before it read the
# server's settings come back REFUSED_STREAM (UNAVAILABLE): the chaos bench's overload lost calls that way.
GRPC_MAX_CONCURRENT_STREAMS_DEFAULT = 0
GRPC_MAX_CONNECTION_AGE_SECONDS_DEFAULT = 1800  # server.grpcMaxConnectionAgeSeconds
MAX_QUEUED_BYTES_DEFAULT = 256 * 1024 * 1024  # batch.maxQueuedBytes: the bodies of every queued request
# the engine paths the HTTP door forwards (GET/HEAD) without being listed in server.passthroughPaths
DEFAULT_PASSTHROUGH_PATHS = ("/v1/models", "/metrics", "/version")
PASSTHROUGH_PATHS_LIMIT = 32
PASSTHROUGH_PATH_LENGTH = 256
# an exact path: "/" then RFC 3986 path characters, without "%" (no encoded tricks) and without "*" (no wildcards)
_PASSTHROUGH_PATH = re.compile(r"/[A-Za-z0-9._~!$&'()+,;=:@/-]*")
# the HTTP door's own routes: never forwarded, so listing one is a mistake
DOOR_PATHS = ("/v1/completions", "/v1/chat/completions", "/health")
# the pattern is the API server's check too (the CRD is generated from this model); the validator names the problem
PassthroughPath = Annotated[str, Field(min_length=1, max_length=PASSTHROUGH_PATH_LENGTH,
                                       json_schema_extra={"pattern": f"^{_PASSTHROUGH_PATH.pattern}$"})]

_RULE = "binbatch_rule"  # error type of a cross-field rule; ctx["problems"] holds (relative path, message)


def _broken(problems: Sequence[tuple[str, str]]) -> NoReturn:
    summary = "; ".join(f"{path}: {msg}" for path, msg in problems)
    raise PydanticCustomError(_RULE, "{summary}", {"summary": summary, "problems": tuple(problems)})


def _http_url(value: str) -> str:
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ValueError(f"not a valid URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http(s) URL with a host, got {value!r}")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", populate_by_name=True, frozen=True, strict=True, alias_generator=to_camel
    )


class EngineConfig(_Section):
    url: str = Field("http://127.0.0.1:8000", max_length=2048, description="Base URL of the vLLM OpenAI-compatible server (http or https).")  # fmt: skip
    model: str = Field("", max_length=512, description='Model used when a request names none; "" means the request must name one, or the engine serves exactly one.')  # fmt: skip
    request_timeout_seconds: int = Field(600, ge=1, le=86400, description="Timeout of one engine HTTP call.")
    health_path: str = Field("/health", min_length=1, max_length=512, description="Engine path whose 200 answer marks the sidecar ready; while it fails, queued requests are held (up to their deadlines), not sent.")  # fmt: skip
    max_request_body_bytes: int = Field(786_432, ge=1024, le=1_073_741_824, description="Largest JSON body of one engine call; a batch's list call beyond it is split, a single request beyond it fails alone. Keep it below the engine's limit (vLLM: 1 MiB).")  # fmt: skip
    api_key_file: str = Field("", max_length=4096, description="Path, in the sidecar's filesystem, of a file holding the key of an engine started with --api-key (surrounding whitespace is stripped); sent as 'Authorization: Bearer <key>' on every engine call. Read at start, at every reload and whenever the file changes; a file that cannot be read or is empty refuses the config. Empty: no key. In a BatchingPolicy use engine.apiKeySecretRef instead.")  # fmt: skip

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        return _http_url(value)

    @field_validator("health_path")
    @classmethod
    def _absolute_path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"must start with '/', got {value!r}")
        return value

    @field_validator("api_key_file")
    @classmethod
    def _key_path(cls, value: str) -> str:
        if value and not value.strip():
            raise ValueError("must be a file path or empty, got only whitespace")
        return value


class BinsConfig(_Section):
    mode: BinMode = Field("Fixed", description="Fixed boundaries; Auto, boundaries learned from the predicted lengths of arriving requests (in Gang mode those that make batches finish soonest, since a batch holds the engine until its longest request ends: between the peaks of a two-peaked distribution, equal shares for an even spread; in Continuous mode equal shares); or Adaptive (split/merge by load).")  # fmt: skip
    count: int = Field(4, ge=1, le=64, description="Number of bins (with mode Adaptive: the most bins it may split into; with countMode Auto: the most bins it may choose).")  # fmt: skip
    count_mode: CountMode = Field("Fixed", description="Fixed: use count bins. Auto: the sidecar measures the arrival rate and re-chooses the number of bins, from 1 to count, to meet latencyTargetMilliseconds (more bins raise throughput, but each bin takes longer to fill); not with mode Adaptive or boundaries.")  # fmt: skip
    latency_target_milliseconds: int = Field(0, ge=0, le=600_000, description="countMode Auto: the latency the number of bins is chosen to meet (the time to serve a batch plus the wait for its bin to fill); required (> 0) with countMode Auto.")  # fmt: skip
    boundaries: list[int] = Field(default_factory=list, max_length=63, description="Fixed only: count-1 strictly increasing token boundaries below maxOutputTokens; empty means uniform over [1, maxOutputTokens].")  # fmt: skip
    max_output_tokens: int = Field(2048, ge=1, le=1_000_000, description="Upper end of the uniform bins and the default max_tokens cap.")  # fmt: skip
    auto_window: int = Field(4096, ge=16, le=1_000_000, description="Auto: predicted output lengths of the latest requests the boundaries are learned from.")  # fmt: skip
    auto_refresh_every: int = Field(256, ge=1, le=1_000_000, description="Auto: recompute the boundaries every N requests (the first time after 16, then after 32, 64, ... until N).")  # fmt: skip
    split_threshold_percent: int = Field(60, ge=1, le=99, description="Adaptive: a bin holding more than maxRequestsPerBin requests splits at its midpoint when more than this percentage of them lie below it.")  # fmt: skip
    max_requests_per_bin: int = Field(0, ge=0, le=1_000_000, description="Adaptive: a bin holding more requests than this may split, and the bins merge back into one while fewer than this are queued in all; 0 derives it from the KV-cache size.")  # fmt: skip

    @field_validator("boundaries")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        for i, b in enumerate(value):
            if not 1 <= b <= 1_000_000:
                raise ValueError(f"entry {i} must be between 1 and 1000000, got {b}")
        return value

    @model_validator(mode="after")
    def _boundaries_fit(self) -> BinsConfig:
        b, problems = self.boundaries, []
        if self.count_mode == "Auto":
            if self.mode == "Adaptive":
                problems.append(("countMode", "must be Fixed when mode is Adaptive (it splits and merges bins itself)"))
            if self.latency_target_milliseconds == 0:
                problems.append(("latencyTargetMilliseconds", "must be > 0 when countMode is Auto"))
            if b:
                problems.append(("boundaries", "must be empty when countMode is Auto"))
        if b and self.mode != "Fixed":
            problems.append(("boundaries", f"must be empty unless mode is Fixed (mode is {self.mode})"))
        elif b:
            if len(b) != self.count - 1:
                problems.append(("boundaries", f"needs count-1 = {self.count - 1} entries, got {len(b)}"))
            if any(x >= y for x, y in zip(b, b[1:])):
                problems.append(("boundaries", f"must be strictly increasing, got {b}"))
            if max(b) >= self.max_output_tokens:
                problems.append(("boundaries", f"every entry must be below maxOutputTokens ({self.max_output_tokens}), got {max(b)}"))  # fmt: skip
        if problems:
            _broken(problems)
        return self


class BatchConfig(_Section):
    mode: BatchMode = Field("Continuous", description="Gang: a batch holds its slot until all its requests finish. Continuous: admit into the engine per request.")  # fmt: skip
    sizing: Sizing = Field("Combined", description="How the target batch size is chosen: Static (batch.staticSize), Memory (the largest size whose KV-cache overflow probability stays within memory.overflowPerMille), Sla (the largest size whose time per output token meets latency.tpotMilliseconds) or Combined (the smaller of Memory and Sla).")  # fmt: skip
    static_size: int = Field(32, ge=1, le=4096, description="Batch size for Static sizing, and before metrics arrive.")
    min_batch_size: int = Field(1, ge=1, le=4096, description="Lower clamp of the dynamic batch size.")
    max_batch_size: int = Field(256, ge=1, le=4096, description="Upper clamp of the dynamic batch size.")
    max_wait_milliseconds: int = Field(0, ge=0, le=600_000, description="A partial batch leaves its bin once its oldest request waited this long (Continuous mode: at once while the engine holds fewer requests than the batch size). 0 (the default): a request goes as soon as the engine has room for it -- holding it to fill a batch only added waiting in every measured workload of a continuous-batching engine; Gang mode may set a wait to send fuller batches.")  # fmt: skip
    max_inflight_batches: int = Field(4, ge=1, le=1024, description="Gang mode: the most batches in the engine at once (each holds its place until all its requests finish).")  # fmt: skip
    max_queued_requests: int = Field(10_000, ge=1, le=10_000_000, description="Queued requests across all bins; beyond it requests are refused (RESOURCE_EXHAUSTED). A request whose predicted queue wait exceeds its deadline is refused too.")  # fmt: skip
    dispatch: Dispatch = Field("MaxWait", description="When a partial batch leaves: MaxWait (after maxWaitMilliseconds), or Smdp (Gang only: as soon as a slot is free and its bin holds enough requests, the threshold coming from a semi-Markov decision process (SMDP) solved for the measured arrival rate and batch service time (fitted as a linear function of batch size); maxWaitMilliseconds still bounds the wait, and alone decides until a solution exists).")  # fmt: skip
    smdp_engine_weight: int = Field(16, ge=1, le=100_000, description="Smdp: request-seconds of waiting one engine-second is worth; larger sends fewer, fuller batches.")  # fmt: skip
    order: AdmissionOrderName = Field("ShortestFirst", description="Continuous mode, when the engine is full: which waiting request is admitted next. Fifo: in arrival order. ShortestFirst: the smallest predicted output first, aged (aging) and bounded by maxQueueWaitMilliseconds; a request past its TTFT SLO's queue share goes after those that can still meet theirs. EnginePriority (for a vLLM started with --scheduling-policy priority): the queue forms in the engine, which orders it -- each request is sent at once with vLLM's priority set to when it would end if served at once (arrival plus predicted tokens times the engine's time per token, in ms; a higher request-class priority first), so the shortest goes first and a long one moves up as it waits, with no dispatch delay; needs mode Continuous, no memory.admission Projected and no followEngineQueue.")  # fmt: skip
    aging: Aging = Field("EnginePace", description="ShortestFirst: how a waiting request moves up. EnginePace: each second it waits lowers its rank by the tokens the engine decodes per sequence in a second (1/TPOT, measured), so the order is by when each request would end if sent now -- a long one moves up by one token of its own for each token the engine decodes while it waits. Fixed: by agingTokensPerSecond.")  # fmt: skip
    aging_tokens_per_second: int = Field(20, ge=0, le=1_000_000, description="ShortestFirst with aging Fixed: each second a request waits lowers its rank by this many predicted tokens, so long requests move up.")  # fmt: skip
    follow_engine_queue: bool = Field(True, description="Continuous mode: also hold admission while the engine's own queue is not empty (from its running and waiting counts each scrape), so the queue forms here where it is ordered; while the engine queues nothing the cap grows above what it runs. With memory.admission Projected only a sequence limit caps (a queue held at two scrapes, the engine running no more, its KV cache not full): the KV plan bounds the cache.")  # fmt: skip
    max_queue_wait_milliseconds: int = Field(30_000, ge=1, le=3_600_000, description="ShortestFirst: a request that waited this long for admission goes before every other, the oldest first (no request is starved).")  # fmt: skip
    drain_order: DrainOrder = Field("ShortestFirst", description="The order once arrivals stop (a burst or a batch job is over, what is queued is a batch). ShortestFirst: while the KV plan admits, the longest requests the cache holds to their end go first until they hold half of it (or are half of the engine's own sequence limit, where that holds its queue), so long answers overlap the short ones instead of running alone at the end; the rest goes shortest first, the longest of it first only when the rest would drain before it could end. LongestFitFirst (needs memory.admission Projected) sends the longest request the KV cache holds to its end next, so long answers overlap the short ones and the cache stays full (best throughput, for a later median).")  # fmt: skip
    max_queued_bytes: int = Field(MAX_QUEUED_BYTES_DEFAULT, ge=1_048_576, le=68_719_476_736, description="Total bytes of the request bodies queued across all bins (waiting for the engine, not yet sent) and of those the HTTP door is still reading: beyond it a request is refused (HTTP 429 with Retry-After, before its body is read; gRPC RESOURCE_EXHAUSTED), so the queue's memory is bounded in bytes as well as in requests. A body counts from when its reading starts (its Content-Length, or server.maxRequestBytes if chunked) and is released when its request leaves the queue (sent, cancelled, expired or failed). 1 MiB to 64 GiB; at least server.maxRequestBytes.")  # fmt: skip
    shortest_by: ShortestBy = Field("Auto", description="ShortestFirst: what makes a request short. Auto (the default): KvFootprint where the projected KV plan applies (memory.admission resolves to Projected), else OutputTokens. OutputTokens: its predicted output tokens. KvFootprint (needs the projected KV plan: memory.admission Projected or Auto resolving to it): its predicted tokens, each weighted by the KV cache the request holds while it runs (its prompt plus half the mean answer) against the usual request's (the mean prompt plus that half), so a request of the usual prompt ranks at its tokens and aging keeps its pace: when the KV cache limits the engine's batch, a short answer to a long prompt holds as much of it as a longer answer to a short one.")  # fmt: skip

    @model_validator(mode="after")
    def _sizes_ordered(self) -> BatchConfig:
        problems = []
        if self.min_batch_size > self.static_size:
            problems.append(("minBatchSize", f"must be <= staticSize ({self.static_size}), got {self.min_batch_size}"))
        if self.static_size > self.max_batch_size:
            problems.append(("staticSize", f"must be <= maxBatchSize ({self.max_batch_size}), got {self.static_size}"))
        if self.dispatch == "Smdp" and self.mode != "Gang":
            problems.append(("dispatch", f"Smdp needs mode Gang (its cost is a gang batch's engine time), mode is {self.mode}"))
        if self.order == "EnginePriority":
            if self.mode != "Continuous":
                problems.append(("order", f"EnginePriority sends requests one by one and needs mode Continuous, mode is {self.mode}"))  # fmt: skip
            if self.follow_engine_queue:  # its default is true: say it, as the CRD's defaulting would fill it in
                problems.append(("followEngineQueue", "must be false with order EnginePriority: the queue is to form in "
                                                      "the engine, which orders it"))  # fmt: skip
        if problems:
            _broken(problems)
        return self


class MemoryConfig(_Section):
    admission: MemoryAdmission = Field("Auto", description="How the KV cache bounds admission (sizing Memory or Combined). Auto (the default): Projected in Continuous mode unless batch.order is EnginePriority (the queue then forms in the engine), else BatchSize. BatchSize: a batch size from the observed length distribution and overflowPerMille. Projected (Continuous mode): each request enters only if the cache, less kvReservePercent, holds it and every request in flight until each finishes, from their prompt and predicted output lengths; the engine's preemptions tighten it. Exact with hints: no preemption.")  # fmt: skip
    overflow_per_mille: int = Field(10, ge=1, le=999, description="Accepted probability that a batch overflows the KV cache, per mille (10 means 1%).")  # fmt: skip
    kv_reserve_percent: int = Field(0, ge=0, le=90, description="Share of the KV cache kept out of the memory bound, in percent.")  # fmt: skip
    kv_saturation_percent: int = Field(95, ge=1, le=100, description="KV-cache usage at or above which no bin grows, in percent.")  # fmt: skip


class LatencyConfig(_Section):
    tpot_milliseconds: int = Field(0, ge=0, le=100_000, description="Time-per-output-token (TPOT) target that Sla sizing keeps to; 0 means none.")
    ttft_milliseconds: int = Field(0, ge=0, le=600_000, description="Time-to-first-token SLO of requests without x-slo-ttft-ms; 0 means none.")  # fmt: skip
    queue_share_percent: int = Field(50, ge=1, le=100, description="Share of a request's TTFT SLO it may wait in its bin; then the bin is sent, full or not.")  # fmt: skip
    tolerance_percent: int = Field(10, ge=0, le=100, description="How far the measured time per output token may stray from tpotMilliseconds, in percent of it, before Sla sizing changes the batch size.")  # fmt: skip


class ExternalPredictorConfig(_Section):
    url: str = Field("", max_length=2048, description="An external length-predictor service a team runs with its own model (docs/predictor.md, 'Bring your own predictor'): each request without a hint is POSTed here before it is queued, and the service's quantiles of its output length place it. Empty: none.")  # fmt: skip
    timeout_milliseconds: int = Field(50, ge=1, le=10_000, description="Deadline of one call; past it (or on an error or a malformed answer) the built-in predictor places the request.")  # fmt: skip
    breaker_open_milliseconds: int = Field(5000, ge=100, le=600_000, description="After a timeout or an outage (no answer, a 5xx), how long no call is made (the built-in predictor places requests at once) before one request tries the service again.")  # fmt: skip
    feedback_url: str = Field("", max_length=2048, description="Optional: where to POST the output tokens of completed requests the service was asked about, in batches, off the request path, so it can learn. Empty: none.")  # fmt: skip

    @field_validator("url", "feedback_url")
    @classmethod
    def _http_or_empty(cls, value: str) -> str:
        return _http_url(value) if value else value

    @model_validator(mode="after")
    def _feedback_needs_url(self) -> ExternalPredictorConfig:
        if self.feedback_url and not self.url:
            _broken([("feedbackUrl", "needs url: completions are reported only for requests the service was asked about")])  # fmt: skip
        return self


class PredictorConfig(_Section):
    kind: PredictorKind = Field("Learned", description="Hint: the client's hint only. Online: the spread of the last 64 output lengths per request class and prompt-length bucket seen in completions. Learned: a model that reads the prompt (what is asked, its class, max_tokens) predicts a distribution of the length; refitted off the request path from the completions the sidecar sees (their prompts kept only as hashed features), warm-started from warmStart; Online answers until it has a model. The client's hint wins, when honoured (classes.*.allowHints).")  # fmt: skip
    default_output_tokens: int = Field(256, ge=1, le=1_000_000, description="Expected output length with no hint, no max_tokens and no history.")  # fmt: skip
    external: ExternalPredictorConfig = Field(default_factory=ExternalPredictorConfig, description="An external length-predictor service, asked after the client's hint and before the built-in predictor.")  # fmt: skip
    warm_start: str = Field("", max_length=4096, description="Learned: path, in the sidecar's filesystem, of a model written by the command binbatch predictor train to start from (a file that cannot be read as one refuses the config, unless warmStartOptional); empty: start with none and learn from completions. When the file changes (a ConfigMap volume updated in place) the new model is swapped in.")  # fmt: skip
    warm_start_optional: bool = Field(False, description="Learned: a warmStart file that is missing or cannot be read is not an error: the sidecar starts cold (learning from completions) with one warning, binbatch_predictor_model_loaded is 0, and the model is loaded when the file appears. The operator sets it for the file spec.predictor.model mounts; a path you type yourself is best left strict.")  # fmt: skip
    refit_every_records: int = Field(1024, ge=16, le=1_000_000, description="Learned: refit the model after this many new completions (the first fits come sooner: after 64, then each time the records double).")  # fmt: skip
    training_buffer_records: int = Field(4096, ge=64, le=100_000, description="Learned: the latest completions kept to refit on (hashed features, about 5 KiB each).")  # fmt: skip

    @model_validator(mode="after")
    def _warm_start_needs_learned(self) -> PredictorConfig:
        if self.warm_start and self.kind != "Learned":
            _broken([("warmStart", f"is only read with kind Learned (kind is {self.kind})")])
        if self.warm_start_optional and not self.warm_start:
            _broken([("warmStartOptional", "needs warmStart: it says what to do when that file cannot be read")])
        return self


class MetricsConfig(_Section):
    source: MetricsSource = Field("Scrape", description="Scrape the engine's /metrics, query Prometheus (PromQL), or None.")  # fmt: skip
    url: str = Field("http://127.0.0.1:8000/metrics", max_length=2048, description="Scrape: the engine's /metrics URL. PromQL: the Prometheus base URL.")  # fmt: skip
    interval_milliseconds: int = Field(500, ge=50, le=60_000, description="Time between scrapes (and batch-size updates).")  # fmt: skip
    stale_after_milliseconds: int = Field(3000, ge=100, le=600_000, description="Metrics older than this count as stale: the batch size holds its last good value (the static size if none), shrinking only if the last fresh scrape showed pressure.")  # fmt: skip
    promql_selector: str = Field("", max_length=1024, description="PromQL: label matcher appended to every metric, e.g. '{pod=\"x\"}'.")  # fmt: skip

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        return _http_url(value)

    @field_validator("promql_selector")
    @classmethod
    def _braced(cls, value: str) -> str:
        if value and not (value.startswith("{") and value.endswith("}")):
            raise ValueError(f"must be a label matcher in braces, e.g. '{{pod=\"x\"}}', got {value!r}")
        return value

    @model_validator(mode="after")
    def _stale_after_two_scrapes(self) -> MetricsConfig:
        if self.stale_after_milliseconds < 2 * self.interval_milliseconds:
            _broken([("staleAfterMilliseconds", f"must be >= 2 x intervalMilliseconds ({2 * self.interval_milliseconds}), got {self.stale_after_milliseconds}")])  # fmt: skip
        return self


class ServerConfig(_Section):
    grpc_port: int = Field(50051, ge=0, le=65535, description="gRPC listen port; 0 picks a free port. Bound at start-up: a reload that changes it is refused (needs a restart).")  # fmt: skip
    http_port: int = Field(8080, ge=0, le=65535, description="OpenAI-compatible HTTP listen port (/v1/completions, /v1/chat/completions, /v1/models); 0 picks a free port. Bound at start-up: a reload that changes it is refused (needs a restart).")  # fmt: skip
    metrics_port: int = Field(9090, ge=0, le=65535, description="Prometheus /metrics listen port; 0 picks a free port. Bound at start-up: a reload that changes it is refused (needs a restart).")  # fmt: skip
    drain_grace_seconds: int = Field(30, ge=0, le=3600, description="On SIGTERM, time to drain queued and in-flight requests.")  # fmt: skip
    config_poll_milliseconds: int = Field(1000, ge=100, le=600_000, description="How often the config file is checked for a change.")  # fmt: skip
    passthrough_paths: list[PassthroughPath] = Field(default_factory=list, max_length=PASSTHROUGH_PATHS_LIMIT, description="Engine paths the HTTP door forwards unqueued (GET, HEAD and POST: vLLM's /tokenize and /v1/embeddings are POST only), besides GET of /v1/models, /metrics and /version; every other path is answered 404 and never reaches the engine (admin routes such as /pause, /invocations, /pooling, /score, /tokenize stay closed unless listed). Exact absolute paths, no wildcards, no query, at most 32 of at most 256 characters. A reload applies it at once.")  # fmt: skip
    max_request_bytes: int = Field(MAX_REQUEST_BYTES_DEFAULT, ge=65_536, le=67_108_864, description="Largest request the sidecar reads: an HTTP body beyond it is answered 413, a gRPC message beyond it RESOURCE_EXHAUSTED, before it is held in memory. 64 KiB to 64 MiB. Bound at start-up: a reload that changes it is refused (needs a restart).")  # fmt: skip
    http_request_read_timeout_milliseconds: int = Field(HTTP_REQUEST_READ_TIMEOUT_MILLISECONDS_DEFAULT, ge=100, le=600_000, description="HTTP door: a connection must deliver a request's headers within this time of opening (or of its previous answer), else it is closed; the body must then arrive within this time of the headers (also one streamed on to the engine on a server.passthroughPaths path), else the answer is 408 and the connection closed. It is also the keep-alive idle timeout: an idle connection closes after it (keep a gateway's upstream idle timeout below it). 100 ms to 10 minutes. Bound at start-up: a reload that changes it is refused (needs a restart).")  # fmt: skip
    max_connections: int = Field(MAX_CONNECTIONS_DEFAULT, ge=1, le=1_000_000, description="HTTP door: the most open connections (over the serving port and a taken-over port together); a connection past it is closed at once, unread, so the open ones keep being served. A reload applies it to new connections.")  # fmt: skip
    grpc_max_concurrent_streams: int = Field(GRPC_MAX_CONCURRENT_STREAMS_DEFAULT, ge=0, le=65_536, description="gRPC: the most calls at once on one client connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); 0 (the default): no cap -- a cap refuses the streams a client opens before it has read the server's settings (UNAVAILABLE), so set one only for clients that retry; a client's further calls wait in the client until one ends. Bound at start-up: a reload that changes it is refused (needs a restart).")  # fmt: skip
    grpc_max_connection_age_seconds: int = Field(GRPC_MAX_CONNECTION_AGE_SECONDS_DEFAULT, ge=10, le=86_400, description="gRPC: a client connection older than this is asked to go away (GOAWAY; the client reconnects, to any replica behind the Service); calls running then get 10 minutes to finish. Spreads long-lived clients over new replicas. 10 s to 24 h. Bound at start-up: a reload that changes it is refused (needs a restart).")  # fmt: skip

    @field_validator("passthrough_paths")
    @classmethod
    def _exact_paths(cls, value: list[str]) -> list[str]:
        seen: set[str] = set()
        for i, path in enumerate(value):
            shown = path if len(path) <= 64 else path[:64] + "..."
            if not 1 <= len(path) <= PASSTHROUGH_PATH_LENGTH:
                raise ValueError(f"entry {i} must be 1 to {PASSTHROUGH_PATH_LENGTH} characters, got {len(path)}")
            if "*" in path:
                raise ValueError(f"entry {i} must be an exact path (no wildcards), got {shown!r}")
            if not _PASSTHROUGH_PATH.fullmatch(path):
                raise ValueError(f"entry {i} must be an absolute path ('/' then letters, digits and -._~!$&'()+,;=:@/; "
                                 f"no query, no percent-encoding), got {shown!r}")
            if any(seg in (".", "..") for seg in path.split("/")):
                raise ValueError(f"entry {i} must not hold '.' or '..' segments, got {shown!r}")
            if path in DOOR_PATHS:
                raise ValueError(f"entry {i}: {path} is the sidecar's own route, never forwarded")
            if path in seen:
                raise ValueError(f"entry {i}: {path} is listed twice")
            seen.add(path)
        return value

    @model_validator(mode="after")
    def _distinct_ports(self) -> ServerConfig:
        ports = {"grpcPort": self.grpc_port, "httpPort": self.http_port, "metricsPort": self.metrics_port}
        named = list(ports.items())
        clashes = [(a, f"must differ from {b} (both {pa}); only 0 may repeat")
                   for i, (a, pa) in enumerate(named) for b, pb in named[i + 1:] if pa == pb != 0]  # fmt: skip
        if clashes:
            _broken(clashes)
        return self


class LoggingConfig(_Section):
    level: LogLevel = Field("Info", description="Level of the sidecar's logs; a reload applies it at once.")
    format: LogFormat = Field("Json", description="Json: one JSON object per line (time, level, logger, message, and request_id/trace_id on request lines) for a log system; Text: plain lines for a person. A reload applies it at once.")  # fmt: skip
    log_prompts: bool = Field(False, description="Log each request's prompt and completion text at Info (logger binbatch.prompts). Off: never logged at any level (they may hold personal data).")  # fmt: skip


# What a caller of a class may send to steer its own place in the queue. An input not allowed is ignored,
# not refused: the request is served as if it had not sent it (binbatch_ignored_inputs_total).
# Each subclass declares allow_hints, allow_priority and allow_slo_headers with its own defaults.
class _CallerInputs(_Section):
    def allows(self, what: CallerInput) -> bool:
        """Whether a caller of this class may send ``what`` (one of ``CALLER_INPUTS``)."""
        return bool(getattr(self, _ALLOW_KEY[what]))


# The defaults of both kinds of class, in this one place (docs/security.md, "Scheduling inputs a caller may send").
# Hints: allowed, since the measured wins need them and a class whose hints keep running short loses them
# (core/hint_trust.py). Priority and SLO headers: only for a named class that says so. Requests naming no class
# keep all three: a policy without classes serves as it did before these keys existed.
_HINTS = "Honour the length hint a request of this class sends (expected_output_tokens, header x-expected-output-tokens); false: ignore it and let the predictor place the request. A class whose hints keep running short (answers over twice the hint, on the median of its latest hinted completions) loses its hints until honest ones bring the median back."  # fmt: skip
_PRIORITY = "Honour the priority a request of this class sends (priority, header x-request-priority); false: ignore it (priority 0). The class's own priority applies either way."  # fmt: skip
_SLO = "Honour the SLO headers a request of this class sends (x-slo-ttft-ms, x-slo-tpot-ms); false: ignore them (the policy's latency targets apply)."  # fmt: skip


class RequestClass(_CallerInputs):
    name: str = Field(min_length=1, max_length=63, pattern=CLASS_NAME_PATTERN, description="Name a request gives in request_class (lower-case DNS label).")  # fmt: skip
    priority: int = Field(0, ge=-CLASS_PRIORITY_LIMIT, le=CLASS_PRIORITY_LIMIT, description="Rank of the class; larger is more urgent. It orders bins and batches before the request's own priority.")  # fmt: skip
    allow_hints: bool = Field(True, description=_HINTS)
    allow_priority: bool = Field(False, description=_PRIORITY)
    allow_slo_headers: bool = Field(False, description=_SLO)


class DefaultClass(_CallerInputs):  # requests naming no class
    allow_hints: bool = Field(True, description=_HINTS)
    allow_priority: bool = Field(True, description=_PRIORITY + " True by default, so a policy without classes serves as before; set false when classes mark the callers you trust.")  # fmt: skip
    allow_slo_headers: bool = Field(True, description=_SLO + " True by default, so a policy without classes serves as before; set false when classes mark the callers you trust.")  # fmt: skip


def _class_list_schema() -> dict[str, Any]:
    """The list inlined (the CRD generator takes no $ref), keyed by name as a list-map."""
    item = RequestClass.model_json_schema(by_alias=True)
    item.pop("title", None)
    for prop in item["properties"].values():
        prop.pop("title", None)
    item["required"] = ["name"]
    return {
        "type": "array", "maxItems": 64, "items": item,
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
        "description": "The request classes clients may name; a request naming another class is refused (INVALID_ARGUMENT). Empty request_class: no class, priority 0, and classes.default says what it may send.",
    }  # fmt: skip


class ClassesConfig(_Section):
    classes: Annotated[list[RequestClass], WithJsonSchema(_class_list_schema())] = Field(default_factory=list, max_length=64)  # fmt: skip
    default: DefaultClass = Field(default_factory=DefaultClass, description="What requests naming no class may send to steer their place in the queue (length hint, priority, SLO headers).")  # fmt: skip

    @model_validator(mode="after")
    def _unique(self) -> ClassesConfig:
        seen: set[str] = set()
        for i, c in enumerate(self.classes):
            if c.name in seen:
                _broken([(f"classes[{i}].name", f"duplicate class {c.name!r}")])
            seen.add(c.name)
        return self

    def inputs_of(self, name: str) -> RequestClass | DefaultClass | None:
        """What a request of class ``name`` ("" : none) may send; None if the policy defines no class ``name``."""
        if not name:
            return self.default
        for c in self.classes:
            if c.name == name:
                return c
        return None

    def priority_of(self, name: str) -> int | None:
        """The class's priority, or None if the policy defines no class ``name``."""
        for c in self.classes:
            if c.name == name:
                return c.priority
        return None


# auth.callers[].name: a caller is a file of the callerTokensDir Secret, so its name is a Secret key
CALLER_NAME_PATTERN = r"^[-._a-zA-Z0-9]+$"
CALLERS_LIMIT = 256
OPERATOR_KEYS_LIMIT = 4  # the operator's current key and those it rotates through
_CALLER_INPUT = "What an authenticated caller may send to steer its place in the queue: honoured only if both the caller and the request's class allow it."  # fmt: skip


class AuthCaller(_CallerInputs):
    name: str = Field(min_length=1, max_length=253, pattern=CALLER_NAME_PATTERN, description="The caller: the name of its token's file in auth.callerTokensDir (a key of the callers' Secret).")  # fmt: skip
    allow_hints: bool = Field(True, description="Honour this caller's length hints (expected_output_tokens, header x-expected-output-tokens) where its request's class allows them too; false: ignore them. " + _CALLER_INPUT)  # fmt: skip
    allow_priority: bool = Field(True, description="Honour this caller's priority (priority, header x-request-priority) where its request's class allows it too; false: ignore it. " + _CALLER_INPUT)  # fmt: skip
    allow_slo_headers: bool = Field(True, description="Honour this caller's SLO headers (x-slo-ttft-ms, x-slo-tpot-ms) where its request's class allows them too; false: ignore them. " + _CALLER_INPUT)  # fmt: skip


ALL_INPUTS_ALLOWED = AuthCaller(name="-")  # a caller auth.callers does not list: its class decides


def _caller_list_schema() -> dict[str, Any]:
    """The list inlined (the CRD generator takes no $ref), keyed by name as a list-map."""
    item = AuthCaller.model_json_schema(by_alias=True)
    item.pop("title", None)
    for prop in item["properties"].values():
        prop.pop("title", None)
    item["required"] = ["name"]
    return {
        "type": "array", "maxItems": CALLERS_LIMIT, "items": item,
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
        "description": "What each authenticated caller may send to steer its place in the queue (length hint, priority, SLO headers); a caller not listed may send all three, and its request's class decides. A listed caller with no token is only warned about (its Secret may be rotating).",
    }  # fmt: skip


class AuthConfig(_Section):
    caller_tokens_dir: str = Field("", max_length=4096, description="Caller authentication. A directory (in Kubernetes a mounted Secret): each file's name is a caller and its content (surrounding whitespace stripped) that caller's bearer token. Set: every request of the HTTP door (Authorization: Bearer <token>; /health excepted) and of the gRPC Inference service (metadata authorization: Bearer <token>) must carry a known token, else 401 / UNAUTHENTICATED and it is never queued. Read at start, at every reload and whenever its files change; a directory that cannot be read, holds no token, an empty token or one token twice refuses the config. Empty: off (a gateway in front authenticates, and a NetworkPolicy limits who reaches the sidecar). In a BatchingPolicy use auth.callerTokensSecretRef instead.")  # fmt: skip
    callers: Annotated[list[AuthCaller], WithJsonSchema(_caller_list_schema())] = Field(default_factory=list, max_length=CALLERS_LIMIT)  # fmt: skip
    admin_token_file: str = Field("", max_length=4096, description="Path of a file holding a token (surrounding whitespace stripped) that lets a caller off loopback use the Admin service (authorization: Bearer <token>). Admin always answers loopback; off loopback it needs this token or a token signed by the operator (operatorPublicKeys). Read at start, at every reload and whenever the file changes; a file that cannot be read or is empty refuses the config. In a BatchingPolicy use auth.adminTokenSecretRef instead.")  # fmt: skip
    operator_public_keys: list[Annotated[str, Field(min_length=1, max_length=1024)]] = Field(default_factory=list, max_length=OPERATOR_KEYS_LIMIT, description="PEM Ed25519 public keys of the operator: an Admin call off loopback carrying a JWT (EdDSA) signed by one of them, for audience, expiring within 10 minutes, is answered. The operator sets it; public, not a secret.")  # fmt: skip
    audience: str = Field("", max_length=512, description="The aud an operator-signed Admin token must name (the operator sets <namespace>/<policy>, so a token for one policy opens no other). Required with operatorPublicKeys.")  # fmt: skip

    @field_validator("caller_tokens_dir", "admin_token_file")
    @classmethod
    def _path(cls, value: str) -> str:
        if value and not value.strip():
            raise ValueError("must be a path or empty, got only whitespace")
        return value

    @field_validator("operator_public_keys")
    @classmethod
    def _ed25519(cls, value: list[str]) -> list[str]:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        from cryptography.hazmat.primitives.serialization import load_pem_public_key

        for i, pem in enumerate(value):
            try:
                key = load_pem_public_key(pem.encode())
            except (ValueError, TypeError, UnicodeEncodeError):
                raise ValueError(f"entry {i} is not a PEM public key") from None
            if not isinstance(key, Ed25519PublicKey):
                raise ValueError(f"entry {i} is not an Ed25519 public key (the operator signs with EdDSA only)")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> AuthConfig:
        seen: set[str] = set()
        for i, c in enumerate(self.callers):
            if c.name in seen:
                _broken([(f"callers[{i}].name", f"duplicate caller {c.name!r}")])
            seen.add(c.name)
        if self.operator_public_keys and not self.audience:
            _broken([("audience", "must be set with operatorPublicKeys: a signed token must name the sidecar it is for")])  # fmt: skip
        return self

    @property
    def callers_on(self) -> bool:
        """Caller authentication is on."""
        return bool(self.caller_tokens_dir)

    def inputs_of(self, caller: str) -> AuthCaller:
        """What ``caller`` may send (all three for a caller not listed, or with authentication off)."""
        for c in self.callers:
            if c.name == caller:
                return c
        return ALL_INPUTS_ALLOWED


# A tenant's name as a request sends it (x-llm-d-inference-fairness-id): printable ASCII, no space at either end;
# a name listed in the config does not start with "_" (the metrics' _shared and _other labels).
TENANT_NAME_LIMIT = 256
TENANT_WEIGHT_LIMIT = 1000
TENANT_NAME_PATTERN = r"^[!-^`-~]([ -~]{0,254}[!-~])?$"


class TenantWeight(_Section):
    name: str = Field(min_length=1, max_length=TENANT_NAME_LIMIT, pattern=TENANT_NAME_PATTERN, description="The tenant as requests name it in the header x-llm-d-inference-fairness-id (or x-gateway-inference-fairness-id; gRPC metadata of the same name): 1 to 256 printable ASCII characters, no space at either end, not starting with '_'.")  # fmt: skip
    weight: int = Field(1, ge=1, le=TENANT_WEIGHT_LIMIT, description="The tenant's weight: while tenants wait, each is admitted its weight's share of the predicted output tokens admitted, and may hold its weight's share of the queue (batch.maxQueuedRequests, batch.maxQueuedBytes).")  # fmt: skip


def _tenant_list_schema() -> dict[str, Any]:
    """The list inlined (the CRD generator takes no $ref), keyed by name as a list-map."""
    item = TenantWeight.model_json_schema(by_alias=True)
    item.pop("title", None)
    for prop in item["properties"].values():
        prop.pop("title", None)
    item["required"] = ["name"]
    return {
        "type": "array", "maxItems": 256, "items": item,
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
        "description": "Tenants with a weight of their own (the rest have defaultWeight). The tenant of a request is its authenticated caller where auth.callerTokensDir is set, else the x-llm-d-inference-fairness-id header it sends (or x-gateway-inference-fairness-id); none: the one shared tenant. Their names label the binbatch_tenant_* metrics; other tenants are counted as _other.",
    }  # fmt: skip


class TenantsConfig(_Section):
    tenants: Annotated[list[TenantWeight], WithJsonSchema(_tenant_list_schema())] = Field(default_factory=list, max_length=256)  # fmt: skip
    default_weight: int = Field(1, ge=1, le=TENANT_WEIGHT_LIMIT, description="The weight of every tenant not listed in tenants, the shared tenant (requests naming none) included.")  # fmt: skip
    max_queued_share_percent: int = Field(10, ge=1, le=100, description="The least share of batch.maxQueuedRequests and batch.maxQueuedBytes a tenant may hold whatever its weight, in percent. While other tenants have requests queued or running, a tenant may hold at most the larger of its weighted share (its weight over the weights of every tenant with requests queued or running, its own included) and this; beyond it its requests are refused (HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED). A lone tenant may use the whole queue. 100: no per-tenant bound.")  # fmt: skip

    @model_validator(mode="after")
    def _unique(self) -> TenantsConfig:
        seen: set[str] = set()
        for i, t in enumerate(self.tenants):
            if t.name in seen:
                _broken([(f"tenants[{i}].name", f"duplicate tenant {t.name!r}")])
            seen.add(t.name)
        return self

    def weights(self) -> dict[str, int]:
        return {t.name: t.weight for t in self.tenants}


class SidecarConfig(_Section):
    """The whole file; every section defaults."""

    engine: EngineConfig = Field(default_factory=EngineConfig, description="The vLLM server behind the sidecar.")
    bins: BinsConfig = Field(default_factory=BinsConfig, description="Bins over predicted output length.")
    batch: BatchConfig = Field(default_factory=BatchConfig, description="Batch forming, sizing and dispatch.")
    memory: MemoryConfig = Field(default_factory=MemoryConfig, description="The memory-aware batch-size bound.")
    latency: LatencyConfig = Field(default_factory=LatencyConfig, description="Latency SLOs.")
    predictor: PredictorConfig = Field(default_factory=PredictorConfig, description="Output-length predictor.")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig, description="Where engine metrics come from.")
    server: ServerConfig = Field(default_factory=ServerConfig, description="The sidecar's own ports and lifecycle.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Logging.")
    classes: ClassesConfig = Field(default_factory=ClassesConfig, description="Request classes, their priorities and what their callers may send.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="Who may call the sidecar: caller tokens for both doors, and the Admin service's credentials.")  # fmt: skip
    tenants: TenantsConfig = Field(default_factory=TenantsConfig, description="Tenants and their weights: each gets its weighted fair share of admission and of the queue.")  # fmt: skip

    @model_validator(mode="after")
    def _sla_needs_target(self) -> SidecarConfig:
        if self.batch.sizing == "Sla" and self.latency.tpot_milliseconds == 0:
            _broken([("latency.tpotMilliseconds", "must be > 0 when batch.sizing is Sla")])
        b = self.batch
        if b.max_queued_bytes < self.server.max_request_bytes:
            _broken([("batch.maxQueuedBytes", f"must be >= server.maxRequestBytes ({self.server.max_request_bytes}): "
                      f"a request of the largest size could never be queued, got {b.max_queued_bytes}")])  # fmt: skip
        if b.order == "EnginePriority" and self.memory.admission == "Projected":
            _broken([("memory.admission", "Projected holds requests here until the KV cache holds them; with "
                      "batch.order EnginePriority the queue is to form in the engine, which orders it: use BatchSize")])  # fmt: skip
        if b.shortest_by == "KvFootprint" and self.kv_admission != "Projected":
            _broken([("batch.shortestBy", "KvFootprint ranks by the KV cache a request holds, which only the projected KV "
                      f"plan limits: it needs memory.admission Projected (is {self._admission_said})")])  # fmt: skip
        if b.drain_order == "LongestFitFirst":
            needs = [(b.mode == "Continuous", f"batch.mode Continuous (is {b.mode})"),
                     (b.order == "ShortestFirst", f"batch.order ShortestFirst (is {b.order})"),
                     (self.kv_admission == "Projected", f"memory.admission Projected (is {self._admission_said})"),
                     (b.sizing in ("Memory", "Combined"), f"batch.sizing Memory or Combined (is {b.sizing})")]  # fmt: skip
            missing = [what for ok, what in needs if not ok]
            if missing:
                _broken([("batch.drainOrder", "LongestFitFirst packs by the projected KV plan and needs "
                          + ", ".join(missing))])  # fmt: skip
        return self

    # The two Auto defaults resolved: what a policy that sets nothing runs is the configuration measured
    # best without hints (docs/results): the projected KV plan, ranking by KV footprint.
    @property
    def kv_admission(self) -> Literal["BatchSize", "Projected"]:
        """``memory.admission`` with Auto resolved: Projected in Continuous mode unless ``batch.order`` is
        EnginePriority (the queue then forms in the engine, which orders it), else BatchSize."""
        said = self.memory.admission
        if said != "Auto":
            return said
        b = self.batch
        return "Projected" if b.mode == "Continuous" and b.order != "EnginePriority" else "BatchSize"

    @property
    def projected_kv(self) -> bool:
        """The projected KV plan applies: Projected admission, Continuous mode, a memory-aware sizing."""
        b = self.batch
        return self.kv_admission == "Projected" and b.mode == "Continuous" and b.sizing in ("Memory", "Combined")

    @property
    def rank_by(self) -> Literal["OutputTokens", "KvFootprint"]:
        """``batch.shortestBy`` with Auto resolved: KvFootprint where the projected KV plan applies to a
        ShortestFirst queue."""
        said = self.batch.shortest_by
        if said != "Auto":
            return said
        return "KvFootprint" if self.projected_kv and self.batch.order == "ShortestFirst" else "OutputTokens"

    @property
    def _admission_said(self) -> str:
        a = self.memory.admission
        return f"Auto, resolving to {self.kv_admission}" if a == "Auto" else a

    # SI values for the server, converted once here.
    @property
    def max_wait_seconds(self) -> float:
        return self.batch.max_wait_milliseconds / 1000

    @property
    def eps_m(self) -> float:
        return self.memory.overflow_per_mille / 1000

    @property
    def tpot_seconds(self) -> float | None:
        ms = self.latency.tpot_milliseconds
        return ms / 1000 if ms else None

    def queue_budget_seconds(self, ttft_milliseconds: int | None) -> float | None:
        """How long a request may wait in its bin: a share of its TTFT SLO (the
        request's own, else the policy's), or None when neither is set."""
        ms = ttft_milliseconds or self.latency.ttft_milliseconds
        return ms / 1000 * self.latency.queue_share_percent / 100 if ms else None

    @property
    def eps_d(self) -> float:
        """ε_D as a fraction of the TPOT target (multiply by ``tpot_seconds`` for seconds)."""
        return self.latency.tolerance_percent / 100

    @property
    def kv_reserve_ratio(self) -> float:
        return self.memory.kv_reserve_percent / 100

    @property
    def kv_saturation(self) -> float:
        return self.memory.kv_saturation_percent / 100

    @property
    def scrape_interval_seconds(self) -> float:
        return self.metrics.interval_milliseconds / 1000

    @property
    def stale_after_seconds(self) -> float:
        return self.metrics.stale_after_milliseconds / 1000


class ConfigError(ValueError):
    """An invalid config: ``str()`` lists every problem, one ``<path>: <message>`` a line."""

    def __init__(self, problems: Sequence[tuple[str, str]]) -> None:
        self.problems: list[tuple[str, str]] = list(problems)
        super().__init__("\n".join(f"{path}: {msg}" for path, msg in self.problems))

    @classmethod
    def from_validation(cls, exc: ValidationError) -> ConfigError:
        problems = []
        for err in exc.errors(include_url=False):
            where = _dotted(err["loc"])
            if err["type"] == _RULE:
                problems += [(f"{where}.{rel}" if where else rel, msg) for rel, msg in err["ctx"]["problems"]]
            else:
                msg = err["msg"].removeprefix("Value error, ")
                problems.append((where or "<root>", msg))
        return cls(problems)


def _dotted(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def parse_config(data: Mapping[str, Any] | None) -> SidecarConfig:
    """Validate a decoded document; ``None`` or ``{}`` gives the defaults."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError([("<root>", "expected a mapping")])
    try:
        return SidecarConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError.from_validation(exc) from None


def parse_config_bytes(raw: bytes, source: str) -> SidecarConfig:
    """Parse and validate a config file's bytes; ``source`` names the file in errors."""
    try:
        data = yaml.safe_load(raw)
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark else "?"
        raise ConfigError([(source, f"invalid YAML at line {line}: {exc.problem or exc.context}")]) from None
    except yaml.YAMLError as exc:  # e.g. bytes that are not UTF-8
        raise ConfigError([(source, f"invalid YAML: {exc}")]) from None
    except RecursionError:  # found by bench fuzz: "a: [[[[..." thousands deep
        raise ConfigError([(source, "invalid YAML: nested too deeply")]) from None
    except (ValueError, TypeError) as exc:  # a tagged or implicit value PyYAML cannot build: 2001-02-30, !!int 1e9
        raise ConfigError([(source, f"invalid YAML: a value that cannot be read ({exc})")]) from None
    if data is None:  # empty, whitespace or comments only: a file being written, never "all defaults"
        raise ConfigError([(source, "the file holds no config (empty, or only whitespace and comments)")])
    return parse_config(data)


def restart_required(running: SidecarConfig, new: SidecarConfig) -> list[tuple[str, str]]:
    """Problems for the keys in ``RESTART_KEYS`` that ``new`` changes: they cannot be applied live."""
    problems = []
    for section, key in RESTART_KEYS:
        old_value, new_value = getattr(getattr(running, section), key), getattr(getattr(new, section), key)
        if old_value != new_value:
            problems.append((f"{section}.{to_camel(key)}", f"changed from {old_value} to {new_value}: needs a restart (bound at start-up); keeping the running config"))  # fmt: skip
    return problems


@dataclass(frozen=True)
class LoadedConfig:
    """A validated config and where it came from; ``generation`` counts applied reloads."""

    config: SidecarConfig
    sha256: str
    source: str
    loaded_at: float = field(default_factory=time.time)
    generation: int = 1


def load_config(path: str | os.PathLike[str], *, generation: int = 1) -> LoadedConfig:
    """Read and validate ``path``; raises ``ConfigError`` or ``OSError``."""
    raw = Path(path).read_bytes()
    source = os.fspath(path)
    return LoadedConfig(parse_config_bytes(raw, source), hashlib.sha256(raw).hexdigest(), source, generation=generation)


def dump_config(cfg: SidecarConfig) -> dict[str, Any]:
    """The config as the file spells it: camelCase keys, JSON-safe values."""
    return cfg.model_dump(mode="json", by_alias=True)


def config_json(cfg: SidecarConfig) -> str:
    return json.dumps(dump_config(cfg), sort_keys=True)


_USERINFO = re.compile(r"(?<=://)[^/?#\s]*@")  # scheme://user:pass@host: the user:pass@


def redact_urls(text: str) -> str:
    """``text`` with the user information of every URL in it replaced (``https://u:p@h`` -> ``https://***@h``)."""
    return _USERINFO.sub("***@", text)


def _redacted(value: Any) -> Any:
    if isinstance(value, str):
        return redact_urls(value) if "://" in value else value
    if isinstance(value, dict):
        return {k: _redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    return value


def shown_config_json(cfg: SidecarConfig) -> str:
    """``config_json`` as the Admin service shows it: no credential in it.  Paths of the files that hold
    keys and tokens (engine.apiKeyFile, auth.callerTokensDir, auth.adminTokenFile) show, never what the
    files hold (the config never holds it); the user information of every URL is replaced by ``***``."""
    return json.dumps(_redacted(dump_config(cfg)), sort_keys=True)
