"""--restricted-api (Triton's --grpc-restricted-protocol): the group of every RPC, the parse and
the constant-time check, and a real server: PERMISSION_DENIED without the header (naming it,
never the value), success with tritonclient's headers=, repository changes logged with who
asked, and the start-up warning for an open repository API in explicit mode."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2
from tritonclient.utils import InferenceServerException

from service.client import AttentionClient
from service.errors import PermissionDenied
from service.frontend.restricted import GROUP_OF_METHOD, GROUPS, Restrictions
from service.generated.attention.v1 import attention_pb2
from service.generated.inference import grpc_service_pb2
from service.settings import describe, load_settings
from tests.server_process import ServerProcess
from tests.tls_helpers import tiny_repository

HEADER = "x-admin-key"
SECRET = "s3cret-Value-42"


def _methods(service: object) -> list[str]:
    return [f"/{service.full_name}/{m.name}" for m in service.methods]  # type: ignore[attr-defined]


def test_every_rpc_has_a_triton_group() -> None:
    services = [
        attention_pb2.DESCRIPTOR.services_by_name["AttentionService"],
        grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"],
        health_pb2.DESCRIPTOR.services_by_name["Health"],
    ]
    methods = [name for service in services for name in _methods(service)]
    assert [m for m in methods if m not in GROUP_OF_METHOD] == []
    assert set(GROUP_OF_METHOD.values()) <= set(GROUPS)
    assert GROUP_OF_METHOD["/attention.v1.AttentionService/Attend"] == "inference"
    assert GROUP_OF_METHOD["/attention.v1.AttentionService/ListModels"] == "metadata"
    assert GROUP_OF_METHOD["/inference.GRPCInferenceService/RepositoryModelUnload"] == (
        "model-repository"
    )


def test_the_check_names_the_header_never_the_value(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(SECRET + "\n")  # a mounted Secret's trailing newline is dropped
    restrictions = Restrictions.parse(
        [f"model-repository,statistics:{HEADER}=@{key_file}", "inference:other=plain"]
    )
    restrictions.check("model-repository", {HEADER: SECRET})
    restrictions.check("health", {})  # not restricted
    restrictions.check("inference", {"other": "plain"})
    for headers in ({}, {HEADER: "wrong"}, {HEADER: SECRET[:-1]}):
        with pytest.raises(PermissionDenied) as denied:
            restrictions.check("statistics", headers)
        assert HEADER in str(denied.value)
        assert SECRET not in str(denied.value)
    assert SECRET not in restrictions.describe()


@pytest.mark.parametrize(
    "spec",
    [
        "model-repository",  # no key
        "nonsense:key=value",
        "inference:grpc-timeout=value",
        "inference:key=",
        "inference:key=@/nonexistent/secret",
    ],
)
def test_bad_specs_say_what_is_wrong_without_the_value(spec: str) -> None:
    with pytest.raises(ValueError, match="--restricted-api #1"):
        Restrictions.parse([spec])


def test_a_group_takes_one_key() -> None:
    with pytest.raises(ValueError, match="restricted twice"):
        Restrictions.parse(["inference:a=1", "metadata,inference:b=2"])


def test_settings_read_specs_from_the_environment_and_never_log_them() -> None:
    settings = load_settings(
        [], {"ATTENTION_RESTRICTED_API": f"inference,metadata:{HEADER}={SECRET};health:h=v"}
    )
    assert settings.restricted_api == (f"inference,metadata:{HEADER}={SECRET}", "health:h=v")
    assert SECRET not in describe(settings)


@pytest.fixture(scope="module")
def restricted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repository = tiny_repository(tmp_path_factory.getbasetemp())
    key_file = tmp_path_factory.mktemp("secret") / "admin-key"
    key_file.write_text(SECRET)
    flags = (
        "--model-control-mode", "explicit",
        "--restricted-api", f"model-repository,inference:{HEADER}=@{key_file}",
    )  # fmt: skip
    with ServerProcess(repository, *flags, http=True) as server:
        yield server


def _infer(client: triton.InferenceServerClient, **kwargs: object) -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((1, 4, 32), dtype=np.float32)
    tensor = triton.InferInput("embeddings", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    result = client.infer("mha", [tensor], **kwargs)  # type: ignore[arg-type]
    return result.as_numpy("output")


def test_restricted_groups_need_the_header(restricted: ServerProcess) -> None:
    client = triton.InferenceServerClient(restricted.target)
    assert client.is_server_live()  # health: not restricted
    for call in (
        lambda: client.get_model_repository_index(),
        lambda: client.unload_model("mha"),
        lambda: _infer(client),
        lambda: _infer(client, headers={HEADER: "guess"}),
    ):
        with pytest.raises(InferenceServerException) as denied:
            call()
        assert denied.value.status() == "StatusCode.PERMISSION_DENIED"
        assert HEADER in denied.value.message()
        assert SECRET not in denied.value.message()
    with AttentionClient(restricted.target) as ours, pytest.raises(grpc.RpcError) as attend:
        ours.attend(np.zeros((4, 32), dtype=np.float32))
    assert attend.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert restricted.metric("attention_restricted_api_denials_total", group="inference") >= 3
    assert SECRET not in restricted.log


def test_the_key_opens_them_and_changes_are_logged_with_the_caller(
    restricted: ServerProcess,
) -> None:
    client = triton.InferenceServerClient(restricted.target)
    headers = {HEADER: SECRET}
    assert _infer(client, headers=headers).shape == (1, 4, 32)
    client.unload_model("mha", headers=headers)
    client.load_model("mha", headers=headers)
    assert client.is_model_ready("mha")
    index = client.get_model_repository_index(headers=headers, as_json=True)
    assert [m["name"] for m in index["models"]] == ["mha"]
    assert "RepositoryModelUnload 'mha' asked by peer 'ipv4:127.0.0.1:" in restricted.log
    assert "RepositoryModelLoad 'mha' asked by peer 'ipv4:127.0.0.1:" in restricted.log
    assert "model-repository API unrestricted" not in restricted.log


def test_rest_answers_403_without_the_key_and_serves_with_it(restricted: ServerProcess) -> None:
    import tritonclient.http as triton_http

    client = triton_http.InferenceServerClient(restricted.http_url)
    assert client.is_server_live()  # health: not restricted
    x = np.random.default_rng(0).standard_normal((1, 4, 32), dtype=np.float32)
    tensor = triton_http.InferInput("embeddings", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as denied:
        client.infer("mha", [tensor])
    assert denied.value.status() == "403"
    assert HEADER in denied.value.message()
    assert SECRET not in denied.value.message()
    with pytest.raises(InferenceServerException) as index:
        client.get_model_repository_index()
    assert index.value.status() == "403"
    answer = client.infer("mha", [tensor], headers={HEADER: SECRET})
    assert answer.as_numpy("output").shape == (1, 4, 32)


def test_explicit_mode_with_an_open_repository_api_warns(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    repository = tiny_repository(tmp_path_factory.getbasetemp())
    flags = ("--model-control-mode", "explicit", "--restricted-api", "inference:k=v")
    with ServerProcess(repository, *flags) as server:
        assert "model-repository API unrestricted" in server.log
