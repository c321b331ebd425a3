"""The sidecar's log output (``server/logs.py``): JSON lines from python-json-logger
with the request path's ``extra`` fields as JSON fields, or Text lines; switched by
``logging.format`` at start-up and on reload."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from binbatch_sidecar.server import logs


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """``logs.setup`` on a private stream; the root logger is restored after."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logs._handler)
    stream = io.StringIO()
    logs.setup("info", "Json")
    assert isinstance(logs._handler, logging.StreamHandler)
    logs._handler.setStream(stream)
    try:
        yield stream
    finally:
        root.handlers[:], level, logs._handler = saved
        root.setLevel(level)


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_json_lines_carry_level_logger_message_and_the_request_fields(captured: io.StringIO) -> None:
    log = logging.getLogger("binbatch.test")
    log.info("answered %s in %.1f s", "r-1", 0.5, extra={"request_id": "r-1", "trace_id": "4bf92f3577b34da6"})
    try:
        raise RuntimeError("engine bug")
    except RuntimeError:
        log.exception("dispatch failed", extra={"request_id": "r-2"})
    first, second = (json.loads(line) for line in lines(captured))
    assert {k: first[k] for k in ("level", "logger", "message", "request_id", "trace_id")} == {
        "level": "INFO", "logger": "binbatch.test", "message": "answered r-1 in 0.5 s",
        "request_id": "r-1", "trace_id": "4bf92f3577b34da6",
    }  # fmt: skip
    assert first["time"].endswith("+00:00")  # ISO 8601, UTC
    assert second["level"] == "ERROR" and second["request_id"] == "r-2"
    assert "RuntimeError: engine bug" in second["exc_info"]


def test_a_reload_switches_the_format_to_text_and_back(captured: io.StringIO) -> None:
    log = logging.getLogger("binbatch.test")
    logs.set_format("Text")
    log.warning("queue full", extra={"request_id": "r-3"})
    log.warning("no ids here")
    logs.set_format("Json")
    log.warning("json again")
    text, plain, again = lines(captured)
    assert text.endswith("WARNING binbatch.test: queue full [request_id=r-3]")
    assert plain.endswith("WARNING binbatch.test: no ids here")
    assert json.loads(again)["message"] == "json again"


def test_an_unknown_format_names_the_field() -> None:
    with pytest.raises(ValueError, match="logging.format: must be one of Json, Text"):
        logs.formatter("Yaml")
