"""Restricted APIs, as Triton's --grpc-restricted-protocol: calls in a restricted group need a
header with a key. One check, Restrictions.check(group, headers), serves gRPC (the interceptor
below) and REST alike; it raises PermissionDenied naming the header, never the value. The gRPC
gateway checks the calls it answers itself by the same rule, with what for_gateway() gives it
(service/gateway/restricted.go)."""

from __future__ import annotations

import hmac
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from service.errors import ModelNotFound, PermissionDenied, ServingError
from service.observability import metrics

# Triton's group names (its `trace` group has no RPC here).
GROUPS = (
    "model-repository",
    "shared-memory",
    "statistics",
    "model-config",
    "metadata",
    "inference",
    "health",
    "logging",
)

# Every RPC this server answers, in the group Triton puts it (or would: AttentionService's
# calls go where their V2 counterparts are; reflection describes the API, like metadata).
_V2 = "/inference.GRPCInferenceService/"
_ATTENTION = "/attention.v1.AttentionService/"
GROUP_OF_METHOD: dict[str, str] = {
    **{_V2 + m: "health" for m in ("ServerLive", "ServerReady", "ModelReady")},
    **{_V2 + m: "metadata" for m in ("ServerMetadata", "ModelMetadata")},
    **{_V2 + m: "inference" for m in ("ModelInfer", "ModelStreamInfer")},
    _V2 + "ModelConfig": "model-config",
    _V2 + "ModelStatistics": "statistics",
    **{
        _V2 + m: "model-repository"
        for m in ("RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload")
    },
    **{
        _V2 + f"{kind}SharedMemory{op}": "shared-memory"
        for kind in ("System", "Cuda")
        for op in ("Status", "Register", "Unregister")
    },
    _V2 + "LogSettings": "logging",
    **{_ATTENTION + m: "inference" for m in ("Attend", "AttendStream")},
    **{_ATTENTION + m: "metadata" for m in ("GetModel", "ListModels")},
    "/grpc.health.v1.Health/Check": "health",
    "/grpc.health.v1.Health/Watch": "health",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": "metadata",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": "metadata",
}

# A header name gRPC metadata can carry and that is not gRPC's own (or binary).
HEADER_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
SPEC_FORM = "GROUPS:KEY=VALUE (e.g. model-repository,shared-memory:admin-key=@/run/secrets/key)"


@dataclass(frozen=True)
class Key:
    """The header a restricted group needs, and its value (never shown)."""

    header: str
    value: str

    def __repr__(self) -> str:
        return f"Key(header={self.header!r}, value=<redacted>)"


class Restrictions:
    """Which groups need which header; empty = nothing restricted."""

    def __init__(self, keys: Mapping[str, Key] | None = None) -> None:
        self._keys = dict(keys or {})

    @classmethod
    def parse(cls, specs: Iterable[str]) -> Restrictions:
        """--restricted-api values; ValueError says what is wrong (never the value)."""
        keys: dict[str, Key] = {}
        for index, spec in enumerate(specs, start=1):
            groups, key = _parse_one(spec, index)
            for group in groups:
                if group in keys:
                    raise ValueError(
                        f"--restricted-api #{index}: group {group!r} is restricted twice; "
                        "each group takes one key"
                    )
                keys[group] = key
        return cls(keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def restricted(self, group: str) -> bool:
        return group in self._keys

    def describe(self) -> str:
        """Which groups need which header (for the start-up log; no values)."""
        by_header: dict[str, list[str]] = {}
        for group, key in self._keys.items():
            by_header.setdefault(key.header, []).append(group)
        return "; ".join(f"{','.join(g)} need header {h!r}" for h, g in by_header.items())

    def allows(self, group: str, headers: Mapping[str, str]) -> bool:
        """Whether group is open to a call with these headers (names in lower case): not
        restricted, or its key sent. Counts no denial (check() does)."""
        key = self._keys.get(group)
        if key is None:
            return True
        sent = headers.get(key.header)
        # Constant time: how much of a guess matched must not show in the answer's timing.
        return sent is not None and hmac.compare_digest(_raw(sent), key.value.encode())

    def details(self, err: ServingError, headers: Mapping[str, str]) -> str:
        """err's message for a caller with these headers: an unknown model's without the
        models (or versions) served where `metadata` is restricted and the caller lacks its
        key, as the metadata API that lists them would refuse it."""
        if not isinstance(err, ModelNotFound) or self.allows("metadata", headers):
            return str(err)
        return f"{err.unlisted}; the models served are listed by the metadata API"

    def check(self, group: str, headers: Mapping[str, str]) -> None:
        """Raise PermissionDenied unless headers (names in lower case) carry group's key."""
        if self.allows(group, headers):
            return
        sent = headers.get(self._keys[group].header) is not None
        metrics.RESTRICTED_DENIALS.labels(group).inc()
        raise PermissionDenied(self.denial(group, sent=sent))

    def denial(self, group: str, *, sent: bool) -> str:
        """Why a call of restricted group is refused: it came without the header (sent
        false) or with a wrong value in it. Names the header, never the value."""
        header = self._keys[group].header
        problem = "with a wrong value in the header" if sent else "without the header"
        return (
            f"the {group!r} API group is restricted on this server and this call came "
            f"{problem} {header!r}; send {header!r} with the key for {group!r}"
        )

    def for_gateway(self, groups: Iterable[str]) -> dict[str, Any]:
        """What the gateway needs to check the calls of groups it answers itself as check()
        does: the group of every restricted method, and each of those groups' header, key and
        refusals. It holds keys: it goes to the gateway by a file descriptor, never logged."""
        return {
            "methods": {m: g for m, g in GROUP_OF_METHOD.items() if g in self._keys},
            "keys": {
                group: {
                    "header": key.header,
                    "value": key.value,
                    "without": self.denial(group, sent=False),
                    "wrong": self.denial(group, sent=True),
                }
                for group in groups
                if (key := self._keys.get(group)) is not None
            },
        }


def _raw(sent: str | bytes) -> bytes:
    """A header value's bytes, for comparing with a key: aiohttp decodes header bytes that
    are not UTF-8 with surrogateescape (b"\\xff" is "\\udcff", which a plain encode()
    refuses: a 500 where a wrong key is a 403); surrogatepass encodes any surrogate, to bytes
    no key (valid UTF-8) has. gRPC's binary (-bin) metadata comes as bytes."""
    return sent if isinstance(sent, bytes) else sent.encode("utf-8", "surrogatepass")


def _parse_one(spec: str, index: int) -> tuple[list[str], Key]:
    where = f"--restricted-api #{index}"
    groups_text, colon, assignment = spec.partition(":")
    header, equals, value = assignment.partition("=")
    if not colon or not equals:
        raise ValueError(f"{where} is not of the form {SPEC_FORM}")
    groups = [group.strip() for group in groups_text.split(",") if group.strip()]
    unknown = [group for group in groups if group not in GROUPS]
    if not groups or unknown:
        raise ValueError(
            f"{where}: unknown group(s) {unknown or groups_text!r}; expected some of {GROUPS}"
        )
    header = header.strip().lower()
    if not HEADER_NAME.fullmatch(header) or header.startswith("grpc-") or header.endswith("-bin"):
        raise ValueError(
            f"{where}: KEY {header!r} is not a usable header name (lower-case letters, digits, "
            "'-', '_', '.'; not grpc-* nor *-bin)"
        )
    if value.startswith("@"):
        value = _read_secret(Path(value[1:]), where)
    if not value or not value.isprintable():
        raise ValueError(f"{where}: the VALUE for {header!r} is empty or not printable text")
    return groups, Key(header, value)


def _read_secret(path: Path, where: str) -> str:
    try:
        return path.read_text().strip()  # a mounted Secret often ends in a newline
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{where}: cannot read the key file {path}: {err}") from err


def _text_headers(metadata: Iterable[Any] | None) -> dict[str, str]:
    return {
        str(key).lower(): value
        for key, value in (metadata or ())
        if isinstance(value, str)  # -bin headers arrive as bytes and are never keys
    }


def error_details(
    restrictions: Restrictions, err: ServingError, context: grpc.aio.ServicerContext
) -> str:
    """Restrictions.details for a gRPC call (its metadata read only where it matters)."""
    if not isinstance(err, ModelNotFound) or not restrictions.restricted("metadata"):
        return str(err)
    return restrictions.details(err, _text_headers(context.invocation_metadata()))


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class RestrictedApiInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls of restricted groups before their handler runs (or reads a message)."""

    def __init__(self, restrictions: Restrictions) -> None:
        self._restrictions = restrictions

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        group = GROUP_OF_METHOD.get(method)
        if group is None or not self._restrictions.restricted(group):
            return await continuation(handler_call_details)
        headers = _text_headers(handler_call_details.invocation_metadata)
        try:
            self._restrictions.check(group, headers)
        except PermissionDenied as err:
            handler = await continuation(handler_call_details)
            return None if handler is None else _denying(handler, str(err))
        return await continuation(handler_call_details)


def _denying(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as handler that answers PERMISSION_DENIED; requests stay
    raw bytes (nothing is parsed or inflated for a call that is refused)."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)

    serializer = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, response_serializer=serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, response_serializer=serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, response_serializer=serializer)
    return grpc.unary_unary_rpc_method_handler(deny, response_serializer=serializer)
