"""Length predictors (hint, online, learned) and the accuracy tracker (Table 1 analogue, Kendall's tau)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from binbatch_sidecar.core import length_model as lm
from binbatch_sidecar.core import predictor as predictor_module
from binbatch_sidecar.core.predictor import (
    AccuracyTracker,
    HintPredictor,
    LearnedPredictor,
    LengthPredictor,
    OnlinePredictor,
    prompt_bucket,
)
from binbatch_sidecar.core.request import Request

_ids = itertools.count()


def req(**kw) -> Request:
    return Request(id=f"r{next(_ids)}", arrival=0.0, **kw)


def test_every_predictor_satisfies_the_protocol():
    predictors: list[LengthPredictor] = [HintPredictor(), OnlinePredictor(), LearnedPredictor()]
    assert [p.name for p in predictors] == ["hint", "online", "learned"]
    assert all(isinstance(p, LengthPredictor) for p in predictors)


@pytest.mark.parametrize("make", [HintPredictor, OnlinePredictor, LearnedPredictor])
def test_every_predictor_sets_the_length_distribution_and_returns_its_median(make):
    for r in (req(max_tokens=300), req(hint_tokens=40.0, max_tokens=300), req()):
        y = make().predict(r)
        assert r.length is not None and r.length.median == y


@pytest.mark.parametrize("make", [HintPredictor, OnlinePredictor, LearnedPredictor])
def test_a_hint_is_an_exact_length(make):
    r = req(hint_tokens=40.0, max_tokens=300, prompt_text="write a long essay")
    assert make().predict(r) == 40.0
    assert r.length.plan == r.length.median == 40.0 and r.prediction_source == "hint"


# -- HintPredictor -------------------------------------------------------------------


def test_hint_predictor_uses_the_clients_hint_first():
    assert HintPredictor().predict(req(hint_tokens=42.0, max_tokens=512)) == 42.0


@pytest.mark.parametrize("hint", [None, 0.0, -3.0])
def test_hint_predictor_falls_back_to_max_tokens_without_a_positive_hint(hint):
    assert HintPredictor().predict(req(hint_tokens=hint, max_tokens=512)) == 512.0


def test_hint_predictor_uses_its_default_when_neither_is_set():
    assert HintPredictor(default_tokens=100).predict(req(hint_tokens=0.0, max_tokens=0)) == 100.0


def test_hint_predictor_ignores_observations():
    p = HintPredictor()
    r = req(max_tokens=512)
    p.observe(r, 3.0)
    assert p.predict(r) == 512.0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_hint_predictor_rejects_a_bad_default_naming_it(bad):
    with pytest.raises(ValueError, match="default_tokens"):
        HintPredictor(default_tokens=bad)


# -- OnlinePredictor -----------------------------------------------------------------


def synthetic_stream(n: int, seed: int = 0):
    """Class "a" answers ≈ 100 tokens, class "b" ≈ 10; every request allows 200."""
    rng = random.Random(seed)
    for _ in range(n):
        cls = rng.choice("ab")
        actual = rng.gauss(100, 8) if cls == "a" else rng.gauss(10, 2)
        r = req(request_class=cls, prompt_tokens=rng.randint(20, 30), max_tokens=200)
        yield r, max(actual, 1)


def test_online_predictor_learns_the_mean_per_class():
    p = OnlinePredictor(min_samples=5)
    for r, actual in synthetic_stream(2000):
        p.observe(r, actual)
    a = p.predict(req(request_class="a", prompt_tokens=25, max_tokens=200))
    b = p.predict(req(request_class="b", prompt_tokens=25, max_tokens=200))
    assert a == pytest.approx(100, abs=6)
    assert b == pytest.approx(10, abs=1.5)


def test_online_predictor_beats_the_hint_predictor_on_bin_accuracy():
    hint, online = HintPredictor(), OnlinePredictor(min_samples=5)
    scores = {"hint": AccuracyTracker(), "online": AccuracyTracker()}
    for r, actual in synthetic_stream(3000, seed=1):
        for p in (hint, online):
            scores[p.name].record(p.predict(r), actual)
            p.observe(r, actual)
    boundaries = (50.0,)
    assert scores["hint"].bin_accuracy(boundaries) == pytest.approx(0.5, abs=0.05)  # all say 200
    assert scores["online"].bin_accuracy(boundaries) > 0.95


def test_online_predictor_prefers_the_prompt_bucket_key_when_it_has_enough_samples():
    p = OnlinePredictor(min_samples=3)
    for _ in range(3):
        p.observe(req(request_class="a", prompt_tokens=10), 40.0)  # bucket 4 (8-15)
        p.observe(req(request_class="a", prompt_tokens=1000), 400.0)  # bucket 10
    assert p.predict(req(request_class="a", prompt_tokens=12)) == 40.0
    assert p.predict(req(request_class="a", prompt_tokens=900)) == 400.0


def test_online_predictor_falls_back_to_the_class_then_global_then_hint():
    p = OnlinePredictor(min_samples=3)
    assert p.predict(req(request_class="a", max_tokens=77)) == 77.0  # nothing learned: hint rule
    for _ in range(3):
        p.observe(req(request_class="a", prompt_tokens=10), 40.0)
    # An unseen prompt bucket of a known class: the class estimate.
    assert p.predict(req(request_class="a", prompt_tokens=5000)) == 40.0
    # An unseen class: the global estimate.
    assert p.predict(req(request_class="zzz", max_tokens=77)) == 40.0


def test_the_clients_hint_wins_over_what_the_online_predictor_learned():
    # Issue 9 defect 4: after 8 samples of ~80 tokens, hint 1800 (max_tokens 2000) predicted 80.
    p = OnlinePredictor()
    for _ in range(20):
        p.observe(req(prompt_tokens=30), 80.0)
    r = req(prompt_tokens=30, max_tokens=2000, hint_tokens=1800.0)
    assert p.predict(r) == 1800.0 and r.prediction_source == "hint"
    capped = req(prompt_tokens=30, max_tokens=500, hint_tokens=1800.0)
    assert p.predict(capped) == 500.0 and capped.prediction_source == "hint"  # a hint is capped at max_tokens
    learned = req(prompt_tokens=30, max_tokens=2000)
    assert p.predict(learned) == 80.0 and learned.prediction_source == "online"


@pytest.mark.parametrize(
    ("fields", "source"),
    [({"hint_tokens": 5.0}, "hint"), ({"max_tokens": 9}, "max_tokens"), ({}, "default")],
)
def test_predictors_record_where_a_prediction_came_from(fields, source):
    for p in (HintPredictor(), OnlinePredictor()):
        r = req(**fields)
        p.predict(r)
        assert r.prediction_source == source


def test_hint_predictor_caps_the_hint_at_max_tokens():
    assert HintPredictor().predict(req(hint_tokens=1800.0, max_tokens=500)) == 500.0


def test_online_predictor_needs_min_samples_before_trusting_a_key():
    p = OnlinePredictor(min_samples=4)
    for _ in range(3):
        p.observe(req(request_class="a", prompt_tokens=10), 40.0)
    p.observe(req(request_class="b", prompt_tokens=10), 400.0)
    # class "a" has 3 < 4 answers: the global window (40, 40, 40, 400) answers
    assert p.predict(req(request_class="a", prompt_tokens=10, max_tokens=1000)) == 40.0
    glob = req(request_class="a", prompt_tokens=10, max_tokens=1000)
    p.predict(glob)
    assert glob.length.quantile(0.98) > 300  # the global spread, with "b"'s 400
    p.observe(req(request_class="a", prompt_tokens=10), 40.0)
    own = req(request_class="a", prompt_tokens=10, max_tokens=1000)
    p.predict(own)
    assert own.length.quantile(0.98) == 40.0  # its own key now: all four were 40


def test_online_predictor_answers_from_two_completions_before_the_max_tokens_rule():
    p = OnlinePredictor()
    assert p.predict(req(max_tokens=1024)) == 1024.0  # nothing learned: the hint rule
    p.observe(req(), 100.0)
    assert p.predict(req(max_tokens=1024)) == 1024.0
    p.observe(req(), 300.0)
    r = req(max_tokens=1024)
    assert p.predict(r) == 200.0 and r.prediction_source == "online"
    assert not r.length.known and r.length.quantile(0.02) < 110 and r.length.quantile(0.98) > 290


def test_online_predictor_gives_the_spread_of_a_keys_answers_not_their_mean_as_exact():
    p = OnlinePredictor(min_samples=1)
    for x in range(10, 1010, 10):  # 100 answers, 10..1000 tokens: the window keeps the last 64
        p.observe(req(request_class="a"), float(x))
    r = req(request_class="a", max_tokens=2000)
    p.predict(r)
    assert not r.length.known
    assert r.length.median == pytest.approx(685, abs=10)  # the median of 370..1000
    assert r.length.quantile(0.9) == pytest.approx(937, abs=10)


def test_online_predictor_never_predicts_above_max_tokens():
    p = OnlinePredictor(min_samples=1)
    p.observe(req(request_class="a"), 900.0)
    assert p.predict(req(request_class="a", max_tokens=128)) == 128.0
    assert p.predict(req(request_class="a", max_tokens=0)) == 900.0  # 0 = no cap


def test_online_predictor_always_predicts_a_positive_length():
    p = OnlinePredictor(min_samples=1)
    p.observe(req(request_class="a"), 0.0)  # an immediate end-of-sequence
    assert p.predict(req(request_class="a")) == 1.0


def test_online_predictor_follows_a_drift_in_lengths():
    p = OnlinePredictor(min_samples=1, window=64)
    for _ in range(200):
        p.observe(req(request_class="a"), 100.0)
    for _ in range(100):
        p.observe(req(request_class="a"), 20.0)
    assert p.predict(req(request_class="a")) == pytest.approx(20.0, abs=0.1)


def test_online_predictor_memory_stays_bounded_with_100k_distinct_keys():
    p = OnlinePredictor(max_keys=500, min_samples=1)
    for i in range(100_000):
        p.observe(req(request_class=f"c{i}", prompt_tokens=i), 10.0)
    assert len(p) <= 500
    # The most recent keys survive; the oldest were evicted (falls back to global = 10).
    assert p.predict(req(request_class="c99999", prompt_tokens=99_999)) == 10.0


def test_online_predictor_evicts_the_least_recently_used_key():
    p = OnlinePredictor(max_keys=2, min_samples=1)
    p.observe(req(request_class="a"), 40.0)  # keys ("a", 0), ("a",)
    p.observe(req(request_class="b"), 80.0)  # evicts both "a" keys
    assert len(p) == 2
    assert p.predict(req(request_class="a", max_tokens=1000)) == 60.0  # global mean of 40, 80


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"min_samples": 0}, "min_samples"),
        ({"window": 1}, "window"),
        ({"min_samples": 9, "window": 8}, "window"),
        ({"max_keys": 1}, "max_keys"),
        ({"min_tokens": 0.0}, "min_tokens"),
    ],
)
def test_online_predictor_rejects_bad_settings_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        OnlinePredictor(**kw)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_online_predictor_rejects_a_bad_observation_naming_it(bad):
    with pytest.raises(ValueError, match="actual_tokens"):
        OnlinePredictor().observe(req(), bad)


@given(
    observations=st.lists(st.floats(0, 10_000), max_size=30),
    max_tokens=st.integers(0, 4096),
    hint=st.none() | st.floats(-10, 10_000),
)
def test_online_prediction_is_positive_and_within_max_tokens(observations, max_tokens, hint):
    p = OnlinePredictor(min_samples=2)
    for x in observations:
        p.observe(req(request_class="a", prompt_tokens=7), x)
    y = p.predict(req(request_class="a", prompt_tokens=7, max_tokens=max_tokens, hint_tokens=hint))
    assert y > 0
    if max_tokens > 0:
        assert y <= max_tokens


@pytest.mark.parametrize(
    ("tokens", "bucket"), [(0, 0), (1, 1), (2, 2), (3, 2), (4, 3), (1023, 10), (1024, 11)]
)
def test_prompt_buckets_are_powers_of_two(tokens, bucket):
    assert prompt_bucket(tokens) == bucket


# -- AccuracyTracker -----------------------------------------------------------------


def test_accuracy_is_none_without_samples():
    t = AccuracyTracker()
    assert t.bin_accuracy((10.0,)) is None
    assert t.within_one_bin_accuracy((10.0,)) is None


def test_accuracy_worked_by_hand():
    # Boundaries (10, 20, 30): bins [<10], [10,20), [20,30), [>=30].
    t = AccuracyTracker()
    t.record(5, 9)  # bins 0, 0: exact
    t.record(10, 19.9)  # bins 1, 1: exact (10 is the lower edge of bin 1)
    t.record(15, 25)  # bins 1, 2: off by one
    t.record(35, 5)  # bins 3, 0: off by three
    boundaries = (10.0, 20.0, 30.0)
    assert t.bin_accuracy(boundaries) == 2 / 4
    assert t.within_one_bin_accuracy(boundaries) == 3 / 4


def test_accuracy_window_keeps_only_the_latest_pairs():
    t = AccuracyTracker(window=2)
    t.record(5, 50)  # wrong, then pushed out
    t.record(5, 5)
    t.record(50, 50)
    assert len(t) == 2
    assert t.bin_accuracy((10.0,)) == 1.0


def test_accuracy_is_reported_per_source():
    t = AccuracyTracker()
    t.record(5, 5, "hint")  # exact
    t.record(5, 50, "online")  # wrong
    t.record(50, 50, "online")  # exact
    b = (10.0,)
    assert t.sources() == ["hint", "online"]
    assert (t.samples("hint"), t.samples("online"), t.samples()) == (1, 2, 3)
    assert t.bin_accuracy(b, "hint") == 1.0
    assert t.bin_accuracy(b, "online") == 0.5
    assert t.bin_accuracy(b) == 2 / 3
    assert t.bin_accuracy(b, "default") is None


def test_accuracy_tracker_rejects_a_bad_window_naming_it():
    with pytest.raises(ValueError, match="window"):
        AccuracyTracker(window=0)


@given(st.lists(st.tuples(st.floats(0, 1e4), st.floats(0, 1e4)), min_size=1, max_size=50))
def test_within_one_bin_accuracy_is_never_below_bin_accuracy(pairs):
    t = AccuracyTracker()
    for p, a in pairs:
        t.record(p, a)
    boundaries = (10.0, 100.0, 1000.0)
    exact, near = t.bin_accuracy(boundaries), t.within_one_bin_accuracy(boundaries)
    assert exact is not None and near is not None
    assert 0 <= exact <= near <= 1


def _scored_from_scratch(pairs, boundaries, tolerance, source=None):
    import bisect

    kept = [(p, a) for p, a, s in pairs if source is None or s == source]
    if not kept:
        return None
    bin_of = bisect.bisect_right
    hits = sum(abs(bin_of(boundaries, p) - bin_of(boundaries, a)) <= tolerance for p, a in kept)
    return hits / len(kept)


@given(
    st.lists(st.one_of(
        st.tuples(st.just("record"), st.floats(0, 100), st.floats(0, 100), st.sampled_from(["hint", "online", ""])),
        st.tuples(st.just("score"), st.sampled_from([(10.0,), (10.0, 50.0), (30.0, 60.0, 90.0)])),
    ), max_size=60),
)  # fmt: skip
def test_running_scores_equal_scoring_the_window_from_scratch(ops):
    t = AccuracyTracker(window=5)
    window: list[tuple[float, float, str]] = []
    for op in ops:
        if op[0] == "record":
            t.record(op[1], op[2], op[3])
            window = (window + [(op[1], op[2], op[3])])[-5:]
            continue
        b = op[1]
        for source in (None, "hint", "online", "", "default"):
            assert t.bin_accuracy(b, source) == _scored_from_scratch(window, b, 0, source)
            assert t.within_one_bin_accuracy(b, source) == _scored_from_scratch(window, b, 1, source)
            assert t.samples(source) == sum(1 for w in window if source is None or w[2] == source)
        assert t.sources() == [s for s in ("hint", "online") if any(w[2] == s for w in window)] + (
            [""] if any(w[2] == "" for w in window) else [])  # fmt: skip


def test_scoring_again_with_the_same_boundaries_does_not_rescan_the_window(monkeypatch):
    # issue 11: every metrics snapshot asks for every score; recounting the whole
    # window each time cost ~3 ms per score on the sidecar's event loop.
    import bisect

    from binbatch_sidecar.core import predictor

    t = AccuracyTracker(window=1024)
    for i in range(1024):
        t.record(i % 50, (i * 7) % 50, "hint" if i % 3 else "online")
    b = (10.0, 20.0, 30.0)
    first = (t.bin_accuracy(b), t.within_one_bin_accuracy(b), t.bin_accuracy(b, "online"))
    calls = 0
    real = bisect.bisect_right

    def counting(*args):
        nonlocal calls
        calls += 1
        return real(*args)

    monkeypatch.setattr(predictor.bisect, "bisect_right", counting)
    assert (t.bin_accuracy(b), t.within_one_bin_accuracy(b), t.bin_accuracy(b, "online")) == first
    assert calls == 0
    t.record(5, 5, "hint")  # one pair in, the oldest out: a few lookups, not a window's worth
    assert calls <= 4


# -- LearnedPredictor ----------------------------------------------------------------

SHORT, LONG = "answer yes or no: is {} blue?", "write a detailed essay about {}"


def _learned_req(i: int, **kw) -> tuple[Request, float]:
    long = i % 2 == 0
    text = (LONG if long else SHORT).format(f"thing{i % 13}")
    return req(prompt_text=text, max_tokens=1000, **kw), (500.0 if long else 6.0)


def _fitted(p: LearnedPredictor) -> None:
    """What the dispatcher does in a worker thread, done inline."""
    p.install(lm.fit(*p.training_set(), prior=p.prior), now=5.0)


def _feed(p: LearnedPredictor, n: int) -> list[int]:
    """Predict and observe ``n`` completions, fitting whenever one is due; after which ones it was."""
    due = []
    for i in range(n):
        r, y = _learned_req(i)
        p.predict(r)
        p.observe(r, y)
        if p.refit_due():
            due.append(i + 1)
            _fitted(p)
    return due


def test_learned_answers_with_the_online_fallback_until_it_has_a_model():
    p = LearnedPredictor(first_fit=16)
    r, _ = _learned_req(0)
    p.predict(r)
    assert r.prediction_source == "max_tokens" and p.model is None


def test_learned_refits_after_first_fit_records_then_as_records_double():
    p = LearnedPredictor(first_fit=16, refit_every=100)
    assert _feed(p, 80) == [16, 32, 64]
    assert p.model is not None and p.model.version == 3 and p.installed_at == 5.0


def test_a_warm_started_learned_predictor_refits_every_refit_every_records():
    prior = LearnedPredictor(first_fit=40)
    assert _feed(prior, 40) == [40]
    p = LearnedPredictor(model=prior.model, first_fit=16, refit_every=50)
    assert _feed(p, 120) == [50, 100]  # not after 16: a few records would replace the prior's residual quantiles
    assert p.model.version == 3 and p.model.records == 40 + 100  # the warm start, two refits each centred on it


def test_learned_reads_the_prompt_once_fitted():
    p = LearnedPredictor(first_fit=40)
    assert _feed(p, 40) == [40]
    short, _ = _learned_req(1)
    long, _ = _learned_req(2)
    assert p.predict(long) > 10 * p.predict(short)
    assert long.prediction_source == short.prediction_source == "learned"
    assert long.length.plan >= long.length.median


def test_learned_featurizes_a_request_once_to_predict_and_learn(monkeypatch):
    p = LearnedPredictor(first_fit=40)
    _feed(p, 40)
    calls = []

    def counted(text, request_class="", max_tokens=0):
        calls.append(text)
        return lm.featurize(text, request_class, max_tokens)

    monkeypatch.setattr(predictor_module, "featurize", counted)
    r, y = _learned_req(7)
    p.predict(r)
    p.observe(r, y)
    assert calls == [r.prompt_text]
    kept = p.training_set()[0][-1]
    want = lm.featurize(r.prompt_text, r.request_class, r.max_tokens)
    assert np.array_equal(kept.indices, want.indices) and np.array_equal(kept.values, want.values)


def test_learned_keeps_no_prompt_text_and_a_bounded_buffer():
    p = LearnedPredictor(buffer=32, first_fit=16)
    for i in range(100):
        r, y = _learned_req(i)
        p.observe(r, y)
    assert p.buffered == 32
    features, tokens = p.training_set()
    assert len(features) == len(tokens) == 32
    assert all(isinstance(f, lm.Features) for f in features)  # hashed numbers, never the text
    assert not p.refit_due()  # a fit is out: no second one until it is installed
    p.install(None, now=1.0)  # a failed fit keeps what runs
    assert p.model is None and not p.fitting


def test_kendall_tau_ranks_the_window_per_source():
    acc = AccuracyTracker(window=64)
    assert acc.kendall_tau() is None
    for x in range(20):
        acc.record(x, 10 * x, "learned")
        acc.record(x, -x, "online")
    assert acc.kendall_tau("learned") == pytest.approx(1.0)
    assert acc.kendall_tau("online") == pytest.approx(-1.0)
    acc.record(100, 1000, "learned")  # a new pair: the cached figure is recomputed
    assert acc.kendall_tau("learned") == pytest.approx(1.0)
    assert acc.kendall_tau("hint") is None
