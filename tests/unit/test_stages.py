"""Every implementation of a pipeline stage conforms to its contract in
``core/stages.py``: it has each member, and each method takes the contract's
parameters (same names and kinds; anything extra has a default)."""

from __future__ import annotations

import inspect
import pytest

from binbatch_sidecar.config import SidecarConfig
from binbatch_sidecar.core import stages
from binbatch_sidecar.core.binner import AdaptiveBinner, AutoBinner, FixedBinner
from binbatch_sidecar.core.clock import ManualClock
from binbatch_sidecar.core.former import BatchFormer
from binbatch_sidecar.core.predictor import ExternalFirst, HintPredictor, OnlinePredictor
from binbatch_sidecar.core.sizer import BatchSizer
from binbatch_sidecar.engine.dispatcher import Dispatcher
from binbatch_sidecar.engine.metrics_feed import MetricsFeed
from binbatch_sidecar.engine.sidecar_metrics import SidecarMetrics
from binbatch_sidecar.server.assembly import build_core


def members(contract: type) -> set[str]:
    """The names a Protocol declares (``typing.get_protocol_members`` is Python 3.13)."""
    return {n for n in vars(contract) if not n.startswith("_")} | set(vars(contract).get("__annotations__", {}))


def problems(impl: type, contract: type) -> list[str]:
    """Where ``impl`` does not fit ``contract`` (empty: it conforms)."""
    found = []
    for name in sorted(members(contract)):
        want = vars(contract).get(name)  # None: a data member, declared by annotation only
        annotated = any(name in vars(k).get("__annotations__", {}) for k in impl.__mro__)
        if not hasattr(impl, name) and not annotated:
            found.append(f"{name}: missing")
            continue
        if not inspect.isfunction(want):
            continue
        have = inspect.getattr_static(impl, name)
        if not inspect.isfunction(have):
            found.append(f"{name}: not a method")
            continue
        if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(have):
            found.append(f"{name}: async differs")
        wanted = list(inspect.signature(want).parameters.values())[1:]
        params = list(inspect.signature(have).parameters.values())[1:]
        by_name = {p.name: p for p in params}
        for p in wanted:
            q = by_name.get(p.name)
            if q is None or q.kind != p.kind or (p.default is not p.empty and q.default is q.empty):
                found.append(f"{name}({p.name}): {q or 'missing'}")
        for q in params:
            if q.name not in {p.name for p in wanted} and q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
                found.append(f"{name}({q.name}): required, not in the contract")
    return found


IMPLEMENTATIONS = [
    (stages.LengthPredictor, HintPredictor),
    (stages.LengthPredictor, OnlinePredictor),
    (stages.LengthPredictor, ExternalFirst),
    (stages.Binner, FixedBinner),
    (stages.Binner, AutoBinner),
    (stages.Binner, AdaptiveBinner),
    (stages.Former, BatchFormer),
    (stages.Sizer, BatchSizer),
    (stages.SnapshotSource, MetricsFeed),
    (stages.RequestDispatcher, Dispatcher),
]


@pytest.mark.parametrize(("contract", "impl"), IMPLEMENTATIONS, ids=lambda x: x.__name__)
def test_each_implementation_has_its_stages_signature(contract, impl):
    assert problems(impl, contract) == []


def test_a_misfit_is_reported():
    class Guessing:
        name = "guess"

        def predict(self, request):  # the contract's parameter is ``req``
            return 1.0

    assert problems(Guessing, stages.LengthPredictor) == [
        "observe: missing", "predict(req): missing", "predict(request): required, not in the contract",
    ]


async def test_the_running_parts_are_instances_of_their_contracts():
    clock = ManualClock()
    core = build_core(SidecarConfig(), clock)
    dispatcher = Dispatcher(core, None, clock, SidecarMetrics())  # type: ignore[arg-type]
    feed = MetricsFeed(None, interval=1.0, stale_after=5.0, clock=clock, on_snapshot=dispatcher.on_snapshot)
    parts = {
        stages.LengthPredictor: core.predictor, stages.Binner: core.binner, stages.Former: core.former,
        stages.Sizer: core.sizer, stages.SnapshotSource: feed, stages.RequestDispatcher: dispatcher,
    }  # fmt: skip
    assert [c.__name__ for c, part in parts.items() if not isinstance(part, c)] == []


def test_the_contracts_are_declared_in_request_order():
    order = [
        name for name, obj in vars(stages).items() if inspect.isclass(obj) and getattr(obj, "_is_protocol", False) and obj.__module__ == stages.__name__
    ]
    assert order == ["LengthPredictor", "Binner", "Former", "Sizer", "SnapshotSource", "RequestDispatcher"]
