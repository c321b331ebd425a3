"""The predicted-length distribution every stage reads (core/length_dist.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from binbatch_sidecar.core.length_dist import LEVELS, OUTRUN, PLAN_LEVEL, LengthDist


def test_a_hint_is_a_point_mass_until_the_answer_passes_it() -> None:
    d = LengthDist.exact(100, cap=1024)
    assert d.median == d.plan == d.quantile(0.02) == 100
    assert d.remaining(PLAN_LEVEL, produced=40) == 60
    assert d.quantile(0.5, produced=120) > 120  # past the hint: planned on, not held at 100


def test_empirical_quantiles_interpolate_as_numpy_does() -> None:
    d = LengthDist.from_samples(range(1, 102))  # 1..101
    assert d.median == pytest.approx(51)
    assert d.quantile(0.9) == pytest.approx(91)


def test_the_cap_bounds_every_quantile_and_the_tail() -> None:
    d = LengthDist.scaled(500, [0.2 + 0.3 * i for i in range(len(LEVELS))], cap=1024)
    assert max(d.points) <= 1024
    assert d.quantile(1.0) == 1024
    assert d.quantile(0.9, produced=1023) == 1024


def test_a_short_answer_releases_what_a_long_prediction_held() -> None:
    # Wide: 10..1000 tokens.  After 50 tokens the answer may still be long, but the plan's
    # quantile of what remains shrinks only when the answer ends -- and grows past a quantile.
    d = LengthDist.from_samples([10, 20, 40, 80, 160, 320, 640, 1000])
    fresh = d.plan
    assert d.quantile(PLAN_LEVEL, produced=5) == pytest.approx(fresh, rel=0.05)
    assert d.quantile(0.5, produced=300) > d.median  # it outgrew the short half: re-planned longer


def test_an_answer_past_every_quantile_is_planned_on() -> None:
    d = LengthDist.from_samples([10, 20, 30], cap=math.inf)
    top = d.points[-1] * 1.5
    assert d.quantile(0.9, produced=top + 10) == pytest.approx((top + 10) * (1 + OUTRUN))


@pytest.mark.parametrize("bad", [(), (0.5,) * len(LEVELS), tuple(range(len(LEVELS), 0, -1))])
def test_malformed_quantiles_are_refused_naming_the_field(bad: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="points"):
        LengthDist(tuple(float(x) for x in bad))


@given(
    st.lists(st.floats(1, 5000), min_size=1, max_size=50),
    st.floats(0, 1),
    st.floats(0, 6000),
)
def test_conditional_quantiles_are_monotone_and_exceed_what_is_produced(xs, p, g) -> None:
    d = LengthDist.from_samples(xs, cap=8000)
    q = d.quantile(p, produced=g)
    assert q >= min(d.cap, g + 1) - 1e-9
    assert q <= d.cap
    assert d.quantile(min(1.0, p + 0.1), produced=g) >= q - 1e-9
    assert 0 <= d.cdf(g) <= 1


def test_the_chance_an_answer_is_still_running_is_its_conditional_survival() -> None:
    d = LengthDist.from_samples([10, 20, 40, 80, 160, 320, 640], cap=1024)
    steps = np.array([0.0, 5.0, 50.0, 300.0, 2000.0])
    for produced in (0.0, 30.0, 500.0):
        gone = d.cdf(produced) if produced else 0.0
        expected = [(1 - d.cdf(produced + s)) / (1 - gone) for s in steps]
        assert d.still_running(steps, produced) == pytest.approx(expected)
    assert LengthDist.exact(100).known and not d.known
