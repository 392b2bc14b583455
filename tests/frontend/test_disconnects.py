"""Clients that go away: a reset after the answer was computed counts CANCELLED (never OK) and
leaves one debug line, not gRPC's ExecuteBatchError traceback; a connection that sends the
preface and then nothing is closed after --max-connection-idle-s."""

from __future__ import annotations

import logging
import socket
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from bench.harness import wait_for
from service.client import attend_request
from service.frontend.delivery import GRPC_LOGGER, GrpcDisconnectFilter
from tests.harness.h2_raw import RawGrpc
from tests.harness.server_process import ServerProcess
from tests.harness.tls_helpers import tiny_repository

# Every server here runs with the gRPC gateway, then without it (the module's server
# fixtures take grpc_gateway; tests that start their own servers get it from this mark).
pytestmark = pytest.mark.usefixtures("grpc_gateway")

ATTEND = "/attention.v1.AttentionService/Attend"
IDLE_S = 1.0
RESETS = 40
GOAWAY = 7


class ExecuteBatchError(Exception):
    """Named as gRPC's own, which the filter recognises by name."""


def test_the_filter_turns_the_traceback_into_one_debug_line() -> None:
    try:
        raise ExecuteBatchError("Failed execute_batch")
    except ExecuteBatchError:
        record = logging.LogRecord(
            GRPC_LOGGER,
            logging.ERROR,
            __file__,
            1,
            "ExecuteBatchError raised in core by servicer method [%s]",
            ("/a/B",),
            None,
        )

        record.exc_info = sys.exc_info()  # as logging.exception() would set it
    logging.getLogger(GRPC_LOGGER).setLevel(logging.INFO)
    assert GrpcDisconnectFilter().filter(record) is False  # debug, below INFO: dropped
    assert record.levelno == logging.DEBUG
    assert record.exc_info is None
    assert record.getMessage().startswith("/a/B: the call ended")
    other = logging.LogRecord(GRPC_LOGGER, logging.ERROR, __file__, 1, "other", (), None)
    assert GrpcDisconnectFilter().filter(other) is True


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, grpc_gateway: str) -> Iterator[ServerProcess]:
    repository = tiny_repository(tmp_path_factory.getbasetemp())
    with ServerProcess(repository, "--max-connection-idle-s", str(IDLE_S)) as process:
        yield process


def test_resets_after_the_answer_count_cancelled_without_tracebacks(
    server: ServerProcess,
) -> None:
    x = np.random.default_rng(0).standard_normal((4, 32), dtype=np.float32)
    message = attend_request(x, return_attention_weights=True).SerializeToString()
    ok = server.metric("attention_requests_total", api="attention", code="OK")
    cancelled = server.metric("attention_requests_total", api="attention", code="CANCELLED")
    batches = server.metric("attention_batch_size_sequences_count")
    connection = RawGrpc(server.grpc_port, window=1, read=False)  # the answer cannot go out
    try:
        for done in range(1, RESETS + 1):
            stream = connection.call(ATTEND, message)
            wait_for(
                lambda done=done: (
                    server.metric("attention_undelivered_answer_bytes") > 0
                    and server.metric("attention_batch_size_sequences_count") >= batches + done
                ),
                timeout_s=10,
                what="the answer computed",
            )
            connection.reset(stream)
            wait_for(
                lambda: server.metric("attention_undelivered_answer_bytes") == 0,
                timeout_s=10,
                what="the reset call's answer let go",
            )
    finally:
        connection.close()
    counted = server.metric("attention_requests_total", api="attention", code="CANCELLED")
    assert counted - cancelled == RESETS
    assert server.metric("attention_requests_total", api="attention", code="OK") == ok
    assert "Traceback" not in server.log
    assert "ExecuteBatchError" not in server.log


def test_connections_that_send_nothing_are_closed(server: ServerProcess) -> None:
    silent = socket.create_connection(("127.0.0.1", server.grpc_port), timeout=10)
    silent.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))
    started = time.monotonic()
    received = b""
    try:
        while chunk := silent.recv(65536):  # SETTINGS, then GOAWAY, then the close
            received += chunk
    finally:
        silent.close()
    waited = time.monotonic() - started
    assert IDLE_S * 0.5 < waited < IDLE_S * 5 + 2, waited
    assert GOAWAY in _frame_types(received)


def _frame_types(data: bytes) -> list[int]:
    """The types of the HTTP/2 frames in data (9-byte headers: length, type, flags, id)."""
    types, at = [], 0
    while at + 9 <= len(data):
        types.append(data[at + 3])
        at += 9 + int.from_bytes(data[at : at + 3], "big")
    return types
