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

Pure: the former asks ``admits`` when it hands out a batch, the sidecar calls
``observe`` on every metrics snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TpotGate:
    """``policy_tpot``: the policy's TPOT SLO in seconds (None: none)."""

    policy_tpot: float | None = None
    observed: float | None = None  # the engine's recent mean inter-token latency, seconds
    fresh: bool = False

    def observe(self, tpot_seconds: float | None, fresh: bool, running: int | None = None) -> None:
        """A metrics snapshot: its recent inter-token latency, whether it is fresh, and
        how many requests the engine runs (None: not reported)."""
        self.fresh = fresh
        if fresh and tpot_seconds is None and running:
            return  # the same sample again (see the module doc): keep the last observation
        self.observed = tpot_seconds

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
        return self.observed <= slo  # type: ignore[operator]
