"""OpenAI request bodies, parsed and validated the way vLLM does (errors name the field)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .answers import prompt_key
from .config import EmulatorConfig
from .model import (
    CHAT_ROLES, SeqEvent, Sequence, eos_position, prefix_blocks, render_chat, sequence_rng, tokenize,
)


class RequestError(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def _bad(param: str, message: str) -> RequestError:
    return RequestError(400, f"{param}: {message}", param)


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt: what seeds it, how many tokens it costs and the key of its
    recorded answer (``answers.prompt_key``; "" for token ids: none)."""

    key: str
    tokens: int
    answer_key: str = ""
    words: tuple[str, ...] = ()  # its tokens, for the prefix cache (``model.prefix_blocks``)


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """The validated sampling fields shared by every prompt of a request."""

    max_tokens: int | None
    min_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk (vLLM)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated completion or chat request."""

    chat: bool
    prompts: list[Prompt]
    sampling: SamplingSpec
    priority: int = 0


def _int(body: dict[str, Any], name: str, default: int | None, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise _bad(name, f"must be >= {minimum}, got {value}")
    return value


def _number(
    body: dict[str, Any], name: str, default: float, low: float, high: float, low_open: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(name, f"must be a number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low}, {high}]"
        raise _bad(name, f"must be in {interval}, got {value}")
    return float(value)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"must be true or false, got {value!r}")
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise _bad("stop", f"must be a string or a list of strings, got {value!r}")


def _include_usage(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """``stream_options``: (include_usage, continuous_usage_stats); as in vLLM the
    second counts only with the first."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise _bad("stream_options", "must be an object")
    if not stream:
        raise _bad("stream_options", "is only allowed when stream is true")
    include = _bool(options, "include_usage", False)
    return include, include and _bool(options, "continuous_usage_stats", False)


def _reject_unsupported(body: dict[str, Any], chat: bool) -> None:
    """Fields whose silent neglect would change what the client gets back."""
    if body.get("n", 1) != 1:
        raise _bad("n", f"the emulator serves n=1 only, got {body.get('n')!r}")
    if body.get("best_of") not in (None, 1):
        raise _bad("best_of", "the emulator does not support best_of")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise _bad("logprobs", "the emulator does not produce logprobs")
    if not chat and body.get("echo"):
        raise _bad("echo", "the emulator does not echo prompts")


def parse_sampling(body: dict[str, Any], chat: bool) -> SamplingSpec:
    """Validate the sampling fields; a 400 names the first bad one."""
    _reject_unsupported(body, chat)
    max_tokens = _int(body, "max_tokens", None, 1)
    if chat:
        max_tokens = _int(body, "max_completion_tokens", max_tokens, 1)
    min_tokens = _int(body, "min_tokens", 0, 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise _bad("min_tokens", f"must be <= max_tokens ({max_tokens}), got {min_tokens}")
    stream = _bool(body, "stream", False)
    include_usage, continuous_usage = _include_usage(body, stream)
    return SamplingSpec(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, math.inf),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        stop=_stop(body),
        seed=_int(body, "seed", None, -(2**63)),
        ignore_eos=_bool(body, "ignore_eos", False),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
    )


def parse_prompts(value: Any) -> list[Prompt]:
    """``prompt``: a string, a list of strings, a list of token ids or a list of those."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise _bad("prompt", "must be a non-empty string or a non-empty list of prompts")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]
    prompts = []
    for i, item in enumerate(value):
        if isinstance(item, str) and item.strip():
            words = tokenize(item)
            prompts.append(Prompt(key=item, tokens=len(words), answer_key=prompt_key(item), words=words))
        elif isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            prompts.append(Prompt(key=",".join(map(str, item)), tokens=len(item), words=tuple(map(str, item))))
        else:
            raise _bad(f"prompt[{i}]" if len(value) > 1 else "prompt", "must be non-empty text or token ids")
    return prompts


def parse_messages(value: Any) -> Prompt:
    """``messages``: a list of {role, content}; content is text or a list of text parts."""
    if not isinstance(value, list) or not value:
        raise _bad("messages", "must be a non-empty list of messages")
    rendered: list[tuple[str, str]] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad(where, "must be an object with role and content")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise _bad(f"{where}.role", f"must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        rendered.append((role, _message_text(message.get("content"), f"{where}.content")))
    text = render_chat(rendered)
    asked = next((content for role, content in reversed(rendered) if role == "user"), None)
    words = tokenize(text)
    return Prompt(key=text, tokens=len(words), answer_key="" if asked is None else prompt_key(asked), words=words)


def _message_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(f"{where}[{j}]", "the emulator takes text parts only")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad(where, "must be a string or a list of text parts")


def parse_request(body: Any, config: EmulatorConfig, chat: bool) -> ParsedRequest:
    """Validate a request body: 404 for another model, 400 naming a bad field."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    model = body.get("model", config.model)
    if model != config.model:
        raise RequestError(404, f"The model `{model}` does not exist.", "model", "NotFoundError")
    if chat:
        prompts = [parse_messages(body.get("messages"))]
    else:
        prompts = parse_prompts(body.get("prompt"))
    sampling = parse_sampling(body, chat)
    for prompt in prompts:
        _check_context(prompt, sampling, config, "messages" if chat else "prompt")
    return ParsedRequest(chat=chat, prompts=prompts, sampling=sampling, priority=_priority(body))


def _priority(body: dict[str, Any]) -> int:
    """``priority`` (lower first).  Under "fcfs" it is accepted and has no effect,
    as in vLLM 0.32 (older vLLM refused anything but 0 there)."""
    return _int(body, "priority", 0, -(2**63)) or 0


def _check_context(prompt: Prompt, sampling: SamplingSpec, config: EmulatorConfig, prompt_field: str) -> None:
    """Prompt plus output must fit ``max_model_len``, as vLLM checks."""
    limit = config.max_model_len
    if prompt.tokens >= limit:
        raise _bad(prompt_field, f"this model's maximum context length is {limit} tokens, "
                                 f"the prompt has {prompt.tokens}")  # fmt: skip
    if sampling.max_tokens is not None and prompt.tokens + sampling.max_tokens > limit:
        raise _bad("max_tokens", f"this model's maximum context length is {limit} tokens; you requested "
                                 f"{prompt.tokens + sampling.max_tokens} ({prompt.tokens} in the prompt, "
                                 f"{sampling.max_tokens} for the completion)")  # fmt: skip
    if sampling.min_tokens > limit - prompt.tokens:
        raise _bad("min_tokens", f"must leave room for the prompt in {limit} tokens")


def build_sequences(
    parsed: ParsedRequest, config: EmulatorConfig, arrival: float, events: asyncio.Queue[SeqEvent],
    answers: Mapping[str, int] | None = None,
) -> list[Sequence]:
    """One sequence per prompt; without max_tokens a prompt may use the whole context.
    A prompt with a recorded answer in ``answers`` (``answers.py``) emits EOS after
    its recorded count of tokens (at least ``min_tokens``; one longer than
    ``max_tokens`` is cut there, finish reason "length")."""
    seqs = []
    s = parsed.sampling
    for index, prompt in enumerate(parsed.prompts):
        max_tokens = s.max_tokens if s.max_tokens is not None else config.max_model_len - prompt.tokens
        rng = sequence_rng(config.seed, s.seed, prompt.key)
        eos = eos_position(rng, max_tokens=max_tokens, min_tokens=s.min_tokens, ignore_eos=s.ignore_eos)
        recorded = (answers or {}).get(prompt.answer_key)
        if recorded is not None and not s.ignore_eos:  # past max_tokens it is cut there ("length")
            eos = after if (after := max(recorded, s.min_tokens, 1)) <= max_tokens else None
        prefix = prefix_blocks(prompt.words, config.block_size) if config.enable_prefix_caching else ()
        seqs.append(Sequence(index=index, prompt_tokens=prompt.tokens, max_tokens=max_tokens,
                             min_tokens=s.min_tokens, eos_after=eos, stop=s.stop, rng=rng,
                             arrival=arrival, events=events, priority=parsed.priority, prefix=prefix))  # fmt: skip
    return seqs
