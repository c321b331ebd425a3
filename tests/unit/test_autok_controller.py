"""bins.countMode Auto: the controller that re-chooses k from the measured arrival rate."""

from __future__ import annotations

import pytest

from binbatch_sidecar.core.autok import ArrivalWindow, BinCountController, choose_k

SPT = 0.01  # engine seconds per output token
SHAPE = dict(batch=16, lmin=1.0, lmax=256.0)  # k for these at a 10 s target: λ=2/s -> 2, λ=5/s -> 5 (k_max 8)


def drive(ctl: BinCountController, rates: list[float], start: float = 0.0, accepted: float = 0.0):
    """One snapshot per second at the given arrival rates; the decisions made."""
    out = []
    t = start
    for lam in rates:
        t += 1.0
        accepted += lam
        d = ctl.on_snapshot(t, int(round(accepted)), SPT, **SHAPE)
        if d is not None:
            out.append((t, d))
    return out, t, accepted


def test_arrival_window_measures_the_rate_over_its_window():
    w = ArrivalWindow(window=10.0)
    assert w.sample(0.0, 0) is None
    assert w.sample(5.0, 20) == pytest.approx(4.0)
    for t in range(6, 21):
        rate = w.sample(float(t), 20 + (t - 5))  # then 1/s
    assert rate == pytest.approx(1.0, rel=0.15)


def test_a_steady_rate_moves_k_once_after_confirmation_with_its_reason():
    ctl = BinCountController(k=1, k_max=8, latency_target=10.0, window=1.0, confirm=3, hold=0.0)
    decisions, *_ = drive(ctl, [5.0] * 10)
    assert len(decisions) == 1
    t, d = decisions[0]
    assert t == 4.0  # the first snapshot only starts the window; then three agreeing decisions
    assert (d.old, d.new, d.reason) == (1, choose_k(5 * SPT, 10 / SPT, k_max=8, **SHAPE).k, "meets-target")
    assert d.new == 5 and ctl.k == 5
    assert "arrival rate 5/s" in d.detail


def test_noise_around_a_boundary_does_not_flap():
    ctl = BinCountController(k=5, k_max=8, latency_target=10.0, window=1.0, confirm=1, hold=0.0)
    # 4.6/s and 5.4/s alone would choose 4 and 5: within the 20 % band, k stays.
    noisy = [4.6, 5.4] * 20
    assert choose_k(4.6 * SPT, 10 / SPT, k_max=8, **SHAPE).k != choose_k(5.4 * SPT, 10 / SPT, k_max=8, **SHAPE).k
    decisions, *_ = drive(ctl, noisy)
    assert decisions == [] and ctl.k == 5


def test_a_new_choice_waits_for_the_hold_time():
    ctl = BinCountController(k=1, k_max=8, latency_target=10.0, window=1.0, confirm=1, hold=10.0)
    first, t, acc = drive(ctl, [5.0] * 3)
    assert [d.new for _, d in first] == [5]
    second, *_ = drive(ctl, [2.0] * 12, start=t, accepted=acc)
    assert [d.new for _, d in second] == [2]
    assert second[0][0] - first[0][0] >= 10.0


def test_idle_or_no_time_scale_keeps_k():
    ctl = BinCountController(k=3, k_max=8, latency_target=10.0, window=1.0, confirm=1, hold=0.0)
    assert ctl.on_snapshot(1.0, 0, SPT, **SHAPE) is None
    assert ctl.on_snapshot(2.0, 0, SPT, **SHAPE) is None  # nothing arrived
    assert ctl.on_snapshot(3.0, 10, None, **SHAPE) is None  # no seconds-per-token known
    assert ctl.k == 3


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="latency_target"):
        BinCountController(k=1, k_max=4, latency_target=0)
    with pytest.raises(ValueError, match="k must be"):
        BinCountController(k=5, k_max=4, latency_target=1.0)
