"""``binbatch predictor train`` and ``records``: records in, a model file out; every bad line named."""

from __future__ import annotations

import json
import re

import pytest

from binbatch_sidecar import cli
from binbatch_sidecar.engine.model_file import load_model
from binbatch_sidecar.engine.training_records import RecordsError, parse_record, read_records

GOOD = [{"prompt": f"write a long essay about topic {i}", "output_tokens": 400 + i} for i in range(10)] + [
    {"messages": [{"role": "user", "content": f"yes or no: is {i} prime?"}], "output_tokens": 3, "request_class": "chat",
     "max_tokens": 64} for i in range(10)]  # fmt: skip


def _write(path, lines) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_train_writes_a_model_the_sidecar_can_load(tmp_path, capsys):
    records, out = _write(tmp_path / "r.jsonl", GOOD), tmp_path / "m.npz"
    assert cli.main(["predictor", "train", "--records", records, "--out", str(out)]) == 0
    assert load_model(out).records == 20
    assert "fitted on 20 records" in capsys.readouterr().out


def test_every_bad_record_is_named_by_line_and_field(tmp_path, capsys):
    lines = [GOOD[0], "{not json", {"prompt": 7, "output_tokens": 1}, {"prompt": "x"}, {"prompt": "x", "output_tokens": -2},
             {"prompt": "x", "messages": [], "output_tokens": 1}, {"messages": [{"role": "user"}], "output_tokens": 1},
             {"prompt": "x", "output_tokens": 1, "max_tokens": True}, {"prompt": "x", "output_tokens": 1, "request_class": 3},
             [1, 2]]  # fmt: skip
    records = _write(tmp_path / "r.jsonl", lines)
    assert cli.main(["predictor", "train", "--records", records, "--out", str(tmp_path / "m.npz")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "binbatch predictor train: bad records:"
    named = [re.match(rf"{re.escape(records)}:(\d+): ([^:]+): ", line).groups() for line in err[1:]]
    assert named == [("2", "<line>"), ("3", "prompt"), ("4", "output_tokens"), ("5", "output_tokens"), ("6", "prompt"),
                     ("7", "messages[0]"), ("8", "max_tokens"), ("9", "request_class"), ("10", "<line>")]  # fmt: skip
    assert not (tmp_path / "m.npz").exists()


def test_too_few_records_and_an_unwritable_out_are_one_line_each(tmp_path, capsys):
    few = _write(tmp_path / "few.jsonl", GOOD[:3])
    assert cli.main(["predictor", "train", "--records", few, "--out", str(tmp_path / "m.npz")]) == 2
    assert "--records: records: at least 10 are needed" in capsys.readouterr().err
    records = _write(tmp_path / "r.jsonl", GOOD)
    assert cli.main(["predictor", "train", "--records", records, "--out", str(tmp_path / "no" / "m.npz")]) == 2
    assert "--out: cannot write" in capsys.readouterr().err
    assert cli.main(["predictor", "train", "--records", str(tmp_path / "none.jsonl"), "--out", "m.npz"]) == 2
    assert "--records: cannot read" in capsys.readouterr().err


def test_a_chat_record_reads_as_the_sidecar_reads_a_chat():
    r = parse_record({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                      "output_tokens": 2})  # fmt: skip
    assert r.prompt == "be brief\nhi"


def test_an_empty_file_has_no_records(tmp_path):
    with pytest.raises(RecordsError, match="no records"):
        read_records(_write(tmp_path / "e.jsonl", []))


def test_records_writes_the_training_split(tmp_path, capsys):
    out = tmp_path / "train.jsonl"
    assert cli.main(["predictor", "records", "--split", "train", "--out", str(out)]) == 0
    records = read_records(out)
    assert len(records) == 8427 + 14888 and all(r.output_tokens >= 1 for r in records)  # first turns, later turns
    assert "23315 records of the ShareGPT train split" in capsys.readouterr().out
