"""The one place that maps domain errors to status codes: gRPC's, and HTTP's derived from them."""

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
    RegionExists,
    RegionNotFound,
    RegionsExhausted,
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
    RegionNotFound: grpc.StatusCode.NOT_FOUND,
    RegionExists: grpc.StatusCode.ALREADY_EXISTS,
    RegionsExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def code_for(error: ServingError) -> grpc.StatusCode:
    for kind in type(error).__mro__:
        if kind in CODE_BY_ERROR:
            return CODE_BY_ERROR[kind]
    return grpc.StatusCode.INTERNAL


# The HTTP/REST front end answers the HTTP status of the gRPC code the same error gets, so the
# two APIs cannot disagree about an error.
HTTP_STATUS_BY_CODE: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,  # the client went away (nginx's code; never sent)
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

# Codes that mean the server failed the call (OpenTelemetry's rule for gRPC server spans).
SERVER_FAULTS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS_BY_CODE.get(code, 500)
