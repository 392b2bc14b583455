"""Server reflection as both `grpc.reflection.v1` and `grpc.reflection.v1alpha`.

grpcio-reflection serves only v1alpha, while current grpcurl and Postman ask v1 first. The two
protocols are the same messages under another package name, so one servicer answers both; the
v1 file is v1alpha's descriptor renamed, so reflection can describe itself under either name.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha import reflection, reflection_pb2

from service.transport.proto_pool import pool_of

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)


def _v1_file() -> bytes:
    """grpc/reflection/v1/reflection.proto: v1alpha's file with its package renamed."""
    old = reflection_pb2.DESCRIPTOR.package
    proto = descriptor_pb2.FileDescriptorProto.FromString(reflection_pb2.DESCRIPTOR.serialized_pb)
    proto.name = "grpc/reflection/v1/reflection.proto"
    proto.package = V1_PACKAGE
    proto.ClearField("options")  # v1alpha's java_package and friends

    def rename(type_name: str) -> str:
        return f".{V1_PACKAGE}.{type_name.removeprefix(f'.{old}.')}"

    def messages(
        found: Iterable[descriptor_pb2.DescriptorProto],
    ) -> Iterable[descriptor_pb2.DescriptorProto]:
        for message in found:
            yield message
            yield from messages(message.nested_type)

    for message in messages(proto.message_type):
        for field in message.field:
            if field.HasField("type_name"):  # messages only: setting it on a scalar is invalid
                field.type_name = rename(field.type_name)
    for service in proto.service:
        for method in service.method:
            method.input_type = rename(method.input_type)
            method.output_type = rename(method.output_type)
    return proto.SerializeToString()


def reflection_pool(files: Iterable[FileDescriptor]) -> DescriptorPool:
    """The served files, their imports, and both reflection protocols' own files."""
    pool = pool_of([*files, reflection_pb2.DESCRIPTOR])
    pool.AddSerializedFile(_v1_file())
    return pool


def enable(
    server: grpc.aio.Server, services: Iterable[str], files: Iterable[FileDescriptor]
) -> None:
    """Serve reflection under both names, listing services and these two."""
    servicer = reflection.aio.ReflectionServicer(
        [*services, *SERVICE_NAMES], pool=reflection_pool(files)
    )
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler})
            for name in SERVICE_NAMES
        ]
    )
