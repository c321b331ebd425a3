"""Structured (one JSON object per line) logs for the sidecar.

The request path logs ids, counts and timings only. Prompt and generated text
are logged only when the policy sets ``logging.logPrompts`` (at Info, logger
``binbatch.prompts``); otherwise no log call receives them, at any level.
"""

from __future__ import annotations

import json
import logging
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


def setup(level: str) -> None:
    """Route the root logger to stderr as JSON lines at ``level`` (debug|info|warning|error)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    set_level(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def set_level(level: str) -> None:
    """Set the root logger's level (``logging.level``; at start-up and on reload)."""
    logging.getLogger().setLevel(level.upper())
