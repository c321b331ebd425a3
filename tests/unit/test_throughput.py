"""Recent throughput over a sliding window (Stats.throughput)."""

from __future__ import annotations

import pytest

from binbatch_sidecar.core.throughput import ThroughputWindow


def test_rates_divide_by_the_age_while_younger_than_the_window():
    w = ThroughputWindow(start=100.0, window=60.0)
    for t in (100.5, 101.0, 101.5, 102.0):
        w.completed(t, 10)
    r = w.rates(102.0)
    assert r.window_seconds == 2.0
    assert r.requests_per_second == 2.0 and r.output_tokens_per_second == 20.0


def test_completions_older_than_the_window_drop_out():
    w = ThroughputWindow(start=0.0, window=10.0)
    w.completed(1.0, 100)
    w.completed(9.0, 50)
    r = w.rates(15.0)
    assert r.window_seconds == 10.0
    assert r.requests_per_second == pytest.approx(0.1) and r.output_tokens_per_second == pytest.approx(5.0)
    assert w.rates(30.0).requests_per_second == 0.0


def test_bad_window_names_the_field():
    with pytest.raises(ValueError, match="window"):
        ThroughputWindow(start=0.0, window=0)
