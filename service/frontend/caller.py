"""Who made a call: its peer, for per-connection bounds and log lines, and its certificate's
subject, for the log lines of calls that change what is served. Behind the gRPC gateway
(--grpc-gateway on) every call arrives over one Unix socket, so the gateway names the
client's address and certificate in headers of its own (it drops any a client sent)."""

from __future__ import annotations

import grpc

from service.text import shown

# Auth-context properties gRPC sets from a verified client certificate (mutual TLS).
SUBJECT_PROPERTIES = ("x509_subject", "x509_common_name")
# Set by the gateway on every call it hands over (service/gateway/proxy.go).
PEER_HEADER = "x-attention-gateway-peer"
SUBJECT_HEADER = "x-attention-gateway-subject"
# Set by the gateway on the stream it opens here for those messages of a client's stream it
# does not answer itself (service/gateway/stream.go): the gateway drains that client stream.
STREAM_PART_HEADER = "x-attention-gateway-stream-part"


class _Gateway:
    """Whether this process serves only calls the gateway handed over: then, and only then,
    its headers are trusted (a client reaching Python directly could send them)."""

    behind = False


def serve_behind_gateway() -> None:
    _Gateway.behind = True


def _forwarded(context: grpc.aio.ServicerContext, header: str) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == header:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return ""


def is_stream_part(context: grpc.aio.ServicerContext) -> bool:
    """Whether this stream is the gateway's part of a client's stream: the gateway took that
    stream and ends it in the drain (it half-closes this part once it stops reading), so this
    process neither refuses nor closes it then."""
    return _Gateway.behind and _forwarded(context, STREAM_PART_HEADER) != ""


def peer(context: grpc.aio.ServicerContext) -> str:
    """The client's address as gRPC writes it ('ipv4:10.0.0.7:51234')."""
    if _Gateway.behind:
        return _forwarded(context, PEER_HEADER) or context.peer()
    return context.peer()


def caller(context: grpc.aio.ServicerContext) -> str:
    """'peer ipv4:10.0.0.7:51234' plus ', subject CN=...' when the client showed a
    certificate; escaped, since both come from the client."""
    described = f"peer {shown(peer(context) or 'unknown')}"
    if _Gateway.behind:
        subject = _forwarded(context, SUBJECT_HEADER)
        return f"{described}, subject {shown(subject)}" if subject else described
    try:
        auth = context.auth_context() or {}
    except Exception:  # no transport security: nothing more to say
        auth = {}
    for name in SUBJECT_PROPERTIES:
        values = auth.get(name) or []
        if values:
            subject = values[0].decode(errors="replace")
            return f"{described}, subject {shown(subject)}"
    return described
