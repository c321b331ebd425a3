"""The learned predictor in the sidecar: requests from the real front door, refits off
the event loop fed by the dispatcher's completions, its metrics, its warm start."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client.parser import text_string_to_metric_families

from binbatch_sidecar.config import ConfigError, parse_config
from binbatch_sidecar.core import length_model as lm
from binbatch_sidecar.core.binner import FixedBinner
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.former import BatchFormer
from binbatch_sidecar.core.predictor import HintPredictor, LearnedPredictor, OnlinePredictor
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.core.sizer import BatchSizer
from binbatch_sidecar.engine.dispatcher import Call, Core, Dispatcher
from binbatch_sidecar.engine.engine_client import EngineRequest, EngineResult, SamplingParams
from binbatch_sidecar.engine.model_file import save_model
from binbatch_sidecar.engine.sidecar_metrics import SidecarMetrics
from binbatch_sidecar.server.assembly import build_core, model_file_changed
from binbatch_sidecar.server.front import Fields, Front

from test_dispatcher import FakeClient, settle

SHORT, LONG = "answer yes or no: is {} blue?", "write a detailed essay about {}"


def _prompt(i: int) -> tuple[str, int]:
    long = i % 2 == 0
    return (LONG if long else SHORT).format(f"thing{i % 11}"), (400 if long else 6)


def _model(n: int = 60) -> lm.LengthModel:
    prompts = [_prompt(i) for i in range(n)]
    return lm.fit([lm.featurize(p) for p, _ in prompts], [float(y) for _, y in prompts])


# -- nothing that forces a length reaches a predictor -------------------------------

FORCING_FIELDS = ("min_tokens", "stop", "ignore_eos", "seed", "temperature", "top_p")


def test_the_core_request_carries_nothing_that_forces_a_length():
    names = {f.name for f in dataclasses.fields(Request)}
    assert not names & set(FORCING_FIELDS)


class _Door:
    def submit(self, req, call):  # the front door's dispatcher, unused: only build() is called
        raise AssertionError


@pytest.mark.parametrize("predictor", [HintPredictor(), OnlinePredictor(), LearnedPredictor(model=_model())],
                         ids=["hint", "online", "learned"])  # fmt: skip
async def test_min_tokens_stop_and_ignore_eos_leave_every_prediction_unchanged(predictor):
    cfg = parse_config({})
    front = Front(_Door(), ManualClock(), config=lambda: cfg, default_model=lambda: "m")
    for i in range(6):
        text, recorded = _prompt(i)
        base = dict(prompt=text, max_tokens=1024, request_id=f"r{i}")
        plain = front.build(Fields(**base), stream=False).req
        forced = front.build(Fields(**base, min_tokens=recorded, stop=("<end>",), ignore_eos=True), stream=False).req
        chat = front.build(Fields(messages=(("user", text),), max_tokens=1024, min_tokens=recorded), stream=False).req
        assert predictor.predict(plain) == predictor.predict(forced) == predictor.predict(chat)
        assert plain.length == forced.length == chat.length
        assert plain.prediction_source == forced.prediction_source


# -- refit off the event loop ---------------------------------------------------------


def _dispatcher(predictor: LearnedPredictor) -> tuple[Dispatcher, FakeClient, SidecarMetrics]:
    clock = ManualClock()
    binner = FixedBinner(())
    former = BatchFormer(binner, clock, target_size=16, max_wait=1.0, max_queue=100)
    metrics = SidecarMetrics()
    core = Core(predictor, binner, former, BatchSizer(mode="static", static_size=16, max_size=256))
    client = FakeClient()
    return Dispatcher(core, client, clock, metrics, mode="gang", max_inflight_batches=2), client, metrics


def _scraped(metrics: SidecarMetrics) -> dict[str, float]:
    return {s.name + str(sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(metrics.render().decode()) for s in fam.samples}  # fmt: skip


async def test_completions_feed_a_refit_in_a_thread_and_the_model_is_swapped_in_whole():
    predictor = LearnedPredictor(first_fit=16)
    d, client, metrics = _dispatcher(predictor)
    assert _scraped(metrics)["binbatch_predictor_model_version[]"] == 0
    truth = {}
    for i in range(16):
        text, tokens = _prompt(i)
        req = Request(id=str(i), arrival=0.0, max_tokens=1024, prompt_text=text)
        call = Call(EngineRequest(params=SamplingParams(model="m", max_tokens=1024), prompt=text),
                    asyncio.get_running_loop().create_future())  # fmt: skip
        d.submit(req, call)
        truth[text] = tokens
    d._step()
    await settle()
    reqs, fut = client.calls[0]
    fut.set_result([EngineResult("x", "stop", 5, truth[r.prompt]) for r in reqs])
    await settle()
    assert predictor.fitting and predictor.model is None  # the fit runs off the event loop
    await d._refit
    assert predictor.model is not None and predictor.model.records == 16
    scraped = _scraped(metrics)
    assert scraped["binbatch_predictor_model_version[]"] == 1
    assert scraped["binbatch_predictor_training_records[]"] == 16
    assert scraped["binbatch_predictor_refits_total[('outcome', 'installed')]"] == 1
    long = Request(id="x", arrival=0.0, prompt_text=LONG.format("thing3"))
    short = Request(id="y", arrival=0.0, prompt_text=SHORT.format("thing3"))
    assert predictor.predict(long) > 5 * predictor.predict(short)


# -- warm start ---------------------------------------------------------------------------


def test_a_warm_start_is_loaded_and_kept_across_a_reload(tmp_path):
    path = tmp_path / "m.npz"
    save_model(path, _model())
    cfg = parse_config({"predictor": {"kind": "Learned", "warmStart": str(path)}})
    clock = ManualClock()
    core = build_core(cfg, clock)
    assert isinstance(core.predictor, LearnedPredictor) and core.predictor.model is not None
    again = build_core(parse_config({"predictor": {"kind": "Learned", "warmStart": str(path), "refitEveryRecords": 64}}),
                       clock, previous=core)  # fmt: skip
    assert again.predictor is core.predictor and core.predictor.refit_every == 64


@pytest.mark.parametrize("content", [None, b"garbage"])
def test_a_warm_start_that_is_no_model_refuses_the_config_naming_the_field(tmp_path, content):
    path = tmp_path / "m.npz"
    if content is not None:
        path.write_bytes(content)
    cfg = parse_config({"predictor": {"kind": "Learned", "warmStart": str(path)}})
    with pytest.raises(ConfigError) as err:
        build_core(cfg, ManualClock())
    assert err.value.problems[0][0] == "predictor.warmStart"


def test_a_warm_start_needs_kind_learned():
    with pytest.raises(ConfigError, match=r"predictor\.warmStart: is only read with kind Learned"):
        parse_config({"predictor": {"kind": "Online", "warmStart": "/m.npz"}})


# -- an optional warm start (the file spec.predictor.model mounts) ------------------------


def _optional(path) -> object:
    return parse_config({"predictor": {"kind": "Learned", "warmStart": str(path), "warmStartOptional": True}})


def test_warm_start_optional_needs_a_warm_start():
    with pytest.raises(ConfigError, match=r"predictor\.warmStartOptional: needs warmStart"):
        parse_config({"predictor": {"kind": "Learned", "warmStartOptional": True}})


@pytest.mark.parametrize("content", [None, b"garbage"], ids=["missing", "no-model"])
async def test_an_optional_warm_start_that_is_no_model_starts_cold_with_one_warning(tmp_path, content, caplog):
    path = tmp_path / "m.npz"
    if content is not None:
        path.write_bytes(content)
    clock = ManualClock()
    core = build_core(_optional(path), clock)
    assert isinstance(core.predictor, LearnedPredictor) and core.predictor.model is None  # cold: Online answers
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "spec.predictor.model" in warnings[0].getMessage()
    assert str(path) in warnings[0].getMessage() and "starting cold" in warnings[0].getMessage()
    metrics = SidecarMetrics()
    Dispatcher(core, FakeClient(), clock, metrics)
    assert _gauge(metrics, "binbatch_predictor_model_loaded") == 0
    again = build_core(_optional(path), clock, previous=core)  # a reload of the same config: no second warning
    assert again.predictor is core.predictor
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    assert not model_file_changed(_optional(path), again.predictor)


async def test_a_model_file_that_appears_or_changes_is_swapped_in_whole(tmp_path):
    path, clock = tmp_path / "m.npz", ManualClock()
    cfg = _optional(path)
    cold = build_core(cfg, clock)
    assert not model_file_changed(cfg, cold.predictor)
    save_model(path, _model(40))  # kubelet fills the volume once the ConfigMap exists
    assert model_file_changed(cfg, cold.predictor)
    first = build_core(cfg, clock, previous=cold)
    assert first.predictor is not cold.predictor and first.predictor.model.records == 40
    metrics = SidecarMetrics()
    Dispatcher(first, FakeClient(), clock, metrics)
    assert _gauge(metrics, "binbatch_predictor_model_loaded") == 1
    replacement = tmp_path / "new.npz"  # kubelet writes the new files, then swaps them in
    save_model(replacement, _model(60))
    replacement.replace(path)
    assert model_file_changed(cfg, first.predictor)
    second = build_core(cfg, clock, previous=first)
    assert second.predictor.model.records == 60 and second.predictor.prior is second.predictor.model
    assert not model_file_changed(cfg, second.predictor)


def test_a_mounted_model_that_goes_away_keeps_the_model_loaded_before(tmp_path, caplog):
    path, clock = tmp_path / "m.npz", ManualClock()
    save_model(path, _model(40))
    cfg = _optional(path)
    core = build_core(cfg, clock)
    path.unlink()  # the ConfigMap was deleted
    assert model_file_changed(cfg, core.predictor)
    again = build_core(cfg, clock, previous=core)
    assert again.predictor is core.predictor and again.predictor.model.records == 40
    assert "keeping the model loaded from it before" in caplog.text
    assert not model_file_changed(cfg, again.predictor)  # once: not retried every poll


async def test_without_a_warm_start_the_loaded_gauge_says_none_is_asked(tmp_path):
    clock, metrics = ManualClock(), SidecarMetrics()
    Dispatcher(build_core(parse_config({"predictor": {"kind": "Learned"}}), clock), FakeClient(), clock, metrics)
    assert _gauge(metrics, "binbatch_predictor_model_loaded") == -1


def _gauge(metrics: SidecarMetrics, name: str) -> float:
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not exported")
