"""A batch of one computed in place: ONNX Runtime reads the input where it lies in shared
memory and writes the output into the answer's region, with the same result as a batch."""

from __future__ import annotations

import asyncio
import mmap
from pathlib import Path

import numpy as np
import pytest

from service.worker.batching.batcher import Batcher
from service.worker.batching.policy import merge, split
from service.worker.batching.protocol import BatchLimits
from service.worker.engine import bound_runs
from service.worker.engine.onnx_model import CPU, OnnxModel
from service.worker.engine.repository import discover
from tests.harness.reference import attend_alone, layer_for

RTOL = 1e-5


def _model(repository: Path, name: str) -> OnnxModel:
    files = next(v for v in discover(repository, quiet=True) if v.name == name and v.version == 1)
    return OnnxModel(files, [CPU], 1)


class _Shared:
    """Arrays in one anonymous shared mapping, as requests and answers lie in a slab."""

    def __init__(self, nbytes: int = 8 << 20) -> None:
        self._bytes = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
        self._next = 0

    def array(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        start = self._next
        self._next += (nbytes + 63) // 64 * 64
        return self._bytes[start : start + nbytes].view(dtype).reshape(shape)


def _batched(model: OnnxModel, x: np.ndarray, other: np.ndarray) -> np.ndarray:
    """x's output when it is computed in a padded batch with other."""
    embeddings, mask = merge([x, other])
    output, _ = model.run(embeddings, mask, False)
    return split(output, None, [x.shape[:2], other.shape[:2]])[0][0]


@pytest.mark.parametrize("name", ["small", "half"])
def test_a_batch_of_one_in_place_equals_the_batched_result(
    model_repository: Path, name: str
) -> None:
    model = _model(model_repository, name)
    dtype, d = model.spec.dtype, model.spec.embed_dim
    shared = _Shared()
    x, into = shared.array((2, 5, d), dtype), shared.array((2, 5, d), dtype)
    rng = np.random.default_rng(3)
    x[:] = rng.standard_normal(x.shape)
    output, weights = model.run(x, np.zeros((2, 5), dtype=bool), False, into=(into, None))
    assert output is into  # written where the answer goes
    assert weights is None
    other = rng.standard_normal((1, 9, d)).astype(dtype)
    tolerance = RTOL if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(into, _batched(model, x.copy(), other), rtol=tolerance, atol=1e-6)
    if dtype == np.float32:
        want, _ = attend_alone(layer_for(d, model.spec.num_heads), np.asarray(x))
        np.testing.assert_allclose(into, want, rtol=1e-4, atol=1e-5)


def test_a_request_at_the_same_place_is_computed_from_its_own_values(
    model_repository: Path,
) -> None:
    """The binding kept for a region reads it afresh: the next request there gets its own
    answer, not the first one's."""
    model = _model(model_repository, "small")
    shared = _Shared()
    x, into = shared.array((1, 7, 64), np.float32), shared.array((1, 7, 64), np.float32)
    mask = np.zeros((1, 7), dtype=bool)
    rng = np.random.default_rng(5)
    for _ in range(3):
        x[:] = rng.standard_normal(x.shape)
        model.run(x, mask, False, into=(into, None))
        want, _ = model.run(x.copy(), mask, False)
        np.testing.assert_array_equal(into, want)


def test_more_places_than_bindings_kept_still_compute_each_right(
    model_repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bound_runs, "MAX_BINDINGS", 2)
    model = _model(model_repository, "small")
    shared = _Shared()
    places = [
        (shared.array((1, 4, 64), np.float32), shared.array((1, 4, 64), np.float32))
        for _ in range(5)
    ]
    mask = np.zeros((1, 4), dtype=bool)
    rng = np.random.default_rng(9)
    for _ in range(3):
        for x, into in places:
            x[:] = rng.standard_normal(x.shape)
            assert model.run(x, mask, False, into=(into, None))[0] is into
            np.testing.assert_array_equal(into, model.run(x.copy(), mask, False)[0])


def test_the_weights_are_written_in_place_too(model_repository: Path) -> None:
    model = _model(model_repository, "small")
    shared = _Shared()
    x = shared.array((2, 6, 64), np.float32)
    into = shared.array((2, 6, 64), np.float32)
    weights_into = shared.array((2, 4, 6, 6), np.float32)
    x[:] = np.random.default_rng(12).standard_normal(x.shape)
    mask = np.zeros((2, 6), dtype=bool)
    output, weights = model.run(x, mask, True, into=(into, weights_into))
    assert output is into
    assert weights is weights_into
    want_output, want_weights = model.run(x.copy(), mask, True)
    np.testing.assert_array_equal(into, want_output)
    np.testing.assert_array_equal(weights_into, want_weights)
    reference_output, reference_weights = attend_alone(layer_for(64, 4), np.asarray(x))
    np.testing.assert_allclose(into, reference_output, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(weights_into, reference_weights, rtol=1e-4, atol=1e-5)


def test_what_cannot_be_bound_is_run_as_before(model_repository: Path) -> None:
    """A strided input, a target of another shape or dtype, weights asked without a place
    for them or with a place of the wrong shape: the answer comes back as ONNX Runtime's
    arrays, the targets untouched."""
    model = _model(model_repository, "small")
    rng = np.random.default_rng(11)
    wide = rng.standard_normal((1, 6, 128)).astype(np.float32)
    strided = wide[:, :, ::2]
    x = np.ascontiguousarray(strided)
    mask = np.zeros((1, 6), dtype=bool)
    f32 = np.float32
    cases = [
        (strided, np.zeros((1, 6, 64), f32), None, False),
        (x, np.zeros((1, 5, 64), f32), None, False),
        (x, np.zeros((1, 6, 64), np.float64), None, False),
        (x, np.zeros((1, 6, 64), f32), None, True),
        (x, np.zeros((1, 6, 64), f32), np.zeros((1, 4, 6, 5), f32), True),
        (x, np.zeros((1, 6, 64), f32), np.zeros((1, 4, 6, 6), f32), False),
    ]
    want, _ = model.run(x, mask, False)
    for embeddings, into, weights_into, with_weights in cases:
        output, _ = model.run(embeddings, mask, with_weights, into=(into, weights_into))
        assert output is not into
        assert not into.any()
        assert weights_into is None or not weights_into.any()
        np.testing.assert_allclose(output, want, rtol=RTOL, atol=1e-6)


def test_the_batcher_answers_a_lone_request_in_its_target(model_repository: Path) -> None:
    """Through the batcher, as the worker computes a lone request: its answer is the
    target itself, equal to the batched result."""
    model = _model(model_repository, "small")
    shared = _Shared()
    x, into = shared.array((1, 8, 64), np.float32), shared.array((1, 8, 64), np.float32)
    x[:] = np.random.default_rng(13).standard_normal(x.shape)

    async def lone() -> np.ndarray:
        batcher = Batcher(BatchLimits(max_batch_size=8, max_queue_delay_s=0.0, max_queue_size=8))
        batcher.compute_short_batches_inline(0.05)
        await batcher.start()
        try:
            result = await batcher.enqueue(model, x, with_weights=False, into=(into, None))
        finally:
            await batcher.stop(timeout_s=5)
        return result.output

    output = asyncio.run(lone())
    assert output is into
    other = np.random.default_rng(14).standard_normal((2, 3, 64)).astype(np.float32)
    np.testing.assert_allclose(into, _batched(model, x.copy(), other), rtol=RTOL, atol=1e-6)
