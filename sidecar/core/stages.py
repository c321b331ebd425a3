"""The request path's stage contracts, in the order a request meets them.

One page to see the pipeline (CONVENTIONS "Stages on one page"): each stage is a
small ``typing.Protocol`` with its one job; the implementations live beside their
fakes in the modules named for them, and a test checks each against its contract.

    GenerateRequest -> Request
      1. LengthPredictor  how many tokens will the answer have?     predictor.py
      2. Binner           which bin holds requests of that length?   binner.py
      3. Former           per-bin queues that turn requests into Batches (full,
                          max wait, SLO, policy); deadlines leave     former.py
      4. Sizer            how large may each bin's batch be now?      sizer.py
           ^ SnapshotSource  the engine's load now (KV cache, TPOT)   engine/metrics_feed.py
      5. RequestDispatcher  take a request in, send batches to the engine,
                          answer every caller exactly once            engine/dispatcher.py
    -> the engine's OpenAI API (engine/engine_client.py)

Time comes from an injected ``clock.Clock`` everywhere, so the simulator drives
the very code that serves.  Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from .request import Request
from .sizer import EngineSnapshot, SizeDecision

# -- 1. predictor -------------------------------------------------------------------


@runtime_checkable
class LengthPredictor(Protocol):
    """What the batch former and the simulator need from a predictor."""

    name: str

    def predict(self, req: Request) -> float:
        """Expected output tokens of ``req`` (> 0, the median); sets ``req.length`` (the
        whole predicted distribution) and ``req.prediction_source``."""
        ...

    def observe(self, req: Request, actual_tokens: float) -> None:
        """A completion the sidecar saw: ``req`` produced ``actual_tokens``."""
        ...


# -- 2. binner ----------------------------------------------------------------------


@runtime_checkable
class Binner(Protocol):
    """What the batch former needs from a binner."""

    @property
    def k(self) -> int:
        """The number of bins now: ``len(boundaries) + 1``."""
        ...

    @property
    def boundaries(self) -> tuple[float, ...]:
        """The k-1 strictly increasing interior cut points."""
        ...

    @property
    def version(self) -> int:
        """Incremented every time ``boundaries`` change."""
        ...

    def assign(self, predicted: float) -> int:
        """The bin for a request of this predicted length."""
        ...

    def observe(self, predicted: float) -> None:
        """The predicted output length of an arriving request (what it is binned by)."""
        ...

    def rebalance(self, queued: Sequence[Sequence[float]]) -> bool:
        """Given the predicted lengths queued in each bin; True if boundaries changed."""
        ...


# -- 3. former ----------------------------------------------------------------------

@dataclass(slots=True)
class Batch:
    bin: int
    requests: list[Request]
    reason: str  # "full" | "timeout" | "slo" | "policy" | "drain"
    formed_at: float

    @property
    def size(self) -> int:
        return len(self.requests)

    @property
    def priority(self) -> int:
        return max(r.priority for r in self.requests)


@dataclass(slots=True)
class PollResult:
    expired: list[Request] = field(default_factory=list)  # deadline passed while queued
    formed: int = 0  # batches moved to the service queue by this poll


@runtime_checkable
class Former(Protocol):
    """Per-bin queues: a request waits in its bin until a batch of it is formed."""

    @property
    def k(self) -> int:
        """The number of bins (follows the binner's)."""
        ...

    def submit(self, req: Request) -> int:
        """Queue ``req`` (``predicted_tokens`` set) in its bin; its bin.  Raises ``QueueFull``."""
        ...

    def cancel(self, req: Request) -> bool:
        """Withdraw ``req``; True if it was still queued."""
        ...

    def poll(self) -> PollResult:
        """Drop expired requests and form the batches that are due, as of the clock's now."""
        ...

    def next_wake(self) -> float | None:
        """When ``poll`` next has work (a deadline, a send-by, a max wait); None: never."""
        ...

    def take(self, idle: bool = False) -> Batch | None:
        """The next batch to dispatch, or None."""
        ...

    def set_target_sizes(self, size: int | Sequence[int]) -> None:
        """The sizer's B_t, one per bin (or one for all)."""
        ...

    def queued_predictions(self) -> list[list[float]]:
        """The predicted lengths queued in each bin (for ``Binner.rebalance``)."""
        ...


# -- 4. sizer -----------------------------------------------------------------------


@runtime_checkable
class Sizer(Protocol):
    """B_t per bin from the engine's KV memory and TPOT (memory/SLA Alg. 1-2)."""

    @property
    def sizes(self) -> list[int]:
        """The last decision's per-bin sizes."""
        ...

    def observe(self, bin: int, prompt_tokens: float, output_tokens: float) -> None:
        """A completed request of ``bin``: its lengths feed the memory bound."""
        ...

    def update(self, snapshot: EngineSnapshot | None, k: int, *, observed_batch: float | None = None) -> SizeDecision:
        """The target sizes of ``k`` bins for the next interval, and why."""
        ...


@runtime_checkable
class SnapshotSource(Protocol):
    """The metrics source as the core sees it: the engine's load now, for the sizer."""

    async def poll_once(self) -> EngineSnapshot | None:
        """One reading (None: no source configured); a failed one is a stale snapshot."""
        ...


# -- 5. dispatcher ------------------------------------------------------------------


@runtime_checkable
class RequestDispatcher(Protocol):
    """Takes requests in, sends their batches to the engine, answers each caller once."""

    def submit(self, req: Request, call: Any) -> int:
        """Predict, bin and queue ``req``; its bin.  ``call`` is how the caller is answered."""
        ...

    def cancel(self, req: Request) -> None:
        """The caller left: drop ``req`` from its bin or abort its engine call."""
        ...

    def byte_room(self) -> int | None:
        """Bytes of request bodies batch.maxQueuedBytes leaves room for now (None: no bound)."""
        ...

    def on_snapshot(self, snapshot: EngineSnapshot | None) -> SizeDecision:
        """A new reading of the engine's load: resize, rebalance the bins."""
        ...
