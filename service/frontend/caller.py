"""Who made a call, for the log lines of calls that change what is served."""

from __future__ import annotations

import grpc

from service.text import shown

# Auth-context properties gRPC sets from a verified client certificate (mutual TLS).
SUBJECT_PROPERTIES = ("x509_subject", "x509_common_name")


def caller(context: grpc.aio.ServicerContext) -> str:
    """'peer ipv4:10.0.0.7:51234' plus ', subject CN=...' when the client showed a
    certificate; escaped, since both come from the client."""
    described = f"peer {shown(context.peer() or 'unknown')}"
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
