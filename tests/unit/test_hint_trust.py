"""A request class whose length hints keep running short loses them, and earns them back
(binbatch_sidecar.core.hint_trust), on a fake clock."""

from __future__ import annotations

import pytest

from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.hint_trust import LOSE_RATIO, MIN_SAMPLES, WINDOW, HintTrust


def test_a_class_never_judged_is_trusted():
    trust = HintTrust(ManualClock())
    assert trust.trusted("any") and trust.trusted("")
    assert trust.median_ratio("any") is None and trust.take_changes() == []


def test_no_verdict_before_enough_completions_however_long_they_ran():
    clock = ManualClock()
    trust = HintTrust(clock)
    for _ in range(MIN_SAMPLES - 1):
        trust.record("batch", hinted=1, actual=2000)
    assert trust.trusted("batch")
    assert trust.take_changes() == []


def test_a_class_whose_answers_run_past_twice_the_hint_loses_its_hints_once():
    clock = ManualClock()
    trust = HintTrust(clock)
    for i in range(MIN_SAMPLES):
        clock.advance(1.0)
        trust.record("batch", hinted=1, actual=2000)
    assert not trust.trusted("batch")
    assert trust.trusted("interactive")  # per class: the others keep theirs
    [change] = trust.take_changes()
    assert (change.request_class, change.trusted, change.samples, change.at) == ("batch", False, MIN_SAMPLES,
                                                                                float(MIN_SAMPLES))  # fmt: skip
    assert change.median_ratio == 2000.0
    for _ in range(5):  # further lies: no further flips
        trust.record("batch", hinted=1, actual=2000)
    assert trust.take_changes() == [] and trust.distrusted() == ["batch"]


def test_the_median_decides_so_a_few_long_answers_do_not_cost_an_honest_class():
    trust = HintTrust(ManualClock())
    for i in range(WINDOW):
        long = i % 3 == 0  # a third of the answers ran 10x over: the median is still honest
        trust.record("chat", hinted=100, actual=1000 if long else 90)
    assert trust.trusted("chat")
    assert trust.median_ratio("chat") == pytest.approx(0.9)


def test_exactly_twice_the_hint_is_not_past_the_line():
    trust = HintTrust(ManualClock())
    for _ in range(WINDOW):
        trust.record("c", hinted=100, actual=100 * LOSE_RATIO)
    assert trust.trusted("c")


def test_honest_completions_bring_the_hints_back_past_the_median():
    trust = HintTrust(ManualClock())
    for _ in range(WINDOW):
        trust.record("batch", hinted=1, actual=2000)
    assert not trust.trusted("batch")
    trust.take_changes()
    honest = 0
    while not trust.trusted("batch"):
        trust.record("batch", hinted=500, actual=480)  # its hints are recorded while they are ignored
        honest += 1
        assert honest <= WINDOW
    assert honest == WINDOW // 2 + 1  # the window holds 32: the 17th honest one moves the median
    [change] = trust.take_changes()
    assert change.trusted and change.median_ratio == pytest.approx(0.96)


def test_near_the_line_a_class_does_not_flip_on_every_completion():
    trust = HintTrust(ManualClock())
    for _ in range(WINDOW):
        trust.record("c", hinted=100, actual=300)
    assert not trust.trusted("c")
    for _ in range(WINDOW):
        trust.record("c", hinted=100, actual=180)  # under the losing line, above the regaining one
    assert not trust.trusted("c")
    assert len(trust.take_changes()) == 1


def test_evidence_ages_out_on_the_clock():
    clock = ManualClock()
    trust = HintTrust(clock, horizon=60.0)
    for _ in range(MIN_SAMPLES):
        trust.record("batch", hinted=1, actual=2000)
    assert not trust.trusted("batch")
    clock.advance(59.0)
    assert not trust.trusted("batch")
    clock.advance(1.0)
    assert trust.trusted("batch")  # nothing recent against it
    lost, back = trust.take_changes()
    assert (lost.trusted, back.trusted, back.median_ratio, back.samples, back.at) == (False, True, None, 0, 60.0)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [({"min_samples": 0}, "min_samples"), ({"min_samples": 40}, "min_samples"), ({"regain_ratio": 3.0}, "regain_ratio"),
     ({"horizon": 0.0}, "horizon")],
)  # fmt: skip
def test_bad_settings_are_refused_naming_them(kwargs, words):
    with pytest.raises(ValueError, match=words):
        HintTrust(ManualClock(), **kwargs)


def test_a_hint_below_one_token_is_a_drivers_bug():
    with pytest.raises(ValueError, match="hinted"):
        HintTrust(ManualClock()).record("c", hinted=0, actual=5)
