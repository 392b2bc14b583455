"""Register generated servicers with response serializers that also take WireMessage."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import grpc

from service.wire import serializer_for


class _Recorder:
    """Stands in for the server while generated add_*_to_server code registers its handlers."""

    def __init__(self) -> None:
        self.services: list[tuple[str, Mapping[str, grpc.RpcMethodHandler]]] = []

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Ignored: the registered handlers below describe the same methods."""

    def add_registered_method_handlers(
        self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]
    ) -> None:
        self.services.append((service, handlers))


def add_servicer(
    server: grpc.aio.Server, add_to_server: Callable[[Any, Any], None], servicer: Any
) -> None:
    """Like add_XServicer_to_server(servicer, server), with WireMessage-aware serializers."""
    recorder = _Recorder()
    add_to_server(servicer, recorder)
    for service, handlers in recorder.services:
        wired = {
            method: handler._replace(  # type: ignore[attr-defined]
                response_serializer=serializer_for(handler.response_serializer)
            )
            for method, handler in handlers.items()
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, wired),))
        server.add_registered_method_handlers(service, wired)
