"""Compressed requests that cannot become memory bombs.

gRPC core would inflate a compressed message in full and only then compare it with the
receive limit (a 1 MiB gzip body of 1 GiB of zeros took +820..940 MiB at its peak). The server
therefore runs with grpc.per_message_decompression off (transport/grpc_options.py): core
checks the receive limit on the message as it came, and hands it over still compressed.
Unpacker then either refuses it (--grpc-compression identity) or inflates it with zlib, never
past the receive limit (gzip).

Core keeps the message's compressed flag to itself, so a compressed message is recognised by
its first bytes: gzip's magic 1f 8b (0x1f is never the first byte of a protobuf message: wire
type 7 does not exist) and zlib's header 78 xx (what every gRPC implementation writes for
deflate; as protobuf 0x78 would open with field 15, which no request message here has).
"""

from __future__ import annotations

import logging
import time
import zlib

from service.errors import CompressedTooLarge, CompressionRefused, InvalidInput, ServingError
from service.frontend.handlers import Undecodable
from service.observability import metrics
from service.text import shown

log = logging.getLogger(__name__)

GZIP_MAGIC = b"\x1f\x8b"
ZLIB_CMF = 0x78  # deflate, 32 KiB window
LOG_EVERY_S = 60.0
MAX_REMEMBERED_PEERS = 4096
INFLATE_STEP = 1 << 20  # one per client address; beyond it the oldest are forgotten


def encoding_of(data: bytes) -> str | None:
    """'gzip', 'deflate' or None (a plain protobuf message), from the first bytes."""
    if data[:2] == GZIP_MAGIC:
        return "gzip"
    if len(data) >= 2 and data[0] == ZLIB_CMF and (data[0] << 8 | data[1]) % 31 == 0:
        return "deflate"
    return None


class RefusalLog:
    """Logs a refused compressed request once per client address per LOG_EVERY_S, with the
    number of refusals it did not log in between (each is counted in the metric)."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[float, int]] = {}  # address -> (logged at, since then)

    def note(self, peer: str, message: str) -> None:
        address = peer.rsplit(":", 1)[0]  # ipv4:10.0.0.7:51234 -> ipv4:10.0.0.7
        now = time.monotonic()
        logged_at, skipped = self._last.get(address, (-LOG_EVERY_S, 0))
        if now - logged_at < LOG_EVERY_S:
            self._last[address] = (logged_at, skipped + 1)
            return
        if len(self._last) >= MAX_REMEMBERED_PEERS:
            self._forget(now)
        self._last[address] = (now, 0)
        more = f" (and {skipped} more since the last line)" if skipped else ""
        log.warning("refused a compressed request from %s%s: %s", shown(address), more, message)

    def _forget(self, now: float) -> None:
        self._last = {
            address: entry for address, entry in self._last.items() if now - entry[0] < LOG_EVERY_S
        }
        if len(self._last) >= MAX_REMEMBERED_PEERS:
            self._last.clear()


class RefusedMessage(Undecodable):
    """A compressed request that will not be parsed; the handler answers with error."""

    def __init__(self, error: ServingError, refusals: RefusalLog) -> None:
        self.message = str(error)
        self._error = error
        self._refusals = refusals

    def refuse(self, peer: str) -> ServingError:
        self._refusals.note(peer, self.message)
        return self._error


class Unpacker:
    """The request deserializers' first step: bytes as they came -> bytes to parse."""

    def __init__(self, mode: str, *, max_bytes: int) -> None:
        self._accept = mode == "gzip"
        self._max_bytes = max_bytes
        self._refusals = RefusalLog()

    def __call__(self, data: bytes) -> bytes | Undecodable:
        encoding = encoding_of(data)
        if encoding is None:
            return data
        try:
            return self._inflate(data, encoding)
        except ServingError as err:
            reason = {CompressionRefused: "encoding", CompressedTooLarge: "too_large"}
            metrics.COMPRESSION_REFUSALS.labels(reason.get(type(err), "corrupt")).inc()
            return RefusedMessage(err, self._refusals)

    def _inflate(self, data: bytes, encoding: str) -> bytes:
        if not self._accept:
            raise CompressionRefused(
                f"this server takes uncompressed requests only, and this one is {encoding}-"
                "compressed: send it uncompressed (gRPC clients do unless told to compress), "
                "or start the server with --grpc-compression gzip"
            )
        inflated = _inflate_at_most(data, encoding, self._max_bytes)
        if inflated is None:
            raise CompressedTooLarge(
                f"the {encoding}-compressed request inflates to more than {self._max_bytes} "
                "bytes, the largest request this server takes; send fewer or shorter sequences"
            )
        return inflated


def _inflate_at_most(data: bytes, encoding: str, max_bytes: int) -> bytes | None:
    """data inflated, or None as soon as more than max_bytes came out. In INFLATE_STEP
    pieces, joined only once the whole message is known to fit: zlib's own bounded
    decompress (and a growing buffer) would hold the limit twice over at the peak."""
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    pieces: list[bytes] = []
    size = 0
    pending = data
    try:
        while not inflater.eof:
            piece = inflater.decompress(pending, INFLATE_STEP)
            size += len(piece)
            if size > max_bytes:
                return None
            pieces.append(piece)
            pending = inflater.unconsumed_tail
            if not piece and not pending:
                break  # the input ended before the compressed stream did
    except zlib.error as err:
        raise InvalidInput(f"the {encoding}-compressed request is corrupt: {err}") from err
    if not inflater.eof or inflater.unused_data:
        raise InvalidInput(
            f"the {encoding}-compressed request is truncated or has bytes after its end"
        )
    return b"".join(pieces)
