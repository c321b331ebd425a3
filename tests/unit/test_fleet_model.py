"""``spec.predictor.fleet``: the operator gathers its sidecars' hashed records (only the new ones, by
cursor), fits one model with the CLI's ``train`` and publishes it in the ConfigMap its pods mount;
a failed fit or publish keeps the last good model.  The API seam is test_operator's FakeKube, the
sidecars' GetStats and ExportTrainingRecords are fakes, the clock is a counter."""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import random

import numpy as np
import pytest

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_operator import builders, fleet_model
from binbatch_operator.fleet_model import FleetModels, Reservoir
from binbatch_operator.indexes import Seen, child_entry
from binbatch_operator.reconcile import Context, reconcile
from binbatch_operator.sidecar_stats import SidecarStats
from binbatch_sidecar.config import ConfigError
from binbatch_sidecar.core import length_model
from binbatch_sidecar.core.length_model import LengthModel
from binbatch_sidecar.engine.record_export import Exported
from binbatch_sidecar.engine.training_records import hashed_record
from test_operator import IMAGE, SPEC, FakeKube, policy_body

FLEET = {**SPEC, "predictor": {"kind": "Learned", "fleet": {"enabled": True, "refitIntervalSeconds": 600,
                                                            "maxRecords": 1000}}}  # fmt: skip
LOG = logging.getLogger("t")


def _record(i: int):
    long = i % 2 == 1
    f = length_model.featurize(f"{'write a long essay' if long else 'answer yes or no'} about thing {i}")
    return hashed_record(f.indices.tolist(), f.values.tolist(), 300 + i % 7 if long else 2 + i % 3)


class FakeSidecars:
    """Each pod's records, numbered from 1; ``ExportTrainingRecords`` as the sidecar answers it."""

    def __init__(self, per_pod: int) -> None:
        self.records = {f"10.0.0.{n}:50061": [_record(1000 * n + i) for i in range(per_pod)] for n in (1, 2)}
        self.asked: list[tuple[str, int, str, int]] = []

    async def export(self, address, *, since, epoch, limit):
        self.asked.append((address, since, epoch, limit))
        held = self.records[address]
        out = held[since:since + limit]
        return Exported(records=out, next=since + len(out), epoch="e-" + address, remaining=len(held) - since - len(out))

    async def stats(self, address):
        return pb.Stats()


def _pods():
    return [{"metadata": {"name": f"vllm-{n}", "labels": {"app": "vllm", builders.POLICY_LABEL: "fast"}},
             "spec": {"containers": [{"name": "vllm"}, {"name": builders.SIDECAR_CONTAINER}]},
             "status": {"phase": "Running", "podIP": f"10.0.0.{n}"}} for n in (1, 2)]  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _context(sidecars: FakeSidecars, kube: FakeKube, clock: Clock, fit=fleet_model.fit_and_score) -> Context:
    return Context(kube=kube, sidecar_image=IMAGE, stats=SidecarStats(fetch=sidecars.stats), stats_max_age=0,
                   fleet=FleetModels(export=sidecars.export, clock=clock, seed=1, fit=fit))  # fmt: skip


async def _reconcile(ctx: Context, status=None, children=None) -> dict:
    """One reconcile, then the round it started (if any) to its end; the status it returned.
    ``children``: what the watches show of the policy's children, by (kind, name)."""
    outcome = await reconcile(ctx, policy_body(spec=FLEET, status=status), Seen(pods=_pods(), children=children or {}), LOG)
    state = ctx.fleet.state("llm", "fast")
    if state is not None and state.task is not None:
        await state.task
    return outcome.status


def _model_ready(status: dict) -> dict:
    return next(c for c in status["conditions"] if c["type"] == "ModelReady")


def _published(kube: FakeKube) -> tuple[dict, LengthModel]:
    cm = kube.children[("ConfigMap", "fast-binbatch-model")]
    data = base64.b64decode(cm["binaryData"][builders.FLEET_MODEL_KEY])
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        return cm, LengthModel.from_arrays({k: arrays[k] for k in arrays.files})


async def test_the_fleet_model_is_fitted_on_every_sidecars_records_published_owned_and_in_status():
    sidecars, kube, clock = FakeSidecars(300), FakeKube(), Clock()
    ctx = _context(sidecars, kube, clock)
    first = await _reconcile(ctx)  # starts the round: nothing published yet
    assert _model_ready(first)["reason"] == "FleetModelPending" and first["model"] is None
    status = await _reconcile(ctx, first)
    cm, model = _published(kube)
    assert cm["metadata"]["labels"][builders.POLICY_LABEL] == "fast"
    assert cm["metadata"]["ownerReferences"][0]["kind"] == "BatchingPolicy"
    assert cm["metadata"]["annotations"][fleet_model.VERSION_ANNOTATION] == "1"
    state = ctx.fleet.state("llm", "fast")
    assert len(state.train.items) + len(state.held.items) == 600  # both pods' records, each once
    assert status["model"]["version"] == 1 and status["model"]["records"] == len(state.train.items)
    assert float(status["model"]["kendallTau"]) > 0.5  # long asks rank above short ones on held-out records
    ready = _model_ready(status)
    assert (ready["status"], ready["reason"]) == ("True", "FleetModelPublished")
    long, short = (model.dist(length_model.featurize(t)).median for t in ("write a long essay about x", "answer yes or no about x"))  # fmt: skip
    assert long > 10 * short


async def test_each_round_asks_only_for_the_records_after_the_cursor_and_only_when_due():
    sidecars, kube, clock = FakeSidecars(300), FakeKube(), Clock()
    ctx = _context(sidecars, kube, clock)
    status = await _reconcile(ctx)
    assert sorted(a[:3] for a in sidecars.asked) == [("10.0.0.1:50061", 0, ""), ("10.0.0.2:50061", 0, "")]
    assert all(a[3] == 500 for a in sidecars.asked)  # maxRecords 1000 over 2 pods
    sidecars.asked.clear()
    clock.now = 599.0
    status = await _reconcile(ctx, status)
    assert sidecars.asked == []  # not due: the interval has not passed
    sidecars.records["10.0.0.1:50061"] += [_record(5000 + i) for i in range(5)]
    clock.now = 600.0
    status = await _reconcile(ctx, status)
    assert sorted(a[:3] for a in sidecars.asked) == [("10.0.0.1:50061", 300, "e-10.0.0.1:50061"),
                                                      ("10.0.0.2:50061", 300, "e-10.0.0.2:50061")]  # fmt: skip
    state = ctx.fleet.state("llm", "fast")
    assert state.train.seen + state.held.seen == 605
    status = await _reconcile(ctx, status)
    assert status["model"]["version"] == 2 and _published(kube)[0]["metadata"]["annotations"][fleet_model.VERSION_ANNOTATION] == "2"


async def test_a_refit_patches_the_model_configmap_the_watch_shows_and_never_someone_elses():
    """The next round hands ``ensure`` the model's ConfigMap as the operator's watch keeps it (owned by the
    policy, no binaryData), so the API seam's ownership check lets it update it; a ConfigMap of that name
    that someone else made is never written, and ModelReady names it."""
    sidecars, kube, clock = FakeSidecars(300), FakeKube(), Clock()
    ctx = _context(sidecars, kube, clock)
    status = await _reconcile(ctx, await _reconcile(ctx))
    key = ("ConfigMap", "fast-binbatch-model")
    watched = {key: child_entry(kube.children[key], "ConfigMap")}
    assert "binaryData" not in watched[key] and watched[key]["metadata"]["ownerReferences"]
    clock.now = 600.0
    status = await _reconcile(ctx, await _reconcile(ctx, status, watched), watched)
    assert status["model"]["version"] == 2 and _model_ready(status)["reason"] == "FleetModelPublished"
    assert kube.children[key]["metadata"]["annotations"][fleet_model.VERSION_ANNOTATION] == "2"

    theirs = {"metadata": {"name": "fast-binbatch-model", "namespace": "llm", "labels": {"team": "x"}}, "data": {}}
    kube.children[key] = theirs
    clock.now = 1200.0
    status = await _reconcile(ctx, await _reconcile(ctx, status, {key: theirs}), {key: theirs})
    assert kube.children[key] is theirs and status["model"]["version"] == 2
    ready = _model_ready(status)
    assert (ready["status"], ready["reason"]) == ("True", "FleetRefitFailed")
    assert "ConfigMap llm/fast-binbatch-model already exists and is not made by this policy" in ready["message"]


async def test_a_failed_fit_keeps_the_last_model_and_says_why():
    sidecars, kube, clock = FakeSidecars(300), FakeKube(), Clock()
    fits = []

    def fit(train_set, held):
        fits.append(len(train_set))
        if len(fits) > 1:
            raise ValueError("records: the solver did not converge")
        return fleet_model.fit_and_score(train_set, held)

    ctx = _context(sidecars, kube, clock, fit=fit)
    status = await _reconcile(ctx, await _reconcile(ctx))
    before = _published(kube)[0]["binaryData"]
    clock.now = 600.0
    status = await _reconcile(ctx, await _reconcile(ctx, status))
    assert len(fits) == 2 and _published(kube)[0]["binaryData"] == before
    assert status["model"]["version"] == 1
    ready = _model_ready(status)
    assert (ready["status"], ready["reason"]) == ("True", "FleetRefitFailed")
    assert "version 1" in ready["message"] and "did not converge" in ready["message"]


async def test_a_refused_publish_keeps_no_model_and_names_the_configmap():
    sidecars, clock = FakeSidecars(300), Clock()
    kube = FakeKube(errors={("ensure", "ConfigMap"): (403, 'configmaps "fast-binbatch-model" is forbidden')})
    ctx = _context(sidecars, kube, clock)
    await _reconcile(ctx)
    state = ctx.fleet.state("llm", "fast")
    assert state.published is None and "ConfigMap fast-binbatch-model" in state.failure and "403" in state.failure


async def test_too_few_records_is_pending_and_asked_again_sooner():
    sidecars, kube, clock = FakeSidecars(50), FakeKube(), Clock()
    ctx = _context(sidecars, kube, clock)
    status = await _reconcile(ctx, await _reconcile(ctx))
    ready = _model_ready(status)
    assert (ready["status"], ready["reason"]) == ("False", "FleetModelPending")
    assert f"needed for a fit" in ready["message"] and ("ConfigMap", "fast-binbatch-model") not in kube.children
    sidecars.asked.clear()
    clock.now = fleet_model.PENDING_RETRY_SECONDS
    await _reconcile(ctx, status)
    assert len(sidecars.asked) == 2


async def test_turning_fleet_off_drops_the_state_and_the_status_model():
    sidecars, kube, clock = FakeSidecars(300), FakeKube(), Clock()
    ctx = _context(sidecars, kube, clock)
    status = await _reconcile(ctx, await _reconcile(ctx))
    off = {**FLEET, "predictor": {"kind": "Learned"}}
    outcome = await reconcile(ctx, policy_body(spec=off, status=status), Seen(pods=_pods()), LOG)
    assert outcome.status["model"] is None and ctx.fleet.state("llm", "fast") is None
    assert all(c["type"] != "ModelReady" for c in outcome.status["conditions"])


def test_pods_mount_the_fleet_configmap_and_its_file_is_the_optional_warm_start():
    pod = {"metadata": {"name": "p", "labels": {"app": "vllm"}}, "spec": {"containers": [{"name": "vllm"}]}}
    patch = builders.build_pod_patch(pod, "fast", 1, FLEET, IMAGE)
    volume = next(v for v in patch["spec"]["volumes"] if v["name"] == builders.MODEL_VOLUME)
    assert volume["configMap"] == {"name": "fast-binbatch-model", "optional": True,
                                   "items": [{"key": builders.FLEET_MODEL_KEY, "path": "model.npz"}]}  # fmt: skip
    sidecar = next(c for c in patch["spec"]["containers"] if c["name"] == builders.SIDECAR_CONTAINER)
    assert {"name": builders.MODEL_VOLUME, "mountPath": builders.MODEL_DIR, "readOnly": True} in sidecar["volumeMounts"]
    predictor = builders.sidecar_config(FLEET)["predictor"]
    assert predictor["warmStart"] == builders.MODEL_PATH and predictor["warmStartOptional"] is True
    assert "fleet" not in predictor
    off = {**FLEET, "predictor": {"kind": "Learned", "fleet": {"enabled": False}}}
    assert all(v["name"] != builders.MODEL_VOLUME for v in builders.build_pod_patch(pod, "fast", 1, off, IMAGE)["spec"]["volumes"])
    assert "warmStart" not in builders.sidecar_config(off)["predictor"]
    assert builders.sidecar_hash(FLEET, IMAGE) != builders.sidecar_hash(off, IMAGE)  # running pods are outdated


@pytest.mark.parametrize(("predictor", "field", "message"), [
    ({"kind": "Online", "fleet": {"enabled": True}}, "spec.predictor.fleet.enabled", "only used with kind Learned"),
    ({"warmStart": "/m.npz", "fleet": {"enabled": True}}, "spec.predictor.fleet", "fleet and warmStart exclude"),
    ({"fleet": {"enabled": True}, "model": {"configMapKeyRef": {"name": "m", "key": "m"}}}, "spec.predictor.fleet",
     "fleet and model exclude"),
    ({"fleet": {"enabled": True, "maxRecords": 10}}, "spec.predictor.fleet.maxRecords", "greater than or equal"),
    ({"fleet": {"enabled": True, "refitIntervalSeconds": 10**6}}, "spec.predictor.fleet.refitIntervalSeconds", "less"),
    ({"fleet": {"enabled": True, "every": 3}}, "spec.predictor.fleet.every", "Extra inputs"),
])  # fmt: skip
def test_a_bad_fleet_spec_is_refused_naming_the_field(predictor, field, message):
    with pytest.raises(ConfigError) as err:
        builders.sidecar_config({**SPEC, "predictor": predictor})
    assert any(path == field and message in text for path, text in err.value.problems), err.value.problems


def test_the_reservoir_keeps_a_bounded_uniform_sample():
    r: Reservoir[int] = Reservoir(100, random.Random(3))
    for i in range(10_000):
        r.add(i)
    assert len(r.items) == 100 and r.seen == 10_000 and len(set(r.items)) == 100
    assert 2_000 < sum(r.items) / 100 < 8_000  # from all of the stream, not its start
    r.resize(10)
    assert len(r.items) == 10


async def test_stopping_the_operator_cancels_a_round_still_running():
    sidecars, kube, clock = FakeSidecars(300), FakeKube(), Clock()
    blocked = asyncio.Event()

    async def export(address, **_):
        await blocked.wait()  # never set: the round is still gathering when the operator stops

    ctx = _context(sidecars, kube, clock)
    ctx.fleet._export = export
    await reconcile(ctx, policy_body(spec=FLEET), Seen(pods=_pods()), LOG)
    task = ctx.fleet.state("llm", "fast").task
    assert task is not None and not task.done()
    ctx.fleet.close()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ctx.fleet.state("llm", "fast") is None
