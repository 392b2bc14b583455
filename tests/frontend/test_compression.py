"""Compressed requests: with --grpc-compression identity (the default) a call that declares an
encoding is refused UNIMPLEMENTED by gRPC itself and no message is looked at; with gzip, gzip and
deflate messages are recognised by their bytes (a zlib header only when the bytes inflate) and
inflated never past the receive limit: a 1 GiB gzip bomb sent over raw HTTP/2 is refused with a
peak RSS growth well under twice the receive limit, while honest gzip clients get their answers."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from service.client import attend_request
from service.errors import CompressedTooLarge, InvalidInput, ServingError
from service.frontend import compression
from service.frontend.compression import RefusalLog, RefusedMessage, Unpacker, encoding_of
from tests.harness.h2_raw import RawGrpc, peak_rss_bytes, reset_peak_rss
from tests.harness.server_process import ServerProcess, behind_gateway, child_pids, rss_bytes

# The gateway drains (and hands compressed calls on) in code of its own: both ways.
pytestmark = pytest.mark.usefixtures("grpc_gateway")

ATTEND = "/attention.v1.AttentionService/Attend"
RECEIVE_LIMIT = 32 * 512 * 512 * 4 + (1 << 20)  # max batch x max seq x d x 4 + envelope
BOMB_BYTES = 1 << 30


def _message() -> bytes:
    x = np.random.default_rng(0).standard_normal((3, 512), dtype=np.float32)
    return attend_request(x).SerializeToString()


def _gzip_bomb(inflated: int = BOMB_BYTES) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(1 << 24)
    return b"".join(packer.compress(block) for _ in range(inflated >> 24)) + packer.flush()


def test_compressed_messages_are_recognised_by_their_first_bytes() -> None:
    message = _message()
    assert encoding_of(message) is None
    assert encoding_of(b"") is None
    assert encoding_of(gzip.compress(message)) == "gzip"
    assert encoding_of(zlib.compress(message)) == "deflate"
    for level in range(10):  # every level writes a valid zlib header
        assert encoding_of(zlib.compress(message, level)) == "deflate"


def _refusal(unpacked: object) -> ServingError:
    assert isinstance(unpacked, RefusedMessage)
    return unpacked.refuse("ipv4:127.0.0.1:1")


def test_identity_never_looks_at_the_bytes_and_gzip_inflates_within_the_limit() -> None:
    message = _message()
    field_15 = b"\x78\x01" + message  # an unknown field 15 opens as a zlib header does
    identity = Unpacker("identity", max_bytes=len(message))
    for data in (message, field_15, gzip.compress(message), zlib.compress(message)):
        assert identity(data) is data  # gRPC refuses calls that declare an encoding
    unpack = Unpacker("gzip", max_bytes=len(field_15))
    assert unpack(gzip.compress(message)) == message
    assert unpack(zlib.compress(message)) == message
    assert unpack(message) == message
    for plain in (field_15, b"\x78\x20" + message, b"\x78\x9c\x01" + message):
        assert unpack(plain) == plain  # does not inflate as a whole zlib stream: plain
    assert isinstance(_refusal(unpack(gzip.compress(field_15 + b"x"))), CompressedTooLarge)
    assert isinstance(_refusal(unpack(zlib.compress(field_15 + b"x"))), CompressedTooLarge)
    assert isinstance(_refusal(unpack(gzip.compress(message)[:-12])), InvalidInput)


def test_refusals_are_logged_once_per_address_per_minute(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1000.0]
    monkeypatch.setattr(compression.time, "monotonic", lambda: now[0])
    refusals = RefusalLog()
    for port in range(5):
        refusals.note(f"ipv4:10.0.0.7:{port}", "no")
    refusals.note("ipv4:10.0.0.8:1", "no")
    now[0] += 61
    refusals.note("ipv4:10.0.0.7:9", "no")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "and 4 more" in lines[2]


@pytest.fixture(scope="module")
def identity_server(grpc_gateway: str, mha_repository: Path) -> Iterator[ServerProcess]:
    with ServerProcess(mha_repository) as server:
        assert behind_gateway(server) == (grpc_gateway == "on"), server.log
        yield server


@pytest.fixture(scope="module")
def gzip_server(grpc_gateway: str, mha_repository: Path) -> Iterator[ServerProcess]:
    with ServerProcess(mha_repository, "--grpc-compression", "gzip") as server:
        assert behind_gateway(server) == (grpc_gateway == "on"), server.log
        yield server


def _infer(target: str, **kwargs: object) -> np.ndarray:
    x = np.random.default_rng(1).standard_normal((2, 16, 512), dtype=np.float32)
    tensor = triton.InferInput("embeddings", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    client = triton.InferenceServerClient(target)
    return client.infer("mha", [tensor], **kwargs).as_numpy("output")  # type: ignore[arg-type]


def test_by_default_compressed_requests_are_refused_by_grpc(
    identity_server: ServerProcess,
) -> None:
    """gRPC refuses a call that declares an encoding the server does not take, whatever its
    messages hold, before any handler runs (gRPC's compression spec: UNIMPLEMENTED)."""
    for algorithm in ("gzip", "deflate"):
        with pytest.raises(InferenceServerException) as refused:
            _infer(identity_server.target, compression_algorithm=algorithm)
        assert refused.value.status() == "StatusCode.UNIMPLEMENTED"
        assert f"'{algorithm}' is disabled" in refused.value.message()
    assert _infer(identity_server.target).shape == (2, 16, 512)  # uncompressed: served


def test_honest_gzip_clients_are_served(gzip_server: ServerProcess) -> None:
    plain = _infer(gzip_server.target)
    for algorithm in ("gzip", "deflate"):
        np.testing.assert_array_equal(
            _infer(gzip_server.target, compression_algorithm=algorithm), plain
        )


def test_a_gzip_bomb_is_refused_before_it_is_inflated(gzip_server: ServerProcess) -> None:
    bomb = _gzip_bomb()
    assert len(bomb) < 2 << 20
    pid = child_pids(gzip_server)["frontend-0"]  # the process that inflates requests
    before = rss_bytes(pid)
    reset_peak_rss(pid)
    connection = RawGrpc(gzip_server.grpc_port)
    try:
        state = connection.wait(connection.call(ATTEND, bomb, compressed=True))
    finally:
        connection.close()
    growth = peak_rss_bytes(pid) - before
    assert state.headers.get("grpc-status") == "8", state  # RESOURCE_EXHAUSTED
    assert "inflates to more than" in state.headers.get("grpc-message", "")
    # At most the receive limit is inflated (plus one step and the 1 MiB upload): measured
    # +39 MiB at a 33 MiB limit, where gRPC core's own inflation peaked at +820..940 MiB.
    assert growth < 1.5 * RECEIVE_LIMIT, f"peak RSS grew {growth >> 20} MiB"
    assert gzip_server.metric(
        "attention_compressed_requests_refused_total", reason="too_large"
    ) == pytest.approx(1)
    x = np.zeros((2, 512), dtype=np.float32)
    connection = RawGrpc(gzip_server.grpc_port, read=True)  # honest calls are still served
    try:
        ok = connection.wait(connection.call(ATTEND, attend_request(x).SerializeToString()))
    finally:
        connection.close()
    assert ok.headers.get("grpc-status") == "0", ok
