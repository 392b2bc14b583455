"""--host takes IPv6 literals, bare or bracketed, for gRPC and /metrics alike."""

from __future__ import annotations

import shutil
import socket
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.harness.server_process import ServerProcess

# The gateway binds the address itself when it serves the port: both ways.
pytestmark = pytest.mark.usefixtures("grpc_gateway")


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def small_only(model_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ipv6-small")
    shutil.copytree(model_repository / "small" / "2", root / "small" / "2")
    return root


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("host", ["::1", "[::1]", "::"])
def test_ipv6_hosts_serve_grpc_and_metrics(small_only: Path, host: str) -> None:
    """Before: each of these failed in the gRPC or the metrics server."""
    server = ServerProcess(small_only, "--host", host, "--batch-cap-budget-s", "0")
    try:
        server.wait_bound()
        with grpc.insecure_channel(f"[::1]:{server.grpc_port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert reply.status in (reply.SERVING, reply.NOT_SERVING)
        url = f"http://[::1]:{server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as page:
            assert b"attention_queue_depth_requests" in page.read()
    finally:
        server.kill()
    assert server.process.returncode == 0, server.log
