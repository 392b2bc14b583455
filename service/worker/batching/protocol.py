"""What the batcher and its callers exchange: the Runner protocol, limits, results."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from service.catalog import BatchCaps
from service.dataplane import DEADLINE_SLACK_S, Result, ended_at_deadline

__all__ = [
    "DEADLINE_SLACK_S",
    "AnswerWriter",
    "BatchFailed",
    "BatchLimits",
    "Result",
    "Runner",
    "ended_at_deadline",
]


class Runner(Protocol):
    """What the batcher needs of a model: a stable key and a thread-safe run."""

    key: str

    @property
    def label(self) -> str: ...

    @property
    def described(self) -> str:
        """How messages to clients name it (service/text.py model_reference)."""
        ...

    @property
    def batch_caps(self) -> BatchCaps: ...

    def run(
        self,
        embeddings: np.ndarray,
        key_padding_mask: np.ndarray,
        with_weights: bool,
        into: tuple[np.ndarray, np.ndarray | None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """into, given for a batch of one (nothing padded) whose answer has its place in
        shared memory (output, and weights when asked): a runner may write it there and
        return those arrays as the answer."""
        ...


class AnswerWriter(Protocol):
    """Takes one request's part of a batch's answer on the compute thread (a client's
    shared-memory region). Must not raise: a failure is the writer's to report, so that it
    fails that request and not the batch."""

    def write(self, part: np.ndarray) -> None: ...


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
    live_caps: bool = False  # caps follow the measured cost of the batches run
