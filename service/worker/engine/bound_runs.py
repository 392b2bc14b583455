"""Batches of one that ONNX Runtime reads from and writes to shared memory itself: an
IOBinding per place (the input's, the output's and the weights' addresses), kept for the
next request at the same place.

A front end's slab hands a lone caller the same regions call after call, so the binding
made for its first request serves the rest. Bound by address, a run reads the input where
it lies and writes the answer into its regions: no feed dictionary, no arrays of ONNX
Runtime's to wrap and then copy. Measured on one core: a lone seq-512 request with weights
(9 MiB of answer) runs 4% faster; at seq 16 the saving is within the worker's noise."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import onnxruntime as ort

# Bindings kept per session: a front end's lone callers reuse a few regions; more than this
# many distinct ones and the oldest goes. A binding holds addresses, not the slab's memory
# (and its own mask: a byte per position).
MAX_BINDINGS = 64

# The input's address and shape, the output's and the weights' addresses (0: none).
_Key = tuple[int, tuple[int, ...], int, int]


def _fits(array: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> bool:
    return (
        array.dtype == dtype
        and array.shape == shape
        and array.flags.c_contiguous
        and array.flags.writeable
    )


class BoundRuns:
    """Runs one graph of a model on a batch of one (nothing padded) in place: the output
    graph, or the graph with weights (weights: their heads and dtype)."""

    def __init__(
        self,
        session: ort.InferenceSession,
        dtype: np.dtype,
        weights: tuple[int, np.dtype] | None = None,
    ) -> None:
        self._session = session
        self._dtype = dtype
        self._weights = weights
        # A binding with the all-false mask it points to (kept alive with it).
        self._bindings: OrderedDict[_Key, tuple[ort.IOBinding, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()  # batches may end on compute threads too

    def run(self, embeddings: np.ndarray, into: np.ndarray, weights: np.ndarray | None) -> bool:
        """Compute embeddings' output [n, seq, d] into into (and, for the graph with weights,
        the weights [n, h, seq, seq] into weights); False (nothing run) when an array is not a
        C-contiguous, writable one of the graph's shape and dtype."""
        if not (
            embeddings.flags.c_contiguous
            and embeddings.dtype == self._dtype
            and _fits(into, embeddings.shape, self._dtype)
        ):
            return False
        if (weights is None) != (self._weights is None):
            return False
        if weights is not None and self._weights is not None:
            heads, weights_dtype = self._weights
            n, seq, _ = embeddings.shape
            if not _fits(weights, (n, heads, seq, seq), weights_dtype):
                return False
        # Addresses identify a request's place: live requests never share regions (a front
        # end frees them only after the worker's last answer to them).
        key = (
            embeddings.ctypes.data,
            embeddings.shape,
            into.ctypes.data,
            0 if weights is None else weights.ctypes.data,
        )
        with self._lock:
            found = self._bindings.get(key)
            if found is None:
                found = self._bindings[key] = self._bind(embeddings, into, weights)
                if len(self._bindings) > MAX_BINDINGS:
                    self._bindings.popitem(last=False)
            else:
                self._bindings.move_to_end(key)
        self._session.run_with_iobinding(found[0])
        return True

    def _bind(
        self, embeddings: np.ndarray, into: np.ndarray, weights: np.ndarray | None
    ) -> tuple[ort.IOBinding, np.ndarray]:
        # By address: the binding holds no reference to the slab's views, so a front end's
        # slab is never kept mapped by it. A later request at the same addresses is one whose
        # own views hold that memory while it runs.
        mask = np.zeros(embeddings.shape[:2], dtype=bool)
        binding = self._session.io_binding()
        shape = list(embeddings.shape)
        binding.bind_input("embeddings", "cpu", 0, self._dtype, shape, embeddings.ctypes.data)
        binding.bind_input("key_padding_mask", "cpu", 0, np.bool_, shape[:2], mask.ctypes.data)
        binding.bind_output("output", "cpu", 0, self._dtype, shape, into.ctypes.data)
        if weights is not None:
            binding.bind_output(
                "attention_weights",
                "cpu",
                0,
                weights.dtype,
                list(weights.shape),
                weights.ctypes.data,
            )
        return binding, mask
