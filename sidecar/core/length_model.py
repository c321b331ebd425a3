"""A learned output-length model that reads the prompt (issue 24): features, fit, predict.

Features (``featurize``), all hashed into one sparse vector of ``DIM`` slots, so
the model's size is fixed, new words need no vocabulary, and what the sidecar
keeps to go on learning is numbers, never text:

* what is asked: word unigrams and bigrams of the prompt's head and tail (at most
  ``HEAD_CHARS`` + ``TAIL_CHARS`` characters are read, which bounds the cost of a
  long pasted document), sublinear counts, L2-normalised;
* where: the first and last ``EDGE_TOKENS`` words again, tagged by position (the
  instruction usually opens or closes a prompt; the middle is often material);
* a few dense meta-features (``META``): the prompt's length, its lines, its
  script (CJK, Hangul, kana, Cyrillic, other non-ASCII), how code-like it is,
  an explicit length ask ("in 500 words", "list 10"), a question mark at the end;
* the ``max_tokens`` cap (its log, a meta-feature: a cap no training record had
  weighs nothing) and the request class (hashed into ``CLASS_SLOTS`` slots of
  its own, so an unseen class takes no n-gram's weight).

Model (``LengthModel``): ridge regression on those features of each answer's
length as a normal score, z = Phi^-1(F(length)), F the training lengths'
distribution (kept as ``KNOTS`` quantiles).  Ranks, not log lengths: what
ordering needs is the order, and the normal score does not let a handful of
one-token or ten-thousand-token answers pull the fit (on ShareGPT it ranked
held-out answers at Kendall tau 0.38 where log length reached 0.36).  The
predicted distribution is the score plus the held-out residuals' quantiles at
``LEVELS``, mapped back to tokens through F^-1: the median is calibrated and the
KV plan's upper quantile has a measured coverage.  ``fit`` takes an optional
prior model: it keeps the prior's F and fits the ridge to what the prior leaves
unexplained (a ridge centred on the prior's weights), so a warm-started model
keeps what it knew while it learns the sidecar's own traffic.

Pure: no I/O and no clock.  A model travels as plain arrays (``to_arrays`` /
``from_arrays``; engine/model_file.py writes them as a compressed .npz without
pickle).  The arrays are sparse: of the ``DIM`` hashed slots only those the
training saw have a weight at all, and of those the ``MAX_WEIGHTS`` largest are
kept, as float16, their slots as a bitmap -- so a model file fits a Kubernetes
ConfigMap (1 MiB) whatever was trained (on ShareGPT: 4.2 MB dense float32, about
0.4 MB this way, Kendall tau unchanged within 0.001).  The dense float32 layout of
``LEGACY_FORMAT`` is still read.
"""

from __future__ import annotations

import math
import re
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from .length_dist import LEVELS, LengthDist

FORMAT = "binbatch-length-model/4"  # sparse: a slot bitmap and float16 weights
LEGACY_FORMAT = "binbatch-length-model/3"  # dense float32 weights (still read)
MAX_WEIGHTS = 200_000  # the largest hashed weights a model file keeps (the meta and class slots always)
DIM = 1 << 20  # hashed feature slots (the weights: 4 MiB of float32)
HEAD_CHARS = 1000  # the prompt's head that is read
TAIL_CHARS = 400  # and its tail (a long prompt's middle is skipped: bounded cost)
HEAD_WORDS, TAIL_WORDS = 128, 64  # and of those, at most this many words from each end
EDGE_TOKENS = 24  # words tagged by position at each end
CLASS_SLOTS = 64  # the request class hashes into slots of its own, after the meta-features
# a word: one kana, CJK or Hangul character, a run of other letters, a run of digits, or one other symbol
_TOKEN = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]|[^\W\d_]+|\d+|[^\w\s]")
_LENGTH_ASK = re.compile(
    r"\b(\d{1,5})\s*(?:-\s*\d{1,5}\s*)?(words?|sentences?|paragraphs?|lines?|points?|bullets?|items?|examples?|"
    r"ideas?|steps?|questions?|tips?|ways?|names?|titles?|reasons?|slides?|chapters?|pages?|characters?|tweets?|"
    r"posts?|options?|days?)\b",
    re.IGNORECASE,
)
_CODE_MARKS = ("{", "}", ";", "()", "=", "def ", "import ", "return", "</", "#include", "```")

# the dense meta-features, each at its own slot after the hashed ones (names for the docs and tests)
META = ("log_chars", "log_lines", "cjk", "hangul", "kana", "cyrillic", "other_non_ascii", "code", "log_length_ask",
        "length_asks", "asks_words", "ends_with_question", "log_distinct_words", "log_max_tokens")  # fmt: skip
N_FEATURES = DIM + len(META) + CLASS_SLOTS


@dataclass(frozen=True, slots=True)
class Features:
    """One prompt's sparse feature vector: slot indices and their values."""

    indices: np.ndarray  # int32; a slot may repeat (its values add up)
    values: np.ndarray  # float32


def _slot(gram: str) -> int:
    """A gram's slot: CRC-32 (stable across processes, unlike ``hash``)."""
    return zlib.crc32(gram.encode("utf-8", "surrogatepass")) & (DIM - 1)


_META_SLOTS = list(range(DIM, DIM + len(META)))


def _block(grams: Sequence[str], weight: float, slots: list[int], values: list[float]) -> None:
    """Append one block's slots and values: sublinear counts (1 + log c), scaled to L2 norm ``weight``.

    Plain lists, made into arrays once per request (``featurize``): a short prompt's blocks
    hold a few grams each, where numpy's per-call cost outweighed the work."""
    distinct = dict.fromkeys(grams)  # first-seen order, as Counter's
    n = len(distinct)
    if not n:
        return
    crc32, mask = zlib.crc32, DIM - 1  # _slot, inlined: this runs for every gram of every request
    slots += [crc32(g.encode("utf-8", "surrogatepass")) & mask for g in distinct]
    if len(grams) == n:  # every gram once (a short prompt's usual case): tf is all 1, its norm sqrt(n), exactly
        values += [weight / math.sqrt(n)] * n
        return
    tf = 1.0 + np.log(np.fromiter(Counter(grams).values(), np.float64, n))
    values += (tf * (weight / np.sqrt(tf @ tf))).astype(np.float32).tolist()


def read_span(text: str) -> str:
    """The part of a prompt the features read: all of it up to HEAD_CHARS + TAIL_CHARS, else head and tail."""
    if len(text) <= HEAD_CHARS + TAIL_CHARS:
        return text
    return text[:HEAD_CHARS] + "\n" + text[-TAIL_CHARS:]


_SCRIPTS = tuple(re.compile(r) for r in (
    r"[\u3400-\u9fff]", r"[\uac00-\ud7af]", r"[\u3040-\u30ff]", r"[\u0400-\u04ff]", r"[^\x00-\x7f]"))


def meta_features(text: str, span: str, words: Sequence[str]) -> list[float]:
    """The ``META`` values a prompt gives (all but ``log_max_tokens``): ``text`` whole
    (only its length and lines are counted), ``span`` what is read, ``words`` its tokens."""
    n = max(1, len(span))
    # every script pattern matches only non-ASCII characters: an ASCII span (most prompts) has none of them
    cjk, hangul, kana, cyrillic, non_ascii = (0,) * 5 if span.isascii() else (len(r.findall(span)) for r in _SCRIPTS)
    other = non_ascii - cjk - hangul - kana - cyrillic
    code = sum(span.count(m) for m in _CODE_MARKS) / max(1, len(words))
    asks = [(int(m.group(1)), m.group(2).lower()) for m in _LENGTH_ASK.finditer(span)]
    biggest = max((a for a, _ in asks), default=0)
    words_asked = max((a for a, unit in asks if unit.startswith("word")), default=0)
    return [
        math.log1p(len(text)) / 8, math.log1p(text.count("\n")) / 4,
        2 * cjk / n, 2 * hangul / n, 2 * kana / n, 2 * cyrillic / n, 2 * other / n, min(code, 2.0),
        math.log1p(biggest) / 6, min(len(asks), 4) / 4, math.log1p(words_asked) / 6,
        float(span.rstrip().endswith("?")), math.log1p(len(set(words))) / 6,
    ]  # fmt: skip


def featurize(text: str, request_class: str = "", max_tokens: int = 0) -> Features:
    """The feature vector of a request: what its prompt asks, its class and its cap."""
    span = read_span(text)
    words = _TOKEN.findall(span.lower())
    if len(words) > HEAD_WORDS + TAIL_WORDS:  # code, tables and CJK run to many words per character
        words = words[:HEAD_WORDS] + words[-TAIL_WORDS:]
    slots: list[int] = []
    values: list[float] = []  # float32 in the end (each rounded once, as before)
    _block([*words, *map(" ".join, zip(words, words[1:]))], 1.0, slots, values)
    head, tail = words[:EDGE_TOKENS], words[-EDGE_TOKENS:]
    edges = [*("^" + w for w in head), *("^" + a + " " + b for a, b in zip(head, head[1:])), *("$" + w for w in tail)]
    _block(edges, 0.7, slots, values)
    _block(["#first " + (words[0] if words else "")], 1.0, slots, values)
    slots += _META_SLOTS
    values += meta_features(text, span, words)
    values.append(math.log2(1 + max(0, max_tokens)) / 20)
    if request_class:  # its own slots: an n-gram's weight never leaks into a class the training never saw
        slots.append(DIM + len(META) + zlib.crc32(request_class.encode()) % CLASS_SLOTS)
        values.append(1.0)
    return Features(np.array(slots, np.int32), np.array(values, np.float32))


KNOTS = 256  # the training lengths' quantiles that map tokens to normal scores and back
_PROBS = (np.arange(KNOTS) + 0.5) / KNOTS


def _z_grid() -> np.ndarray:
    from scipy.special import ndtri

    return ndtri(_PROBS)


_Z = _z_grid()


@dataclass(frozen=True)
class LengthModel:
    """Ridge weights over ``N_FEATURES`` slots and an intercept (a normal score), the
    held-out residuals' quantiles at ``LEVELS``, and the ``KNOTS`` length quantiles."""

    weights: np.ndarray  # float32, N_FEATURES
    intercept: float
    offsets: tuple[float, ...]  # quantiles of held-out residuals (normal-score units) at LEVELS
    knots: np.ndarray  # float64, KNOTS: the training lengths' quantiles at _PROBS
    records: int  # training records it has seen (prior's included)
    version: int = 1  # the predictor running it numbers the models it installs

    def __post_init__(self) -> None:
        if self.weights.shape != (N_FEATURES,):
            raise ValueError(f"weights: {N_FEATURES} expected, got shape {self.weights.shape}")
        if len(self.offsets) != len(LEVELS) or any(not math.isfinite(r) for r in self.offsets):
            raise ValueError(f"offsets: {len(LEVELS)} finite values expected, got {self.offsets}")
        if any(b < a for a, b in zip(self.offsets, self.offsets[1:])):
            raise ValueError("offsets: must not decrease")
        k = self.knots
        if k.shape != (KNOTS,) or not np.all(np.isfinite(k)) or np.any(np.diff(k) < 0) or k[0] < 0:
            raise ValueError(f"knots: {KNOTS} finite, non-negative, non-decreasing lengths expected")
        if not math.isfinite(self.intercept):
            raise ValueError(f"intercept: must be finite, got {self.intercept}")

    def score(self, f: Features) -> float:
        """The predicted normal score, before the residual's median."""
        return self.intercept + float(np.dot(self.weights[f.indices], f.values))

    def dist(self, f: Features, cap: float = math.inf) -> LengthDist:
        tokens = np.interp(self.score(f) + np.asarray(self.offsets), _Z, self.knots)
        top = cap if math.isfinite(cap) else math.inf
        return LengthDist(tuple(min(top, max(1.0, float(t))) for t in tokens), cap)

    @property
    def nbytes(self) -> int:
        return int(self.weights.nbytes + self.knots.nbytes)

    # -- as plain arrays (no pickle) -------------------------------------------------

    def to_arrays(self) -> dict[str, np.ndarray]:
        """The model as plain arrays: the slot bitmap and float16 weights of the ``MAX_WEIGHTS``
        largest hashed weights and every meta and class slot (a dropped weight reads as 0)."""
        kept = np.flatnonzero(self.weights[:DIM])
        if len(kept) > MAX_WEIGHTS:  # the largest magnitudes; ties by slot, so the same model writes the same file
            order = np.lexsort((kept, -np.abs(self.weights[kept])))[:MAX_WEIGHTS]
            kept = np.sort(kept[order])
        slots = np.zeros(N_FEATURES, bool)
        slots[kept] = True
        slots[DIM:] = True
        values = self.weights[slots].astype(np.float16)
        if not np.all(np.isfinite(values)):
            raise ValueError(f"weights: a weight beyond float16's range ({float(np.abs(self.weights).max()):g})")
        return {
            "format": np.array(FORMAT), "dim": np.array(DIM), "meta": np.array(META),
            "slots": np.packbits(slots), "weights": values, "intercept": np.array(self.intercept, dtype=np.float64),
            "levels": np.array(LEVELS), "offsets": np.array(self.offsets, dtype=np.float64),
            "knots": self.knots.astype(np.float64), "records": np.array(self.records, dtype=np.int64),
            "version": np.array(self.version, dtype=np.int64),
        }  # fmt: skip

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> LengthModel:
        """The model those arrays hold (``FORMAT``, or the dense ``LEGACY_FORMAT``); ValueError
        naming the array that is wrong."""
        names = ("format", "dim", "meta", "weights", "intercept", "levels", "offsets", "knots", "records", "version")
        missing = [k for k in names if k not in arrays]
        if missing:
            raise ValueError(f"{missing[0]}: missing (not a binbatch length model)")
        fmt = str(arrays["format"])
        if fmt not in (FORMAT, LEGACY_FORMAT):
            raise ValueError(f"format: expected {FORMAT!r} (or the older {LEGACY_FORMAT!r}), got {fmt!r}")
        if int(arrays["dim"]) != DIM or tuple(str(m) for m in arrays["meta"]) != META:
            raise ValueError(f"dim: the model's features ({int(arrays['dim'])} slots) are not this version's ({DIM})")
        if tuple(float(x) for x in arrays["levels"]) != LEVELS:
            raise ValueError(f"levels: expected {LEVELS}")
        values = np.asarray(arrays["weights"])
        if values.dtype.kind != "f" or values.ndim != 1 or not np.all(np.isfinite(values)):
            raise ValueError("weights: must be finite floats")
        if fmt == LEGACY_FORMAT:
            weights = values.astype(np.float32)
        else:
            if "slots" not in arrays:
                raise ValueError("slots: missing (not a binbatch length model)")
            packed = np.asarray(arrays["slots"])
            if packed.dtype != np.uint8 or packed.shape != ((N_FEATURES + 7) // 8,):
                raise ValueError(f"slots: a bitmap of {N_FEATURES} slots expected, got {packed.dtype} {packed.shape}")
            slots = np.unpackbits(packed, count=N_FEATURES).astype(bool)
            if int(slots.sum()) != len(values):
                raise ValueError(f"weights: {int(slots.sum())} expected (one per slot set), got {len(values)}")
            weights = np.zeros(N_FEATURES, np.float32)
            weights[slots] = values
        return cls(weights, float(arrays["intercept"]), tuple(float(r) for r in arrays["offsets"]),
                   np.asarray(arrays["knots"], dtype=np.float64), int(arrays["records"]), int(arrays["version"]))  # fmt: skip


def normal_scores(tokens: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """Phi^-1(F(tokens)), F the distribution ``knots`` hold; a length several knots share
    gets the middle of their scores (so a tie is one score)."""
    lo = np.searchsorted(knots, tokens, side="left")
    hi = np.searchsorted(knots, tokens, side="right")
    below = np.interp(tokens, knots, _Z)  # strictly between knots: linear
    tied = hi > lo
    mid = (_Z[np.minimum(lo, KNOTS - 1)] + _Z[np.maximum(hi - 1, 0)]) / 2
    return np.where(tied, mid, below)


# -- fitting --------------------------------------------------------------------------

FOLDS = 5  # held-out residuals come from this many folds
ALPHA = 1.0  # the ridge's L2 penalty (of 0.5, 1, 2 and 4 on ShareGPT, 1 ranked best)
MIN_RECORDS = 2 * FOLDS


def load_fit_libraries() -> None:
    """Import what ``fit`` uses (scipy.sparse, sklearn's ridge), which ``fit`` otherwise imports at its first run."""
    import scipy.sparse  # noqa: F401
    import sklearn.linear_model  # noqa: F401


def design(features: Sequence[Features]):
    """The sparse design matrix (CSR, ``N_FEATURES`` columns) of a list of feature vectors."""
    import scipy.sparse as sp

    indptr = np.zeros(len(features) + 1, dtype=np.int64)
    indptr[1:] = np.cumsum([len(f.indices) for f in features])
    idx = np.concatenate([f.indices for f in features]) if features else np.zeros(0, np.int32)
    val = np.concatenate([f.values for f in features]) if features else np.zeros(0, np.float32)
    return sp.csr_matrix((val, idx, indptr), shape=(len(features), N_FEATURES))


def used_columns(x):
    """``x`` narrowed to the slots some record uses, and those slots (``x``'s column of
    each of its first columns).  A slot no record has gets weight 0 from the ridge either
    way, but every one of the ``N_FEATURES`` costs each solver step (centring, the
    residual vectors): a refit on the bench's 4096 records spent ~0.3 s of CPU on them.
    Padded with empty columns to more columns than rows, so sklearn's sparse_cg keeps the
    form it takes on all ``N_FEATURES`` (the kernel one: n_features > n_samples)."""
    import scipy.sparse as sp

    slots, local = np.unique(x.indices, return_inverse=True)
    width = min(N_FEATURES, max(len(slots), x.shape[0] + 1))
    narrowed = sp.csr_matrix((x.data, local.astype(np.int32).ravel(), x.indptr), shape=(x.shape[0], width))
    return narrowed, slots


def _ridge(x, y: np.ndarray, alpha: float) -> tuple[np.ndarray, float]:
    from sklearn.linear_model import Ridge

    m = Ridge(alpha=alpha, solver="sparse_cg", tol=1e-4, max_iter=300).fit(x, y)
    return m.coef_.astype(np.float32), float(m.intercept_)


def fit(
    features: Sequence[Features], output_tokens: Sequence[float], *, alpha: float = ALPHA,
    prior: LengthModel | None = None,
) -> LengthModel:
    """A model fitted to these records (at least ``MIN_RECORDS``); with ``prior``, a ridge centred on it."""
    n = len(features)
    if n != len(output_tokens):
        raise ValueError(f"output_tokens: {len(output_tokens)} values for {n} feature vectors")
    if n < MIN_RECORDS:
        raise ValueError(f"records: at least {MIN_RECORDS} are needed to fit, got {n}")
    x = design(features)
    tokens = np.maximum(0.0, np.asarray(output_tokens, dtype=np.float64))
    knots = prior.knots if prior is not None else np.quantile(tokens, _PROBS)
    z = normal_scores(tokens, knots)
    base = np.zeros(n) if prior is None else x @ prior.weights.astype(np.float64) + prior.intercept
    resid = z - base
    xu, slots = used_columns(x)
    held_out = np.empty(n)
    folds = np.arange(n) % FOLDS
    for k in range(FOLDS):
        w, b = _ridge(xu[folds != k], resid[folds != k], alpha)
        held_out[folds == k] = resid[folds == k] - (xu[folds == k] @ w + b)
    wu, b = _ridge(xu, resid, alpha)
    w = np.zeros(N_FEATURES, np.float32)
    w[slots] = wu[: len(slots)]
    if prior is not None:
        w, b = w + prior.weights, b + prior.intercept
    offsets = np.maximum.accumulate(np.quantile(held_out, LEVELS))
    records = n + (prior.records if prior is not None else 0)
    return LengthModel(w.astype(np.float32), b, tuple(float(r) for r in offsets), knots, records)
