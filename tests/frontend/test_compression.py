"""Compressed requests: with --grpc-compression identity (the default) a call that declares an
encoding is refused UNIMPLEMENTED by gRPC itself and no message is looked at; with gzip, gzip
messages are recognised by gzip's magic bytes (which open no protobuf message), deflate is
refused as by default (only the compressed flag, which gRPC core hides, tells a zlib stream from
a plain message), and every plain message is read as it is; gzip is inflated never past the
receive limit: a 1 GiB gzip bomb sent over raw HTTP/2 is refused with a peak RSS growth well
under twice the receive limit, while honest gzip clients get their answers."""

from __future__ import annotations

import gzip
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from service.client import attend_request
from service.errors import CompressedTooLarge, InvalidInput, ServingError
from service.frontend import compression
from service.frontend.compression import RefusalLog, RefusedMessage, Unpacker, encoding_of
from service.generated.attention.v1 import attention_pb2 as pb
from tests.harness.h2_raw import RawGrpc
from tests.harness.server_process import (
    ServerProcess,
    behind_gateway,
    child_pids,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)

# The gateway drains (and hands compressed calls on) in code of its own: both ways.
pytestmark = pytest.mark.usefixtures("grpc_gateway")

ATTEND = "/attention.v1.AttentionService/Attend"
ATTEND_STREAM = "/attention.v1.AttentionService/AttendStream"
RECEIVE_LIMIT = 32 * 512 * 512 * 4 + (1 << 20)  # max batch x max seq x d x 4 + envelope
BOMB_BYTES = 1 << 30


def _message() -> bytes:
    x = np.random.default_rng(0).standard_normal((3, 512), dtype=np.float32)
    return attend_request(x).SerializeToString()


def _gzip_bomb(inflated: int = BOMB_BYTES) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(1 << 24)
    return b"".join(packer.compress(block) for _ in range(inflated >> 24)) + packer.flush()


def _also_a_zlib_stream(message: bytes) -> bytes:
    """message with unknown fields around it that make the whole one zlib stream as well."""
    # 78 9c: a zlib header, and field 15 = 156 (a varint); 01: a final stored block, whose
    # 2-byte length opens with 4a (field 9, bytes) and holds that field's size: the field
    # takes the length's complement and filler. The stored data ends inside field 16 (bytes),
    # whose last 4 bytes are the stream's Adler-32.
    for size in range(2, 128):
        stored = size * 256 + 0x4A
        tail = stored - (size - 2) - len(message)  # field 16, less the Adler-32
        if 3 <= tail < 127:
            data = bytes(size - 2) + message + bytes([0x82, 0x01, tail + 1]) + bytes(tail - 3)
            head = b"\x78\x9c\x01" + struct.pack("<HH", stored, stored ^ 0xFFFF)
            return head + data + struct.pack(">I", zlib.adler32(data))
    raise ValueError(f"no stored block fits a {len(message)}-byte message")


def _request(request_id: str = "") -> bytes:
    x = np.random.default_rng(0).standard_normal((3, 512), dtype=np.float32)
    return attend_request(x, request_id=request_id).SerializeToString()


def test_compressed_messages_are_recognised_by_their_first_bytes() -> None:
    message = _message()
    assert encoding_of(message) is None
    assert encoding_of(b"") is None
    assert encoding_of(gzip.compress(message)) == "gzip"
    for level in range(10):  # a zlib stream is no encoding taken: read as it is
        assert encoding_of(zlib.compress(message, level)) is None


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
    assert unpack(message) == message
    for plain in (field_15, b"\x78\x20" + message, b"\x78\x9c\x01" + message):
        assert unpack(plain) is plain
    assert isinstance(_refusal(unpack(gzip.compress(field_15 + b"x"))), CompressedTooLarge)
    assert isinstance(_refusal(unpack(gzip.compress(message)[:-12])), InvalidInput)


def test_gzip_members_one_after_another_are_one_message() -> None:
    """RFC 1952's multi-member gzip, as gzip and grpc-go read it. Before: refused as
    "truncated or has bytes after its end"."""
    message = _message()
    half = len(message) // 2
    two_members = gzip.compress(message[:half]) + gzip.compress(message[half:])
    unpack = Unpacker("gzip", max_bytes=len(message))
    assert unpack(two_members) == message
    assert unpack(gzip.compress(message) + gzip.compress(b"")) == message  # an empty member
    over = Unpacker("gzip", max_bytes=len(message) - 1)  # the limit counts every member
    assert isinstance(_refusal(over(two_members)), CompressedTooLarge)
    trailing = _refusal(unpack(gzip.compress(message) + b"junk"))
    assert isinstance(trailing, InvalidInput)
    assert "bytes after its end" in str(trailing)
    corrupt_second = gzip.compress(message[:half]) + gzip.compress(message[half:])[:-6]
    assert isinstance(_refusal(unpack(corrupt_second)), InvalidInput)
    # As many members as the bound allows (64-byte pieces), then one more: refused. The
    # review's 240,000 empty members (4.8 MB) held a front end's event loop 10 s and got it
    # killed; the bound, and zlib never handed more than a piece at a time, keep it short.
    pieces = [message[i : i + 64] for i in range(0, len(message), 64)]
    pieces += [b""] * (compression.MAX_GZIP_MEMBERS - len(pieces))
    members = b"".join(gzip.compress(piece, 1) for piece in pieces)
    assert unpack(members) == message
    too_many = _refusal(unpack(members + gzip.compress(b"")))
    assert isinstance(too_many, InvalidInput)
    assert f"more than {compression.MAX_GZIP_MEMBERS} gzip members" in str(too_many)
    flood = _refusal(unpack(gzip.compress(b"") * 240_000 + gzip.compress(message)))
    assert "gzip members" in str(flood)


def test_a_plain_message_that_is_also_a_zlib_stream_is_read_as_it_is() -> None:
    """Its flag says plain, and so it is: never inflated (the Python front end used to take
    any message that inflates as one whole zlib stream for deflate, and refuse it)."""
    message = _also_a_zlib_stream(_request("plain"))
    inflater = zlib.decompressobj()
    assert len(inflater.decompress(message)) > len(_request("plain"))
    assert (inflater.eof, inflater.unused_data) == (True, b"")  # a whole zlib stream
    parsed = pb.AttendRequest.FromString(message)
    assert parsed.request_id == "plain"
    assert parsed.embeddings == pb.AttendRequest.FromString(_request()).embeddings
    assert Unpacker("gzip", max_bytes=len(message))(message) is message


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
    np.testing.assert_array_equal(_infer(gzip_server.target, compression_algorithm="gzip"), plain)
    with pytest.raises(InferenceServerException) as refused:
        _infer(gzip_server.target, compression_algorithm="deflate")
    assert refused.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "'deflate' is disabled" in refused.value.message()


def test_a_message_of_two_gzip_members_is_answered(gzip_server: ServerProcess) -> None:
    message = _request("two-members")
    half = len(message) // 2
    connection = RawGrpc(gzip_server.grpc_port)
    try:
        compressed = gzip.compress(message[:half]) + gzip.compress(message[half:])
        state = connection.wait(connection.call(ATTEND, compressed, compressed=True))
    finally:
        connection.close()
    assert state.headers.get("grpc-status") == "0", state


def test_plain_messages_are_read_as_they_are_with_gzip_taken(gzip_server: ServerProcess) -> None:
    """A valid request whose bytes also form a whole zlib stream, sent uncompressed (and in a
    call that declares gzip), is served, and in a stream its answer carries its id."""
    message = _also_a_zlib_stream(_request("plain"))
    connection = RawGrpc(gzip_server.grpc_port, read=True)
    try:  # flag 0 in a call that declares gzip, as gRPC clients send what gzip cannot shrink
        call = connection.call(ATTEND, message, metadata={"grpc-encoding": "gzip"})
        state = connection.wait(call)
    finally:
        connection.close()
    assert state.headers.get("grpc-status") == "0", state
    with grpc.insecure_channel(gzip_server.target) as channel:
        for compression in (None, grpc.Compression.Gzip):
            attend = channel.unary_unary(ATTEND)
            answer = pb.AttendResponse.FromString(attend(message, compression=compression))
            assert (answer.request_id, list(answer.output.shape)) == ("plain", [3, 512])
            stream = channel.stream_stream(ATTEND_STREAM)
            sent = [message, _also_a_zlib_stream(_request("next"))]
            replies = stream(iter(sent), compression=compression, timeout=30)
            answers = [pb.AttendStreamResponse.FromString(reply) for reply in replies]
            assert sorted(a.request_id for a in answers) == ["next", "plain"], answers
            assert all(a.HasField("response") for a in answers), answers


@pytest.mark.gateway_off_heavy
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
    connection = RawGrpc(gzip_server.grpc_port)  # honest calls are still served
    try:
        ok = connection.wait(connection.call(ATTEND, attend_request(x).SerializeToString()))
    finally:
        connection.close()
    assert ok.headers.get("grpc-status") == "0", ok
