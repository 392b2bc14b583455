"""What clients see of the model repository: paths relative to it, never the server's absolute
ones (load errors, RepositoryIndex); a model folder that links out of the repository is
refused with a clear load error unless --repository-follow-symlinks on."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from service.worker.engine.repository import is_model_name, relative_text, scan
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
    # Names no client can send, or that would forge log lines: not models.
    os.mkdir(bytes(repository) + b"/bad\xffname")
    shutil.copytree(tiny, repository / "new\nline")
    return repository


def test_links_out_of_the_repository_are_refused_unless_followed(layout: Path) -> None:
    refused = {files.name: files.refused for files in scan(layout).versions}
    assert sorted(refused) == ["broken", "inside", "linked", "mha"]  # not the unprintable
    assert refused["mha"] == refused["inside"] == refused["broken"] == ""
    assert refused["linked"].startswith("linked is a symbolic link")
    assert "--repository-follow-symlinks on" in refused["linked"]
    followed = scan(layout, follow_symlinks=True).versions
    assert all(files.refused == "" for files in followed)


def test_a_models_name_is_valid_utf8_without_control_characters() -> None:
    assert is_model_name("nb\u00a0sp")  # a no-break space
    assert is_model_name("\U0001f469\u200d\U0001f4bb")  # an emoji sequence (a joiner)
    for name in ("new\nline", "bad\udcffname", "tab\tbed", "line\u2028separated"):
        assert not is_model_name(name), name


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
    assert sorted(reasons) == ["broken", "inside", "linked", "mha"]  # was INTERNAL
    assert "symbolic link" in reasons["linked"]
    assert all(absolute not in reason for reason in reasons.values()), reasons


LONG_NAME = "m" * 70  # a folder name past what messages echo (service/text.py SHOWN_CHARS)


@pytest.fixture(scope="module")
def long_named(tmp_path_factory: pytest.TempPathFactory, grpc_gateway: str) -> Iterator[str]:
    """A server whose one model's folder has a 70-character name."""
    tiny = tiny_repository(tmp_path_factory.getbasetemp()) / "mha"
    repository = tmp_path_factory.mktemp("long") / "repository"
    shutil.copytree(tiny, repository / LONG_NAME)
    with ServerProcess(repository) as process:
        yield process.target


def _message(failed: pytest.ExceptionInfo) -> str:
    error = failed.value
    return error.details() if isinstance(error, grpc.RpcError) else error.message()


def _attend(target: str, shape: list[int], value: float, model: str = LONG_NAME) -> None:
    with grpc.insecure_channel(target) as channel:
        data = np.full(shape, value, np.float32).tobytes()
        embeddings = pb.Tensor(shape=shape, dtype=pb.FLOAT32, data=data)
        attention_pb2_grpc.AttentionServiceStub(channel).Attend(
            pb.AttendRequest(model=model, embeddings=embeddings), timeout=30
        )


def _infer(target: str, shape: list[int], value: float, model: str = LONG_NAME) -> None:
    tensor = triton.InferInput("embeddings", shape, "FP32")
    tensor.set_data_from_numpy(np.full(shape, value, np.float32))
    triton.InferenceServerClient(target).infer(model, [tensor])


@pytest.mark.parametrize(
    ("call", "shape", "value", "expected"),
    [
        (_attend, [2, 16], 1.0, "expects d=32"),  # the front end's shape check
        (_infer, [2, 16], 1.0, "expects [n, seq, 32]"),  # the V2 codec's rank check
        (_attend, [4, 32], 1e30, "holds NaN or inf"),  # the worker's check of the output
        (_infer, [1, 4, 32], 1e30, "holds NaN or inf"),
    ],
)
def test_a_long_model_name_is_cut_in_messages(
    long_named: str, call, shape: list[int], value: float, expected: str
) -> None:
    with pytest.raises((grpc.RpcError, InferenceServerException)) as failed:
        call(long_named, shape, value)
    message = _message(failed)
    assert expected in message
    assert f"'{'m' * 64}'... (6 more characters)" in message
    assert "m" * 65 not in message


def test_an_unknown_model_lists_the_served_names_cut(long_named: str) -> None:
    for call in (_attend, _infer):
        with pytest.raises((grpc.RpcError, InferenceServerException)) as failed:
            call(long_named, [1, 2, 32], 1.0, model="nope")
        message = _message(failed)
        assert f"this server serves ['{'m' * 64}'... (6 more characters)]" in message, message
