"""Helpers of the GPU check (bench/gpu_check.py) that need neither torch nor a GPU: a float64
numpy reference read from the graph's own weights, what libraries the process loaded, and the
GPU memory in use (NVML)."""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

Reference = Callable[[np.ndarray, np.ndarray], np.ndarray]


def numpy_reference(model_path: Path) -> Reference:
    """The layer in float64 from the graph's initializers (found by shape: Wqkvᵀ [d, 3d],
    bqkv [3d], Woᵀ [d, d], bo [d]), so the check needs no torch on the GPU machine."""
    model = onnx.load(str(model_path))
    meta = {p.key: p.value for p in model.metadata_props}
    d, h = int(meta["embed_dim"]), int(meta["num_heads"])
    causal = meta.get("causal") == "true"
    # Exports since the fold carry 1/sqrt(d/h) in the q rows of the weights already.
    query_scale = 1.0 if meta.get("query_scale_folded") == "true" else (d // h) ** -0.5
    by_shape: dict[tuple[int, ...], np.ndarray] = {}
    for tensor in model.graph.initializer:
        value = numpy_helper.to_array(tensor)
        if value.shape in ((d, 3 * d), (3 * d,), (d, d), (d,)):
            by_shape.setdefault(value.shape, value.astype(np.float64))
    w_in, w_out = by_shape[(d, 3 * d)], by_shape[(d, d)]
    b_in = by_shape.get((3 * d,), np.zeros(3 * d))
    b_out = by_shape.get((d,), np.zeros(d))

    def forward(embeddings: np.ndarray, mask: np.ndarray) -> np.ndarray:
        x = embeddings.astype(np.float64)
        b, t, _ = x.shape
        qkv = (x @ w_in + b_in).reshape(b, t, 3, h, d // h).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0] * query_scale, qkv[1], qkv[2]
        scores = q @ k.transpose(0, 1, 3, 2)
        blocked = np.broadcast_to(mask[:, None, None, :], scores.shape)
        if causal:
            blocked = blocked | np.triu(np.ones((t, t), dtype=bool), 1)
        scores = np.where(blocked, -np.inf, scores)  # a row of only -inf is never a real one
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        heads = (weights @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        return heads @ w_out + b_out

    return forward


def padded_batch(
    rng: np.random.Generator, batch: int, seq: int, d: int, scale: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Random inputs with padding at the end, at the start and in holes (row 0 unpadded)."""
    x = rng.standard_normal((batch, seq, d)) * scale
    mask = np.zeros((batch, seq), dtype=bool)
    for row in range(1, batch):
        kind, cut = row % 3, int(rng.integers(1, seq)) if seq > 1 else 1
        if kind == 0:
            mask[row, cut:] = True
        elif kind == 1:
            mask[row, : seq - cut] = True
        else:
            mask[row] = rng.random(seq) < 0.3
            mask[row, 0] = False
    return x, mask


def errors(got: np.ndarray, want: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """Over real positions: non-finite count, max abs error, and relative to max |want|."""
    real = ~mask
    values, reference = got[real].astype(np.float64), want[real]
    finite = np.isfinite(values)
    bad = int(values.size - np.count_nonzero(finite))
    diff = np.abs(values - reference)[finite]
    worst = float(diff.max()) if diff.size else float("nan")
    scale = float(np.abs(reference).max())
    return {"nonfinite": bad, "max_abs": worst, "relative": worst / scale, "max_ref": scale}


LIBRARIES = re.compile(
    r"/(lib(?:cuda|cudart|cublas|cublasLt|cudnn|nvrtc|cufft|curand)[^/]*\.so[^/]*)$"
)


def loaded_libraries() -> dict[str, str]:
    """CUDA libraries mapped into this process: file name -> path (versions are in names)."""
    found: dict[str, str] = {}
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return found
    for line in maps.read_text().splitlines():
        path = line.split()[-1] if line.split() else ""
        match = LIBRARIES.search(path)
        if match:
            found[match.group(1)] = path
    return dict(sorted(found.items()))


def nvidia_wheels() -> dict[str, str]:
    """Installed NVIDIA runtime wheels and onnxruntime, name -> version."""
    wanted = ("nvidia-", "onnxruntime")
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(wanted):
            found[name] = dist.version
    return dict(sorted(found.items()))


class NvmlMemory(ctypes.Structure):
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


def gpu_memory_used_mib(device: int = 0) -> float | None:
    """Device memory in use (all processes), from NVML; None when NVML is not there."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        handle, memory = ctypes.c_void_p(), NvmlMemory()
        ok = nvml.nvmlDeviceGetHandleByIndex_v2(device, ctypes.byref(handle)) == 0
        ok = ok and nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) == 0
        nvml.nvmlShutdown()
        return memory.used / (1 << 20) if ok else None
    except (OSError, AttributeError):
        return None


def node_providers(
    path: Path,
    providers: list[str | tuple[str, dict[str, str]]],
    feeds: dict[str, np.ndarray],
    folder: Path,
) -> dict[str, list[str]]:
    """Which execution provider ran each op type of one call (ONNX Runtime's profiler): an op
    with no CUDA kernel runs on CPU without any error, which only this shows."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(folder / path.stem)
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=providers)
    session.run(None, feeds)
    trace = json.loads(Path(session.end_profiling()).read_text())
    found: dict[str, set[str]] = {}
    for event in trace:
        args = event.get("args", {})
        if event.get("cat") == "Node" and "provider" in args:
            found.setdefault(args.get("op_name", "?"), set()).add(args["provider"])
    return {op: sorted(names) for op, names in sorted(found.items())}


# Ops that carry the layer's arithmetic. ONNX Runtime puts small shape computations (Shape,
# Gather, Concat, ...) on CPU on purpose under CUDA; one of these on CPU is a missing kernel.
COMPUTE_OPS = frozenset(
    {"Attention", "FusedMatMul", "Gemm", "MatMul", "MultiHeadAttention", "Softmax"}
)


def compute_ops_on(placement: dict[str, list[str]], provider: str) -> list[str]:
    """The compute ops of node_providers()'s answer that ran (also) on provider."""
    return sorted(op for op, names in placement.items() if op in COMPUTE_OPS and provider in names)
