"""Connection hygiene: a connection older than --max-connection-age-s is replaced under a
client that keeps calling, without one failed call; a client given two backends with the
round_robin policy spreads its calls over both."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from service.client import AttentionClient, attend_request
from service.generated.attention.v1 import attention_pb2_grpc
from service.settings import load_settings
from service.transport.grpc_options import (
    HANDSHAKE_TIMEOUT_MS,
    MAX_CONCURRENT_STREAMS,
    connection_options,
    server_options,
)
from tests.harness.server_process import ServerProcess, behind_gateway
from tests.harness.tls_helpers import tiny_repository

# Every server here runs with the gRPC gateway, then without it (the module's server
# fixtures take grpc_gateway; tests that start their own servers get it from this mark).
pytestmark = pytest.mark.usefixtures("grpc_gateway")

MAX_AGE_S = 1.0
ESTABLISHED = "01"


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, grpc_gateway: str
) -> Iterator[list[ServerProcess]]:
    repository = tiny_repository(tmp_path_factory.getbasetemp())
    flags = ("--max-connection-age-s", str(MAX_AGE_S), "--grace-period-s", "5")
    first, second = ServerProcess(repository, *flags), ServerProcess(repository, *flags)
    with first, second:  # both start at once; each waits for SERVING
        yield [first, second]
    assert (first.terminate(), second.terminate()) == (0, 0), first.log + second.log


def _embeddings() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((6, 32), dtype=np.float32)


def _client_ports(server_port: int) -> set[int]:
    """Local ports of the established TCP connections to server_port (this host's /proc)."""
    ports = set()
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        if not table.exists():
            continue
        for line in table.read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, state = fields[1], fields[2], fields[3]
            if state == ESTABLISHED and int(remote.rsplit(":", 1)[1], 16) == server_port:
                ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


@pytest.mark.gateway_off_heavy
def test_an_aged_connection_is_replaced_without_a_failed_call(
    servers: list[ServerProcess],
) -> None:
    server = servers[0]
    if not Path("/proc/net/tcp").exists():
        pytest.skip("needs Linux /proc/net/tcp to see the connections")
    states: list[grpc.ChannelConnectivity] = []
    channel = grpc.insecure_channel(server.target)
    channel.subscribe(states.append, try_to_connect=True)
    stub = attention_pb2_grpc.AttentionServiceStub(channel)
    request = attend_request(_embeddings())
    failures: list[grpc.StatusCode] = []
    calls = 0
    seen_ports: set[int] = set()
    # Past three ages (each 0.9-1.1 s with gRPC's jitter): at least three connections.
    until = time.monotonic() + 3.5 * MAX_AGE_S
    while time.monotonic() < until:
        try:
            stub.Attend(request, timeout=5)
            calls += 1
        except grpc.RpcError as err:
            failures.append(err.code())
        seen_ports |= _client_ports(server.grpc_port)
    channel.close()
    print(
        f"{calls} calls over {3.5 * MAX_AGE_S:.1f}s, {len(failures)} failed; client ports "
        f"{sorted(seen_ports)}; connectivity {[s.name for s in states]}"
    )
    assert failures == []
    assert calls > 20
    assert len(seen_ports) >= 3, "the connection was not replaced at its max age"
    assert states.count(grpc.ChannelConnectivity.READY) >= 2


def test_a_client_of_two_backends_spreads_its_calls_over_both(
    servers: list[ServerProcess],
) -> None:
    target = "ipv4:" + ",".join(f"127.0.0.1:{server.grpc_port}" for server in servers)
    counted = {"name": "attention_requests_total", "api": "attention", "code": "OK"}

    def served() -> list[float]:
        return [server.metric(**counted) for server in servers]

    before = served()
    calls = 40
    with AttentionClient(target, load_balancing="round_robin") as client:
        for _ in range(calls):
            client.attend(_embeddings(), timeout_s=5)
    for server, start in zip(servers, before, strict=True):
        server.wait_metric(counted["name"], start + 1, api="attention", code="OK")
    deadline = time.monotonic() + 5
    while sum(served()) - sum(before) < calls and time.monotonic() < deadline:
        time.sleep(0.02)
    each = [after - start for after, start in zip(served(), before, strict=True)]
    print(f"calls per backend: {each}")
    assert sum(each) == calls
    assert min(each) >= calls // 4, each  # round robin: about half each


def test_server_options_bound_every_connection() -> None:
    settings = load_settings(["--max-connection-age-s", "120", "--grace-period-s", "30"], {})
    options = dict(
        server_options(
            receive_bytes=1 << 20,
            send_bytes=1 << 21,
            max_connection_age_s=settings.max_connection_age_s,
            max_connection_age_grace_s=settings.grace_period_s,
        )
    )
    assert options["grpc.max_connection_age_ms"] == 120_000
    assert options["grpc.max_connection_age_grace_ms"] == 30_000
    assert options["grpc.keepalive_time_ms"] > options["grpc.keepalive_timeout_ms"] > 0
    assert options["grpc.http2.min_ping_interval_without_data_ms"] > 0
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.max_concurrent_streams"] >= 1
    assert options["grpc.server_handshake_timeout_ms"] == HANDSHAKE_TIMEOUT_MS
    assert (
        options["grpc.max_receive_message_length"],
        options["grpc.max_send_message_length"],
    ) == (
        1 << 20,
        1 << 21,
    )
    forever = dict(server_options(receive_bytes=1, send_bytes=1, max_connection_age_s=0))
    assert "grpc.max_connection_age_ms" not in forever


@pytest.mark.gateway_off_heavy
def test_a_client_pinging_too_often_is_sent_away_and_a_quiet_one_is_not(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Keepalive enforcement: pings more often than the server allows (every 10 s without
    data) earn a GOAWAY (too_many_pings) after a few strikes; the connection drops."""
    repository = tiny_repository(tmp_path_factory.getbasetemp())
    pushy_options = [
        ("grpc.keepalive_time_ms", 100),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    with ServerProcess(repository) as server:  # the default max age (minutes): no confounding
        channels = {
            "pushy": grpc.insecure_channel(server.target, options=pushy_options),
            "quiet": grpc.insecure_channel(server.target),
        }
        states: dict[str, list[grpc.ChannelConnectivity]] = {name: [] for name in channels}
        for name, channel in channels.items():
            channel.subscribe(states[name].append, try_to_connect=True)
            grpc.channel_ready_future(channel).result(timeout=10)
        give_up = time.monotonic() + 10
        while grpc.ChannelConnectivity.IDLE not in states["pushy"][1:]:
            assert time.monotonic() < give_up, f"never sent away: {states['pushy']}"
            time.sleep(0.05)
        for channel in channels.values():
            channel.close()
    print({name: [state.name for state in seen] for name, seen in states.items()})
    assert grpc.ChannelConnectivity.READY in states["quiet"]
    assert grpc.ChannelConnectivity.IDLE not in states["quiet"][1:]


def test_a_connection_that_never_finishes_its_tls_handshake_is_closed(tmp_path: Path) -> None:
    """A client that connects and stays silent held the connection for gRPC's default 120 s
    (hundreds of them, as many descriptors); the server now closes it at its deadline."""
    import asyncio
    import socket

    from tests.harness.tls_helpers import Authority

    cert, key = Authority("CA").issue("server", server=True).write(tmp_path, "tls")

    async def silent_for() -> float:
        server = grpc.aio.server(options=connection_options(handshake_timeout_ms=300))
        credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
        port = server.add_secure_port("127.0.0.1:0", credentials)
        await server.start()
        try:
            with socket.create_connection(("127.0.0.1", port)) as silent:
                silent.settimeout(10)
                started = time.monotonic()
                assert await asyncio.to_thread(silent.recv, 1) == b""  # closed by the server
                return time.monotonic() - started
        finally:
            await server.stop(0)

    assert asyncio.run(silent_for()) < 5


def test_calls_beyond_the_stream_bound_of_one_connection_are_refused_unavailable(
    server: ServerProcess,
) -> None:
    """More calls at once on one connection than grpc.max_concurrent_streams: the excess is
    refused by HTTP/2 (REFUSED_STREAM), so those calls fail UNAVAILABLE (retryable) without
    reaching a handler. gRPC core's server refuses streams its client already counts as
    closed, so the client does not hold them back (before, the README said so); behind the
    gateway the client waits for a free stream instead (the gateway's refusal of streams past
    the bound is checked by its Go tests)."""
    import asyncio

    from service.generated.attention.v1 import attention_pb2 as pb

    calls = 2 * MAX_CONCURRENT_STREAMS
    x = np.zeros((1, 64), np.float32)
    request = pb.AttendRequest(model="small", embeddings=pb.Tensor(shape=[1, 64], data=x.tobytes()))
    counted = sum(
        server.metric("attention_requests_total", model="small", api="attention", code=code)
        for code in ("OK", "UNAVAILABLE")
    )

    async def burst() -> list[str]:
        async with grpc.aio.insecure_channel(server.target) as channel:
            attend = attention_pb2_grpc.AttentionServiceStub(channel).Attend
            await attend(request, timeout=30)  # connected, the server's SETTINGS known

            async def one() -> str:
                try:
                    await attend(request, timeout=60)
                    return "OK"
                except grpc.aio.AioRpcError as err:
                    return err.code().name

            return list(await asyncio.gather(*(one() for _ in range(calls))))

    codes = asyncio.run(burst())
    tally = {code: codes.count(code) for code in set(codes)}
    assert set(tally) <= {"OK", "UNAVAILABLE"}, tally
    assert tally.get("UNAVAILABLE", 0) > 0 or behind_gateway(server), tally
    after = sum(
        server.metric("attention_requests_total", model="small", api="attention", code=code)
        for code in ("OK", "UNAVAILABLE")
    )
    assert after - counted == 1 + tally["OK"]  # refused streams never reached a handler
    with AttentionClient(server.target) as client:
        assert client.is_serving()
