"""OpenAI request bodies into the door-neutral fields, strictly (binbatch_sidecar.server.openai_bodies)."""

from __future__ import annotations

import pytest

from binbatch_sidecar.server.front import InvalidRequest
from binbatch_sidecar.server.openai_bodies import include_usage, parse_body, read_json, to_fields


def fields(obj, chat=False):
    return to_fields(parse_body(obj, chat))


def test_a_completion_body_becomes_the_fields_grpc_has():
    f, names = fields({"model": "m", "prompt": ["hello"], "max_tokens": 7, "temperature": 0, "top_p": 0.5,
                       "stop": "\n", "seed": 3, "ignore_eos": True, "min_tokens": 2, "user": "u", "n": 1,
                       "logprobs": None, "presence_penalty": 0, "stream": True,
                       "stream_options": {"include_usage": True}})  # fmt: skip
    assert (f.prompt, f.messages, f.model, f.max_tokens, f.temperature, f.top_p) == ("hello", None, "m", 7, 0, 0.5)
    assert (f.stop, f.seed, f.ignore_eos, f.min_tokens) == (("\n",), 3, True, 2)
    assert names == {}


def test_chat_takes_max_completion_tokens_and_text_parts():
    body = parse_body({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]},
                                    {"role": "assistant", "content": None}],
                       "max_completion_tokens": 9, "stream": True}, chat=True)  # fmt: skip
    f, names = to_fields(body)
    assert f.messages == (("user", "ab"), ("assistant", "")) and f.max_tokens == 9
    assert names == {"max_tokens": "max_completion_tokens"}  # a bound broken is reported as the caller spelled it
    assert not include_usage(body)


@pytest.mark.parametrize(
    ("obj", "chat", "param"),
    [
        ({"prompt": "x", "n": 3}, False, "n"),
        ({"prompt": "x", "best_of": 2}, False, "best_of"),
        ({"prompt": "x", "logprobs": 0}, False, "logprobs"),  # 0 asks for the sampled token's logprob: not "off"
        ({"prompt": "x", "echo": True}, False, "echo"),
        ({"prompt": "x", "frequency_penalty": 0.5}, False, "frequency_penalty"),
        ({"prompt": "x", "logit_bias": {"1": 5}}, False, "logit_bias"),
        ({"prompt": [1, 2, 3]}, False, "prompt"),
        ({"prompt": ["a", "b"]}, False, "prompt"),
        ({"prompt": ""}, False, "prompt"),
        ({"prompt": "x", "temperature": "0.5"}, False, "temperature"),  # strict JSON types
        ({"prompt": "x", "stream": 1}, False, "stream"),
        ({"prompt": "x", "stop": [1]}, False, "stop"),
        ({"prompt": "x", "max_tokens": 0}, False, "max_tokens"),
        ({"prompt": "x", "stream_options": {"continuous_usage_stats": True}}, False, "stream_options.continuous_usage_stats"),
        ({"prompt": "x", "tools": []}, False, "tools"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, False, "stream_options"),  # not streaming
        ({}, False, "prompt"),
        ({"messages": []}, True, "messages"),
        ({"messages": [{"role": "", "content": "x"}]}, True, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "x", "name": "n"}]}, True, "messages[0].name"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, True, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, True, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 4}, True,
         "max_completion_tokens"),
    ],
)
def test_what_binbatch_cannot_carry_is_refused_naming_the_field(obj, chat, param):
    with pytest.raises(InvalidRequest) as err:
        fields(obj, chat)
    assert err.value.param == param
    assert str(err.value).startswith(param + ":")


@pytest.mark.parametrize("raw", [b"{", b"[1]", b"\xff"])
def test_a_body_that_is_not_a_json_object_is_refused_as_body(raw):
    with pytest.raises(InvalidRequest) as err:
        read_json(raw)
    assert err.value.param == "body"
