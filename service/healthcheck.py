"""python -m service.healthcheck [--target HOST:PORT]: exit 0 when the server reports SERVING.

For Docker HEALTHCHECK and other places without a gRPC probe binary.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="127.0.0.1:8001")
    parser.add_argument("--service", default="", help="health service name ('' = server)")
    parser.add_argument("--timeout-s", type=float, default=3.0)
    args = parser.parse_args(argv)
    with grpc.insecure_channel(args.target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s
            )
        except grpc.RpcError as err:
            print(f"unhealthy: {err.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
