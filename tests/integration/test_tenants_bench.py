"""``binbatch bench tenants --quick`` end to end: the embedded engine and a sidecar as child processes
on 127.0.0.1, a steady tenant beside one flooding at 10x its share.  Held to what does not depend on
the machine's speed: the flood gets 429s and the steady tenant loses no call (every one answered
200).  The latency ratios are the bench's figures, reported, not asserted here."""

from __future__ import annotations

import json

from bench_support import run_binbatch

BENCH_TIMEOUT = 300  # seconds; the quick bench takes under a minute on 2 busy cores


async def test_quick_tenants_bench_refuses_the_flood_and_not_the_steady_tenant(tmp_path):
    code, out, err = await run_binbatch(tmp_path, "bench", "tenants", "--quick", "--json", "--quiet",
                                        timeout=BENCH_TIMEOUT)  # fmt: skip
    assert code == 0, err.decode()[-3000:]
    doc = json.loads(out)
    setup, phases = doc["setup"], doc["phases"]
    assert setup["offered_over_capacity"] > 2  # the flood really is an overload
    assert list(phases) == ["alone", "flood", "unfair"]
    alone, flood = phases["alone"], phases["flood"]
    assert alone["steady"]["statuses"] and set(alone["steady"]["statuses"]) == {"200"}
    assert not alone["flood"]["statuses"]
    assert flood["flood"]["statuses"].get("429", 0) > 0 and doc["flood_429"] == flood["flood"]["statuses"]["429"]
    assert set(flood["steady"]["statuses"]) == {"200"} and doc["steady_not_ok_in_flood"] == 0
    assert flood["steady"]["completed"] == flood["steady"]["statuses"]["200"]
    assert set(doc["ratios"]) == {"flood_over_alone_p50", "flood_over_alone_p99", "unfair_over_alone_p50",
                                  "unfair_over_alone_p99"}  # fmt: skip
