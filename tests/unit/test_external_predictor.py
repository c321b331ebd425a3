"""Bring your own predictor, without the network: the service's quantiles as a
LengthDist, the contract's validation, the core's order of sources (hint, external,
built-in) and the core a config with ``predictor.external`` builds.  The calls
themselves, against a real server, are in tests/integration/test_external_predictor_service.py."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from statistics import NormalDist

import pytest
import yaml

from binbatch_sidecar.config import parse_config
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.length_dist import LEVELS, LengthDist
from binbatch_sidecar.core.predictor import ExternalFirst, LearnedPredictor, OnlinePredictor
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.engine.engine_client import EngineRequest, SamplingParams
from binbatch_sidecar.engine.external_predictor import ANSWER_LIMIT, Invalid, parse_answer, query
from binbatch_sidecar.server.assembly import build_core

PREDICTOR_DOC = Path(__file__).resolve().parents[2] / "docs" / "predictor.md"


# -- the service's quantiles as the core's distribution ---------------------------------


def test_a_median_and_an_upper_quantile_make_a_log_normal():
    d = LengthDist.from_quantiles([(0.5, 100), (0.9, 400)], cap=4096)
    sigma = math.log(4) / NormalDist().inv_cdf(0.9)
    assert d.median == pytest.approx(100) and d.plan == pytest.approx(400)
    for level, point in zip(LEVELS, d.points):
        assert point == pytest.approx(100 * math.exp(sigma * NormalDist().inv_cdf(level)))


def test_one_quantile_is_a_point_mass_and_the_cap_bounds_every_level():
    assert LengthDist.from_quantiles([(0.5, 30)]).points == (30,) * len(LEVELS)
    d = LengthDist.from_quantiles([(0.1, 10), (0.5, 100), (0.9, 5000)], cap=1024)
    assert max(d.points) == 1024 and d.median == pytest.approx(100)
    assert d.quantile(0.3) < d.median  # between named levels: interpolated, not flat


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ([], "at least one"),
        ([(0.9, 10), (0.5, 20)], "levels must rise strictly"),
        ([(0.5, 10), (0.5, 20)], "levels must rise strictly"),
        ([(1.0, 10)], "levels must rise strictly within (0, 1)"),
        ([(0.5, 30), (0.9, 20)], "tokens must be finite, >= 0 and not fall"),
        ([(0.5, math.nan)], "tokens must be finite"),
    ],
)
def test_quantiles_out_of_order_are_refused_naming_them(given, words):
    with pytest.raises(ValueError, match=r"^quantiles: ") as err:
        LengthDist.from_quantiles(given)
    assert words in str(err.value)


# -- the contract -------------------------------------------------------------------


def test_an_answer_with_more_keys_is_read_and_capped_at_max_tokens():
    raw = b'{"quantiles": [{"level": 0.5, "tokens": 300, "note": "x"}, {"level": 0.9, "tokens": 900}], "model": "v3"}'
    d = parse_answer(raw, cap=512)
    assert d.median == 300 and d.plan == 512 and d.cap == 512


def test_an_answer_over_the_limit_is_invalid():
    with pytest.raises(Invalid, match="over 65536 bytes"):
        parse_answer(b" " * (ANSWER_LIMIT + 1), cap=100)


def test_problems_of_one_kind_share_a_kind_whatever_the_entry():
    kinds = set()
    for i in (0, 1):
        entries = [{"level": 0.5, "tokens": 5}, {"level": 0.9, "tokens": 9}]
        entries[i]["tokens"] = -1
        with pytest.raises(Invalid) as err:
            parse_answer(json.dumps({"quantiles": entries}).encode(), cap=100)
        assert f"quantiles[{i}].tokens" in str(err.value)  # the message names the entry
        kinds.add(err.value.kind)
    assert len(kinds) == 1  # logged once, whichever entry


def test_the_query_says_what_is_asked_its_class_cap_and_id():
    req = Request(id="r1", arrival=0.0, request_class="batch")
    chat = EngineRequest(params=SamplingParams(model="m", max_tokens=256), messages=(("system", "be brief"), ("user", "hi")))
    assert query(req, chat) == {"id": "r1", "model": "m", "request_class": "batch", "max_tokens": 256,
                                "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}  # fmt: skip


def _doc_blocks(after: str) -> list[str]:
    """The fenced blocks of the predictor page's section headed ``after``."""
    text = PREDICTOR_DOC.read_text()
    section = text.split(f"## {after}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```[a-z]*\n(.*?)```", section, re.S)


def test_the_docs_show_the_contract_the_sidecar_speaks():
    blocks = _doc_blocks("Bring your own predictor")
    asked = json.loads(blocks[0])
    req = Request(id=asked["id"], arrival=0.0, request_class=asked["request_class"])
    engine_request = EngineRequest(params=SamplingParams(model=asked["model"], max_tokens=asked["max_tokens"]),
                                   prompt=asked["prompt"])  # fmt: skip
    assert query(req, engine_request) == asked
    answer = parse_answer(blocks[1].encode(), cap=asked["max_tokens"])
    assert answer.median == pytest.approx(120)
    config = parse_config(yaml.safe_load(blocks[2]))
    assert config.predictor.external.url and config.predictor.external.feedback_url


# -- the order of sources in the core -------------------------------------------------


def test_the_hint_wins_then_the_service_then_the_built_in_predictor():
    p = ExternalFirst(OnlinePredictor())
    told = LengthDist.from_quantiles([(0.5, 40), (0.9, 90)], cap=200)
    hinted = Request(id="a", arrival=0.0, max_tokens=200, hint_tokens=7, external_length=told)
    assert p.predict(hinted) == 7 and hinted.prediction_source == "hint"
    asked = Request(id="b", arrival=0.0, max_tokens=200, external_length=told)
    assert p.predict(asked) == pytest.approx(40) and asked.prediction_source == "external"
    assert asked.length is told  # the KV plan reads its upper quantile
    unanswered = Request(id="c", arrival=0.0, max_tokens=200)
    assert p.predict(unanswered) == 200 and unanswered.prediction_source == "max_tokens"
    assert p.name == "online"


def test_the_built_in_predictor_keeps_learning_while_the_service_answers():
    inner = OnlinePredictor(min_samples=1)
    p = ExternalFirst(inner)
    told = LengthDist.from_quantiles([(0.5, 40)], cap=200)
    for i in range(3):
        r = Request(id=f"r{i}", arrival=0.0, max_tokens=200, external_length=told)
        p.predict(r)
        p.observe(r, 100)
    later = Request(id="x", arrival=0.0, max_tokens=200)  # the service did not answer this one
    assert p.predict(later) == pytest.approx(100) and later.prediction_source == "online"


def test_a_config_with_a_service_wraps_the_predictor_and_a_reload_keeps_what_it_learned():
    clock = ManualClock()
    with_service = parse_config({"predictor": {"external": {"url": "http://p:9000/predict"}}})
    core = build_core(with_service, clock)
    assert isinstance(core.predictor, ExternalFirst) and isinstance(core.predictor.inner, LearnedPredictor)  # the default
    learned = core.predictor.inner
    reloaded = build_core(with_service, clock, previous=core)
    assert isinstance(reloaded.predictor, ExternalFirst) and reloaded.predictor.inner is learned
    without = build_core(parse_config({}), clock, previous=reloaded)
    assert without.predictor is learned  # the service removed: the built-in predictor alone, still learned
