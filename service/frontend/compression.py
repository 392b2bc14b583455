"""Compressed requests that cannot become memory bombs, and never a guess at plain ones.

Which encodings a call may declare (grpc-encoding) is gRPC core's to check: the server takes
only those of --grpc-compression (transport/grpc_options.py), and core refuses a call that
declares any other with UNIMPLEMENTED before any handler runs. With --grpc-compression identity
every message is therefore plain, and nothing here looks at its bytes.

gRPC core would inflate a compressed message in full and only then compare it with the receive
limit (a 1 MiB gzip body of 1 GiB of zeros took +820..940 MiB at its peak). The server therefore
runs with grpc.per_message_decompression off: core checks the receive limit on the message as
it came, and hands it over still compressed. With --grpc-compression gzip, Unpacker inflates it
with zlib, never past the receive limit.

Core keeps each message's compressed flag to itself (a call that declares gzip may still send a
message uncompressed, as gRPC clients do when compressing would not make it smaller), and the
flag alone says whether a message is compressed. A gzip one is told by its bytes all the same:
gzip's magic 1f 8b opens every gzip stream and never a protobuf message (field 3 of wire type
7, which does not exist), so no plain message is ever taken for one. That is why gzip is the
only encoding taken: a deflate (zlib) stream opens with 78 xx, as a plain message whose first
field is 15 does, and such a message may be a whole zlib stream too; only the flag tells them
apart.
"""

from __future__ import annotations

import logging
import time
import zlib

from service.errors import CompressedTooLarge, InvalidInput, ServingError
from service.frontend.handlers import Undecodable
from service.observability import metrics
from service.text import shown

log = logging.getLogger(__name__)

GZIP_MAGIC = b"\x1f\x8b"
LOG_EVERY_S = 60.0
MAX_REMEMBERED_PEERS = 4096  # one per client address; beyond it the oldest are forgotten
INFLATE_STEP = 1 << 20
# Compressed bytes handed to zlib at a time: what it copies out as a member's leftover input
# is at most this, however many members follow (handing it the rest of the message made a
# message of many tiny members cost time in the square of their number).
FEED_BYTES = 64 << 10
# Members in one message: BGZF-style blocks of 64 KiB come to about 512 for the largest
# request; each member costs zlib a new stream, so thousands of empty ones are refused.
MAX_GZIP_MEMBERS = 1024


def encoding_of(data: bytes) -> str | None:
    """'gzip' or None (a plain protobuf message), from the first bytes."""
    return "gzip" if data[:2] == GZIP_MAGIC else None


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
        # identity: core refuses every call that declares an encoding, so no message is
        # compressed and none is looked at.
        self._accept = mode == "gzip"
        self._max_bytes = max_bytes
        self._refusals = RefusalLog()

    def __call__(self, data: bytes) -> bytes | Undecodable:
        encoding = encoding_of(data) if self._accept else None
        if encoding is None:
            return data
        try:
            return self._inflate(data, encoding)
        except ServingError as err:
            reason = "too_large" if isinstance(err, CompressedTooLarge) else "corrupt"
            metrics.COMPRESSION_REFUSALS.labels(reason).inc()
            return RefusedMessage(err, self._refusals)

    def _inflate(self, data: bytes, encoding: str) -> bytes:
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
    decompress (and a growing buffer) would hold the limit twice over at the peak. Gzip
    members one after another are one stream (RFC 1952; as gzip and grpc-go read them), at
    most MAX_GZIP_MEMBERS of them."""
    view = memoryview(data)
    pieces: list[bytes] = []
    size = 0
    at = 0  # the end of what zlib was handed
    try:
        for _ in range(MAX_GZIP_MEMBERS):
            inflater = zlib.decompressobj(wbits=31)  # one gzip member
            pending: bytes | memoryview = b""
            while not inflater.eof:
                if not pending:
                    if at == len(view):
                        break  # the input ended before the member did
                    pending = view[at : at + FEED_BYTES]
                    at += len(pending)
                piece = inflater.decompress(pending, INFLATE_STEP)
                size += len(piece)
                if size > max_bytes:
                    return None
                pieces.append(piece)
                pending = inflater.unconsumed_tail
            if not inflater.eof:
                raise InvalidInput(f"the {encoding}-compressed request is truncated")
            at -= len(inflater.unused_data)  # where the member ended
            if at == len(view):
                return b"".join(pieces)
            if view[at : at + 2] != GZIP_MAGIC:
                raise InvalidInput(f"the {encoding}-compressed request has bytes after its end")
    except zlib.error as err:
        raise InvalidInput(f"the {encoding}-compressed request is corrupt: {err}") from err
    raise InvalidInput(
        f"the {encoding}-compressed request has more than {MAX_GZIP_MEMBERS} gzip members; "
        "compress it as one"
    )
