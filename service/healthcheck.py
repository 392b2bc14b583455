"""python -m service.healthcheck [--target HOST:PORT]: exit 0 when the server reports SERVING.

For Docker HEALTHCHECK and other places without a gRPC probe binary (Kubernetes' own gRPC
probes speak no TLS, so a TLS deployment probes with this: --tls-ca, --tls-cert, --tls-key).
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.generated.attention.v1 import attention_pb2, attention_pb2_grpc
from service.transport.tls import TlsError, add_tls_arguments, channel_credentials, tls_requested


def _channel(args: argparse.Namespace) -> grpc.Channel:
    if not tls_requested(args):
        return grpc.insecure_channel(args.target)
    credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    options = (
        [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    )
    return grpc.secure_channel(args.target, credentials, options=options)


# The health entries every server has (the server as a whole, and each API); one more per
# served model, under the model's name.
SERVER_ENTRIES = ("", "attention.v1.AttentionService", "inference.GRPCInferenceService")


def _not_found(channel: grpc.Channel, args: argparse.Namespace) -> str:
    """What was asked, and the names the server's health service does report."""
    try:
        listed = attention_pb2_grpc.AttentionServiceStub(channel).ListModels(
            attention_pb2.ListModelsRequest(), timeout=args.timeout_s
        )
        models = ", ".join(repr(model.name) for model in listed.models) or "none served"
    except grpc.RpcError as err:
        models = f"their names unknown: ListModels answered {err.code().name}"
    entries = ", ".join(repr(name) for name in SERVER_ENTRIES)
    return (
        f"{args.target} has no health entry named {args.service!r}; it has {entries} "
        f"('' = the whole server) and one per served model ({models})"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m service.healthcheck", description=(__doc__ or "").splitlines()[0]
    )
    # The server's own port variable: an image run with ATTENTION_GRPC_PORT=9001 is still
    # probed where it listens by its HEALTHCHECK.
    port = os.environ.get("ATTENTION_GRPC_PORT", "8001")
    parser.add_argument(
        "--target", default=f"127.0.0.1:{port}", help="default: 127.0.0.1:$ATTENTION_GRPC_PORT"
    )
    parser.add_argument("--service", default="", help="health service name ('' = server)")
    parser.add_argument("--timeout-s", type=float, default=3.0)
    add_tls_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        channel = _channel(args)
    except TlsError as err:
        parser.error(str(err))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s
            )
        except grpc.RpcError as err:
            reason = err.details() or ""
            if err.code() == grpc.StatusCode.NOT_FOUND:
                reason = _not_found(channel, args)
            print(f"unhealthy: {err.code().name}: {reason}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
