"""``binbatch bench fuzz``: generated bad input on both doors and the config parsers.

Every input comes from a seeded ``random.Random`` (one per input: the seed, the
target and the input's index name it, so any input can be made again) that
mutates a corpus of valid requests and configs: fields deleted, duplicated or
given another type, huge numbers, NaN, lone surrogates, deep nesting, long
lists, bad UTF-8, truncation, bit flips.  The same generators drive the
hypothesis tests (tests/integration/test_fuzz_doors.py, tests/unit/test_fuzz_config.py)
at CI scale, seeded by hypothesis.

Targets and what each input must get:

* ``http``: a raw HTTP/1.1 request on a new connection to the HTTP door -- the
  method, path, headers (``x-expected-output-tokens``, ``x-request-priority``,
  ``x-request-class``, ``x-slo-*``, ``x-request-timeout-ms``, content type,
  content-length lies, chunked bodies) and the body (JSON for ``/v1/completions``
  and ``/v1/chat/completions``, or bytes) all generated.  The answer's status is
  below 500, or the connection is closed without one (a request the HTTP parser
  cannot frame); the answer holds no traceback, source path or loopback address.
* ``grpc``: the serialized request of a gRPC call given as raw bytes (identity
  serializers), mutated from valid ``GenerateRequest`` messages or built from
  wire-format pieces, with generated metadata, on ``Generate``,
  ``GenerateStream``, the ``Admin`` RPCs, the health check and unknown methods.
  The status is not INTERNAL or UNKNOWN; its details hold no traceback.
* ``config``: documents for ``parse_config``, YAML text for
  ``parse_config_bytes`` (what ``load_config`` reads), and ``BatchingPolicy``
  specs through the operator's ``sidecar_config`` and ``build_configmap``.  The
  API server's schema would have refused many of these specs, so the contract is
  only: a ``ConfigError`` or a valid config, never another exception.

The bench runs the doors against a sidecar process (the policy default, as the
operator renders it) in front of an instant engine (the emulator with zero step
time), both children on 127.0.0.1, with ``concurrency`` inputs in flight.  It
counts the sidecar's ERROR log records as they arrive, samples its RSS, and
reports a crash if it exits.  Every failing input is kept (its seed, index and
bytes, base64) as a reproducer in the report.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import math
import random
import re
import signal
import struct
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from binbatch_api.v1 import binbatch_pb2 as pb

from ..config import ConfigError, parse_config, parse_config_bytes
from .bench_processes import sidecar_doc, started_engine
from .chaos_processes import SidecarProcess, http_port, rss_and_fds, run_to_end
from .e2e import policy_default
from .overhead import INSTANT

TARGETS = ("http", "grpc", "config")
CONCURRENCY = 32
ANSWER_TIMEOUT_S = 60.0  # one input's bound: an input still unanswered then is a failure (a hang)
READ_TIMEOUT_MS = 2000  # the fuzzed sidecar's server.httpRequestReadTimeoutMilliseconds: a body lie ends soon
KEEP_EXAMPLES = 5  # reproducers kept per target and kind of failure
# what an answer must never show: a traceback, a source file, a loopback address (the engine's)
LEAKS = re.compile(r"Traceback \(most recent call last\)|File \"[^\"]+\.py\"|\.py\", line \d|127\.0\.0\.1:\d+")
GRPC_BAD = ("INTERNAL", "UNKNOWN")

# ----------------------------------------------------------------------------- JSON with holes


@dataclass(frozen=True, slots=True)
class Raw:
    """JSON text put in as is: numbers JSON's grammar allows but Python's json cannot
    write (``1e999``, 5,000 digits), NaN, nesting too deep to build as objects."""

    text: str


@dataclass(frozen=True, slots=True)
class Pairs:
    """A JSON object whose keys may repeat."""

    items: tuple[tuple[str, Any], ...]


BODY_LIMIT = 4 * 1024 * 1024  # a generated body longer than this is cut to it: past maxRequestBytes, and cheap


class TooLong(ValueError):
    """A value whose JSON text would pass ``dump_json``'s limit."""


def dump_json(value: Any, limit: int | None = None) -> str:
    """``value`` as JSON text; ``Raw`` and ``Pairs`` as written, lone surrogates as ``\\udXXX`` escapes.
    ``TooLong`` past ``limit`` characters (a list repeated 10,000 times of a 70,000-character
    string would be 700 MB: writing it blocked the bench's event loop for minutes)."""
    budget = [limit if limit is not None else math.inf]

    def dump(v: Any) -> str:
        if isinstance(v, Raw):
            out = v.text
        elif isinstance(v, Pairs):
            out = "{" + ",".join(f"{json.dumps(k)}:{dump(x)}" for k, x in v.items) + "}"
        elif isinstance(v, dict):
            out = "{" + ",".join(f"{json.dumps(str(k))}:{dump(x)}" for k, x in v.items()) + "}"
        elif isinstance(v, list | tuple):
            out = "[" + ",".join(dump(x) for x in v) + "]"
        elif isinstance(v, float) and not math.isfinite(v):
            out = "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
        else:
            out = json.dumps(v)
        budget[0] -= len(out)
        if budget[0] < 0:
            raise TooLong(f"longer than {limit} characters")
        return out

    return dump(value)


def body_bytes(value: Any) -> bytes:
    """A generated value as a request body: its JSON, or (too long) its JSON's first ``BODY_LIMIT`` bytes' worth."""
    try:
        return dump_json(value, BODY_LIMIT).encode("utf-8", "surrogatepass")
    except TooLong:
        return (b'{"prompt": "' + b"x" * BODY_LIMIT)[:BODY_LIMIT]


def plain(value: Any) -> Any:
    """``value`` without ``Raw``/``Pairs``: what a JSON or YAML decoder would have handed a parser."""
    if isinstance(value, Raw):
        return None
    if isinstance(value, Pairs):
        return {k: plain(v) for k, v in value.items}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


# ----------------------------------------------------------------------------- the mutator

_WEIRD_TEXT = ("", " ", "\ud800", "ok\udfff", "\udbff\udc00", "\x00", "\u202e", "é", "𝔘𝔫𝔦", "\ufeff", "null",
               "0", "-1", "1e9", "NaN", "true", "[]", "{}", "\\", '"', "%s%n", "../../etc/passwd", "\r\n", "a" * 600,
               "Emulated", "emulated ", "EMULATED")  # fmt: skip
_NUMBERS = (0, -1, 1, 2, -(2**31), 2**31, 2**32, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**30, 1.5, -0.0, 1e-320,
            1e308, -1e308, math.nan, math.inf, -math.inf, 0.1, 4096, 513)  # fmt: skip
_RAW_NUMBERS = ("1e999", "-1e999", "1" + "0" * 5000, "0.0000000000000000000000000001", "1E400", "-0", "1.0e+2",
                "NaN", "Infinity", "-Infinity", "01", "1.", ".5", "+1", "0x10", "1_000")  # fmt: skip


class Mutator:
    """Mutations of JSON-like values, text and bytes, all drawn from one ``random.Random``."""

    def __init__(self, rng: random.Random, *, raw: bool = True) -> None:
        self.rng = rng
        self.raw = raw  # may put Raw/Pairs in values (JSON text targets); off for Python-object parsers

    def text(self) -> str:
        r = self.rng
        pick = r.random()
        if pick < 0.5:
            return r.choice(_WEIRD_TEXT)
        if pick < 0.8:
            return "".join(chr(r.choice((r.randrange(32, 127), r.randrange(0x80, 0x800), r.randrange(0xD800, 0xE000),
                                          r.randrange(0x10000, 0x110000), r.randrange(0, 32))))
                           for _ in range(r.randrange(0, 40)))  # fmt: skip
        return r.choice(("x", "ab", "é", "\ud800", "[")) * r.choice((100, 5000, 70_000))

    def scalar(self) -> Any:
        r = self.rng
        pick = r.random()
        if pick < 0.35:
            return r.choice(_NUMBERS)
        if pick < 0.45 and self.raw:
            return Raw(r.choice(_RAW_NUMBERS))
        if pick < 0.55:
            return r.choice((None, True, False))
        if pick < 0.65:
            return r.randrange(-(2**70), 2**70) if r.random() < 0.5 else r.uniform(-1e6, 1e6)
        return self.text()

    def any_value(self, depth: int = 0) -> Any:
        r = self.rng
        pick = r.random()
        if depth > 3 or pick < 0.6:
            return self.scalar()
        if pick < 0.75:
            return [self.any_value(depth + 1) for _ in range(r.randrange(0, 4))]
        if pick < 0.85 and self.raw:
            n = r.choice((50, 200, 1000, 5000, 100_000))
            return Raw(r.choice(("[", '{"a":')) * n + "1" + "]" * n)  # deep nesting (and, as often, unbalanced)
        if pick < 0.9:
            return [self.scalar()] * r.choice((100, 1000, 10_000 if self.raw else 1000))
        return {self.text()[:20]: self.any_value(depth + 1) for _ in range(r.randrange(0, 4))}

    def value(self, v: Any, keys: tuple[str, ...] = (), depth: int = 0) -> Any:
        """One mutation somewhere in ``v``; ``keys`` are field names worth adding."""
        r = self.rng
        if isinstance(v, dict) and v and r.random() < 0.75:
            items = list(v.items())
            pick = r.random()
            if pick < 0.55:  # go down into one field
                i = r.randrange(len(items))
                items[i] = (items[i][0], self.value(items[i][1], keys, depth + 1))
            elif pick < 0.7:  # delete a field
                del items[r.randrange(len(items))]
            elif pick < 0.8 and self.raw:  # a field twice, the second value another
                k, old = items[r.randrange(len(items))]
                return Pairs((*items, (k, self.value(old, keys, depth + 1))))
            else:  # add a field: a known name or any
                name = r.choice(keys) if keys and r.random() < 0.7 else self.text()[:30]
                items.append((name, self.any_value(depth + 1)))
            return dict(items)
        if isinstance(v, list) and v and r.random() < 0.7:
            out = list(v)
            pick = r.random()
            if pick < 0.5:
                i = r.randrange(len(out))
                out[i] = self.value(out[i], keys, depth + 1)
            elif pick < 0.7:
                del out[r.randrange(len(out))]
            elif pick < 0.85:
                out.append(copy.deepcopy(r.choice(out)))
            elif len(out) < 100:
                out = out * r.choice((10, 100))
            return out
        pick = r.random()
        if pick < 0.15:
            return [v]
        if pick < 0.25:
            return {self.text()[:10]: v}
        if pick < 0.35 and isinstance(v, str):
            return v + self.text()
        if pick < 0.45 and isinstance(v, int | float) and not isinstance(v, bool):
            return r.choice((-v, v * 1000, v + 1, v - 1, str(v), float(v), math.nan))
        return self.any_value(depth)

    def mutate(self, v: Any, keys: tuple[str, ...] = ()) -> Any:
        """One to four mutations."""
        for _ in range(1 + int(self.rng.expovariate(1.2)) % 4):
            v = self.value(v, keys)
        return v

    def bytes(self, data: bytes) -> bytes:
        """One to four byte-level mutations: bit flips, truncation, insertions of bad
        UTF-8 and random bytes, deleted or repeated ranges."""
        r = self.rng
        out = bytearray(data)
        for _ in range(1 + int(r.expovariate(1.0)) % 4):
            n = len(out)
            pick = r.random()
            if pick < 0.3 and n:
                i = r.randrange(n)
                out[i] ^= 1 << r.randrange(8)
            elif pick < 0.45 and n:
                del out[r.randrange(n) :]
            elif pick < 0.65:
                bad = r.choice((b"\xff", b"\xfe\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80",
                                b"\x00", b"\xe2\x82", bytes(r.randrange(256) for _ in range(r.randrange(1, 16)))))  # fmt: skip
                i = r.randrange(n + 1)
                out[i:i] = bad
            elif pick < 0.8 and n:
                i = r.randrange(n)
                del out[i : i + r.randrange(1, 16)]
            elif n:
                i = r.randrange(n)
                j = min(n, i + r.randrange(1, 32))
                out[i:i] = out[i:j] * r.choice((1, 2, 100))
            else:
                out += bytes(r.randrange(256) for _ in range(r.randrange(1, 64)))
        return bytes(out)


def case_rng(seed: int, target: str, index: int) -> random.Random:
    """The generator of input ``index`` of ``target`` in a run seeded ``seed``."""
    return random.Random(f"{seed}:{target}:{index}")


# ----------------------------------------------------------------------------- HTTP door

COMPLETION_KEYS = ("model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "stream",
                   "stream_options", "n", "logprobs", "ignore_eos", "min_tokens", "user", "echo", "best_of",
                   "logit_bias", "suffix", "priority", "max_completion_tokens", "response_format", "tools")  # fmt: skip
CHAT_KEYS = (*COMPLETION_KEYS, "messages", "tool_choice", "top_logprobs", "add_generation_prompt",
             "continue_final_message", "chat_template")  # fmt: skip
HTTP_HEADERS = ("x-expected-output-tokens", "x-request-priority", "x-request-class", "x-slo-ttft-ms",
                "x-slo-tpot-ms", "x-request-timeout-ms", "x-request-id", "x-gateway-inference-fairness-id",
                "traceparent", "tracestate", "authorization", "accept", "accept-encoding", "expect")  # fmt: skip
_HEADER_VALUES = ("1", "0", "-1", "16", "600000", "600001", "100000", "4294967296", "99999999999999999999",
                  "1.5", "1e3", " 5", "5 ", "+5", "0x10", "١٢", "", "abc", "NaN", "interactive", "batch",
                  "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "00-zz-zz-01", "100-continue",
                  "gzip", "br, deflate", "text/event-stream", "x" * 9000)  # fmt: skip
_PATHS = ("/v1/completions", "/v1/chat/completions", "/health", "/v1/models", "/metrics", "/v1/completions/",
          "//v1/completions", "/v1/completions?stream=true", "/v1/../v1/completions", "/%2e%2e/pause",
          "/v1/completions%00", "/v1/chat/completions#x", "*", "/", "/pause", "/tokenize", "/v1/models/../pause",
          "/v1/%ZZ", "/" + "a" * 10_000, "http://127.0.0.1/v1/completions", "/v1/completions\x00")  # fmt: skip
_METHODS = ("GET", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH", "TRACE", "CONNECT", "post", "P0ST", "BREW", "")
_CONTENT_TYPES = ("application/json", "text/plain", "", "application/json; charset=latin-1",
                  "application/json; charset=utf-16", "multipart/form-data; boundary=x",
                  "application/x-www-form-urlencoded", "application/json;;", "\x7f")  # fmt: skip


def completion_corpus(model: str) -> list[dict[str, Any]]:
    return [
        {"model": model, "prompt": "hello there", "max_tokens": 4},
        {"model": model, "prompt": "count to three", "max_tokens": 3, "ignore_eos": True, "temperature": 0.5,
         "top_p": 0.9, "stop": ["\n"], "seed": 7},
        {"model": model, "prompt": ["one", "two"], "max_tokens": 2, "stream": True,
         "stream_options": {"include_usage": True}},
        {"prompt": "no model named", "max_tokens": 1, "min_tokens": 1, "n": 1, "user": "u1"},
    ]  # fmt: skip


def chat_corpus(model: str) -> list[dict[str, Any]]:
    return [
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        {"model": model, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
         "max_completion_tokens": 3, "stream": True},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}], "max_tokens": 2,
         "ignore_eos": True, "temperature": 0},
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class HttpCase:
    kind: str
    request: bytes  # the whole request as sent
    half_close: bool  # shut our side after sending: a body shorter than its Content-Length ends


def http_case(rng: random.Random, model: str) -> HttpCase:
    """One generated HTTP request."""
    m = Mutator(rng)
    chat = rng.random() < 0.45
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body_value: Any = rng.choice(chat_corpus(model) if chat else completion_corpus(model))
    method = "POST"
    headers: list[tuple[str, str]] = [("Host", "127.0.0.1"), ("Content-Type", "application/json")]
    pick = rng.random()
    if pick < 0.45:
        kind = "json"
        body_value = m.mutate(body_value, CHAT_KEYS if chat else COMPLETION_KEYS)
        body = body_bytes(body_value)
    elif pick < 0.65:
        kind = "bytes"
        body = m.bytes(dump_json(body_value).encode())
    elif pick < 0.85:
        kind = "headers"
        if rng.random() < 0.3:
            body_value = m.mutate(body_value, CHAT_KEYS if chat else COMPLETION_KEYS)
        body = body_bytes(body_value)
        for _ in range(rng.randrange(1, 5)):
            name = rng.choice(HTTP_HEADERS)
            value = rng.choice(_HEADER_VALUES) if rng.random() < 0.7 else m.text()[:200]
            headers.append((name, value))
        if rng.random() < 0.3:
            headers[1] = ("Content-Type", rng.choice(_CONTENT_TYPES))
    else:
        kind = "method-path"
        body = dump_json(body_value).encode() if rng.random() < 0.7 else m.bytes(b"")
        method = rng.choice(("POST", *_METHODS))
        path = rng.choice(_PATHS) if rng.random() < 0.8 else "/" + m.text()[:100]
    return _frame(rng, kind, method, path, headers, body)


def _frame(rng: random.Random, kind: str, method: str, path: str, headers: list[tuple[str, str]],
           body: bytes) -> HttpCase:  # fmt: skip
    """The request's bytes: a Content-Length (true, or a lie), or a chunked body (well formed or not)."""
    half_close = False
    framing = rng.random()
    if kind == "method-path" or kind == "headers":
        framing = framing * 0.8 + 0.2  # lies are the bytes kind's; these mostly frame truthfully
    if framing < 0.05:
        headers.append(("Content-Length", str(max(0, len(body) - rng.randrange(1, 50)))))  # shorter: the rest is junk
    elif framing < 0.1:
        headers.append(("Content-Length", str(len(body) + rng.randrange(1, 10_000))))  # longer: we close our side
        half_close = True
    elif framing < 0.13:
        headers.append(("Content-Length", rng.choice(("-1", "abc", "1e3", " 12", "99999999999999999999", ""))))
    elif framing < 0.16:
        headers += [("Content-Length", str(len(body))), ("Content-Length", str(len(body) + 1))]
    elif framing < 0.2:
        headers.append(("Transfer-Encoding", "chunked"))
        chunks = [body[i : i + 7] for i in range(0, len(body), 7)]
        coded = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
        body = coded if rng.random() < 0.5 else Mutator(rng).bytes(coded)
        half_close = True
    else:
        headers.append(("Content-Length", str(len(body))))
    headers.append(("Connection", "close"))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    return HttpCase(kind, head.encode("utf-8", "surrogatepass") + body, half_close)


@dataclass(slots=True)
class Answer:
    """What one input got: ``status`` an HTTP status, a gRPC code name, ``closed`` (no
    answer: the connection ended), ``ok``/``ConfigError`` (config), or a failure."""

    status: str
    text: str = ""
    failure: str | None = None  # why the oracle refused it


DEADLINE_504 = "504 (the caller's deadline)"


def http_status_class(status: str) -> str:
    return f"{status[0]}xx" if status.isdigit() else status


async def send_http(port: int, case: HttpCase, timeout: float = ANSWER_TIMEOUT_S) -> Answer:
    """Send ``case`` on a new connection to 127.0.0.1:``port`` and judge the answer."""
    data = b""
    try:
        async with asyncio.timeout(timeout):
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError as exc:
                return Answer("unreachable", str(exc), failure=f"could not connect: {exc}")
            try:
                with contextlib.suppress(OSError):  # the server may close first (a 413, a 400): read what it said
                    writer.write(case.request)
                    await writer.drain()
                    if case.half_close and writer.can_write_eof():
                        writer.write_eof()
                with contextlib.suppress(OSError):
                    while chunk := await reader.read(65536):
                        data += chunk
                        if len(data) > 8 * 1024 * 1024:
                            break
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except TimeoutError:
        return Answer("timeout", data[:300].decode(errors="replace"), failure=f"no answer within {timeout:.0f} s")
    return judge_http(data, deadline=b"\r\nx-request-timeout-ms:" in case.request.lower())


def judge_http(data: bytes, deadline: bool = False) -> Answer:
    """The oracle for one HTTP answer (the raw bytes the server sent); ``deadline``: the request
    set its own (``x-request-timeout-ms``), whose passing is a documented 504, gRPC's DEADLINE_EXCEEDED."""
    text = data.decode("utf-8", errors="replace")
    if not data:
        return Answer("closed")
    match = re.match(r"HTTP/1\.[01] (\d{3})", text)
    while match and match.group(1).startswith("1") and (end := text.find("\r\n\r\n", match.start())) >= 0:
        match = re.compile(r"HTTP/1\.[01] (\d{3})").match(text, end + 4)  # past an interim answer (100 Continue)
    if not match:
        return Answer("garbled", text[:300], failure="the answer is not an HTTP response")
    status = match.group(1)
    if status == "504" and deadline and '"code": "deadline_exceeded"' in text:
        status = DEADLINE_504
    elif int(status) >= 500:
        return Answer(status, text[:2000], failure=f"HTTP {status}")
    if leak := LEAKS.search(text):
        return Answer(status, text[:2000], failure=f"the answer shows {leak.group(0)!r}")
    return Answer(status)


# ----------------------------------------------------------------------------- gRPC door

GRPC_METHODS = {  # path: (corpus of valid requests, unary_stream)
    "/binbatch.v1.Inference/Generate": False,
    "/binbatch.v1.Inference/GenerateStream": True,
    "/binbatch.v1.Admin/GetStats": False,
    "/binbatch.v1.Admin/GetConfig": False,
    "/binbatch.v1.Admin/ExportTrainingRecords": False,
    "/grpc.health.v1.Health/Check": False,
    "/binbatch.v1.Inference/Nope": False,
    "/binbatch.v1.Nope/Generate": False,
}
GRPC_METADATA = ("x-slo-ttft-ms", "x-slo-tpot-ms", "x-expected-output-tokens", "x-request-class",
                 "x-request-priority", "x-request-id", "traceparent", "tracestate", "x-gateway-inference-fairness-id",
                 "grpc-encoding", "x-bin-bin", "authorization")  # fmt: skip


def generate_corpus(model: str) -> list[pb.GenerateRequest]:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="system", content="be brief"),
                                     pb.ChatMessage(role="user", content="hi")])  # fmt: skip
    return [
        pb.GenerateRequest(prompt="hello there", max_tokens=4, model=model),
        pb.GenerateRequest(prompt="count", max_tokens=3, ignore_eos=True, temperature=0.5, top_p=0.9, stop=["\n"],
                           seed=7, min_tokens=1, expected_output_tokens=3, priority=2, request_class="",
                           request_id="r-1"),
        pb.GenerateRequest(chat=chat, max_tokens=2),
    ]  # fmt: skip


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _wire_piece(rng: random.Random) -> bytes:
    """One protobuf field in wire format: any field number, any wire type, odd lengths."""
    number = rng.choice((1, 2, 3, 4, 5, 7, 8, 11, 12, 13, 14, 99, 536870911, 0))
    wire = rng.choice((0, 1, 2, 3, 4, 5, 6, 7))
    tag = _varint((number << 3) | wire)
    if wire == 0:
        return tag + _varint(rng.choice((0, 1, 2**32, 2**63, 2**64 - 1, rng.randrange(2**64))))
    if wire == 1:
        return tag + struct.pack("<d", rng.choice((math.nan, math.inf, -1.0, 1e300)))
    if wire == 5:
        return tag + struct.pack("<f", rng.choice((math.nan, math.inf, -1.0, 3.4e38)))
    if wire == 2:
        payload = rng.choice((b"", b"\xff\xfe", b"\xed\xa0\x80", b"ok", b"\x0a\x02hi" * 3, b"x" * 5000))
        declared = len(payload) if rng.random() < 0.7 else rng.choice((len(payload) + 5, 2**31, 2**64 - 1))
        return tag + _varint(declared) + payload
    if wire == 3:  # a group, nested deep (unknown fields may be groups)
        depth = rng.choice((1, 10, 99, 101, 1000))
        return tag * depth + _varint((number << 3) | 4) * (depth if rng.random() < 0.8 else depth - 1)
    return tag


def grpc_payload(rng: random.Random, model: str) -> tuple[str, bytes]:
    """(kind, bytes) of one request body."""
    m = Mutator(rng)
    base = rng.choice(generate_corpus(model))
    pick = rng.random()
    if pick < 0.35:
        msg = pb.GenerateRequest()
        msg.CopyFrom(base)
        for _ in range(rng.randrange(1, 4)):
            _mutate_fields(rng, m, msg)
        return "protobuf", msg.SerializeToString()
    if pick < 0.65:
        return "bytes", m.bytes(base.SerializeToString())
    if pick < 0.85:
        pieces = [base.SerializeToString()] if rng.random() < 0.5 else []
        pieces += [_wire_piece(rng) for _ in range(rng.randrange(1, 5))]
        rng.shuffle(pieces)
        return "wire", b"".join(pieces)
    return "random", bytes(rng.randrange(256) for _ in range(rng.choice((0, 1, 5, 64, 1024))))


def _mutate_fields(rng: random.Random, m: Mutator, msg: pb.GenerateRequest) -> None:
    """Set one field to an odd value (within what protobuf lets a client set)."""
    name = rng.choice(("prompt", "chat", "model", "max_tokens", "temperature", "top_p", "stop", "seed", "min_tokens",
                       "expected_output_tokens", "priority", "request_class", "request_id", "ignore_eos"))  # fmt: skip
    try:
        if name in ("prompt", "model", "request_class", "request_id"):
            setattr(msg, name, m.text())
        elif name == "chat":
            msg.chat.messages.add(role=m.text()[:50], content=m.text())
            if rng.random() < 0.3:
                del msg.chat.messages[:]
        elif name == "stop":
            msg.stop.extend(m.text() for _ in range(rng.choice((1, 5, 1000))))
        elif name in ("temperature", "top_p"):
            setattr(msg, name, rng.choice((math.nan, math.inf, -math.inf, -1.0, 0.0, 3e38, 1e-45, 2.0)))
        elif name == "ignore_eos":
            msg.ignore_eos = not msg.ignore_eos
        elif name in ("seed", "priority"):
            bits = 63 if name == "seed" else 31
            setattr(msg, name, rng.choice((-(2**bits), 2**bits - 1, 0, -1, 1)))
        else:
            setattr(msg, name, rng.choice((0, 1, 2**32 - 1, 2**31, 511, 512, 513, 100_000)))
    except ValueError:  # a lone surrogate: protobuf refuses it on the client (the bytes kind sends those)
        pass


def grpc_metadata(rng: random.Random) -> list[tuple[str, str | bytes]]:
    """Metadata a client can send: gRPC refuses a text value outside printable ASCII before it
    leaves; a ``-bin`` key takes any bytes."""
    m = Mutator(rng)
    md: list[tuple[str, str | bytes]] = []
    for _ in range(rng.choice((0, 0, 1, 2, 3))):
        key = rng.choice(GRPC_METADATA)
        value = rng.choice(_HEADER_VALUES) if rng.random() < 0.8 else m.text()[:100]
        if key.endswith("-bin"):
            md.append((key, m.bytes(value.encode("utf-8", "surrogatepass"))))
        else:
            md.append((key, "".join(c for c in value if " " <= c <= "~")))
    return md


@dataclass(frozen=True, slots=True)
class GrpcCase:
    kind: str
    method: str
    payload: bytes
    metadata: tuple[tuple[str, str | bytes], ...]
    timeout: float


def grpc_case(rng: random.Random, model: str) -> GrpcCase:
    methods = list(GRPC_METHODS)
    method = methods[0] if rng.random() < 0.5 else rng.choice(methods)
    kind, payload = grpc_payload(rng, model)
    if method not in ("/binbatch.v1.Inference/Generate", "/binbatch.v1.Inference/GenerateStream") and rng.random() < 0.5:
        kind, payload = "bytes", Mutator(rng).bytes(b"")  # Admin and health requests: garbage of their own
    timeout = ANSWER_TIMEOUT_S if rng.random() < 0.9 else rng.choice((0.001, 0.05, 0.5))
    return GrpcCase(kind, method, payload, tuple(grpc_metadata(rng)), timeout)


async def send_grpc(channel: grpc.aio.Channel, case: GrpcCase) -> Answer:
    """Call ``case.method`` with ``case.payload`` as its serialized request and judge the status."""
    code, details = "OK", ""
    try:
        if GRPC_METHODS.get(case.method, False):
            call = channel.unary_stream(case.method)(case.payload, metadata=case.metadata, timeout=case.timeout)
            async for _ in call:
                pass
        else:
            await channel.unary_unary(case.method)(case.payload, metadata=case.metadata, timeout=case.timeout)
    except grpc.aio.AioRpcError as exc:
        code, details = exc.code().name, exc.details() or ""
    except (ValueError, TypeError, UnicodeError):  # metadata the client itself will not send
        return Answer("unsendable")
    if code in GRPC_BAD:
        return Answer(code, details[:2000], failure=f"gRPC {code}")
    if leak := LEAKS.search(details):
        return Answer(code, details[:2000], failure=f"the status details show {leak.group(0)!r}")
    return Answer(code)


# ----------------------------------------------------------------------------- config parsers

SIDECAR_KEYS = ("engine", "bins", "batch", "memory", "latency", "predictor", "metrics", "server", "logging",
                "classes", "url", "model", "count", "boundaries", "mode", "sizing", "staticSize", "maxBatchSize",
                "maxWaitMilliseconds", "kind", "level", "format", "passthroughPaths", "maxRequestBytes")  # fmt: skip


def config_corpus() -> list[dict[str, Any]]:
    """Valid sidecar config documents."""
    engine = "http://127.0.0.1:8000"
    return [
        {"engine": {"url": engine}},
        sidecar_doc(engine, "m", policy_default({})),
        {"engine": {"url": engine, "model": "emulated", "requestTimeoutSeconds": 120},
         "bins": {"mode": "Fixed", "count": 3, "boundaries": [32, 128], "maxOutputTokens": 512},
         "batch": {"mode": "Continuous", "sizing": "Memory", "staticSize": 16, "minBatchSize": 1,
                   "maxBatchSize": 128, "maxWaitMilliseconds": 20, "maxInflightBatches": 4, "maxQueuedRequests": 2000},
         "memory": {"overflowPerMille": 10, "kvReservePercent": 5},
         "predictor": {"kind": "Learned", "defaultOutputTokens": 64}, "metrics": {"source": "Scrape"},
         "classes": {"list": [{"name": "interactive", "priority": 1}]}},
        {"engine": {"url": engine}, "predictor": {"kind": "Hint"}, "bins": {"count": 4, "maxOutputTokens": 16},
         "batch": {"mode": "Gang", "sizing": "Static", "staticSize": 64}, "logging": {"level": "Debug", "format": "Text"}},
    ]  # fmt: skip


def crd_corpus() -> list[dict[str, Any]]:
    """Valid BatchingPolicy specs (the samples' shapes)."""
    return [
        {"selector": {}, "predictor": {}},
        {"selector": {"matchLabels": {"app.kubernetes.io/name": "vllm-emulator"}},
         "sidecar": {"image": "", "grpcPort": 50051, "httpPort": 8080, "metricsPort": 9090, "drainGraceSeconds": 20},
         "engine": {"url": "http://127.0.0.1:8000", "model": "emulated", "requestTimeoutSeconds": 120},
         "bins": {"mode": "Fixed", "count": 3, "boundaries": [32, 128], "maxOutputTokens": 512},
         "batch": {"mode": "Continuous", "sizing": "Memory", "staticSize": 16, "minBatchSize": 1, "maxBatchSize": 128,
                   "maxWaitMilliseconds": 20, "maxInflightBatches": 4, "maxQueuedRequests": 2000},
         "memory": {"overflowPerMille": 10, "kvReservePercent": 5},
         "predictor": {"kind": "Learned", "defaultOutputTokens": 64}, "metrics": {"source": "Scrape"}},
        {"selector": {"matchLabels": {"app": "vllm"}},
         "sidecar": {"takeOverServingPort": {"enabled": True, "enginePort": 8001}},
         "engine": {"url": "http://127.0.0.1:8000", "model": "Qwen/Qwen2.5-1.5B-Instruct", "apiKeySecretRef": {"name": "k", "key": "token"}},
         "bins": {"mode": "Auto", "count": 4, "maxOutputTokens": 2048},
         "predictor": {"kind": "Learned", "fleet": {"enabled": True}}},
        {"selector": {}, "predictor": {"kind": "Learned", "model": {"configMapKeyRef": {"name": "m", "key": "model.json"}}}},
    ]  # fmt: skip


CRD_KEYS = ("selector", "sidecar", "engine", "bins", "batch", "memory", "latency", "predictor", "metrics", "logging",
            "classes", "service", "fleet", "model", "apiKeySecretRef", "apiKeyFile", "takeOverServingPort",
            "enginePort", "enabled", "warmStart", "configMapKeyRef", "secretKeyRef", "name", "key")  # fmt: skip
_YAML_SNIPPETS = ("2001-13-45", "2001-02-30", "2001-02-28 25:61:61", "!!binary ===", "!!float abc", "!!int 1e9",
                  "*undefined", "&a [*a]", "{a: 1, a: 2}", "? [1, 2]\n  : x", ".nan", ".inf", "-.inf", "0x1F", "0o17",
                  "1_000", "~", "!!set {a}", "!!omap [{a: 1}]", "!!python/object:os.system {}", "!!str", "@x", "`x",
                  "|\n  multi\n  line", "'unterminated", "[1, 2", "{a: [", "<<: {count: 3}", "!!timestamp 2001-1-1",
                  "99999999999999999999999999999999", "1e400", "!!merge x", "!<tag:yaml.org,2002:int> abc",
                  "\t- tab", "\x00", "\ufffe")  # fmt: skip


def _yaml_text(rng: random.Random, doc: Any) -> bytes:
    m = Mutator(rng, raw=False)
    try:
        dump_json(doc, 4000)
    except TooLong:  # emitting YAML is slow: long values are the dict kind's
        doc = config_corpus()[0]
    try:
        text = yaml.dump(doc, Dumper=yaml.CSafeDumper, sort_keys=False, allow_unicode=rng.random() < 0.5)
    except (yaml.YAMLError, ValueError, UnicodeError):
        text = yaml.safe_dump(config_corpus()[0])
    lines = text.splitlines()
    pick = rng.random()
    if pick < 0.4 and lines:
        i = rng.randrange(len(lines))
        head, sep, _ = lines[i].partition(": ")
        lines[i] = f"{head}{sep or ': '}{rng.choice(_YAML_SNIPPETS)}"
        data = "\n".join(lines).encode("utf-8", "surrogatepass")
    elif pick < 0.55:
        depth = rng.choice((10, 100, 300, 600))  # 600: past Python's recursion limit in PyYAML
        data = ("a: " + "[" * depth + "]" * depth if rng.random() < 0.5 else "a:\n" + "".join(
            "  " * i + "b:\n" for i in range(min(depth, 100)))).encode()  # fmt: skip
    elif pick < 0.65:
        data = b"a: &a [1, 2]\nb: &b [*a, *a, *a, *a]\nc: &c [*b, *b, *b, *b]\nd: [*c, *c, *c, *c]\n"
    else:
        data = m.bytes(text.encode("utf-8", "surrogatepass"))
    return data


@dataclass(frozen=True, slots=True)
class ConfigCase:
    kind: str  # dict | yaml | crd
    value: Any  # the document, the YAML bytes, or the spec


def config_case(rng: random.Random) -> ConfigCase:
    m = Mutator(rng, raw=False)
    pick = rng.random()
    if pick < 0.35:
        return ConfigCase("dict", plain(m.mutate(copy.deepcopy(rng.choice(config_corpus())), SIDECAR_KEYS)))
    if pick < 0.65:
        doc = rng.choice(config_corpus())
        if rng.random() < 0.5:
            doc = plain(m.mutate(copy.deepcopy(doc), SIDECAR_KEYS))
        return ConfigCase("yaml", _yaml_text(rng, doc))
    return ConfigCase("crd", plain(m.mutate(copy.deepcopy(rng.choice(crd_corpus())), CRD_KEYS)))


def run_config_case(case: ConfigCase) -> Answer:
    """Parse ``case``; success and ``ConfigError`` are answers, any other exception a failure."""
    from binbatch_operator import builders  # the operator's builder: the CRD spec -> the sidecar's config

    try:
        if case.kind == "dict":
            parse_config(case.value)
        elif case.kind == "yaml":
            parse_config_bytes(case.value, "fuzz.yaml")
        else:
            doc = builders.sidecar_config(case.value)
            parse_config(doc)
            cm = builders.build_configmap("fuzz", "ns", case.value)
            parse_config_bytes(cm["data"][builders.CONFIG_KEY].encode(), "configmap")
    except ConfigError:
        return Answer("ConfigError")
    except Exception as exc:  # noqa: BLE001 -- the oracle: any other exception is the finding
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return Answer(type(exc).__name__, f"{type(exc).__name__}: {str(exc)[:300]} at {Path(where.filename).name}:"
                      f"{where.lineno}", failure=f"{type(exc).__name__} escaped the parser")  # fmt: skip
    return Answer("ok")


# ----------------------------------------------------------------------------- the run


@dataclass
class Tally:
    """One target's counts and kept reproducers."""

    target: str
    inputs: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    answers: Counter[str] = field(default_factory=Counter)
    failures: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, index: int, kind: str, answer: Answer, reproducer: Callable[[], dict[str, Any]]) -> None:
        self.inputs += 1
        self.by_kind[kind] += 1
        self.answers[http_status_class(answer.status) if self.target == "http" else answer.status] += 1
        if answer.failure is not None:
            self.failures += 1
            if len(self.examples) < KEEP_EXAMPLES:
                self.examples.append({"index": index, "kind": kind, "failure": answer.failure, "answer": answer.text,
                                      **reproducer()})  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {"inputs": self.inputs, "by_kind": dict(sorted(self.by_kind.items())),
                "answers": dict(sorted(self.answers.items())), "failures": self.failures,
                "seconds": round(self.seconds, 1), "examples": self.examples}  # fmt: skip


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


PROGRESS_EVERY = 5000  # inputs between progress lines on a door


async def _pool(n: int, concurrency: int, one: Callable[[int], Any], say: Callable[[str], None] | None = None) -> None:
    """``one(i)`` for i in range(n), ``concurrency`` at a time; a progress line every ``PROGRESS_EVERY``."""
    indices: Iterator[int] = iter(range(n))
    done = 0
    t0 = time.perf_counter()

    async def worker() -> None:
        nonlocal done
        for i in indices:
            await one(i)
            done += 1
            if say is not None and done % PROGRESS_EVERY == 0:
                say(f"  {done} of {n} ({done / (time.perf_counter() - t0):.0f} a second)")

    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))


async def fuzz_http(port: int, model: str, seed: int, n: int, concurrency: int = CONCURRENCY,
                    say: Callable[[str], None] | None = None) -> Tally:  # fmt: skip
    tally = Tally("http")
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        case = http_case(case_rng(seed, "http", i), model)
        answer = await send_http(port, case)
        tally.add(i, case.kind, answer, lambda: {"request_b64": _b64(case.request), "half_close": case.half_close})

    await _pool(n, concurrency, one, say)
    tally.seconds = time.perf_counter() - t0
    return tally


async def fuzz_grpc(target: str, model: str, seed: int, n: int, concurrency: int = CONCURRENCY,
                    say: Callable[[str], None] | None = None) -> Tally:  # fmt: skip
    tally = Tally("grpc")
    t0 = time.perf_counter()
    async with grpc.aio.insecure_channel(target) as channel:

        async def one(i: int) -> None:
            case = grpc_case(case_rng(seed, "grpc", i), model)
            answer = await send_grpc(channel, case)
            tally.add(i, case.kind, answer, lambda: {"method": case.method, "payload_b64": _b64(case.payload),
                                                     "metadata": [[k, v if isinstance(v, str) else _b64(v)]
                                                                  for k, v in case.metadata]})  # fmt: skip

        await _pool(n, concurrency, one, say)
    tally.seconds = time.perf_counter() - t0
    return tally


def fuzz_config(seed: int, n: int, stop: threading.Event | None = None) -> Tally:
    """``n`` config inputs (in a thread: ``stop`` ends it early, when the bench is cancelled)."""
    tally = Tally("config")
    t0 = time.perf_counter()
    for i in range(n):
        if stop is not None and stop.is_set():
            break
        case = config_case(case_rng(seed, "config", i))
        answer = run_config_case(case)
        tally.add(i, case.kind, answer, lambda c=case: {"value_b64": _b64(c.value) if isinstance(c.value, bytes)
                                                        else _b64(body_bytes(c.value))})  # fmt: skip
    tally.seconds = time.perf_counter() - t0
    return tally


@dataclass(frozen=True)
class FuzzConfig:
    inputs: int = 120_000  # in all, split evenly across the targets
    seed: int = 0
    targets: tuple[str, ...] = TARGETS
    concurrency: int = CONCURRENCY


class FuzzedSidecar(SidecarProcess):
    """The sidecar under fuzz: counts its log records by level as they arrive (the kept
    tail is bounded) and keeps the first few ERROR records."""

    def __init__(self, config_path: Path, cwd: Path) -> None:
        super().__init__(config_path, cwd)
        self.levels: Counter[str] = Counter()
        self.errors: list[str] = []

    async def _read_rest(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while raw := await self.proc.stderr.readline():
            line = raw.decode(errors="replace")
            self.lines.append(line)
            del self.lines[:-1000]
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = {"level": "RAW", "message": line.rstrip()}
            level = str(record.get("level", "?")).upper() if isinstance(record, dict) else "RAW"
            self.levels[level] += 1
            if level in ("ERROR", "CRITICAL", "RAW") and len(self.errors) < KEEP_EXAMPLES:
                self.errors.append(line.rstrip()[:2000])


def fuzzed_sidecar_doc(engine_url: str, model: str) -> dict[str, Any]:
    """The policy default (as the operator renders a policy that sets nothing) in front of the
    engine, with a short request-read deadline so a body shorter than its Content-Length ends soon."""
    doc = sidecar_doc(engine_url, model, policy_default({}), scrape_ms=None)
    doc["server"]["httpRequestReadTimeoutMilliseconds"] = READ_TIMEOUT_MS
    return doc


async def run_async(cfg: FuzzConfig, say: Callable[[str], None]) -> dict[str, Any]:
    unknown = set(cfg.targets) - set(TARGETS)
    if unknown or not cfg.targets:
        raise ValueError(f"targets: each one of {', '.join(TARGETS)}, got {', '.join(cfg.targets) or 'none'}")
    share = {t: cfg.inputs // len(cfg.targets) + (1 if i < cfg.inputs % len(cfg.targets) else 0)
             for i, t in enumerate(cfg.targets)}  # fmt: skip
    tallies: dict[str, Tally] = {}
    doc: dict[str, Any] = {"seed": cfg.seed, "concurrency": cfg.concurrency, "targets": {}}
    config = None
    stop = threading.Event()
    if "config" in cfg.targets:  # in a thread, beside the doors: it needs no sidecar
        say(f"config: {share['config']} inputs")
        config = asyncio.create_task(asyncio.to_thread(fuzz_config, cfg.seed, share["config"], stop))
    try:
        doors = [t for t in cfg.targets if t != "config"]
        if doors:
            doc["sidecar"] = await _fuzz_doors(cfg, doors, share, tallies, say)
        if config is not None:
            tallies["config"] = t = await config
            say(f"config: {t.inputs} inputs in {t.seconds:.0f} s, {t.failures} failures, answers {dict(t.answers)}")
    finally:
        stop.set()  # cancelled (Ctrl-C, SIGTERM): the thread ends at its next input, so the bench can exit
    doc["targets"] = {t: tallies[t].as_dict() for t in cfg.targets}
    doc["inputs"] = sum(t.inputs for t in tallies.values())
    doc["failures"] = sum(t.failures for t in tallies.values())
    doc["http_5xx"] = sum(n for k, n in tallies["http"].answers.items() if k == "5xx") if "http" in tallies else 0
    doc["grpc_internal_or_unknown"] = sum(tallies["grpc"].answers.get(c, 0) for c in GRPC_BAD) if "grpc" in tallies else 0
    doc["config_other_exceptions"] = tallies["config"].failures if "config" in tallies else 0
    return doc


async def _fuzz_doors(cfg: FuzzConfig, doors: list[str], share: dict[str, int], tallies: dict[str, Tally],
                      say: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="binbatch-bench-fuzz-") as tmp_name:
        tmp = Path(tmp_name)
        async with contextlib.AsyncExitStack() as stack:
            engine, model = await started_engine(stack, INSTANT, tmp)
            path = tmp / "sidecar.yaml"
            path.write_text(yaml.safe_dump(fuzzed_sidecar_doc(engine.url, model), sort_keys=False))
            sidecar = FuzzedSidecar(path, tmp)
            await sidecar.start()
            stack.push_async_callback(sidecar.signal_and_wait, signal.SIGTERM, 30)
            port = http_port(sidecar.lines)
            first = rss_and_fds(sidecar.pid)
            rss = [first[0]] if first else []
            say(f"instant engine on {engine.url}, sidecar gRPC on {sidecar.target}, HTTP on :{port}")

            async def sample() -> None:
                while True:
                    await asyncio.sleep(1.0)  # a sampling period, not a synchronisation
                    if got := rss_and_fds(sidecar.pid):
                        rss.append(got[0])

            sampler = asyncio.create_task(sample())
            try:
                for door in doors:
                    say(f"{door}: {share[door]} inputs, {cfg.concurrency} in flight")
                    if door == "http":
                        tallies[door] = await fuzz_http(port, model, cfg.seed, share[door], cfg.concurrency, say)
                    else:
                        tallies[door] = await fuzz_grpc(sidecar.target, model, cfg.seed, share[door], cfg.concurrency, say)
                    t = tallies[door]
                    say(f"{door}: {t.inputs} inputs in {t.seconds:.0f} s, {t.failures} failures, "
                        f"answers {dict(t.answers.most_common(8))}")  # fmt: skip
                    if not sidecar.running:
                        break
            finally:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
            alive = sidecar.running
            last = rss_and_fds(sidecar.pid) if alive else None
            if last:
                rss.append(last[0])
            exit_code = await sidecar.signal_and_wait(signal.SIGTERM, 30)
    mib = 1024 * 1024
    return {
        "crashed": not alive,
        "exit_code": exit_code,
        "log_levels": dict(sorted(sidecar.levels.items())),
        "error_logs": sum(sidecar.levels.get(k, 0) for k in ("ERROR", "CRITICAL")),
        "error_examples": sidecar.errors,
        "rss_start_mib": round(rss[0] / mib, 1) if rss else None,
        "rss_end_mib": round(rss[-1] / mib, 1) if rss else None,
        "rss_max_mib": round(max(rss) / mib, 1) if rss else None,
    }


def run(cfg: FuzzConfig, say: Callable[[str], None]) -> dict[str, Any]:
    return run_to_end(run_async(cfg, say))


def passed(doc: dict[str, Any]) -> bool:
    """No input failed its oracle, the sidecar did not crash and logged no ERROR."""
    side = doc.get("sidecar", {})
    return doc["failures"] == 0 and not side.get("crashed", False) and side.get("error_logs", 0) == 0 \
        and side.get("exit_code", 0) == 0  # fmt: skip


def print_table(doc: dict[str, Any]) -> None:
    print(f"binbatch bench fuzz: {doc['inputs']} inputs (seed {doc['seed']}, {doc['concurrency']} in flight)")
    print(f"{'target':8} {'inputs':>8} {'failures':>9} {'seconds':>8}  answers")
    for name, t in doc["targets"].items():
        answers = ", ".join(f"{k} {v}" for k, v in sorted(t["answers"].items(), key=lambda kv: -kv[1]))
        print(f"{name:8} {t['inputs']:>8} {t['failures']:>9} {t['seconds']:>8}  {answers}")
    print(f"HTTP 5xx {doc['http_5xx']}, gRPC INTERNAL/UNKNOWN {doc['grpc_internal_or_unknown']}, "
          f"config exceptions other than ConfigError {doc['config_other_exceptions']}")  # fmt: skip
    if side := doc.get("sidecar"):
        print(f"sidecar: crashed {side['crashed']}, exit {side['exit_code']}, ERROR records {side['error_logs']}, "
              f"RSS start/end/max {side['rss_start_mib']}/{side['rss_end_mib']}/{side['rss_max_mib']} MiB")  # fmt: skip
    for name, t in doc["targets"].items():
        for ex in t["examples"]:
            print(f"  {name} #{ex['index']} ({ex['kind']}): {ex['failure']}: {ex['answer'][:160]!r}")
    if side := doc.get("sidecar"):
        for line in side["error_examples"]:
            print(f"  sidecar log: {line[:200]}")
