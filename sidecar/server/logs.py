"""The sidecar's log output: one JSON object per line (``logging.format: Json``, the
default) or plain text lines (``Text``, for a person at a terminal).

JSON comes from python-json-logger, a maintained library, not a formatter of our
own: every record has ``time`` (ISO 8601, UTC), ``level``, ``logger`` and
``message``, plus ``exc_info`` with a traceback, and the standard ``extra=``
fields of the call become fields of their own -- the request path logs with
``extra={"request_id": ..., "trace_id": ...}`` so a log system can join a
request's lines with its trace.  Text lines show those two after the message.

The request path logs ids, counts and timings only. Prompt and generated text
are logged only when the policy sets ``logging.logPrompts`` (at Info, logger
``binbatch.prompts``); otherwise no log call receives them, at any level.
"""

from __future__ import annotations

import logging

from pythonjsonlogger.json import JsonFormatter

REQUEST_FIELDS = ("request_id", "trace_id")  # the extras the request path sets; Text shows them too
FORMATS = ("Json", "Text")

_handler: logging.Handler | None = None  # the stderr handler ``setup`` installed
_format = "Json"  # the logging.format last set (``current_format``)


class TextFormatter(logging.Formatter):
    """``time level logger: message [request_id=... trace_id=...]``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = " ".join(f"{k}={getattr(record, k)}" for k in REQUEST_FIELDS if getattr(record, k, None))
        if not ids:
            return line
        first, sep, rest = line.partition("\n")  # keep a traceback below the ids
        return f"{first} [{ids}]{sep}{rest}"


def formatter(fmt: str) -> logging.Formatter:
    """The formatter for ``logging.format`` (Json | Text)."""
    if fmt == "Json":
        return JsonFormatter(
            "{levelname}{name}{message}", style="{", timestamp="time",
            rename_fields={"levelname": "level", "name": "logger"}, json_ensure_ascii=False,
        )  # fmt: skip
    if fmt == "Text":
        return TextFormatter()
    raise ValueError(f"logging.format: must be one of {', '.join(FORMATS)}, got {fmt!r}")


def setup(level: str, fmt: str = "Json") -> None:
    """Route the root logger to stderr at ``level`` (debug|info|warning|error) in
    ``fmt`` (Json | Text)."""
    global _handler, _format
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(fmt))
    _format = fmt
    root = logging.getLogger()
    root.handlers[:] = [handler]
    _handler = handler
    set_level(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def set_level(level: str) -> None:
    """Set the root logger's level (``logging.level``; at start-up and on reload)."""
    logging.getLogger().setLevel(level.upper())


def set_format(fmt: str) -> None:
    """Switch the output of ``setup``'s handler to ``fmt`` (a reload of
    ``logging.format``); without ``setup`` (a sidecar inside a test) only
    ``current_format`` changes."""
    global _format
    chosen = formatter(fmt)
    _format = fmt
    if _handler is not None:
        _handler.setFormatter(chosen)


def current_format() -> str:
    """The ``logging.format`` in effect (what the last setup or reload chose)."""
    return _format
