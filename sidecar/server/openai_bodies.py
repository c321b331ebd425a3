"""OpenAI request bodies, parsed strictly into the door-neutral ``front.Fields``.

The HTTP door takes what the gRPC API can express, nothing more, and says so:
a body field binbatch cannot honour is a 400 naming it, never dropped in
silence.  So:

* fields the gRPC request has (``model``, ``prompt``/``messages``, ``max_tokens``
  -- or chat's ``max_completion_tokens`` --, ``temperature``, ``top_p``, ``stop``,
  ``seed``, and vLLM's ``ignore_eos`` and ``min_tokens``) are parsed and sent on;
* ``stream``, ``stream_options.include_usage`` shape the reply;
* ``user`` is accepted and not sent on (it changes no output; OpenAI keeps it
  for abuse reports);
* fields that change the output in ways binbatch does not carry (``n`` > 1,
  ``best_of``, ``logprobs``, ``echo``, ``suffix``, penalties, ``logit_bias``,
  several prompts, token-id prompts, non-text content parts) are accepted only
  at their no-op value (``n: 1``, ``logprobs: null``, ``presence_penalty: 0``,
  ..., as some clients always send them) and are otherwise a 400 naming the field;
* any other field is a 400 naming it (gRPC has no way to pass unknown fields
  to the engine, so neither has this door).

JSON types are checked strictly (``"0.5"`` is not a number, ``1`` not a bool).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .front import SURROGATE, UNENCODABLE, Fields, InvalidRequest


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str = ""
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stop: Any = None  # a string or a list of strings (checked in _stop)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # int64, as in binbatch.proto
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extra, as in binbatch.proto
    min_tokens: int | None = Field(None, ge=0)  # vLLM's extra, as in binbatch.proto
    # Accepted at their no-op value only (module docstring).
    n: int | None = None
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None


class CompletionBody(_Common):
    prompt: Any  # one string, or a list of exactly one string (checked in _prompt)
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None


class Message(_Strict):
    role: str = Field(min_length=1)
    content: Any = None  # a string, or a list of text parts (checked in _content)


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = None


# field -> the values that change nothing (what is accepted of what binbatch does not carry)
_NO_OP: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "logprobs": (None, False), "echo": (None, False), "suffix": (None, ""),
    "presence_penalty": (None, 0.0), "frequency_penalty": (None, 0.0), "logit_bias": (None, {}),
    "top_logprobs": (None, 0),
}  # fmt: skip


def _no_op(value: Any, allowed: tuple[Any, ...]) -> bool:
    """``value`` is one of ``allowed`` of the same type (``0`` is not ``False``)."""
    return any(value is a or (type(value) is type(a) and value == a) for a in allowed)


def read_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or ``InvalidRequest``: "body" when it is no JSON
    object, the field's path when a string in it holds a lone surrogate."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"body: not valid JSON ({exc})", "body") from None
    except RecursionError:  # nested deeper than the parser's stack
        raise InvalidRequest("body: nested too deeply", "body") from None
    if not isinstance(obj, dict):
        raise InvalidRequest("body: must be a JSON object", "body")
    where = _unencodable(obj)
    if where is not None:
        raise InvalidRequest(f"{where}: {UNENCODABLE}", where)
    return obj


def _unencodable(obj: dict[str, Any]) -> str | None:
    """The JSON path (``messages[0].content``) of the first string, key or value,
    holding a lone surrogate (JSON lets ``"\\ud800"`` through; no UTF-8 carries it);
    None if there is none.  Iterative: the body may be as deep as the parser allowed."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if SURROGATE.search(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                here = f"{path}.{key}" if path else key
                if SURROGATE.search(key):
                    return f"{path}.<key>" if path else "body"  # the key itself cannot be shown
                stack.append((here, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
    return None


def parse_body(obj: dict[str, Any], chat: bool) -> CompletionBody | ChatBody:
    """Validate ``obj`` as a completion or chat body; the first problem becomes
    ``InvalidRequest`` naming its field (``messages[0].content`` style)."""
    try:
        body = (ChatBody if chat else CompletionBody).model_validate(obj)
    except ValidationError as exc:
        raise _invalid(exc) from None
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options: only with stream: true (as vLLM and OpenAI have it)")
    for name, allowed in _NO_OP.items():
        if name in body.model_fields_set and not _no_op(getattr(body, name), allowed):
            shown = ", ".join(json.dumps(v) for v in allowed if v is not None)
            raise InvalidRequest(f"{name}: not supported by binbatch (only {shown} is accepted)", name)
    return body


def to_fields(body: CompletionBody | ChatBody) -> tuple[Fields, dict[str, str]]:
    """The door-neutral fields of ``body`` (headers are added by the door), and the
    names to report them by where the body's spelling differs from gRPC's."""
    names: dict[str, str] = {}
    max_tokens = body.max_tokens
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        if max_tokens is not None and max_tokens != body.max_completion_tokens:
            raise InvalidRequest("max_completion_tokens: differs from max_tokens; give one of them")
        max_tokens = body.max_completion_tokens
        names["max_tokens"] = "max_completion_tokens"
    f = Fields(
        model=body.model,
        max_tokens=max_tokens or 0,
        temperature=body.temperature,
        top_p=body.top_p,
        stop=_stop(body.stop),
        seed=body.seed,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
    )
    if isinstance(body, ChatBody):
        f.messages = tuple((m.role, _content(i, m)) for i, m in enumerate(body.messages))
    else:
        f.prompt = _prompt(body.prompt)
    return f, names


def include_usage(body: CompletionBody | ChatBody) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _prompt(value: Any) -> str:
    if isinstance(value, list):
        if len(value) != 1:
            raise InvalidRequest(f"prompt: one prompt per request is supported, got a list of {len(value)}")
        value = value[0]
    if not isinstance(value, str):
        raise InvalidRequest("prompt: must be a string (token-id prompts are not supported)")
    if not value:
        raise InvalidRequest("prompt: must not be empty")
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise InvalidRequest("stop: must be a string or a list of strings")


def _content(i: int, m: Message) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    if not isinstance(m.content, list):
        raise InvalidRequest(f"messages[{i}].content: must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(m.content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            shown = json.dumps(kind)[:40]
            raise InvalidRequest(f"messages[{i}].content[{j}].type: only text parts are supported, got {shown}")
        if not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
            raise InvalidRequest(f"messages[{i}].content[{j}]: a text part is {{\"type\": \"text\", \"text\": string}}")
        texts.append(part["text"])
    return "".join(texts)


def _invalid(exc: ValidationError) -> InvalidRequest:
    """The first error, named as the JSON path a caller would write."""
    err = exc.errors(include_url=False)[0]
    param = ""
    for part in err["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        else:
            param += f".{part}" if param else str(part)
    param = param or "body"
    if err["type"] == "extra_forbidden":
        problem = "not a supported field (the HTTP API takes what binbatch's gRPC API can carry; see docs/api.md, 'Not supported')"
    elif err["type"] == "missing":
        problem = "required"
    else:
        problem = err["msg"]
    more = len(exc.errors()) - 1
    return InvalidRequest(f"{param}: {problem}" + (f" (and {more} more problems)" if more else ""), param)
