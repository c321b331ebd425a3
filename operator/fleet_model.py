"""The fleet's learned length model: one per policy, fitted by the operator (``spec.predictor.fleet``).

Each sidecar's Learned predictor learns from the completions it sees, alone, and
what it learned dies with its pod.  With ``spec.predictor.fleet.enabled`` the
leader, every ``refitIntervalSeconds``:

1. gathers from each of the policy's running sidecars the training records it
   learned since the last round (``Admin/ExportTrainingRecords``: hashed features
   and output lengths, never prompt text; a cursor per pod, so only new ones; at
   most ``per_pod`` a pod a round);
2. keeps a uniform sample of everything gathered: a reservoir of ``maxRecords``,
   and one record in ``HELD_OUT_EVERY`` goes to a held-out reservoir a tenth as
   large instead, never fitted on;
3. fits with ``training_records.train`` (what ``binbatch predictor train`` runs),
   in a thread and one fit at a time across the operator (a fit's memory is a
   few times its records'), and scores it on the held-out records (Kendall's tau
   of the predicted medians against the actual lengths);
4. publishes the model file in the ConfigMap ``<policy>-binbatch-model``
   (``binaryData``, the policy's labels, owned by it), which new pods mount as
   their model (``builders.model_volume``) and running sidecars swap in whole
   when kubelet updates the file (their model-file reload).

A round that fails (too few records yet, a fit that raises, a publish the API
server refuses) keeps the last good model; ``condition`` says why in
``ModelReady``, and the status' ``model`` field says which model is published.
"""

from __future__ import annotations

import asyncio
import base64
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import kopf

from binbatch_sidecar.core import length_model
from binbatch_sidecar.engine.model_file import MAX_FILE_BYTES, model_bytes
from binbatch_sidecar.engine.record_export import Exported, export_records
from binbatch_sidecar.engine.training_records import Record, features, train

from .builders import FLEET_MODEL_KEY, _labels, fleet_model_name
from .crd import GROUP, FleetSpec
from .sidecar_stats import describe_error
from .status import Condition, now_iso

MIN_FIT_RECORDS = 256  # records a first fit needs: fewer would replace each sidecar's own model with a worse one
HELD_OUT_EVERY = 10  # one gathered record in this many is held out (scored on, never fitted on)
MIN_PER_POD, MAX_PER_POD = 200, 4000  # records asked of one pod in one round
PENDING_RETRY_SECONDS = 60.0  # before a first model, a round that gathered too few is tried again this soon
VERSION_ANNOTATION = f"{GROUP}/model-version"
TAU_MIN_PAIRS = 8

ExportFn = Callable[..., Awaitable[Exported]]
T = TypeVar("T")


class Reservoir(Generic[T]):
    """A uniform sample of at most ``size`` of all the items ever added (Algorithm R)."""

    def __init__(self, size: int, rng: random.Random) -> None:
        self.size, self.rng = size, rng
        self.items: list[T] = []
        self.seen = 0

    def add(self, item: T) -> None:
        self.seen += 1
        if len(self.items) < self.size:
            self.items.append(item)
        else:
            j = self.rng.randrange(self.seen)
            if j < self.size:
                self.items[j] = item

    def resize(self, size: int) -> None:
        if size < len(self.items):
            self.items = self.rng.sample(self.items, size)
        self.size = size


@dataclass(frozen=True)
class Published:
    """The model in the ConfigMap: what the status' ``model`` field shows."""

    version: int
    records: int
    kendall_tau: float | None
    held_out: int
    published_at: str

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version, "records": self.records, "publishedAt": self.published_at}
        if self.kendall_tau is not None:
            out["kendallTau"] = f"{self.kendall_tau:.3f}"
        return out


@dataclass
class PolicyFleet:
    """What the operator holds for one policy's fleet model."""

    train: Reservoir[Record]
    held: Reservoir[Record]
    cursors: dict[str, tuple[str, int]] = field(default_factory=dict)  # pod → (epoch, next)
    last_round: float | None = None
    rounds: int = 0
    published: Published | None = None
    failure: str = ""  # why the last round's fit or publish failed ("" it did not)
    note: str = ""  # what else the last round met: too few records yet, sidecars it could not ask
    task: asyncio.Task[None] | None = None


def kendall_tau(predicted: Sequence[float], actual: Sequence[float]) -> float | None:
    """Kendall's tau-b (None below ``TAU_MIN_PAIRS`` pairs or when a side is constant)."""
    if len(predicted) < TAU_MIN_PAIRS:
        return None
    from scipy.stats import kendalltau

    value = float(kendalltau(predicted, actual).statistic)
    return value if math.isfinite(value) else None


def fit_and_score(train_set: Sequence[Record], held: Sequence[Record]) -> tuple[bytes, int, float | None]:
    """The model file fitted on ``train_set`` (``train``, as the CLI), its records, and its tau on ``held``.
    Runs in a thread; ``ValueError`` when there is nothing to fit or the file would not fit a ConfigMap."""
    model = train(train_set)
    data = model_bytes(model)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"the model file is {len(data) // 1024} KiB, over the {MAX_FILE_BYTES // 1024} KiB a "
                         "ConfigMap holds")  # fmt: skip
    predicted = [model.dist(f).median for f in features(held)]
    return data, model.records, kendall_tau(predicted, [float(r.output_tokens) for r in held])


def build_model_configmap(name: str, namespace: str, data: bytes, version: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": fleet_model_name(name), "namespace": namespace, "labels": _labels(name),
                     "annotations": {VERSION_ANNOTATION: str(version)}},
        "binaryData": {FLEET_MODEL_KEY: base64.b64encode(data).decode()},
    }  # fmt: skip


class FleetModels:
    """Every policy's fleet model state; ``maybe_start`` runs a round in the background when one is due."""

    def __init__(
        self, export: ExportFn = export_records, clock: Callable[[], float] = time.monotonic, seed: int | None = None,
        fit: Callable[[Sequence[Record], Sequence[Record]], tuple[bytes, int, float | None]] = fit_and_score,
        signer: Callable[[str], str] | None = None,
    ) -> None:  # fmt: skip
        self._export, self._clock, self._fit = export, clock, fit
        self.signer = signer  # audience -> the operator's signed Admin token for it (admin_signing.AdminSigner.token)
        self._rng = random.Random(seed)
        self._policies: dict[tuple[str, str], PolicyFleet] = {}
        self._fits: asyncio.Semaphore | None = None  # one fit at a time (made on the running loop)

    def state(self, namespace: str, name: str) -> PolicyFleet | None:
        return self._policies.get((namespace, name))

    def forget(self, namespace: str, name: str) -> None:
        """The policy went or turned fleet off: drop what was gathered (a running round is cancelled)."""
        state = self._policies.pop((namespace, name), None)
        if state is not None and state.task is not None and not state.task.done():
            state.task.cancel()

    def _state(self, namespace: str, name: str, settings: FleetSpec) -> PolicyFleet:
        held_size = max(1, settings.max_records // HELD_OUT_EVERY)
        state = self._policies.get((namespace, name))
        if state is None:
            state = self._policies[(namespace, name)] = PolicyFleet(
                Reservoir(settings.max_records, self._rng), Reservoir(held_size, self._rng))
        elif state.train.size != settings.max_records:
            state.train.resize(settings.max_records)
            state.held.resize(held_size)
        return state

    def due(self, state: PolicyFleet, settings: FleetSpec) -> bool:
        if state.task is not None and not state.task.done():
            return False
        if state.last_round is None:
            return True
        wait = float(settings.refit_interval_seconds)
        if state.published is None:
            wait = min(wait, PENDING_RETRY_SECONDS)
        return self._clock() - state.last_round >= wait

    def close(self) -> None:
        """The operator stops: cancel the rounds still running (a fit in its thread finishes alone)."""
        for key in list(self._policies):
            self.forget(*key)

    def maybe_start(
        self, kube: Any, body: Mapping[str, Any], settings: FleetSpec, addresses: Mapping[str, str], logger: Any,
        current: Mapping[str, Any] | None = None,
    ) -> PolicyFleet:
        """The policy's state; a round is started in the background when one is due (the reconcile does not wait).
        ``current``: the model's ConfigMap as the operator's watch shows it (None: not seen)."""
        meta = body["metadata"]
        state = self._state(meta["namespace"], meta["name"], settings)
        if self.due(state, settings):
            state.last_round = self._clock()
            state.task = asyncio.ensure_future(self._guarded(state, kube, body, settings, addresses, logger,
                                                             current=current))  # fmt: skip
        return state

    async def _guarded(self, state: PolicyFleet, *args: Any, current: Mapping[str, Any] | None) -> None:
        """A round in the background: whatever it raises is its failure, never an unretrieved task error."""
        try:
            await self.round(*args, current=current)
        except Exception as exc:  # noqa: BLE001 - reported in ModelReady; the last good model stays
            state.failure = f"{type(exc).__name__}: {exc}"
            args[-1].exception("spec.predictor.fleet: the round failed; keeping the last good model")

    async def gather(self, state: PolicyFleet, settings: FleetSpec, addresses: Mapping[str, str],
                     audience: str = "") -> list[str]:  # fmt: skip
        """New records of every pod into the reservoirs; the pods that could not be asked, with why.  Each
        page carries a token signed for ``audience`` (the policy's ``<namespace>/<policy>``)."""
        signer = self.signer
        signed = {"token": lambda: signer(audience)} if signer is not None and audience else {}
        per_pod = min(MAX_PER_POD, max(MIN_PER_POD, math.ceil(settings.max_records / max(1, len(addresses)))))
        failed = []
        for pod, address in sorted(addresses.items()):
            epoch, since = state.cursors.get(pod, ("", 0))
            try:
                got = await self._export(address, since=since, epoch=epoch, limit=per_pod, **signed)
            except Exception as exc:  # noqa: BLE001 - one pod's failure is reported, the others still count
                failed.append(f"{pod.rpartition('/')[2]}: {describe_error(exc)}")
                continue
            state.cursors[pod] = (got.epoch, got.next)
            for record in got.records:
                (state.held if self._rng.randrange(HELD_OUT_EVERY) == 0 else state.train).add(record)
        for gone in set(state.cursors) - set(addresses):
            del state.cursors[gone]
        return failed

    async def round(
        self, kube: Any, body: Mapping[str, Any], settings: FleetSpec, addresses: Mapping[str, str], logger: Any,
        current: Mapping[str, Any] | None = None,
    ) -> None:
        """Gather, fit, publish; a failure keeps the last good model and is kept in ``state.failure``.

        ``current`` is the model's ConfigMap as watched (None: not seen), which ``kube.ensure`` patches
        only if it is the policy's own; one the watch has not shown yet is found by the create's 409."""
        meta = body["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        state = self._state(namespace, name, settings)
        state.rounds += 1
        failed = await self.gather(state, settings, addresses, f"{namespace}/{name}")  # builders.admin_audience
        unreached = f" ({len(failed)} sidecar(s) not asked: {'; '.join(failed[:5])})" if failed else ""
        state.note = unreached.strip(" ()")
        if len(state.train.items) < MIN_FIT_RECORDS:
            state.note = (f"{len(state.train.items)} records gathered from {len(addresses) - len(failed)} sidecar(s), "
                          f"{MIN_FIT_RECORDS} needed for a fit{unreached}")  # fmt: skip
            return
        if self._fits is None:
            self._fits = asyncio.Semaphore(1)
        train_set, held = list(state.train.items), list(state.held.items)
        try:
            async with self._fits:
                data, records, tau = await asyncio.to_thread(self._fit, train_set, held)
        except Exception as exc:  # noqa: BLE001 - a failed fit keeps the last good model
            state.failure = f"the fit on {len(train_set)} records failed: {type(exc).__name__}: {exc}"
            logger.warning("spec.predictor.fleet: %s; keeping the last good model", state.failure)
            return
        old = ((body.get("status") or {}).get("model") or {}).get("version") or 0
        version = max(int(old), state.published.version if state.published else 0) + 1
        obj = build_model_configmap(name, namespace, data, version)
        kopf.adopt(obj, owner=dict(body))
        try:
            await kube.ensure(obj, current)
        except Exception as exc:  # noqa: BLE001 - a refused publish keeps the last good model
            state.failure = f"publishing ConfigMap {fleet_model_name(name)} failed: {describe_api_error(exc)}"
            logger.warning("spec.predictor.fleet: %s; keeping the last good model", state.failure)
            return
        state.published, state.failure = Published(version, records, tau, len(held), now_iso()), ""
        logger.info("fleet model version %d (%d records, %d KiB) published in ConfigMap %s", version, records,
                    len(data) // 1024, fleet_model_name(name))  # fmt: skip


def describe_api_error(exc: BaseException) -> str:
    from kubernetes.client.exceptions import ApiException

    from .kube import api_error_message

    if isinstance(exc, ApiException):
        return f"{exc.status} {api_error_message(exc)}"
    return f"{type(exc).__name__}: {exc}"


def condition(policy: str, state: PolicyFleet | None, old_model: Mapping[str, Any] | None) -> Condition:
    """``ModelReady`` for a fleet model: published (and whether the last round failed), or not yet."""
    where = f"ConfigMap {fleet_model_name(policy)}"
    published = state.published.status() if state is not None and state.published is not None else old_model
    failure, note = (state.failure, state.note) if state is not None else ("", "")
    if published:
        tau = f", rank correlation (Kendall) {published['kendallTau']} on held-out records" if "kendallTau" in published else ""
        text = (f"spec.predictor.fleet: version {published['version']} fitted on {published['records']} records{tau}, "
                f"in {where}; the sidecars load it (binbatch_predictor_model_loaded)")  # fmt: skip
        if failure:
            return Condition("ModelReady", "True", "FleetRefitFailed", f"{text}; the last refit published nothing "
                                                                       f"and the sidecars keep it: {failure}")  # fmt: skip
        return Condition("ModelReady", "True", "FleetModelPublished", text + (f"; {note}" if note else ""))
    if failure:
        return Condition("ModelReady", "False", "FleetRefitFailed",
                         f"spec.predictor.fleet: no fleet model in {where} yet: {failure}; the sidecars learn alone "
                         f"meanwhile")  # fmt: skip
    return Condition("ModelReady", "False", "FleetModelPending",
                     f"spec.predictor.fleet: no fleet model in {where} yet: {note or 'no records gathered yet'}; the "
                     f"sidecars learn alone meanwhile")  # fmt: skip
