"""binbatch.proto's comments are the API's documentation (users read them through
reflection): every closed set of string values they list is the set the code
produces, and what they say about the config hash is what the code computes.

The comments are read from the generated descriptor set, i.e. exactly what
reflection serves.  A string field with a closed set of values carries a line
``values: "a" | "b"`` (continued on lines starting with ``|``), as the proto's
header explains.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from typing import get_args

import pytest
from google.protobuf import descriptor_pb2

from binbatch_api.v1 import source_file_descriptors
from binbatch_operator.builders import CONFIG_KEY, build_configmap
from binbatch_sidecar.core.autok import K_REASONS
from binbatch_sidecar.config import MetricsSource, PredictorKind, config_json, load_config, parse_config
from binbatch_sidecar.core.predictor import SOURCES
from binbatch_sidecar.core.sizer import INITIAL_REASON, REASONS, BatchSizer, EngineSnapshot
from binbatch_sidecar.engine.dispatcher import ADJUSTMENT_FIELDS, REBALANCE_REASON, Rejected
from binbatch_sidecar.engine.breaker import State as BreakerState
from binbatch_sidecar.engine.engine_client import EngineError
from binbatch_sidecar.engine.metrics_feed import NO_SOURCE_KIND, PromQLSource, ScrapeSource
from binbatch_sidecar.server.assembly import build_predictor
from binbatch_sidecar.server.servicer import _ENGINE_CODES, _REJECTED_CODES, InvalidRequest, _status_of

PROTO_NAME = "binbatch_api/v1/binbatch.proto"
PACKAGE = "binbatch.v1"
MESSAGE_TYPE = descriptor_pb2.FileDescriptorProto.MESSAGE_TYPE_FIELD_NUMBER
NESTED_TYPE = descriptor_pb2.DescriptorProto.NESTED_TYPE_FIELD_NUMBER
FIELD = descriptor_pb2.DescriptorProto.FIELD_FIELD_NUMBER


def _file_proto() -> descriptor_pb2.FileDescriptorProto:
    return descriptor_pb2.FileDescriptorProto.FromString(source_file_descriptors()[PROTO_NAME])


def _field_comments(file_proto: descriptor_pb2.FileDescriptorProto) -> dict[str, str]:
    """Leading comment of every field, by full name ("binbatch.v1.Stats.sizer_reason")."""
    comments = {tuple(loc.path): loc.leading_comments for loc in file_proto.source_code_info.location}
    out: dict[str, str] = {}

    def walk(path: tuple[int, ...], prefix: str, message: descriptor_pb2.DescriptorProto) -> None:
        name = f"{prefix}.{message.name}"
        for i, f in enumerate(message.field):
            out[f"{name}.{f.name}"] = comments.get((*path, FIELD, i), "")
        for i, nested in enumerate(message.nested_type):
            walk((*path, NESTED_TYPE, i), name, nested)

    for i, message in enumerate(file_proto.message_type):
        walk((MESSAGE_TYPE, i), file_proto.package, message)
    return out


def parse_values(comment: str) -> list[str] | None:
    """The ``values:`` list of a comment, in order; None if it has none."""
    lines = [line.strip() for line in comment.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("values:")]
    if not starts:
        return None
    assert len(starts) == 1, f"more than one values: line in {comment!r}"
    text = lines[starts[0]].removeprefix("values:")
    for line in itertools.takewhile(lambda s: s.startswith("|"), lines[starts[0] + 1 :]):
        text += " " + line
    items = [item.strip() for item in text.split("|")]
    for item in items:
        assert len(item) >= 3 and item[0] == item[-1] == '"', f"values: items are quoted strings, got {item!r}"
    return [item[1:-1] for item in items]


def documented_values() -> dict[str, list[str]]:
    return {
        name: values
        for name, comment in _field_comments(_file_proto()).items()
        if (values := parse_values(comment)) is not None
    }


def _predictor_names() -> set[str]:
    """What PredictorStats.name reports for each predictor.kind a policy can choose."""
    return {build_predictor(parse_config({"predictor": {"kind": kind}})).name for kind in get_args(PredictorKind)}


def _metrics_source_kinds() -> set[str]:
    kinds = {ScrapeSource.kind, PromQLSource.kind, NO_SOURCE_KIND}
    assert len(kinds) == len(get_args(MetricsSource)), "one kind per metrics.source choice"
    return kinds


# Each documented set and the code it must equal.
CODE_VALUES = {
    f"{PACKAGE}.Stats.sizer_reason": lambda: [INITIAL_REASON, *REASONS],
    f"{PACKAGE}.Adjustment.field": lambda: list(ADJUSTMENT_FIELDS),
    f"{PACKAGE}.Adjustment.reason": lambda: [REBALANCE_REASON, *REASONS, *K_REASONS],
    f"{PACKAGE}.PredictorSourceStats.source": lambda: list(SOURCES),
    f"{PACKAGE}.PredictorStats.name": _predictor_names,
    f"{PACKAGE}.MetricsSourceStatus.kind": _metrics_source_kinds,
    f"{PACKAGE}.EngineBreakerStatus.state": lambda: list(get_args(BreakerState)),
}


def test_every_documented_value_set_is_checked_against_the_code() -> None:
    assert sorted(documented_values()) == sorted(CODE_VALUES)


@pytest.mark.parametrize("field", sorted(CODE_VALUES))
def test_documented_values_are_the_codes(field: str) -> None:
    documented = documented_values().get(field)
    assert documented is not None, f"binbatch.proto: {field} has no values: line"
    code = CODE_VALUES[field]()
    assert len(documented) == len(set(documented)), f"{field}: a value listed twice"
    assert set(documented) == set(code), (
        f"{field}: binbatch.proto lists {sorted(documented)}, the code produces {sorted(code)}"
    )


def test_sizer_reasons_are_listed_in_the_order_they_are_joined() -> None:
    # "memory+sla": joined in REASONS order, which the proto calls "the order above".
    assert documented_values()[f"{PACKAGE}.Stats.sizer_reason"] == [INITIAL_REASON, *REASONS]


def _emitted_sizer_reasons() -> set[str]:
    """Every reason a BatchSizer gives over a grid of modes, metrics and histories."""
    fresh = dict(kv_capacity_tokens=200_000.0, kv_usage_ratio=0.3, running=4, fresh=True)
    snapshots = [
        None,
        EngineSnapshot(fresh=False),
        EngineSnapshot(**fresh, tpot_seconds=0.010),  # fast: b_sla grows
        EngineSnapshot(**fresh, tpot_seconds=0.500),  # slow: b_sla shrinks below b_mem
        EngineSnapshot(**{**fresh, "kv_capacity_tokens": None}, tpot_seconds=0.010),
        EngineSnapshot(**{**fresh, "kv_usage_ratio": 0.99}, tpot_seconds=0.010),
    ]
    reasons: set[str] = set()
    grid = itertools.product(("static", "memory", "sla", "combined"), (0, 64), snapshots, (False, True))
    for mode, samples, snapshot, kv_plan in grid:
        sizer = BatchSizer(mode=mode, static_size=8, max_size=64, d_sla=0.05, min_samples=32, kv_plan=kv_plan)
        for i in range(samples):  # bin 0 short, bin 1 long: per-bin b_mem differ
            sizer.observe(i % 2, 100, 50 if i % 2 == 0 else 20_000)
        for _ in range(12):  # enough slow scrapes for b_sla to reach 1 and give the SLO up ("sla-infeasible")
            reasons.add(sizer.update(snapshot, 2).reason)
        reasons.add(sizer.update(EngineSnapshot(fresh=False), 2).reason)  # stale after that history
    return reasons


def test_the_sizer_emits_exactly_the_documented_reasons() -> None:
    documented = documented_values()[f"{PACKAGE}.Stats.sizer_reason"]
    emitted = _emitted_sizer_reasons()
    parts = {part for reason in emitted for part in reason.split("+")}
    assert parts <= set(documented), f"undocumented sizer reasons: {sorted(parts - set(documented))}"
    assert parts == set(REASONS), f"never emitted: {sorted(set(REASONS) - parts)}"
    for reason in emitted:
        names = reason.split("+")
        assert names == sorted(names, key=documented.index), f"{reason!r} is not joined in the documented order"


def test_config_hash_is_documented_as_what_the_code_hashes(tmp_path) -> None:
    """GetConfig's sha256 hashes the file's bytes: for an injected sidecar, the
    policy ConfigMap's value, which a user can hash to check the rollout."""
    cm = build_configmap("p", "ns", {"batch": {"staticSize": 16}})
    text = cm["data"][CONFIG_KEY]
    path = tmp_path / CONFIG_KEY
    path.write_text(text)  # as the kubelet projects the ConfigMap key
    loaded = load_config(path)
    assert loaded.sha256 == hashlib.sha256(text.encode()).hexdigest()
    assert loaded.sha256 != hashlib.sha256(config_json(loaded.config).encode()).hexdigest()
    comment = " ".join(_field_comments(_file_proto())[f"{PACKAGE}.ConfigView.sha256"].split())
    assert "bytes of the config file" in comment and f"`{CONFIG_KEY}`" in comment
    assert "of `config_json`" not in comment


def test_the_documented_status_codes_are_those_the_servicer_answers() -> None:
    file_proto = _file_proto()
    index = [s.name for s in file_proto.service].index("Inference")
    path = (descriptor_pb2.FileDescriptorProto.SERVICE_FIELD_NUMBER, index)
    comment = next(loc.leading_comments for loc in file_proto.source_code_info.location if tuple(loc.path) == path)
    documented = re.findall(r"^\s*\* ([A-Z_]+):", comment, flags=re.MULTILINE)
    errors = [
        InvalidRequest("prompt: must not be empty"),
        RuntimeError("a bug"),
        *(Rejected(kind, "why") for kind in _REJECTED_CODES),
        *(EngineError(kind, None, "why") for kind in _ENGINE_CODES),
    ]
    answered = {_status_of(exc)[0].name for exc in errors}
    assert sorted(documented) == sorted(answered)
