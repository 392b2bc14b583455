"""What a front end exchanges with whatever computes its requests (the worker process, or a
zero-compute plane for the echo floor): the DataPlane protocol, results, statistics records,
and the one rule for calls that ended at their deadline."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from service.catalog import ModelRegistry, ServedModel
from service.errors import RegionNotFound
from service.text import shown

# Longest region name (and key) a client may register: NAME_MAX. A reference to a longer
# name is refused in the front end, never sent to the worker (nothing can match it).
MAX_REGION_NAME_CHARS = 255


def region_not_found(name: str) -> RegionNotFound:
    return RegionNotFound(f"no shared-memory region {shown(name)} is registered; register it first")


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class RegionRef:
    """byte_size bytes at offset inside a client's registered shared-memory region (system
    shared memory): where the worker reads an input or writes an answer. The front end has
    checked what it can without the region (sizes against shapes); the worker checks the
    rest (the region exists, holds the bytes, and the bytes fit the tensor) before it reads
    or writes a byte."""

    region: str
    offset: int
    byte_size: int
    where: str = ""  # what the client called it, for messages: "input 'embeddings'"


@dataclass(frozen=True)
class RegionTensor:
    """An input in a client's region: [n, seq, d] values of dtype (as the client wrote
    them; the worker casts them to the model's dtype and checks them)."""

    ref: RegionRef
    shape: tuple[int, int, int]
    dtype: np.dtype


@dataclass(frozen=True)
class RegionTarget:
    """Where an answer goes instead of the message: the region, and the dtype to write it in."""

    ref: RegionRef
    dtype: np.dtype


# Answers written into client regions, by output name ("output", "attention_weights").
Targets = Mapping[str, RegionTarget]


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
        embeddings: np.ndarray | RegionTensor,
        *,
        with_weights: bool,
        deadline: float | None,
        tag: object = None,
        targets: Targets | None = None,
    ) -> Result:
        """[n, seq, d] embeddings in the model's dtype (or in a client's region); deadline on
        time.monotonic(); tag (plain data: a trace's span ids) comes back in batch_tags of its
        batch's results. An answer named in targets is written into its region: its array in
        the Result then holds no data, only the shape and dtype written."""
        ...

    async def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Register a client shared-memory region (NotSupported where that is off)."""
        ...

    async def shm_unregister(self, name: str) -> None:
        """Unregister one region, or every one (name "")."""
        ...

    async def shm_status(self, name: str) -> list[tuple[str, str, int, int]]:
        """(name, key, offset, byte_size) of one region (RegionNotFound) or of every one."""
        ...

    async def statistics(self, keys: list[str]) -> dict[str, VersionStats]: ...

    async def index(self, *, ready_only: bool) -> list[IndexEntry]: ...

    async def load(self, name: str, peer: str = "") -> None: ...

    async def unload(self, name: str, peer: str = "") -> None: ...
