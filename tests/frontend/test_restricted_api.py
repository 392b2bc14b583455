"""--restricted-api (Triton's --grpc-restricted-protocol): the group of every RPC, the parse and
the constant-time check, and a real server, its gRPC port served by the gateway and then by
Python: PERMISSION_DENIED without the header (naming it, never the value), success with
tritonclient's headers=, repository changes logged with who asked, and the start-up warning for
an open repository API in explicit mode. With the gateway, restricted inference calls are
answered by the gateway, which checks the key itself: refusals word for word as Python's,
counted once, and the key on no command line and in no log."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2
from prometheus_client.mmap_dict import MmapedDict
from tritonclient.utils import InferenceServerException

from service.client import AttentionClient, attend_request
from service.errors import PermissionDenied
from service.frontend.gateway import ANSWERED_GROUPS, metrics_spec
from service.frontend.restricted import GROUP_OF_METHOD, GROUPS, Restrictions
from service.generated.attention.v1 import attention_pb2, attention_pb2_grpc
from service.generated.inference import grpc_service_pb2
from service.observability.logs import HIDDEN_HEADER
from service.settings import describe, load_settings
from service.transport.codec import decode_tensor
from tests.gateway.test_grpc_differential import call as raw_call
from tests.gateway.test_grpc_differential import framed
from tests.harness.reference import attend_alone, layer_for
from tests.harness.server_process import ServerProcess, behind_gateway, child_pids
from tests.harness.tls_helpers import tiny_repository

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


def test_the_gateway_is_given_the_keys_of_the_calls_it_answers_only() -> None:
    """What the gateway reads (service/gateway/restricted.go): the group of every restricted
    method, and the key and refusals of the groups whose calls it answers, no other key."""
    restrictions = Restrictions.parse([f"inference:{HEADER}={SECRET}", "model-repository:r=v"])
    given = restrictions.for_gateway(ANSWERED_GROUPS)
    assert given["methods"] == {
        method: group
        for method, group in GROUP_OF_METHOD.items()
        if group in ("inference", "model-repository")
    }
    assert given["keys"] == {
        "inference": {
            "header": HEADER,
            "value": SECRET,
            "without": restrictions.denial("inference", sent=False),
            "wrong": restrictions.denial("inference", sent=True),
        }
    }
    # The methods the gateway answers itself are all in the groups it is given keys for.
    fast = ("ModelInfer", "ModelStreamInfer", "Attend", "AttendStream")
    groups = {g for m, g in GROUP_OF_METHOD.items() if m.rsplit("/", 1)[1] in fast}
    assert groups <= set(ANSWERED_GROUPS)
    with pytest.raises(PermissionDenied) as denied:
        restrictions.check("inference", {HEADER: "guess"})
    assert str(denied.value) == given["keys"]["inference"]["wrong"]
    assert Restrictions().for_gateway(ANSWERED_GROUPS) == {"methods": {}, "keys": {}}
    assert metrics_spec()["restricted_denials"]["sample"] == DENIALS


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
def restricted(
    grpc_gateway: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    repository = tiny_repository(tmp_path_factory.getbasetemp())
    key_file = tmp_path_factory.mktemp("secret") / "admin-key"
    key_file.write_text(SECRET)
    flags = (
        "--model-control-mode",
        "explicit",
        "--restricted-api",
        f"model-repository,inference:{HEADER}=@{key_file}",
    )
    with ServerProcess(repository, *flags, http=True) as server:
        assert behind_gateway(server) == (grpc_gateway == "on"), server.log
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
    # The worker's own line names the caller too, and so do REST's (it named no one).
    assert "load of model 'mha' asked by peer 'ipv4:127.0.0.1:" in restricted.log
    import tritonclient.http as triton_http

    rest = triton_http.InferenceServerClient(restricted.http_url)
    rest.unload_model("mha", headers=headers)
    rest.load_model("mha", headers=headers)
    for op in ("unload", "load"):
        assert f"REST {op} of model 'mha' asked by peer '127.0.0.1'" in restricted.log
        assert f": {op} of model 'mha' asked by peer '127.0.0.1'" in restricted.log  # worker
    assert "asked by \n" not in restricted.log
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


DENIALS = "attention_restricted_api_denials_total"
INFERENCE_METHODS = [method for method, group in GROUP_OF_METHOD.items() if group == "inference"]
# The refusals' words, as the Python front end gives them.
WORDS = Restrictions.parse([f"inference:{HEADER}=k"])
WITHOUT, WRONG = WORDS.denial("inference", sent=False), WORDS.denial("inference", sent=True)
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED.value[0]


def _gateway_pid(server: ServerProcess) -> int | None:
    pids = [pid for name, pid in child_pids(server).items() if name.endswith("-gateway")]
    return pids[-1] if pids else None


def _counted_by(pid: int, sample: str, **labels: str) -> float:
    """What the process pid itself counted in a counter (its own multiprocess file)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    folder = next(v[25:] for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR="))
    counters = Path(os.fsdecode(folder)) / f"counter_{pid}.db"
    if not counters.exists():
        return 0.0
    total = 0.0
    for key, value, _, _ in MmapedDict.read_all_values_from_file(str(counters)):
        _, name, sample_labels, _ = json.loads(key)
        if name == sample and labels.items() <= sample_labels.items():
            total += value
    return total


def test_the_gateway_answers_restricted_inference_with_the_key(
    restricted: ServerProcess, grpc_gateway: str
) -> None:
    """Calls with the key get torch's numbers, on each API; with the gateway on, it is running
    and answers them itself (they are in its own request count)."""
    pid = _gateway_pid(restricted)
    assert (pid is not None) == (grpc_gateway == "on"), restricted.log
    if pid is not None:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state not in ("Z", "X"), state
        before = _counted_by(pid, "attention_requests_total", code="OK")
    layer = layer_for(32, 2)
    x = np.random.default_rng(2).standard_normal((2, 5, 32), dtype=np.float32)
    expected, _ = attend_alone(layer, x)
    with triton.InferenceServerClient(restricted.target) as client:
        tensor = triton.InferInput("embeddings", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        answer = client.infer("mha", [tensor], headers={HEADER: SECRET})
    np.testing.assert_allclose(answer.as_numpy("output"), expected, atol=1e-4, rtol=1e-4)
    metadata = ((HEADER, SECRET),)
    with grpc.insecure_channel(restricted.target) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        response = stub.Attend(attend_request(x[0]), metadata=metadata, timeout=20)
        requests = [attend_request(x[i], request_id=str(i)) for i in range(2)]
        streamed = list(stub.AttendStream(iter(requests), metadata=metadata, timeout=20))
    np.testing.assert_allclose(
        decode_tensor(response.output, "output"), expected[0], atol=1e-4, rtol=1e-4
    )
    by_id = {reply.request_id: reply for reply in streamed}
    assert sorted(by_id) == ["0", "1"], streamed
    for i in range(2):
        output = decode_tensor(by_id[str(i)].response.output, "output")
        np.testing.assert_allclose(output, expected[i], atol=1e-4, rtol=1e-4)
    if pid is not None:
        assert _counted_by(pid, "attention_requests_total", code="OK") >= before + 4


def _request(method: str) -> bytes:
    x = np.random.default_rng(1).standard_normal((1, 4, 32), dtype=np.float32)
    if method.startswith("/attention."):
        return attend_request(x[0]).SerializeToString()
    request = grpc_service_pb2.ModelInferRequest(model_name="mha")
    request.inputs.add(name="embeddings", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request.SerializeToString()


@pytest.mark.parametrize("method", INFERENCE_METHODS, ids=lambda m: m.rsplit("/", 1)[1])
def test_refusals_are_pythons_word_for_word_and_counted_once(
    restricted: ServerProcess, grpc_gateway: str, method: str
) -> None:
    """Raw HTTP/2 calls carrying the header in every way a client can: answered alike with the
    gateway and without it (PERMISSION_DENIED with Python's message, or served), each refusal
    counted once, by the process that answered it (with the gateway on: the gateway)."""
    header = HEADER.encode()
    cases: list[tuple[str, list[tuple[bytes, bytes]], str | None]] = [
        ("no header", [], WITHOUT),
        ("a wrong value", [(header, b"guess")], WRONG),
        ("an empty value", [(header, b"")], WRONG),
        ("the key cut short", [(header, SECRET[:-1].encode())], WRONG),
        # Longer than any key, within gRPC core's metadata size (8 KiB: past it gRPC Python
        # refuses a share of calls at random, RESOURCE_EXHAUSTED).
        ("an oversized value", [(header, b"k" * 6000)], WRONG),
        ("bytes that are not ASCII", [(header, b"\xff\xfe-\xc3\xa9")], WRONG),
        ("the key, then a wrong value", [(header, SECRET.encode()), (header, b"guess")], WRONG),
        ("a wrong value, then the key", [(header, b"guess"), (header, SECRET.encode())], None),
        ("the key", [(header, SECRET.encode())], None),
        # gRPC Python logs a header value that is not UTF-8: the key in it stays out of
        # every log (checked below), whichever process answers.
        ("the key and a byte not ASCII", [(header, SECRET.encode() + b"\x80")], WRONG),
    ]
    pid = _gateway_pid(restricted)
    before = restricted.metric(DENIALS, group="inference")
    gateway_before = 0.0 if pid is None else _counted_by(pid, DENIALS, group="inference")
    body = framed(_request(method))
    refused = 0
    for name, headers, message in cases:
        answer = raw_call(restricted.grpc_port, method, body, headers=headers)
        if message is None:
            assert (answer.code, len(answer.messages())) == (0, 1), (name, answer)
            continue
        refused += 1
        assert (answer.code, answer.message, answer.messages()) == (
            PERMISSION_DENIED,
            message,
            [],
        ), (name, answer)
    assert restricted.wait_metric(DENIALS, before + refused, group="inference") == before + refused
    if pid is not None:
        assert _counted_by(pid, DENIALS, group="inference") == gateway_before + refused
    assert SECRET not in restricted.log
    if grpc_gateway == "off":  # gRPC Python logged the value that is not UTF-8, hidden
        assert HIDDEN_HEADER in restricted.log


def test_a_key_set_in_the_environment_stays_out_of_the_childrens(
    tmp_path_factory: pytest.TempPathFactory, grpc_gateway: str
) -> None:
    """ATTENTION_RESTRICTED_API read, the supervisor's children (worker, front ends, their
    gateways) do not inherit it: /proc/PID/environ of each is readable longer than a log."""
    repository = tiny_repository(tmp_path_factory.getbasetemp())
    env = {"ATTENTION_RESTRICTED_API": f"inference:{HEADER}={SECRET}"}
    with ServerProcess(repository, env=env) as server:
        children = child_pids(server)
        assert any(name.endswith("-gateway") for name in children) == (grpc_gateway == "on")
        for name, pid in children.items():
            assert SECRET.encode() not in Path(f"/proc/{pid}/environ").read_bytes(), name
        client = triton.InferenceServerClient(server.target)
        with pytest.raises(InferenceServerException, match="is restricted on this server"):
            _infer(client)  # and the key is still checked
        assert _infer(client, headers={HEADER: SECRET}).shape == (1, 4, 32)


def test_the_key_is_on_no_command_line_and_in_no_log(
    restricted: ServerProcess, grpc_gateway: str
) -> None:
    """Every process's command line (the host's), and the gateway's environment and open
    files: the key is in none of them; nor in the server's log."""
    pid = _gateway_pid(restricted)
    assert (pid is not None) == (grpc_gateway == "on")
    secret = SECRET.encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue  # gone since the listing
            assert secret not in cmdline, proc.name
    if pid is not None:
        assert secret not in Path(f"/proc/{pid}/environ").read_bytes()
        fds = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        assert not [fd for fd in fds if "restricted-api" in fd], fds
    assert SECRET not in restricted.log


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("bogus:x-k=v", "unknown group(s) ['bogus']"),
        ("inference:x-k=@/nonexistent", "cannot read the key file /nonexistent"),
    ],
)
def test_a_bad_spec_is_refused_before_any_model_is_loaded(
    tmp_path: Path, spec: str, says: str
) -> None:
    server = ServerProcess(tiny_repository(tmp_path), "--restricted-api", spec)
    assert server.process.wait(60) == 1
    assert f"cannot start: --restricted-api #1: {says}" in server.log
    assert "loading" not in server.log


def test_an_unknown_model_is_not_listed_to_a_grpc_caller_without_the_metadata_key(
    grpc_gateway: str, tmp_path: Path
) -> None:
    """docs/security.md: where metadata is restricted, a NOT_FOUND names only what was asked
    for to a caller without its key, on every gRPC path as on REST (unary calls and stream
    messages of both APIs listed the models served, or the versions)."""
    flags = (
        "--restricted-api",
        "inference:x-infer-key=s1",
        "--restricted-api",
        f"metadata:{HEADER}={SECRET}",
    )
    x = np.zeros((1, 4, 32), np.float32)

    def texts(headers: dict[str, str]) -> list[str]:
        metadata = tuple(headers.items())
        found = []
        with grpc.insecure_channel(server.target) as channel:
            ours = attention_pb2_grpc.AttentionServiceStub(channel)
            v2 = triton.InferenceServerClient(server.target)
            for model, version in (("nope", ""), ("mha", "9")):
                request = attend_request(x[0], model=model, model_version=version)
                with pytest.raises(grpc.RpcError) as refused:
                    ours.Attend(request, metadata=metadata, timeout=30)
                found.append(refused.value.details() or "")
                (answer,) = ours.AttendStream(iter([request]), metadata=metadata, timeout=30)
                found.append(answer.error.message)
                tensor = triton.InferInput("embeddings", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x)
                with pytest.raises(InferenceServerException) as unknown:
                    v2.infer(model, [tensor], model_version=version, headers=headers)
                found.append(unknown.value.message())
            v2.close()
        return found

    with ServerProcess(tiny_repository(tmp_path), *flags) as server:
        assert behind_gateway(server) == (grpc_gateway == "on"), server.log
        for text in texts({"x-infer-key": "s1"}):
            assert "is served here; the models served are listed by the metadata API" in text
            assert "serves" not in text
            assert "available versions" not in text
        for text in texts({"x-infer-key": "s1", HEADER: SECRET}):
            assert "this server serves ['mha']" in text or "available versions: [1]" in text
