"""The server re-checks each version at load against the golden answer exported with it."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from export.golden import GOLDEN_FILE
from export.pipeline import ExportRequest, run_export
from service.client import AttentionClient
from service.worker.engine.golden import GOLDEN_FILE as SERVED_GOLDEN_FILE
from service.worker.engine.golden import GoldenMismatch, check_golden
from tests.harness.providers import serving_provider
from tests.harness.reference import cpu_session
from tests.harness.server_process import ServerProcess


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """good/1 (with golden), legacy/1 (no golden), swapped/1 (another model's graphs under a
    golden file), skewed/1 (a golden output off by 2 %)."""
    root = tmp_path_factory.mktemp("golden")
    good = run_export(ExportRequest(name="good", embed_dim=32, num_heads=4, out=root)).folder
    for name in ("legacy", "swapped", "skewed"):
        shutil.copytree(good, root / name / "1")
    (root / "legacy" / "1" / GOLDEN_FILE).unlink()
    other = run_export(ExportRequest(name="other", embed_dim=32, num_heads=4, seed=9, out=root))
    for graph in (other.files.output_only, other.files.with_weights):
        shutil.copy(graph, root / "swapped" / "1" / graph.name)
    shutil.rmtree(root / "other")
    skewed = root / "skewed" / "1" / GOLDEN_FILE
    data = dict(np.load(skewed))
    data["output"] = data["output"] * 1.02
    np.savez(skewed, **data)
    return root


def _runner(folder: Path):
    plain, full = (
        cpu_session(folder / "model.onnx"),
        cpu_session(folder / "model.with_weights.onnx"),
    )

    def run(embeddings, mask, with_weights):
        feeds = {"embeddings": embeddings, "key_padding_mask": mask}
        if with_weights:
            return tuple(full.run(None, feeds))
        return plain.run(None, feeds)[0], None

    return run


def test_file_names_agree() -> None:
    assert GOLDEN_FILE == SERVED_GOLDEN_FILE


def test_check_passes_and_fails_with_the_reason(repository: Path) -> None:
    good = repository / "good" / "1"
    error = check_golden(
        good / GOLDEN_FILE, _runner(good), np.dtype(np.float32), has_weights_graph=True
    )
    assert error < 1e-5
    for name, message in (("swapped", "output differs"), ("skewed", "output differs")):
        folder = repository / name / "1"
        with pytest.raises(GoldenMismatch, match=message):
            check_golden(
                folder / GOLDEN_FILE, _runner(folder), np.dtype(np.float32), has_weights_graph=True
            )


def test_non_finite_output_is_refused(repository: Path) -> None:
    good = repository / "good" / "1"
    run = _runner(good)

    def nan_run(embeddings, mask, with_weights):
        output, weights = run(embeddings, mask, with_weights)
        output = output.copy()
        output[0, 0, 0] = np.nan
        return output, weights

    with pytest.raises(GoldenMismatch, match="non-finite"):
        check_golden(good / GOLDEN_FILE, nan_run, np.dtype(np.float32), has_weights_graph=False)


@pytest.mark.parametrize("half", [False, True])
def test_corrupt_golden_file_is_refused(tmp_path: Path, repository: Path, half: bool) -> None:
    """Garbage, or a golden file half written (a zip cut short: BadZipFile, which was reported
    as an unexpected error instead of a refused golden file)."""
    broken = tmp_path / GOLDEN_FILE
    good = (repository / "good" / "1" / GOLDEN_FILE).read_bytes()
    broken.write_bytes(good[: len(good) // 2] if half else b"not an npz")
    with pytest.raises(GoldenMismatch, match="cannot read"):
        check_golden(
            broken, _runner(repository / "good" / "1"), np.dtype(np.float32), has_weights_graph=True
        )


@pytest.mark.usefixtures("grpc_gateway")  # the gateway answers from the served set it is sent
def test_server_refuses_what_does_not_reproduce_and_serves_the_rest(repository: Path) -> None:
    with ServerProcess(repository, "--default-model", "good") as server:
        with AttentionClient(server.target) as client:
            served = {model.name for model in client.list_models()}
            x = np.random.default_rng(0).standard_normal((4, 32), dtype=np.float32)
            assert np.isfinite(client.attend(x, model="legacy").output).all()
        log = server.log
    assert served == {"good", "legacy"}
    provider = serving_provider()
    assert f"good/1: golden check passed on {provider}" in log
    assert "legacy/1: no golden.npz, served without a load-time check" in log
    for name in ("swapped", "skewed"):
        assert (
            f"not serving {name} version 1: golden check failed on {provider}: output differs"
            in log
        )
