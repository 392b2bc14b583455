"""What a front end exchanges with whatever computes its requests (the worker process, or a
zero-compute plane for the echo floor): the DataPlane protocol, results, statistics records,
and the one rule for calls that ended at their deadline."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from service.catalog import ModelRegistry, ServedModel


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Result:
    """One request's share of a batch, with where its time went."""

    output: np.ndarray
    attention_weights: np.ndarray | None
    queue_s: float
    compute_s: float
    batch_size: int
    # Enough to describe the batch after the fact (tracing spans with explicit times), also
    # when the batcher runs in another process: plain numbers, nothing of the tracer.
    started_at: float = 0.0  # time.monotonic() when the batch started computing
    padding: float = 0.0  # fraction of the batch's positions that were padding
    batch_id: int = 0  # the same for every request computed in one batch
    batch_tags: tuple[object, ...] = ()  # the tags submitted with its requests (None left out)
    # Called once the arrays have been encoded: a front end frees their shared memory.
    release: Callable[[], None] = _nothing


# A call cancelled this close to its deadline ended at its deadline: the client's deadline
# timer fires before the server's by the time the request took to arrive, and the client
# then cancels the call (measured: with 400 calls in flight on one connection, up to 7% of
# those that expired in the queue were cancelled >50 ms before the server's deadline).
DEADLINE_SLACK_S = 0.25


def ended_at_deadline(remaining_s: float | None) -> bool:
    """Whether a call cancelled with remaining_s left before its deadline (None: it had no
    deadline) counts as DEADLINE_EXCEEDED rather than CANCELLED. One rule for every counter."""
    return remaining_s is not None and remaining_s <= DEADLINE_SLACK_S


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += round(seconds * 1e9)


@dataclass
class VersionStats:
    inference_count: int = 0  # sequences computed
    execution_count: int = 0  # ONNX Runtime calls
    last_inference_ms: int = 0  # since the epoch
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    batches: dict[int, Duration] = field(default_factory=lambda: defaultdict(Duration))


@dataclass(frozen=True)
class IndexEntry:
    """One row of the V2 RepositoryIndex: a model version and its state."""

    name: str
    version: int
    state: str
    reason: str = ""


class DataPlane(Protocol):
    """The front end's one seam to compute: servicers call this and nothing below it."""

    @property
    def models(self) -> ModelRegistry[ServedModel]:
        """The served set as this front end knows it."""
        ...

    async def infer(
        self,
        model: ServedModel,
        embeddings: np.ndarray,
        *,
        with_weights: bool,
        deadline: float | None,
        tag: object = None,
    ) -> Result:
        """[n, seq, d] embeddings in the model's dtype; deadline on time.monotonic(); tag
        (plain data: a trace's span ids) comes back in batch_tags of its batch's results."""
        ...

    async def statistics(self, keys: list[str]) -> dict[str, VersionStats]: ...

    async def index(self, *, ready_only: bool) -> list[IndexEntry]: ...

    async def load(self, name: str) -> None: ...

    async def unload(self, name: str) -> None: ...
