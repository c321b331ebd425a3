"""Which engine answers mean the engine is down (the core's ``EngineBreaker`` acts on it).

An answer the engine *gave* -- a result, a 400, a 500 for one request, a 429 --
is not an outage: the engine is alive.  No answer at all (connection refused or
lost) or a 502/503/504 is.
"""

from __future__ import annotations

from ..core.breaker import STATES, EngineBreaker, State
from .engine_client import EngineError, EngineResult

__all__ = ["OUTAGE_STATUSES", "STATES", "EngineBreaker", "State", "is_outage", "outage_reason"]

OUTAGE_STATUSES = frozenset({None, 502, 503, 504})  # None: no HTTP answer at all


def is_outage(result: EngineResult | EngineError) -> bool:
    """True if ``result`` says the engine is unreachable or down, not that it refused."""
    return isinstance(result, EngineError) and result.kind == "unavailable" and result.status in OUTAGE_STATUSES


def outage_reason(result: EngineResult | EngineError) -> str | None:
    """Why ``result`` shows the engine down (the breaker's reason), or None."""
    return result.message if is_outage(result) else None  # type: ignore[union-attr]
