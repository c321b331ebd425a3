"""The TPOT gate: requests with a tight ``x-slo-tpot-ms`` enter the engine only
while the engine's observed time per output token meets it.

A request's TPOT is set by the engine's whole running batch, not by the request:
sending one with a 20 ms SLO into an engine that generates a token every 60 ms
breaks its SLO from the first token.  So a request whose TPOT SLO is tighter than
the policy's (``latency.tpotMilliseconds``, which the batch sizer already keeps
the engine at), or any TPOT SLO when the policy has none, waits in the sidecar
until the metrics feed reports a recent inter-token latency at or below its SLO.
The wait is bounded: by the request's deadline (it then ends DEADLINE_EXCEEDED),
and by its TTFT budget (``send_by``): once that passes it is admitted anyway, as
late tokens beat no tokens.

Unknown means open: without fresh metrics (no source, stale scrapes) or without
an observation on an idle engine (no token generated since the last scrape and
nothing running: a request entering an idle engine gets its best TPOT) the gate
admits.  A fresh sample with requests running but no new token is not idleness:
the source has not moved yet (a PromQL source polls every half second, Prometheus
scrapes every 15-30 s and answers the same sample in between), so the last
observation stands; reading it as "unknown" opened the gate between scrapes.

Waiting cannot help an SLO the engine misses even alone.  The TPOT of a scrape
interval in which the engine ran at most one request -- at most one of ours on
average (the scheduler's ledger), and at most one running at both scrapes (other
clients) -- is the best any request gets (``alone``); a request whose SLO is below
it is admitted at once.  Held, it could only wait out its TTFT budget, or, with
none, its deadline (or forever under steady load), and then miss anyway.

Pure: the former asks ``admits`` when it hands out a batch, the sidecar calls
``observe`` on every metrics snapshot, the scheduler ``observe_interval``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TpotGate:
    """``policy_tpot``: the policy's TPOT SLO in seconds (None: none)."""

    policy_tpot: float | None = None
    observed: float | None = None  # the engine's recent mean inter-token latency, seconds
    fresh: bool = False
    alone: float | None = None  # the last TPOT over an interval with at most one request running
    _running: int | None = None  # the engine's running count at the last fresh scrape
    _before: int | None = None  # and at the one before it (None: not fresh)

    def observe(self, tpot_seconds: float | None, fresh: bool, running: int | None = None) -> None:
        """A metrics snapshot: its recent inter-token latency, whether it is fresh, and
        how many requests the engine runs (None: not reported)."""
        self.fresh = fresh
        self._before, self._running = self._running, running if fresh else None
        if fresh and tpot_seconds is None and running:
            return  # the same sample again (see the module doc): keep the last observation
        self.observed = tpot_seconds

    def observe_interval(self, tpot_seconds: float | None, ours: float | None) -> None:
        """The interval of the last ``observe``'s snapshot: its TPOT, and the mean
        number of our requests in flight over it (None: none).  At most one of ours
        and at most one running at both ends: the engine's TPOT alone."""
        if not self.fresh or tpot_seconds is None or ours is None or ours > 1:
            return
        if self._running is not None and self._running <= 1 and self._before is not None and self._before <= 1:
            self.alone = tpot_seconds

    def applies(self, slo: float | None) -> bool:
        """Does a request with TPOT SLO ``slo`` (seconds, None: none) need the gate?"""
        if slo is None:
            return False
        return self.policy_tpot is None or slo < self.policy_tpot

    def admits(self, slo: float | None, now: float, send_by: float | None = None) -> bool:
        """May a request with TPOT SLO ``slo`` enter the engine at ``now``?"""
        if not self.applies(slo):
            return True
        if send_by is not None and now >= send_by:
            return True  # its TTFT budget is spent: waiting longer only adds to it
        if not self.fresh or self.observed is None:
            return True  # nothing known against it
        if self.alone is not None and slo < self.alone:  # type: ignore[operator]
            return True  # beyond the engine even alone: waiting cannot help
        return self.observed <= slo  # type: ignore[operator]
