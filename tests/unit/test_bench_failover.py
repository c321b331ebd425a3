"""``binbatch bench operator --failover``: the figures from each kill's moments (fleet.failover_figures)."""

from __future__ import annotations

import datetime

from binbatch_sidecar.bench.fleet import failover_figures
from binbatch_sidecar.cli import build_parser


def at(text: str) -> float:
    return datetime.datetime.fromisoformat(text).timestamp()


def test_each_kill_is_timed_to_the_new_lease_and_to_the_configmap_and_the_worst_are_kept():
    killed = at("2026-11-26T14:40:43.500000+00:00")
    kills = [
        # the Lease's acquireTime is a MicroTime in UTC, written by the new holder
        {"killed": killed, "lease_acquired": "2026-11-26T14:40:55.918628Z", "configmap": killed + 12.29,
         "holder": "op-1", "self_exits": 0},
        {"killed": killed + 100, "lease_acquired": "2026-11-26T14:42:33.000000Z", "configmap": killed + 100 + 11.0,
         "holder": "op-2", "self_exits": 1},
    ]  # fmt: skip
    figures = failover_figures(kills)
    assert figures["kills"] == [
        {"kill_to_lease_s": 12.42, "kill_to_configmap_s": 12.29, "holder": "op-1", "self_exits": 0},
        {"kill_to_lease_s": 9.5, "kill_to_configmap_s": 11.0, "holder": "op-2", "self_exits": 1},
    ]
    assert figures["kill_to_lease_max_s"] == 12.42 and figures["kill_to_configmap_max_s"] == 12.29
    assert figures["self_exits"] == 1


def test_no_kill_gives_no_figures():
    assert failover_figures([]) == {"kills": [], "kill_to_lease_max_s": None, "kill_to_configmap_max_s": None,
                                    "self_exits": 0}  # fmt: skip


def test_failover_takes_an_optional_kill_count():
    parse = build_parser().parse_args
    assert parse(["bench", "operator", "--failover"]).failover == 3
    assert parse(["bench", "operator", "--failover", "5"]).failover == 5
    assert parse(["bench", "operator"]).failover is None
