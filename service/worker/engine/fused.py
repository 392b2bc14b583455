"""Whether a version's output-only requests run its fused-attention graph (model.fused.onnx,
ONNX's opset-23 Attention op) instead of the unfused one: only where it is verified and faster.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

FUSED_GRAPH = "model.fused.onnx"  # export/onnx_graphs.py FUSED_FILE
FUSED_MODES = ("auto", "on", "off")
CUDA = "CUDAExecutionProvider"


def wanted(mode: str, provider: str) -> bool:
    """Load and check the fused graph at all? auto: on CUDA only (on CPU ONNX Runtime's
    Attention kernel has no measured advantage); on: everywhere; off: never."""
    return mode == "on" or (mode == "auto" and provider == CUDA)


@dataclass(frozen=True)
class Timing:
    """Best seconds per call of each graph at one shape."""

    batch: int
    seq: int
    unfused_s: float
    fused_s: float

    def describe(self) -> str:
        return (
            f"{self.batch}x{self.seq}: fused {self.fused_s * 1e3:.3f} ms, "
            f"unfused {self.unfused_s * 1e3:.3f} ms"
        )


def best_seconds(call: Callable[[], object], repeats: int = 5) -> float:
    """The fastest of a few calls after one untimed call (first runs allocate and tune)."""
    call()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


def comparison_shapes(max_batch_size: int, max_seq_len: int) -> list[tuple[int, int]]:
    """A mid-size batch and the largest one the server accepts."""
    shapes = [(min(8, max_batch_size), min(128, max_seq_len)), (max_batch_size, max_seq_len)]
    return list(dict.fromkeys(shapes))


def decide(mode: str, timings: list[Timing]) -> tuple[bool, str]:
    """(use it, why). on: always (it passed its golden check); auto: only when faster at
    every compared shape."""
    measured = "; ".join(timing.describe() for timing in timings) or "not timed"
    if mode == "on":
        return True, f"--fused-attention on ({measured})"
    if timings and all(timing.fused_s < timing.unfused_s for timing in timings):
        return True, f"faster ({measured})"
    return False, f"not faster ({measured})"
