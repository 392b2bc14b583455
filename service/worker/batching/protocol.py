"""What the batcher and its callers exchange: the Runner protocol, limits, results."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from service.worker.engine.caps import BatchCaps


class Runner(Protocol):
    """What the batcher needs of a model: a stable key and a thread-safe run."""

    key: str

    @property
    def label(self) -> str: ...

    @property
    def batch_caps(self) -> BatchCaps: ...

    def run(
        self, embeddings: np.ndarray, key_padding_mask: np.ndarray, with_weights: bool
    ) -> tuple[np.ndarray, np.ndarray | None]: ...


# A call cancelled this close to its deadline ended at its deadline: the client's deadline
# timer fires before the server's by the time the request took to arrive, and the client
# then cancels the call (measured: with 400 calls in flight on one connection, up to 7% of
# those that expired in the queue were cancelled >50 ms before the server's deadline).
DEADLINE_SLACK_S = 0.25


def ended_at_deadline(remaining_s: float | None) -> bool:
    """Whether a call cancelled with remaining_s left before its deadline (None: it had no
    deadline) counts as DEADLINE_EXCEEDED rather than CANCELLED. One rule for every counter."""
    return remaining_s is not None and remaining_s <= DEADLINE_SLACK_S


class BatchFailed(RuntimeError):
    """The batch this request was in failed; the cause is chained."""


@dataclass(frozen=True, kw_only=True)
class BatchLimits:
    max_batch_size: int
    max_queue_delay_s: float
    max_queue_size: int
    max_padding_ratio: float = 0.5
    group_by_length: bool = True
    max_inflight_batches: int = 4  # all models together
    max_inflight_batches_per_model: int = 1  # per model version
    max_queue_bytes: int = 1 << 62  # embeddings bytes waiting, all models


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
