"""The HTTP door's stream events: a piece of text's event is rendered around the text alone
(``_Shape.text_event``), and must be byte for byte the event of the whole chunk
(``_Shape.chunk``) -- for completions and chats, with and without usage chunks, first
chunk or later, whatever the text holds."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from binbatch_sidecar.server.openai_http import _event, _Shape


@given(chat=st.booleans(), usage=st.booleans(), texts=st.lists(st.text(), min_size=1, max_size=4),
       request_id=st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=20),
       model=st.text(max_size=20))  # fmt: skip
def test_a_text_event_is_the_event_of_its_whole_chunk(chat, usage, texts, request_id, model):
    fast, whole = _Shape(chat, request_id, model, usage), _Shape(chat, request_id, model, usage)
    whole.created = fast.created  # made in the same second, as one request's shape is
    for text in texts:
        event = fast.text_event(text)
        assert event == _event(whole.chunk(text))
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        got = json.loads(event[6:])
        assert (got["choices"][0]["delta"]["content"] if chat else got["choices"][0]["text"]) == text
        assert ("usage" in got) is usage


def test_only_a_chats_first_event_names_the_role():
    shape = _Shape(True, "r1", "m", False)
    first, second = (json.loads(shape.text_event(t)[6:]) for t in ("a", "b"))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert second["choices"][0]["delta"] == {"content": "b"}
