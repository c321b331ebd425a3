"""The Smdp-vs-maxWait simulation: the SMDP control limit costs less than maxWait."""

from __future__ import annotations

from binbatch_sidecar.bench.smdp_dispatch import compare


def test_smdp_dispatch_costs_less_than_every_max_wait_in_simulation():
    rows = compare(rhos=(0.1, 0.3), max_waits=(0.1, 0.5), n=4000)
    for rho in (0.1, 0.3):
        at = {r.policy.split(" (")[0].split(" +")[0]: r for r in rows if r.rho == rho}
        smdp = at.pop("smdp")
        assert at and all(smdp.cost < r.cost for r in at.values()), (rho, smdp, at)
        # it trades: fuller batches than the short wait, shorter latency than the long one
        assert at["maxWait 100 ms"].mean_batch < smdp.mean_batch
        assert smdp.mean_latency < at["maxWait 500 ms"].mean_latency
