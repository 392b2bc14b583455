"""Raw HTTP/2 gRPC calls (the h2 library) that send exactly what they are given: any te and
other headers in the order given, any message bytes with any compressed-flag byte; and their
answers as a client reads them (status, message, the answer messages)."""

from __future__ import annotations

import socket
import struct
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions

VARINT, FIXED64, BYTES, FIXED32 = 0, 1, 2, 5
ANSWER_WAIT_S = 10  # the longest wait for a stream message's answer


def describe(message: bytes) -> str:
    """A message's fields as number:value, short enough for a failure report: a long bytes
    field is shown as its fields when it reads as a message (tensor bytes rarely do), else
    as its size."""
    return _fields(message, nested=False) or f"<not a message: {message[:48].hex()}>"


def _fields(message: bytes, *, nested: bool) -> str:
    shown, rest = [], message
    try:
        while rest:
            key, rest = _read_varint(rest)
            number, wire = key >> 3, key & 7
            if nested and not (0 < number <= 16 and wire in (VARINT, FIXED64, BYTES, FIXED32)):
                return ""
            if wire == VARINT:
                value, rest = _read_varint(rest)
                shown.append(f"{number}:{value}")
            elif wire in (FIXED32, FIXED64):
                size = 4 if wire == FIXED32 else 8
                if len(rest) < size:
                    return ""
                shown.append(f"{number}:0x{rest[:size].hex()}")
                rest = rest[size:]
            elif wire == BYTES:
                size, rest = _read_varint(rest)
                if len(rest) < size:
                    return ""
                data, rest = rest[:size], rest[size:]
                inner = _fields(data, nested=True) if size > 24 else ""
                shown.append(
                    f"{number}:{inner or (repr(data) if size <= 24 else f'<{size} bytes>')}"
                )
            else:
                shown.append(f"{number}:wire{wire}")
    except IndexError:
        return ""
    return "{" + " ".join(shown) + "}"


def _read_varint(data: bytes) -> tuple[int, bytes]:
    value = 0
    for i in range(10):
        value |= (data[i] & 0x7F) << (7 * i)
        if data[i] < 0x80:
            return value, data[i + 1 :]
    raise IndexError("a varint of more than 10 bytes")


@dataclass(frozen=True)
class Message:
    """One gRPC message of a call: its bytes, and its compressed-flag byte (1: compressed,
    in a call that declares no encoding)."""

    body: bytes
    flag: int = 0

    def framed(self) -> bytes:
        return struct.pack(">BI", self.flag, len(self.body)) + self.body

    def __repr__(self) -> str:
        return f"Message({describe(self.body)}{f', flag={self.flag}' if self.flag else ''})"


@dataclass(frozen=True)
class Headers:
    """A call's te header (None: none sent) and its other headers, in the order sent."""

    te: str | None
    pairs: tuple[tuple[str, str], ...] = ()


@dataclass
class Reply:
    """A call's answer as it came."""

    headers: dict[str, str] = field(default_factory=dict)  # response headers and trailers
    body: bytes = b""
    ended: bool = False
    reset: int | None = None  # RST_STREAM's error code

    def messages(self) -> list[bytes]:
        found, rest = [], self.body
        while len(rest) >= 5:
            _, length = struct.unpack(">BI", rest[:5])
            if len(rest) < 5 + length:
                break
            found.append(rest[5 : 5 + length])
            rest = rest[5 + length :]
        return found

    @property
    def code(self) -> int | str:
        """The status a client reads ("reset" for a stream reset without one)."""
        if "grpc-status" in self.headers:
            return int(self.headers["grpc-status"])
        if self.reset is not None:
            return "reset"
        return f"http {self.headers.get(':status')}"

    @property
    def message(self) -> str:
        return urllib.parse.unquote(self.headers.get("grpc-message", ""))


class RawCall:
    """One call on a connection of its own: headers as given (te included or not), messages
    framed as given, within the flow-control windows."""

    def __init__(self, port: int, path: str, headers: Headers) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        config = h2.config.H2Configuration(
            client_side=True, validate_outbound_headers=False, normalize_outbound_headers=False
        )
        self.conn = h2.connection.H2Connection(config)
        self.conn.initiate_connection()
        self.stream = self.conn.get_next_available_stream_id()
        request = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "127.0.0.1"),
            ("content-type", "application/grpc"),
        ]
        if headers.te is not None:
            request.append(("te", headers.te))
        self.conn.send_headers(self.stream, [*request, *headers.pairs])
        self.sock.sendall(self.conn.data_to_send())
        self.reply = Reply()

    @property
    def over(self) -> bool:
        return self.reply.ended or self.reply.reset is not None

    def send(self, data: bytes, *, end: bool) -> None:
        """data (then the client's end of the call), as fast as the windows let it out."""
        unsent = memoryview(data)
        give_up = time.monotonic() + 2 * ANSWER_WAIT_S
        while not self.over:
            if time.monotonic() > give_up:
                raise TimeoutError(f"the server's window stayed closed ({self.reply})")
            room = min(
                self.conn.local_flow_control_window(self.stream),
                len(unsent),
                self.conn.max_outbound_frame_size,
            )
            if unsent and room <= 0:
                self._receive(time.monotonic() + ANSWER_WAIT_S)  # for a window update
                continue
            try:
                if unsent:
                    self.conn.send_data(self.stream, bytes(unsent[:room]))
                    unsent = unsent[room:]
                if not unsent and end:
                    self.conn.end_stream(self.stream)
            except h2.exceptions.StreamClosedError:
                return  # answered before all of it was sent
            self.sock.sendall(self.conn.data_to_send())
            if not unsent:
                return

    def wait(self, messages: int | None, timeout_s: float) -> None:
        """Until the reply holds that many answer messages (None: until the call is over)."""
        give_up = time.monotonic() + timeout_s
        while not self.over and time.monotonic() < give_up:
            if messages is not None and len(self.reply.messages()) >= messages:
                return
            self._receive(give_up)

    def _receive(self, give_up: float) -> None:
        self.sock.settimeout(max(0.01, give_up - time.monotonic()))
        try:
            data = self.sock.recv(1 << 20)
        except TimeoutError:
            return
        if not data:
            raise ConnectionError(f"the server closed the connection ({self.reply})")
        for event in self.conn.receive_data(data):
            if getattr(event, "stream_id", None) != self.stream:
                continue
            if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                self.reply.headers.update({k.decode(): v.decode() for k, v in event.headers})
            elif isinstance(event, h2.events.DataReceived):
                self.reply.body += event.data
                self.conn.acknowledge_received_data(event.flow_controlled_length, self.stream)
            elif isinstance(event, h2.events.StreamEnded):
                self.reply.ended = True
            elif isinstance(event, h2.events.StreamReset):
                self.reply.reset = event.error_code
        self.sock.sendall(self.conn.data_to_send())


def exchange(
    port: int, path: str, headers: Headers, sent: Sequence[Message], *, lockstep: bool = False
) -> Reply:
    """A call on a connection of its own (gRPC core's header table cannot carry a fault from
    one call to the next): the messages, then the end of the client's half. lockstep: each
    message once the one before it is answered (or the call is over), so that a stream's
    answers, which come in completion order, come in the messages' order."""
    call = RawCall(port, path, headers)
    try:
        for i, message in enumerate(sent):
            answered = len(call.reply.messages())
            call.send(message.framed(), end=not lockstep and i == len(sent) - 1)
            if lockstep:
                call.wait(answered + 1, ANSWER_WAIT_S)
        if lockstep or not sent:
            call.send(b"", end=True)
        call.wait(None, 2 * ANSWER_WAIT_S)
        return call.reply
    finally:
        call.sock.close()
