"""``binbatch bench operator --quick``: the operator as a process against kmock, measured."""

from __future__ import annotations

import json

from binbatch_sidecar.bench import fleet
from binbatch_sidecar.cli import main


def test_the_quick_operator_bench_measures_an_idle_fleet_that_costs_no_requests(capsys):
    assert main(["bench", "operator", "--quick", "--json", "--quiet"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    cfg = fleet.quick()
    assert (run["policies"], run["pods"], run["api_server"]) == (4, 8, "kmock")
    assert run["idle_requests_counted_from"] == "kmock requests"
    assert run["idle_requests_per_policy_minute"] == 0, run
    assert run["spec_to_configmap_seconds"]["n"] == cfg.spec_changes and run["spec_to_configmap_seconds"]["p99"] < 5
    assert run["admission_seconds"]["n"] == cfg.admission_rate * cfg.admission_seconds
    assert run["admission_seconds"]["not_injected"] == 0
    # Each pod is asked at most once per half interval (120 a minute at 0.5 s), and at least sometimes.
    assert 0 < run["stats_calls_per_pod_minute"] <= 1.2 * 60 / (cfg.stats_interval / 2)
    assert run["operator_rss_bytes"] > 0 and run["operator_cpu_percent_idle"] >= 0


def test_the_operator_bench_refuses_real_server_options_without_a_real_server():
    try:
        main(["bench", "operator", "--audit-log", "/tmp/audit.log"])
    except SystemExit as exc:
        assert "--audit-log need --kubeconfig" in str(exc)
    else:
        raise AssertionError("accepted --audit-log without --kubeconfig")


def test_the_quick_failover_bench_kills_the_leader_and_the_follower_takes_over_within_15_s(capsys):
    assert main(["bench", "operator", "--quick", "--failover", "1", "--json", "--quiet"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    (kill,) = run["failover"]["kills"]
    assert kill["holder"] == "op-1" and kill["self_exits"] == 0, run
    assert 0 < kill["kill_to_lease_s"] <= kill["kill_to_configmap_s"] < 15, run
