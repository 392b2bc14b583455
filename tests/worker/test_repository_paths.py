"""What clients see of the model repository: paths relative to it, never the server's absolute
ones (load errors, RepositoryIndex); a model folder that links out of the repository is
refused with a clear load error unless --repository-follow-symlinks on."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from service.worker.engine.repository import relative_text, scan
from tests.harness.server_process import ServerProcess
from tests.harness.tls_helpers import tiny_repository


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """repository/ with mha (a copy of the tiny model), linked -> a folder outside it,
    inside -> mha (a link that stays within), broken (a graph ONNX Runtime cannot read)."""
    tiny = tiny_repository(tmp_path_factory.getbasetemp()) / "mha"
    base = tmp_path_factory.mktemp("paths")
    repository, outside = base / "repository", base / "outside"
    shutil.copytree(tiny, repository / "mha")
    shutil.copytree(tiny, outside / "linked")
    (repository / "linked").symlink_to(outside / "linked", target_is_directory=True)
    (repository / "inside").symlink_to(repository / "mha", target_is_directory=True)
    (repository / "broken" / "1").mkdir(parents=True)
    (repository / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx graph")
    return repository


def test_links_out_of_the_repository_are_refused_unless_followed(layout: Path) -> None:
    refused = {files.name: files.refused for files in scan(layout).versions}
    assert refused["mha"] == refused["inside"] == refused["broken"] == ""
    assert refused["linked"].startswith("linked is a symbolic link")
    assert "--repository-follow-symlinks on" in refused["linked"]
    followed = scan(layout, follow_symlinks=True).versions
    assert all(files.refused == "" for files in followed)


def test_messages_lose_the_repository_path(tmp_path: Path) -> None:
    root = tmp_path / "models"
    text = f"Load model from {root}/mha/1/model.onnx failed; {root}2/x stays; {root} is it"
    assert relative_text(text, root) == (
        f"Load model from mha/1/model.onnx failed; {root}2/x stays; <model repository> is it"
    )


@pytest.fixture(scope="module")
def server(layout: Path, grpc_gateway: str) -> Iterator[ServerProcess]:
    """In each gateway mode: the gateway hands these calls on, and their answers back."""
    flags = ("--model-control-mode", "explicit", "--load-model", "mha")
    with ServerProcess(layout, *flags) as process:
        yield process


def _load_error(client: triton.InferenceServerClient, name: str) -> str:
    with pytest.raises(InferenceServerException) as failed:
        client.load_model(name)
    assert failed.value.status() == "StatusCode.INVALID_ARGUMENT"
    return failed.value.message()


def test_clients_see_repository_relative_paths_only(server: ServerProcess, layout: Path) -> None:
    client = triton.InferenceServerClient(server.target)
    absolute = str(layout.parent)
    linked = _load_error(client, "linked")
    assert "symbolic link that leads out of the model repository" in linked
    assert absolute not in linked
    broken = _load_error(client, "broken")
    assert "broken/1/model.onnx" in broken or "ONNX Runtime cannot load it" in broken
    assert absolute not in broken
    client.load_model("inside")  # a link within the repository is fine
    index = client.get_model_repository_index(as_json=True)["models"]
    reasons = {entry["name"]: entry.get("reason", "") for entry in index}
    assert "symbolic link" in reasons["linked"]
    assert all(absolute not in reason for reason in reasons.values()), reasons
