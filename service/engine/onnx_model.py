"""ONNX Runtime sessions for one model version: the batcher's Runner."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from service.engine.caps import BatchCaps, measure_caps
from service.engine.golden import GoldenMismatch, check_golden, golden_path
from service.engine.repository import VersionFiles

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
INPUTS = ("embeddings", "key_padding_mask")


class BrokenModel(ValueError):
    """A model file that cannot be served; the message says why."""


@dataclass(frozen=True)
class ModelSpec:
    """What the ONNX metadata says about a model version."""

    name: str
    version: int
    embed_dim: int
    num_heads: int
    causal: bool
    dtype: np.dtype
    weights_sha256: str
    weights_source: str


def gpu_present() -> bool:
    """True when the CUDA driver loads and sees a device. Asked before creating a CUDA session
    so a CPU-only machine never logs ONNX Runtime's CUDA load errors."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return (
        cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
    )


def choose_providers(preference: str) -> list[str]:
    """CUDA first when asked or when auto finds it usable, CPU always as the fallback."""
    cuda_usable = CUDA in ort.get_available_providers() and gpu_present()
    if preference == "cuda" and not cuda_usable:
        raise RuntimeError("--provider cuda: this onnxruntime build or machine has no usable CUDA")
    if preference != "cpu" and cuda_usable:
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()  # CUDA/cuDNN from the nvidia-* wheels, when installed
        return [CUDA, CPU]
    return [CPU]


def _read_spec(session: ort.InferenceSession, files: VersionFiles) -> ModelSpec:
    meta = session.get_modelmeta().custom_metadata_map
    names = [i.name for i in session.get_inputs()]
    if tuple(names) != INPUTS:
        raise BrokenModel(f"inputs are {names}, expected {list(INPUTS)}")
    try:
        embed_dim, num_heads = int(meta["embed_dim"]), int(meta["num_heads"])
    except (KeyError, ValueError) as err:
        raise BrokenModel(f"metadata lacks a valid embed_dim/num_heads ({err})") from err
    dtype = np.dtype(meta.get("dtype", "float32"))
    if dtype not in (np.float32, np.float16):
        raise BrokenModel(f"dtype {dtype} is not float32 or float16")
    return ModelSpec(
        name=files.name,
        version=files.version,
        embed_dim=embed_dim,
        num_heads=num_heads,
        causal=meta.get("causal", "false") == "true",
        dtype=dtype,
        weights_sha256=meta.get("weights_sha256", ""),
        weights_source=meta.get("weights_source", ""),
    )


class OnnxModel:
    """Both graphs of one version. run() is thread-safe and releases the GIL inside ORT."""

    def __init__(
        self,
        files: VersionFiles,
        providers: list[str],
        intra_op_threads: int,
        *,
        intra_op_spinning: bool = False,
        cpu_arena: bool = False,
    ) -> None:
        options = ort.SessionOptions()
        # Off by default, measured (README, "Memory"): the CPU arena keeps the largest batch's
        # intermediates for good (RSS 94 MiB -> 2.2 GiB after one [32, 512, 512] request with
        # weights); without it RSS returns to ~100 MiB, small batches cost the same and only
        # the largest ones pay for faulting their pages in again.
        options.enable_cpu_mem_arena = cpu_arena
        options.intra_op_num_threads = intra_op_threads
        # Spinning threads keep a core busy between ops; here that core also runs the event
        # loop that feeds the next batch, so they wait on a lock instead unless told to spin.
        options.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if intra_op_spinning else "0"
        )
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        try:
            self._plain = ort.InferenceSession(
                str(files.output_graph), options, providers=providers
            )
            self._full = (
                ort.InferenceSession(str(files.weights_graph), options, providers=providers)
                if files.weights_graph
                else None
            )
        except Exception as err:  # ORT raises its own exception types for bad files
            raise BrokenModel(f"ONNX Runtime cannot load it: {err}") from err
        self.spec = _read_spec(self._plain, files)
        self.key = f"{files.name}/{files.version}"
        self.provider = self._plain.get_providers()[0]
        # Until measure_batch_caps() runs, only --max-batch-size limits a batch.
        self.batch_caps = BatchCaps.uniform(2**31 - 1, 2**31 - 1)
        self._check_golden(files)

    def _check_golden(self, files: VersionFiles) -> None:
        """Refuse a version that does not reproduce its exporter's answer here (this provider,
        this dtype); versions exported before golden files existed are served unverified."""
        path = golden_path(files.output_graph.parent)
        if not path.is_file():
            log.warning("%s: no %s, served without a load-time check", self.key, path.name)
            return
        try:
            error = check_golden(path, self.run, self.spec.dtype,
                                 has_weights_graph=self.has_weights_graph)  # fmt: skip
        except GoldenMismatch as err:
            raise BrokenModel(f"golden check failed on {self.provider}: {err}") from err
        log.info("%s: golden check passed on %s (max error %.2e)", self.key, self.provider, error)

    @property
    def label(self) -> str:
        """Metric label: the model name (versions would multiply series)."""
        return self.spec.name

    @property
    def has_weights_graph(self) -> bool:
        return self._full is not None

    def run(
        self, embeddings: np.ndarray, key_padding_mask: np.ndarray, with_weights: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Output [b, t, d], and weights [b, h, t, t] only from the graph that has them."""
        feeds = {"embeddings": embeddings, "key_padding_mask": key_padding_mask}
        if with_weights:
            assert self._full is not None, "validated before batching"
            output, weights = self._full.run(["output", "attention_weights"], feeds)
            return output, weights
        (output,) = self._plain.run(["output"], feeds)
        return output, None

    def measure_batch_caps(
        self, *, max_batch_size: int, max_seq_len: int, budget_s: float
    ) -> BatchCaps:
        """Time the output graph per length bucket and keep each bucket's best batch size.
        budget_s = 0 skips the measurement: every length may fill max_batch_size."""
        if budget_s <= 0:
            self.batch_caps = BatchCaps.uniform(max_batch_size, max_seq_len)
            return self.batch_caps
        rng = np.random.default_rng(0)
        inputs: dict[int, np.ndarray] = {}

        def run(size: int, length: int) -> None:
            if length not in inputs:
                shape = (max_batch_size, length, self.spec.embed_dim)
                inputs[length] = rng.standard_normal(shape, dtype=np.float32).astype(
                    self.spec.dtype
                )
            # The copy stands in for the batcher's merge, which every real batch pays.
            embeddings = inputs[length][:size].copy()
            self.run(embeddings, np.zeros((size, length), dtype=bool), with_weights=False)

        self.batch_caps = measure_caps(
            run, max_batch_size=max_batch_size, max_seq_len=max_seq_len, budget_s=budget_s
        )
        return self.batch_caps

    def warm_up(self, seq_lengths: tuple[int, ...] = (1, 16, 128)) -> None:
        """First runs allocate and tune; pay for them before reporting ready."""
        for seq in seq_lengths:
            x = np.zeros((2, seq, self.spec.embed_dim), dtype=self.spec.dtype)
            mask = np.zeros((2, seq), dtype=bool)
            self.run(x, mask, with_weights=False)
            if self.has_weights_graph:
                self.run(x, mask, with_weights=True)
