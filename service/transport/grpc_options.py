"""The gRPC server's channel options, in one place (the benchmark's echo floor is the real
server serving a zero-compute model, so it measures these same options).

Connection hygiene (README, "Connection hygiene", says why each value):
- keepalive: the server pings an idle connection every KEEPALIVE_TIME_MS and drops it when no
  answer comes within KEEPALIVE_TIMEOUT_MS, so connections of vanished clients (a node gone,
  a NAT entry dropped) do not pile up.
- keepalive enforcement: clients may ping, even with no call open, but not more often than
  MIN_CLIENT_PING_INTERVAL_MS; a client that does is sent GOAWAY (too_many_pings).
- max connection age: a connection is asked to go away (GOAWAY; gRPC core adds +-10% jitter
  so connections opened together do not all reconnect together) and calls in flight get the
  grace to finish. Clients re-resolve DNS only when a connection drops, so without this the
  clients of a headless Service never reach pods the autoscaler adds.
- streams per connection: bounded; calls beyond it are refused (REFUSED_STREAM: the client
  sees UNAVAILABLE, retryable) before any handler runs, so they never pile up here.
- TLS handshake: a connection that has not finished it within HANDSHAKE_TIMEOUT_MS is closed
  (gRPC's default is 120 s), so silent connections cannot hold the port's descriptors.
- idle connections: a connection with no call open for max_connection_idle_s is sent GOAWAY
  and closed, so connections that sent the preface and then nothing do not pile up.
- compressed messages reach the application still compressed (per-message decompression
  off): core checks the receive limit on the size that came over the wire, and
  service/frontend/compression.py inflates (or refuses) within that limit, where core would
  first inflate the whole message.
- the encodings a request may declare (grpc-encoding) are the ones --grpc-compression takes
  (ACCEPTED_ENCODINGS): core refuses a call that declares any other with UNIMPLEMENTED before
  any handler runs, and advertises the accepted ones in grpc-accept-encoding, as gRPC's
  compression spec asks. The gateway advertises the same on the answers it writes.
"""

from __future__ import annotations

from typing import Any

GRPC_MAX_MESSAGE_BYTES = 2**31 - 1

KEEPALIVE_TIME_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000
MIN_CLIENT_PING_INTERVAL_MS = 10_000
MAX_PING_STRIKES = 2
MAX_CONCURRENT_STREAMS = 1024
HANDSHAKE_TIMEOUT_MS = 10_000

# --grpc-compression -> the encodings requests may declare, in gRPC core's order (bits of
# grpc.compression_enabled_algorithms_bitset: identity 0, deflate 1, gzip 2). Never deflate:
# core hides each message's compressed flag, and a deflate message cannot be told from a
# plain one by its bytes (service/frontend/compression.py).
ACCEPTED_ENCODINGS = {"identity": ("identity",), "gzip": ("identity", "gzip")}
_ALGORITHM_BITS = {"identity": 1, "deflate": 2, "gzip": 4}


# Behind the gateway the header block is bounded there (--max-metadata-bytes, as the client
# sent it); Python's port takes this much more, for the caller's address and certificate
# subject the gateway adds.
GATEWAY_HEADER_ALLOWANCE = 4096


def accepted_encodings(compression: str) -> str:
    """grpc-accept-encoding as gRPC core writes it for this --grpc-compression."""
    return ", ".join(ACCEPTED_ENCODINGS[compression])


def connection_options(
    *,
    max_connection_age_s: float = 0.0,
    max_connection_age_grace_s: float = 0.0,
    handshake_timeout_ms: int = HANDSHAKE_TIMEOUT_MS,
    max_connection_idle_s: float = 0.0,
    max_concurrent_streams: int | None = MAX_CONCURRENT_STREAMS,
) -> list[tuple[str, Any]]:
    """Keepalive, its enforcement, connection age and idleness, the handshake deadline and
    the per-connection stream bound; max_connection_age_s / max_connection_idle_s 0 = none,
    max_concurrent_streams None = none (behind the gateway, which bounds each client's
    connection: its few connections to Python carry every client's calls)."""
    options: list[tuple[str, Any]] = [
        ("grpc.server_handshake_timeout_ms", handshake_timeout_ms),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # Idle connections are kept alive too (the server's pings need no call to ride on).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
    ]
    if max_concurrent_streams is not None:
        options.append(("grpc.max_concurrent_streams", max_concurrent_streams))
    if max_connection_age_s > 0:
        options += [
            ("grpc.max_connection_age_ms", max(1, round(max_connection_age_s * 1000))),
            ("grpc.max_connection_age_grace_ms", max(1, round(max_connection_age_grace_s * 1000))),
        ]
    if max_connection_idle_s > 0:
        options.append(("grpc.max_connection_idle_ms", max(1, round(max_connection_idle_s * 1000))))
    return options


def server_options(
    *,
    receive_bytes: int,
    send_bytes: int,
    max_connection_age_s: float = 0.0,
    max_connection_age_grace_s: float = 0.0,
    share_port: bool = False,
    max_connection_idle_s: float = 0.0,
    max_concurrent_streams: int | None = MAX_CONCURRENT_STREAMS,
    compression: str = "identity",
    max_metadata_bytes: int = 16384,
) -> list[tuple[str, Any]]:
    """Options for grpc.aio.server(); message limits come from the largest legal call.
    share_port: front ends of one server share its port (the supervisor checked that no
    other server holds it); compression: --grpc-compression; max_metadata_bytes: the one
    bound on a call's header block (soft and hard alike, so no call is refused by chance)."""
    return [
        ("grpc.max_receive_message_length", min(receive_bytes, GRPC_MAX_MESSAGE_BYTES)),
        ("grpc.max_metadata_size", max_metadata_bytes),
        ("grpc.absolute_max_metadata_size", max_metadata_bytes),
        ("grpc.max_send_message_length", min(send_bytes, GRPC_MAX_MESSAGE_BYTES)),
        # Compressed requests arrive as they came; the front end inflates them within bounds.
        ("grpc.per_message_decompression", 0),
        (
            "grpc.compression_enabled_algorithms_bitset",
            sum(_ALGORITHM_BITS[name] for name in ACCEPTED_ENCODINGS[compression]),
        ),
        # A second server on a taken port must fail, not silently share it.
        ("grpc.so_reuseport", 1 if share_port else 0),
        *connection_options(
            max_connection_age_s=max_connection_age_s,
            max_connection_age_grace_s=max_connection_age_grace_s,
            max_connection_idle_s=max_connection_idle_s,
            max_concurrent_streams=max_concurrent_streams,
        ),
    ]
