"""The learned length model: features, fit, distribution, and its file."""

from __future__ import annotations

import math
import random
import zipfile
import zlib
from collections import Counter

import numpy as np
import pytest

from binbatch_sidecar.core import length_model as lm
from binbatch_sidecar.core.length_dist import LEVELS
from binbatch_sidecar.engine.model_file import MAX_FILE_BYTES, ModelFileError, load_model, save_model

SHORT = ["yes or no: is {} a colour?", "one word for {}", "translate '{}' to French", "is {} a prime?"]
LONG = ["write a 1000 word essay on {}", "write a detailed story about {}", "explain {} step by step in detail"]


def _records(n: int = 120) -> tuple[list[str], list[float]]:
    prompts, tokens = [], []
    for i in range(n):
        topic = f"topic{i % 17}"
        if i % 2:
            prompts.append(SHORT[i % len(SHORT)].format(topic))
            tokens.append(5.0 + i % 7)
        else:
            prompts.append(LONG[i % len(LONG)].format(topic))
            tokens.append(600.0 + 10 * (i % 9))
    return prompts, tokens


@pytest.fixture(scope="module")
def model() -> lm.LengthModel:
    prompts, tokens = _records()
    return lm.fit([lm.featurize(p) for p in prompts], tokens, alpha=0.5)


def test_features_read_what_is_asked_not_only_the_length():
    a, b = lm.featurize("write an essay about cats"), lm.featurize("write a haiku about cats")
    assert set(a.indices.tolist()) != set(b.indices.tolist())
    assert a.indices.dtype == np.int32 and a.values.dtype == np.float32
    assert int(a.indices.max()) < lm.N_FEATURES


def _dense(f: lm.Features) -> np.ndarray:
    return lm.design([f]).toarray()[0]


def test_class_and_cap_are_features_in_slots_of_their_own():
    base = _dense(lm.featurize("hello"))
    with_class, with_cap = _dense(lm.featurize("hello", request_class="batch")), _dense(lm.featurize("hello", max_tokens=64))
    assert np.flatnonzero(with_class != base).tolist() and min(np.flatnonzero(with_class != base)) >= lm.DIM + len(lm.META)
    assert np.flatnonzero(with_cap != base).tolist() == [lm.DIM + lm.META.index("log_max_tokens")]


def test_a_cap_or_class_no_training_record_had_changes_no_prediction(model):
    f = lm.featurize("write a 1000 word essay on topic3")
    g = lm.featurize("write a 1000 word essay on topic3", request_class="batch", max_tokens=100_000)
    assert model.dist(g).points == model.dist(f).points


def test_a_long_prompt_is_read_at_its_head_and_tail_only():
    middle_a, middle_b = "alpha " * 5000, "omega " * 5000
    a = lm.featurize("Summarise this: " + middle_a + " thanks")
    b = lm.featurize("Summarise this: " + middle_b + " thanks")
    assert len(lm.read_span("x" * 100_000)) == lm.HEAD_CHARS + lm.TAIL_CHARS + 1
    assert len(a.indices) < 200  # bounded work, whatever the length
    assert set(a.indices.tolist()) != set(b.indices.tolist())  # the head differs: it is read


def test_explicit_length_ask_and_script_are_meta_features():
    meta = dict(zip(lm.META, lm.featurize("Write 500 words about Seoul").values[-len(lm.META):]))
    assert meta["log_length_ask"] > 0 and meta["asks_words"] > 0
    hangul = dict(zip(lm.META, lm.featurize("서울에 대해 써 주세요").values[-len(lm.META):]))
    assert hangul["hangul"] > 0 and hangul["cjk"] == 0


def test_fit_ranks_long_asks_above_short_ones(model):
    short = model.dist(lm.featurize("yes or no: is topic3 a colour?"))
    long = model.dist(lm.featurize("write a 1000 word essay on topic3"))
    assert long.median > 5 * short.median
    assert model.records == 120 and model.version == 1


def test_the_plan_quantile_is_above_the_median_and_the_cap_holds(model):
    d = model.dist(lm.featurize("write a detailed story about topic5"), cap=300)
    assert d.median <= d.plan <= 300
    assert len(model.offsets) == len(LEVELS)


def test_a_refit_centred_on_a_prior_keeps_what_the_prior_knew(model):
    new_prompts = ["list the planets of topic1"] * 20
    refit = lm.fit([lm.featurize(p) for p in new_prompts], [80.0] * 20, prior=model)
    assert refit.records == 140
    short = refit.dist(lm.featurize("one word for topic2")).median
    long = refit.dist(lm.featurize("write a 1000 word essay on topic2")).median
    assert long > 5 * short


def test_fit_refuses_too_few_or_mismatched_records():
    f = [lm.featurize("hi")] * 3
    with pytest.raises(ValueError, match="records: at least"):
        lm.fit(f, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="output_tokens"):
        lm.fit(f * 5, [1.0])


def test_model_file_round_trips_within_float16(tmp_path, model):
    path = tmp_path / "m.npz"
    save_model(path, model)
    back = load_model(path)
    assert np.count_nonzero(model.weights) < lm.MAX_WEIGHTS  # nothing dropped: only float16's rounding differs
    assert back.weights == pytest.approx(model.weights, rel=2**-11, abs=1e-7)
    for prompt in ("write a detailed story about topic5", "one word for topic3", "something never seen"):
        f = lm.featurize(prompt)
        assert back.score(f) == pytest.approx(model.score(f), abs=1e-3)
        # a score 1e-3 apart moves a quantile by up to the knots' slope there: well within 1%
        assert back.dist(f).points == pytest.approx(model.dist(f).points, rel=1e-2)
    assert (back.version, back.records, back.offsets) == (model.version, model.records, model.offsets)
    assert np.array_equal(back.knots, model.knots) and back.intercept == model.intercept


def test_any_model_file_fits_a_configmap_keeping_the_largest_weights(tmp_path, model):
    """Every slot trained (the worst case): the file keeps the MAX_WEIGHTS largest hashed
    weights and every meta and class slot, and stays under the ConfigMap-safe size."""
    rng = np.random.default_rng(7)
    weights = rng.normal(0.0, 0.05, lm.N_FEATURES).astype(np.float32)
    weights[lm.DIM:] = 1e-3  # small, yet kept: the meta and class slots are never dropped
    dense = lm.LengthModel(weights, model.intercept, model.offsets, model.knots, model.records)
    path = tmp_path / "dense.npz"
    save_model(path, dense)
    assert path.stat().st_size <= MAX_FILE_BYTES
    assert 4 * (path.stat().st_size + 2) // 3 < 1024 * 1024 - 4096  # as base64 binaryData, with room for metadata
    back = load_model(path).weights
    kept = np.flatnonzero(back[: lm.DIM])
    assert len(kept) == lm.MAX_WEIGHTS
    cut = np.sort(np.abs(weights[: lm.DIM]))[-lm.MAX_WEIGHTS]
    assert np.all(np.abs(weights[kept]) >= cut)  # the largest are the ones kept
    assert back[lm.DIM:] == pytest.approx(weights[lm.DIM:], rel=2**-10)


def test_a_dense_float32_model_file_of_the_older_format_is_still_read(tmp_path, model):
    arrays = {k: v for k, v in model.to_arrays().items() if k != "slots"}
    path = tmp_path / "old.npz"
    np.savez(path, **{**arrays, "format": np.array(lm.LEGACY_FORMAT), "weights": model.weights})
    back = load_model(path)
    f = lm.featurize("write a detailed story about topic5")
    assert np.array_equal(back.weights, model.weights)
    assert back.dist(f).points == model.dist(f).points


def test_model_file_holds_no_pickle(tmp_path, model):
    path = tmp_path / "m.npz"
    save_model(path, model)
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            with z.open(name) as f:
                major, _ = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                assert not read_header(f)[2].hasobject, name


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read .*: no such file"),
        (b"not a zip", "not a model file"),
        ("object", "Object arrays cannot be loaded"),
        ("partial", "format: missing"),
        ("wrong-dim", "dim: "),
        ("nan", "weights: must be finite"),
        ("no-slots", "slots: missing"),
        ("short-slots", "slots: a bitmap of"),
        ("count", "weights: .* expected \\(one per slot set\\)"),
        ("future", "format: expected 'binbatch-length-model/4'"),
    ],
)
def test_a_bad_model_file_says_what_is_wrong(tmp_path, model, content, message):
    path = tmp_path / "bad.npz"
    arrays = model.to_arrays()
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "object":
        np.savez(path, format=np.array([{"a": 1}], dtype=object))
    elif content == "partial":
        np.savez(path, weights=arrays["weights"])
    elif content == "wrong-dim":
        np.savez(path, **{**arrays, "dim": np.array(1 << 10)})
    elif content == "nan":
        np.savez(path, **{**arrays, "weights": np.full_like(arrays["weights"], math.nan)})
    elif content == "no-slots":
        np.savez(path, **{k: v for k, v in arrays.items() if k != "slots"})
    elif content == "short-slots":
        np.savez(path, **{**arrays, "slots": arrays["slots"][:-1]})
    elif content == "count":
        np.savez(path, **{**arrays, "weights": arrays["weights"][:-1]})
    elif content == "future":
        np.savez(path, **{**arrays, "format": np.array("binbatch-length-model/9")})
    with pytest.raises(ModelFileError, match=message):
        load_model(path)


def test_the_ridge_on_the_used_slots_is_the_ridge_on_all_of_them():
    # fit() solves on the slots some record uses (a refit's cost no longer grows with DIM): the same
    # weights as over all N_FEATURES columns, within the solver's tolerance, and 0 on every other slot
    rng = random.Random(5)
    vocab = "write a story about the cat list ten reasons why explain this code in 500 words please".split()
    prompts = [" ".join(rng.choice(vocab) for _ in range(rng.randint(2, 30))) for _ in range(300)]
    x = lm.design([lm.featurize(p, "", 256) for p in prompts])
    y = np.array([rng.gauss(0.0, 1.0) for _ in prompts])
    narrowed, slots = lm.used_columns(x)
    assert narrowed.shape[1] > narrowed.shape[0]  # sklearn keeps the kernel form it takes on N_FEATURES
    assert np.array_equal(slots, np.unique(x.indices))
    w_all, b_all = lm._ridge(x, y, lm.ALPHA)
    w_used, b_used = lm._ridge(narrowed, y, lm.ALPHA)
    assert np.count_nonzero(w_all[np.setdiff1d(np.arange(lm.N_FEATURES), slots)]) == 0
    # sparse_cg stops at a relative residual of 1e-4, so a weight may differ by more: 1.6e-4 of weights
    # up to 0.54 with scipy 1.17 and scikit-learn 1.9 (a slot mapped wrong differs by a whole weight)
    np.testing.assert_allclose(w_used[: len(slots)], w_all[slots], atol=1e-3)
    assert np.count_nonzero(w_used[len(slots):]) == 0
    assert b_used == pytest.approx(b_all, abs=1e-4)
    assert np.abs(narrowed @ w_used - x @ w_all).max() < 1e-3


@pytest.mark.parametrize("n", [1, 2, 3, 7, 24, 100, 383])
def test_a_block_of_distinct_grams_keeps_the_general_formula_exactly(n):
    # featurize's shortcut (every gram once: tf all 1) must give the very floats of 1 + log c scaled to norm w
    grams = [f"g{i} w{i * 7}" for i in range(n)]
    for weight in (1.0, 0.7):
        slots, values = block(grams, weight)
        tf = 1.0 + np.log(np.ones(n))
        want = (tf * (weight / np.sqrt(tf @ tf))).astype(np.float32)
        assert values.dtype == np.float32 and np.array_equal(values, want)
        assert slots.dtype == np.int32 and slots.tolist() == [lm._slot(g) for g in grams]
    repeated_slots, repeated = block(grams + grams[:1], 1.0)  # one gram twice: the general path
    tf = 1.0 + np.log(np.array([2.0] + [1.0] * (n - 1)))
    assert np.array_equal(repeated, (tf / np.sqrt(tf @ tf)).astype(np.float32))
    assert repeated_slots.tolist() == [lm._slot(g) for g in grams]  # each distinct gram once, first-seen order


def block(grams: list[str], weight: float) -> tuple[np.ndarray, np.ndarray]:
    """One ``lm._block`` on its own, as the arrays ``featurize`` makes of its lists."""
    slots: list[int] = []
    values: list[float] = []
    lm._block(grams, weight, slots, values)
    return np.array(slots, np.int32), np.array(values, np.float32)


@pytest.mark.parametrize("text", ["", "overhead 12", "def f():\n    return {a; b} # in 500 words?", "~!@#$%^&*()_+`\x7f\t"])
def test_the_meta_features_of_ascii_text_count_no_script(text):
    span = lm.read_span(text)
    words = lm._TOKEN.findall(span.lower())
    counted = [len(r.findall(span)) for r in lm._SCRIPTS]
    assert counted == [0] * 5
    assert lm.meta_features(text, span, words)[2:7] == [0.0] * 5
    accented = text + " é東"
    assert lm.meta_features(accented, accented, words)[2] > 0 and lm.meta_features(accented, accented, words)[6] > 0


def _reference_block(grams: list[str], weight: float) -> tuple[np.ndarray, np.ndarray]:
    """The block's definition, spelled out with numpy: each distinct gram's slot, 1 + log(count), L2 norm weight."""
    counts = Counter(grams)
    if not counts:
        return np.zeros(0, np.int32), np.zeros(0, np.float32)
    tf = 1.0 + np.log(np.array(list(counts.values()), np.float64))
    return (np.array([lm._slot(g) for g in counts], np.int32),
            (tf * (weight / np.sqrt(tf @ tf))).astype(np.float32))  # fmt: skip


@pytest.mark.parametrize("text, request_class, max_tokens", [
    ("", "", 0), ("overhead 12", "", 1), ("the cat the cat the dog. " * 30, "chat", 500),
    ("List 10 tips, in 200 words?\n" + "word " * 400 + "日本語 тест", "batch-jobs", 2048),
])  # fmt: skip
def test_featurize_gives_the_very_floats_of_its_blocks_definition(text, request_class, max_tokens):
    # the request path builds plain lists and makes arrays once: the vector must be the definition's, bit for bit
    span = lm.read_span(text)
    words = lm._TOKEN.findall(span.lower())
    if len(words) > lm.HEAD_WORDS + lm.TAIL_WORDS:
        words = words[: lm.HEAD_WORDS] + words[-lm.TAIL_WORDS :]
    head, tail = words[: lm.EDGE_TOKENS], words[-lm.EDGE_TOKENS :]
    blocks = [
        _reference_block([*words, *(a + " " + b for a, b in zip(words, words[1:]))], 1.0),
        _reference_block(["^" + w for w in head] + ["^" + a + " " + b for a, b in zip(head, head[1:])]
                         + ["$" + w for w in tail], 0.7),  # fmt: skip
        _reference_block(["#first " + (words[0] if words else "")], 1.0),
    ]
    meta = [*lm.meta_features(text, span, words), math.log2(1 + max_tokens) / 20]
    idx = [b[0] for b in blocks] + [np.arange(lm.DIM, lm.DIM + len(lm.META), dtype=np.int32)]
    val = [b[1] for b in blocks] + [np.array(meta, np.float32)]
    if request_class:
        idx.append(np.array([lm.DIM + len(lm.META) + zlib.crc32(request_class.encode()) % lm.CLASS_SLOTS], np.int32))
        val.append(np.ones(1, np.float32))
    f = lm.featurize(text, request_class, max_tokens)
    assert f.indices.dtype == np.int32 and f.values.dtype == np.float32
    assert np.array_equal(f.indices, np.concatenate(idx)) and np.array_equal(f.values, np.concatenate(val))
