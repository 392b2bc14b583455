"""The gRPC server's channel options, in one place: the real server and the benchmark's echo
server use the same ones, so the echo server measures the same protocol floor."""

from __future__ import annotations

from typing import Any

GRPC_MAX_MESSAGE_BYTES = 2**31 - 1


def server_options(*, receive_bytes: int, send_bytes: int) -> list[tuple[str, Any]]:
    """Options for grpc.aio.server(); message limits come from the largest legal call."""
    return [
        ("grpc.max_receive_message_length", min(receive_bytes, GRPC_MAX_MESSAGE_BYTES)),
        ("grpc.max_send_message_length", min(send_bytes, GRPC_MAX_MESSAGE_BYTES)),
        # A second server on a taken port must fail, not silently share it.
        ("grpc.so_reuseport", 0),
    ]
