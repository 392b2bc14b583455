"""What tools ask a server about itself, with the gateway serving the port and without it:
server reflection as grpc.reflection.v1 (what current grpcurl and Postman ask first) and as
v1alpha (older tools); the healthcheck command naming what exists when asked for what does not."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from service import healthcheck
from tests.harness.server_process import ServerProcess

SERVICES = {
    "attention.v1.AttentionService",
    "inference.GRPCInferenceService",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
}


def _ask_v1(target: str, *requests: reflection_pb2.ServerReflectionRequest) -> list:
    """One grpc.reflection.v1 call (its messages are v1alpha's, field for field)."""
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        return list(call(iter(requests), timeout=30))


def _files(answer: reflection_pb2.ServerReflectionResponse) -> dict:
    protos = answer.file_descriptor_response.file_descriptor_proto
    files = [descriptor_pb2.FileDescriptorProto.FromString(proto) for proto in protos]
    return {file.name: file for file in files}


def test_v1_lists_services_and_describes_them(server: ServerProcess) -> None:
    listed, v2_file, itself = _ask_v1(
        server.target,
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="inference.GRPCInferenceService"
        ),
        reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="grpc.reflection.v1.ServerReflection"
        ),
    )
    assert {service.name for service in listed.list_services_response.service} == SERVICES
    # The file that holds the symbol, and the files it imports.
    v2 = _files(v2_file)["inference/grpc_service.proto"]
    assert "ModelInfer" in [method.name for method in v2.service[0].method]
    assert "inference/model_config.proto" in _files(v2_file)
    own_file = _files(itself)["grpc/reflection/v1/reflection.proto"]
    assert own_file.package == "grpc.reflection.v1"
    (method,) = own_file.service[0].method
    assert method.input_type == ".grpc.reflection.v1.ServerReflectionRequest"


def test_v1_names_an_unknown_symbol_not_found(server: ServerProcess) -> None:
    (answer,) = _ask_v1(
        server.target, reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.Such")
    )
    assert answer.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_v1alpha_lists_and_describes_every_service(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert set(database.get_services()) == SERVICES
        health = database.FindFileContainingSymbol("grpc.health.v1.Health")
        v1 = database.FindFileContainingSymbol("grpc.reflection.v1.ServerReflection")
    assert health.name == "grpc_health/v1/health.proto"
    assert v1.name == "grpc/reflection/v1/reflection.proto"


def test_the_healthcheck_names_what_exists_when_asked_for_what_does_not(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    assert healthcheck.main(["--target", server.target, "--service", "mha"]) == 0
    assert healthcheck.main(["--target", server.target, "--service", "nope"]) == 1
    said = capsys.readouterr().err
    assert said.startswith("unhealthy: NOT_FOUND: ")
    assert "no health entry named 'nope'" in said
    for name in ("'attention.v1.AttentionService'", "'inference.GRPCInferenceService'"):
        assert name in said
    assert "'mha', " in said, said
    assert "'small'" in said, said
