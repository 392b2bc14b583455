"""ONNX Runtime sessions for one model version: the batcher's Runner."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from functools import partial
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.catalog import ModelSpec
from service.memory.budget import is_large_batch
from service.text import model_reference
from service.worker.engine import fused as fusing
from service.worker.engine.bound_runs import BoundRuns
from service.worker.engine.caps import SERVER_BATCH_OVERHEAD_S, BatchCaps, measure_caps
from service.worker.engine.cuda import (
    CPU,
    CUDA,
    CudaOptions,
    choose_providers,
    gpu_present,
    intra_op_threads_for,
)
from service.worker.engine.golden import GoldenMismatch, check_golden, golden_path
from service.worker.engine.repository import VersionFiles

__all__ = [
    "CPU",
    "CUDA",
    "BrokenModel",
    "ModelSpec",
    "OnnxModel",
    "choose_providers",
    "count_sessions",
    "gpu_present",
    "warm_up_shapes",
]
log = logging.getLogger(__name__)

INPUTS = ("embeddings", "key_padding_mask")
SHRINK_DEVICES = "cpu:0"  # arenas a large batch's run gives back (CUDA's is sized apart)
# Attention scores of this size or more (all heads) make a batch give its arena memory back
# (--cpu-arena bounded): below it the arena keeps a few times this much for the next batches.
ARENA_KEEP_BYTES = 32 << 20


NUMPY_OF_ORT: dict[str, np.dtype] = {
    "tensor(float)": np.dtype("float32"),
    "tensor(float16)": np.dtype("float16"),
}


def _output_dtype(session: ort.InferenceSession | None, name: str) -> np.dtype:
    """The numpy dtype of a graph output (float32 where the graph is absent)."""
    for output in session.get_outputs() if session is not None else ():
        if output.name == name:
            return NUMPY_OF_ORT.get(output.type, np.dtype("float32"))
    return np.dtype("float32")


class BrokenModel(ValueError):
    """A model file that cannot be served; the message says why."""


def warm_up_shapes(provider: str, max_batch_size: int, max_seq_len: int) -> list[tuple[int, int]]:
    """(batch, seq) to run before serving. On CUDA the largest batch the server accepts comes
    first, so the arena, cuBLAS and cuDNN are sized and tuned before a request needs them; on
    CPU a few small shapes (a large run would only cost start-up time, and its arena memory)."""
    if provider == CUDA:
        shapes = [(max_batch_size, max_seq_len), (1, min(16, max_seq_len))]
    else:
        shapes = [(2, min(seq, max_seq_len)) for seq in (1, 16, 128)]
    return list(dict.fromkeys(shapes))


def count_sessions(found: Iterable[VersionFiles], fused: str, provider: str) -> int:
    """Sessions the versions found will open: each one's share of the GPU memory bound."""
    return sum(
        1
        + (files.weights_graph is not None)
        + (
            fusing.wanted(fused, provider)
            and (files.output_graph.parent / fusing.FUSED_GRAPH).is_file()
        )
        for files in found
    )


def _session(
    path: Path, options: ort.SessionOptions, providers: list[str], cuda: CudaOptions | None
) -> ort.InferenceSession:
    """One session; under CUDA with its provider options and without the wrapper's silent
    retry on CPU, so a CUDA failure fails the batch instead of moving the model to CPU."""
    chosen: list[str | tuple[str, dict[str, str]]] = [
        (name, (cuda or CudaOptions()).provider_options()) if name == CUDA else name
        for name in providers
    ]
    session = ort.InferenceSession(str(path), options, providers=chosen)
    if CUDA in providers:
        session.disable_fallback()
    return session


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
        cpu_arena: str = "bounded",
        cuda: CudaOptions | None = None,
        fused: str = "auto",
    ) -> None:
        options = ort.SessionOptions()
        # The arena keeps the largest batch's intermediates for good (RSS 94 MiB -> 2.2 GiB
        # after one [32, 512, 512] request with weights); without it every batch faults its
        # intermediates' pages in again (measured on one core: seq 128 205 -> 246 requests/s
        # with it). Bounded: kept, except what a large batch took (docs/batching.md, Memory).
        options.enable_cpu_mem_arena = cpu_arena in ("on", "bounded")
        self._shrink_after_large = cpu_arena == "bounded"
        options.intra_op_num_threads = intra_op_threads_for(intra_op_threads, providers)
        self._one_thread = options.intra_op_num_threads == 1
        # Spinning threads keep a core busy between ops; here that core also runs the event
        # loop that feeds the next batch, so they wait on a lock instead unless told to spin.
        options.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if intra_op_spinning else "0"
        )
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        self._tf32 = cuda is not None and cuda.use_tf32
        self._fused_mode = fused
        fused_path = files.output_graph.parent / fusing.FUSED_GRAPH
        want_fused = fusing.wanted(fused, providers[0]) and fused_path.is_file()
        try:
            self._plain = _session(files.output_graph, options, providers, cuda)
            self._full = (
                _session(files.weights_graph, options, providers, cuda)
                if files.weights_graph
                else None
            )
        except Exception as err:  # ORT raises its own exception types for bad files
            raise BrokenModel(f"ONNX Runtime cannot load it: {err}") from err
        # A candidate: choose_output_graph() decides whether output-only requests use it.
        self._fused = self._load_fused(fused_path, options, providers, cuda) if want_fused else None
        self._use_fused = False
        self.spec = _read_spec(self._plain, files)
        self._weights_dtype = _output_dtype(self._full, "attention_weights")
        self.key = f"{files.name}/{files.version}"
        self.provider = self._common_provider()
        # Batches of one computed in place, per output graph (on a CPU: made when first used).
        self._in_place: dict[str, BoundRuns] = {}
        # Until measure_batch_caps() runs, only --max-batch-size limits a batch.
        self.batch_caps = BatchCaps.uniform(2**31 - 1, 2**31 - 1)
        self._check_golden(files)

    def _load_fused(
        self,
        path: Path,
        options: ort.SessionOptions,
        providers: list[str],
        cuda: CudaOptions | None,
    ) -> ort.InferenceSession | None:
        """The fused graph is optional: failing to load, it is skipped (auto), or the version
        refused (--fused-attention on)."""
        try:
            return _session(path, options, providers, cuda)
        except Exception as err:  # ORT's own exception types, e.g. an op it cannot run here
            if self._fused_mode == "on":
                raise BrokenModel(f"ONNX Runtime cannot load {path.name}: {err}") from err
            log.warning(
                "%s: %s not used, ONNX Runtime cannot load it: %s", path.parent, path.name, err
            )
            return None

    def _sessions(self) -> dict[str, ort.InferenceSession]:
        graphs = {
            "output": self._plain,
            "output+attention_weights": self._full,
            "output(fused)": self._fused,
        }
        return {name: session for name, session in graphs.items() if session is not None}

    def _common_provider(self) -> str:
        """The provider every graph of this version runs on; a version split across devices
        would make the engine-info metric a lie, so it is refused."""
        found = {name: session.get_providers()[0] for name, session in self._sessions().items()}
        if len(set(found.values())) > 1:
            raise BrokenModel(f"ONNX Runtime put its graphs on different providers: {found}")
        return next(iter(found.values()))

    def _check_golden(self, files: VersionFiles) -> None:
        """Refuse a version that does not reproduce its exporter's answer here (this provider,
        this dtype); versions exported before golden files existed are served unverified."""
        path = golden_path(files.output_graph.parent)
        if not path.is_file():
            log.warning("%s: no %s, served without a load-time check", self.key, path.name)
            return
        try:
            error = check_golden(
                path,
                self.run,
                self.spec.dtype,
                tf32=self._tf32,
                has_weights_graph=self.has_weights_graph,
            )
        except GoldenMismatch as err:
            raise BrokenModel(f"golden check failed on {self.provider}: {err}") from err
        log.info("%s: golden check passed on %s (max error %.2e)", self.key, self.provider, error)
        if self._fused is not None:
            self._check_fused_golden(path)

    def _check_fused_golden(self, path: Path) -> None:
        """The fused graph is held to the same golden answer; failing it, it is dropped (auto)
        or the version refused (--fused-attention on)."""
        fused = self._fused
        assert fused is not None

        def run(embeddings: np.ndarray, mask: np.ndarray, _: bool) -> tuple[np.ndarray, None]:
            feeds = {"embeddings": embeddings, "key_padding_mask": mask}
            return fused.run(["output"], feeds)[0], None

        try:
            error = check_golden(
                path, run, self.spec.dtype, tf32=self._tf32, has_weights_graph=False
            )
        except GoldenMismatch as err:
            if self._fused_mode == "on":
                raise BrokenModel(f"fused graph: golden check failed: {err}") from err
            log.warning("%s: fused graph not used, golden check failed: %s", self.key, err)
            self._fused = None
            self._in_place.pop("fused", None)
            return
        log.info("%s: fused graph passed its golden check (max error %.2e)", self.key, error)

    @property
    def label(self) -> str:
        """Metric label: the model name (versions would multiply series)."""
        return self.spec.name

    @property
    def described(self) -> str:
        return model_reference(self.spec.name, self.spec.version)

    @property
    def has_weights_graph(self) -> bool:
        return self._full is not None

    def run(
        self,
        embeddings: np.ndarray,
        key_padding_mask: np.ndarray,
        with_weights: bool,
        into: tuple[np.ndarray, np.ndarray | None] | None = None,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Output [b, t, d], and weights [b, h, t, t] only from the graph that has them.
        into: where a batch of one's output (and weights) go, its mask all false; on a CPU
        ONNX Runtime writes them there itself, and they are what is returned."""
        feeds = {"embeddings": embeddings, "key_padding_mask": key_padding_mask}
        if with_weights:
            assert self._full is not None, "validated before batching"
            session, names = self._full, ["output", "attention_weights"]
        else:
            session = self._fused if self._use_fused and self._fused is not None else self._plain
            names = ["output"]
        giving_back = self._shrink_after_large and self._gives_memory_back(embeddings, with_weights)
        if into is not None and not giving_back and self.provider == CPU:
            out_into, weights_into = into
            if self._in_place_runs(session, with_weights).run(embeddings, out_into, weights_into):
                return out_into, weights_into
        if giving_back:
            outputs = self._run_giving_back(session, names, embeddings, key_padding_mask)
        else:
            outputs = session.run(names, feeds)
        return outputs[0], outputs[1] if with_weights else None

    def _in_place_runs(self, session: ort.InferenceSession, with_weights: bool) -> BoundRuns:
        graph = "full" if with_weights else "fused" if session is self._fused else "plain"
        runs = self._in_place.get(graph)
        if runs is None:
            weights = (self.spec.num_heads, self._weights_dtype) if with_weights else None
            runs = self._in_place[graph] = BoundRuns(session, self.spec.dtype, weights)
        return runs

    def _gives_memory_back(self, embeddings: np.ndarray, with_weights: bool) -> bool:
        """A batch whose input is large, or whose attention scores ([b, h, t, t] float32,
        the largest intermediates; with a small d they dwarf the input) reach
        ARENA_KEEP_BYTES, gives its arena memory back when it ends."""
        b, t, _ = embeddings.shape
        scores = b * self.spec.num_heads * t * t * 4
        return is_large_batch(embeddings, with_weights) or scores >= ARENA_KEEP_BYTES

    def _run_giving_back(
        self,
        session: ort.InferenceSession,
        names: list[str],
        embeddings: np.ndarray,
        key_padding_mask: np.ndarray,
    ) -> list[np.ndarray]:
        """Run a large batch so that its arena memory goes back when it ends: the outputs go
        into arrays of our own (an output left in the arena would keep its region there)
        and the run shrinks the arena afterwards."""
        b, t, d = embeddings.shape
        shapes = {"output": (b, t, d), "attention_weights": (b, self.spec.num_heads, t, t)}
        dtypes = {"output": self.spec.dtype, "attention_weights": self._weights_dtype}
        binding = session.io_binding()
        binding.bind_cpu_input("embeddings", np.ascontiguousarray(embeddings))
        binding.bind_cpu_input("key_padding_mask", np.ascontiguousarray(key_padding_mask))
        outputs = [np.empty(shapes[name], dtypes[name]) for name in names]
        for name, array in zip(names, outputs, strict=True):
            binding.bind_output(name, "cpu", 0, array.dtype, array.shape, array.ctypes.data)
        options = ort.RunOptions()
        options.add_run_config_entry("memory.enable_memory_arena_shrinkage", SHRINK_DEVICES)
        session.run_with_iobinding(binding, options)
        return outputs

    @property
    def uses_fused_graph(self) -> bool:
        return self._use_fused

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
            run,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            budget_s=budget_s,
            batch_overhead_s=SERVER_BATCH_OVERHEAD_S,
            # On one CPU thread ONNX Runtime computes on the calling thread alone: its CPU
            # time is a batch's cost, whatever else starts on the core meanwhile (the live
            # caps time batches the same way).
            cost_clock=time.thread_time if self.provider == CPU and self._one_thread else None,
        )
        return self.batch_caps

    def _inputs(self, batch: int, seq: int) -> dict[str, np.ndarray]:
        x = np.random.default_rng(0).standard_normal((batch, seq, self.spec.embed_dim))
        return {
            "embeddings": x.astype(self.spec.dtype),
            "key_padding_mask": np.zeros((batch, seq), dtype=bool),
        }

    def warm_up(self, shapes: list[tuple[int, int]] | None = None) -> None:
        """First runs allocate and tune; pay for them, on every graph, before reporting ready.
        Called on each thread that will run batches (CUDA keeps per-thread handles)."""
        for batch, seq in shapes or [(2, 1), (2, 16), (2, 128)]:
            feeds = self._inputs(batch, seq)
            for session in self._sessions().values():
                session.run(None, feeds)

    def choose_output_graph(self, max_batch_size: int, max_seq_len: int) -> str:
        """Time the fused graph against the unfused one (when it was loaded and passed its
        golden check); output-only requests use it from now on if decide() says so."""
        fused = self._fused
        if fused is None:
            return "unfused graph"
        timings = []
        if self._fused_mode != "on":
            for batch, seq in fusing.comparison_shapes(max_batch_size, max_seq_len):
                feeds = self._inputs(batch, seq)
                unfused_s = fusing.best_seconds(partial(self._plain.run, ["output"], feeds))
                fused_s = fusing.best_seconds(partial(fused.run, ["output"], feeds))
                timings.append(fusing.Timing(batch, seq, unfused_s, fused_s))
        self._use_fused, reason = fusing.decide(self._fused_mode, timings)
        if not self._use_fused:
            self._fused = None  # its arena goes back
            self._in_place.pop("fused", None)
        return f"{'fused' if self._use_fused else 'unfused'} graph: {reason}"
