"""What a sidecar hands out of its training records (``LearnedPredictor.export``, the Admin reply
``ExportTrainingRecords``) and what ``predictor train`` reads of them: numbered records after a
cursor, bounded by count and bytes, kept across a model swap, hashed features only."""

from __future__ import annotations

import json

import numpy as np
import pytest

from binbatch_api.v1 import binbatch_pb2 as pb
from binbatch_sidecar.config import LoadedConfig, parse_config
from binbatch_sidecar.core import length_model
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.predictor import LearnedPredictor
from binbatch_sidecar.core.request import Request
from binbatch_sidecar.engine import training_records
from binbatch_sidecar.engine.dispatcher import Dispatcher
from binbatch_sidecar.engine.metrics_feed import MetricsFeed
from binbatch_sidecar.engine.sidecar_metrics import SidecarMetrics
from binbatch_sidecar.server import replies as replies_module
from binbatch_sidecar.server.assembly import build_core, learned_of
from binbatch_sidecar.server.replies import Replies
from binbatch_sidecar.server.servicer import AdminServicer


def _req(i: int, text: str = "secret words of prompt {}") -> Request:
    return Request(id=str(i), prompt_tokens=10, max_tokens=100, arrival=0.0, prompt_text=text.format(i))


def _learned(n: int, buffer: int = 64) -> LearnedPredictor:
    p = LearnedPredictor(buffer=buffer, first_fit=16, epoch="e1")
    for i in range(n):
        p.observe(_req(i), float(i))
    return p


def test_export_gives_the_records_after_the_cursor_oldest_first_within_the_limit():
    p = _learned(10)
    records, left = p.export(0, 4)
    assert [r.sequence for r in records] == [1, 2, 3, 4] and left == 6
    records, left = p.export(4, 100)
    assert [r.sequence for r in records] == list(range(5, 11)) and left == 0
    assert p.export(10, 5) == ([], 0)
    assert [r.output_tokens for r in p.export(7, 1)[0]] == [7.0]
    with pytest.raises(ValueError, match="limit"):
        p.export(0, -1)


def test_a_cursor_behind_the_bounded_buffer_gets_what_is_still_held():
    p = _learned(40, buffer=16)
    assert p.oldest_sequence == 25
    records, left = p.export(3, 100)
    assert [r.sequence for r in records] == list(range(25, 41)) and left == 0


def test_a_swapped_in_model_keeps_the_records_their_numbers_and_the_epoch():
    old = _learned(20)
    new = LearnedPredictor(buffer=64, first_fit=16, epoch="e2")
    new.carry_records(old)
    new.observe(_req(99), 5.0)
    assert new.epoch == "e1" and [r.sequence for r in new.export(18, 10)[0]] == [19, 20, 21]
    assert not new.refit_due()  # the carried records were fitted on already: only new ones count


def _replies(config: dict) -> Replies:
    clock = ManualClock(0.0)
    loaded = LoadedConfig(parse_config(config), sha256="ab", source="f.yaml", generation=1)
    dispatcher = Dispatcher(build_core(loaded.config, clock), None, clock, SidecarMetrics())  # type: ignore[arg-type]
    feed = MetricsFeed(None, interval=1.0, stale_after=5.0, clock=clock, on_snapshot=dispatcher.on_snapshot)
    return Replies(dispatcher, feed, clock, loaded=lambda: loaded, engine_serving=lambda: True, started_at=0.0)


async def test_the_reply_holds_hashed_features_only_and_stops_at_its_byte_bound(monkeypatch):
    made = _replies({"predictor": {"kind": "Learned"}})
    learned = learned_of(made.dispatcher.core.predictor)
    assert learned is not None and learned.epoch
    for i in range(30):
        learned.observe(_req(i), 3.0)
    reply = await AdminServicer(made).ExportTrainingRecords(pb.ExportTrainingRecordsRequest(max_records=10), None)
    assert len(reply.records) == 10 and reply.next == 10 and reply.remaining == 20 and reply.epoch == learned.epoch
    assert b"secret" not in reply.SerializeToString()
    want = length_model.featurize("secret words of prompt 0", "", 100)
    assert list(reply.records[0].indices) == want.indices.tolist()
    assert np.allclose(reply.records[0].values, want.values)
    one = reply.records[0].ByteSize()
    monkeypatch.setattr(replies_module, "EXPORT_MAX_BYTES", int(one * 3.5))
    bounded = made.training_records(0, "", 0)
    assert bounded is not None and len(bounded.records) == 3 and bounded.next == 3 and bounded.remaining == 27
    monkeypatch.setattr(replies_module, "EXPORT_MAX_BYTES", 1)  # a record larger than the bound still goes alone
    alone = made.training_records(bounded.next, learned.epoch, 0)
    assert alone is not None and [r.sequence for r in alone.records] == [4]
    stranger = made.training_records(25, "another-process", 0)  # a cursor of another epoch counts from the start
    assert stranger is not None and [r.sequence for r in stranger.records] == [1]


def test_a_reply_for_a_predictor_that_is_not_learned_is_none():
    assert _replies({"predictor": {"kind": "Online"}}).training_records(0, "", 0) is None


def test_hashed_records_round_trip_through_a_records_file_and_fit(tmp_path):
    feats = [length_model.featurize(f"write {'a long essay' if i % 2 else 'one word'} on {i}") for i in range(30)]
    records = [training_records.hashed_record(f.indices.tolist(), f.values.tolist(), 300 if i % 2 else 2)
               for i, f in enumerate(feats)]  # fmt: skip
    path = tmp_path / "r.jsonl"
    assert training_records.write_records(path, records) == 30
    assert "prompt" not in path.read_text()
    back = training_records.read_records(path)
    assert all(np.array_equal(a.hashed.values, b.hashed.values) for a, b in zip(back, records))  # type: ignore[union-attr]
    model = training_records.train(back)
    assert model.dist(feats[1]).median > model.dist(feats[0]).median


@pytest.mark.parametrize(("line", "field"), [
    ({"features": {"indices": [1, 2], "values": [0.5]}, "output_tokens": 3}, "features.values"),
    ({"features": {"indices": [-1], "values": [0.5]}, "output_tokens": 3}, "features.indices"),
    ({"features": {"indices": [length_model.N_FEATURES], "values": [0.5]}, "output_tokens": 3}, "features.indices"),
    ({"features": {"indices": [], "values": []}, "output_tokens": 3}, "features.indices"),
    ({"features": {"indices": [1], "values": ["x"]}, "output_tokens": 3}, "features.values"),
    ({"features": [1, 2], "output_tokens": 3}, "features"),
    ({"features": {"indices": [1], "values": [0.5]}}, "output_tokens"),
    ({"features": {"indices": [1], "values": [0.5]}, "output_tokens": 3, "max_tokens": 9}, "max_tokens"),
    ({"features": {"indices": [1], "values": [0.5]}, "prompt": "hi", "output_tokens": 3}, "prompt"),
])  # fmt: skip
def test_every_bad_hashed_record_names_its_field(tmp_path, line, field):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(training_records.RecordsError) as err:
        training_records.read_records(path)
    assert err.value.problems[0].startswith(f"{path}:1: {field}:")


def test_the_fleet_model_bench_refuses_a_training_count_its_refits_would_not_end_on():
    from binbatch_sidecar.bench.fleet_model import FleetModelBenchConfig, quick

    assert quick().train_requests == 256
    for bad, field in ((100, "train_requests"), (32, "train_requests")):
        with pytest.raises(ValueError, match=field):
            FleetModelBenchConfig(train_requests=bad)
    with pytest.raises(ValueError, match="eval_requests"):
        FleetModelBenchConfig(eval_requests=4)

