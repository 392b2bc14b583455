"""The one place that maps domain errors to gRPC status codes."""

from __future__ import annotations

import grpc

from service.errors import (
    AnswersBacklogged,
    CompressedTooLarge,
    DeadlineExpired,
    InvalidInput,
    ModelControlDisabled,
    ModelNotFound,
    NotSupported,
    PermissionDenied,
    QueueFull,
    ServingError,
    ShuttingDown,
)

CODE_BY_ERROR: dict[type[ServingError], grpc.StatusCode] = {
    InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExpired: grpc.StatusCode.DEADLINE_EXCEEDED,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    NotSupported: grpc.StatusCode.UNIMPLEMENTED,
    # Triton answers UNAVAILABLE, which clients read as "retry"; no retry can change the mode.
    ModelControlDisabled: grpc.StatusCode.FAILED_PRECONDITION,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    AnswersBacklogged: grpc.StatusCode.RESOURCE_EXHAUSTED,
    CompressedTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def code_for(error: ServingError) -> grpc.StatusCode:
    for kind in type(error).__mro__:
        if kind in CODE_BY_ERROR:
            return CODE_BY_ERROR[kind]
    return grpc.StatusCode.INTERNAL
