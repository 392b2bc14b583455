"""Raw HTTP/2 gRPC calls (the h2 library) for what gRPC clients never do on purpose: any te and
other headers in the order given, any body with any framing and compressed-flag byte, a receive
window that is never opened, resets, several calls on one connection; and their answers as a
client reads them (status, message, the answer messages)."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

VARINT, FIXED64, BYTES, FIXED32 = 0, 1, 2, 5
ANSWER_WAIT_S = 10  # the longest wait for a stream message's answer
FRAME_HEADER = 9  # bytes: length (3), type, flags, stream id (4)
# gRPC's mapping of an HTTP status without grpc-status to the code a client reports
# (doc/http-grpc-status-mapping.md); anything else is UNKNOWN.
HTTP_TO_GRPC = {400: 13, 401: 16, 403: 7, 404: 12, 429: 14, 502: 14, 503: 14, 504: 14}
UNKNOWN = 2


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


def framed(body: bytes, *, flag: int = 0, declared: int | None = None) -> bytes:
    """One gRPC message as it goes on the wire: its compressed-flag byte, its length (declared:
    another one than the body's), its body."""
    return struct.pack(">BI", flag, len(body) if declared is None else declared) + body


@dataclass(frozen=True)
class Message:
    """One gRPC message of a call: its bytes, and its compressed-flag byte (1: compressed,
    in a call that declares no encoding)."""

    body: bytes
    flag: int = 0

    def framed(self) -> bytes:
        return framed(self.body, flag=self.flag)

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

    @property
    def over(self) -> bool:
        return self.ended or self.reset is not None

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
        """The status as it came ("reset" for a stream reset without one, "http N" for an HTTP
        answer without one), so that two answers compare apart whenever they differ."""
        if "grpc-status" in self.headers:
            return int(self.headers["grpc-status"])
        if self.reset is not None:
            return "reset"
        return f"http {self.headers.get(':status')}"

    @property
    def client_code(self) -> int | str:
        """The code a gRPC client reports: an HTTP status without grpc-status is mapped."""
        code = self.code
        if isinstance(code, str) and code.startswith("http "):
            return HTTP_TO_GRPC.get(int(self.headers[":status"]), UNKNOWN)
        return code

    @property
    def message(self) -> str:
        return urllib.parse.unquote(self.headers.get("grpc-message", ""))


class RawGrpc:
    """One HTTP/2 connection to a gRPC server on 127.0.0.1, any number of calls on it, each
    sent exactly as given (headers are neither checked nor normalized). A thread pumps the
    socket: it answers PING and SETTINGS (h2 does) so the server sees a live peer, and sends
    each call's body as the server's windows let it out. window: the receive window this
    client grants per stream; read=False: received data is never acknowledged (with window=1,
    a reader that never reads)."""

    def __init__(self, port: int, *, window: int = 65535, read: bool = True) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        # As gRPC clients do: without it, a write after an unanswered one waits for the
        # server's delayed ACK (40 ms a call).
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        config = h2.config.H2Configuration(
            client_side=True, validate_outbound_headers=False, normalize_outbound_headers=False
        )
        self.conn = h2.connection.H2Connection(config)
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self._read = read
        self.replies: dict[int, Reply] = {}
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.closed = threading.Event()
        self.ended_by = ""  # why the connection ended, for test failure messages
        self._pending: dict[int, tuple[memoryview, bool]] = {}  # body left to send, end after
        self._received = b""  # the start of a frame not yet whole
        self._changed = threading.Condition()  # the preface goes with the first call's headers
        self.sock.settimeout(None)  # blocking sends: a full send buffer waits, never fails
        self._pump = threading.Thread(target=self._run, daemon=True)
        self._pump.start()

    def open(
        self,
        path: str,
        body: bytes = b"",
        *,
        te: str | None = "trailers",
        headers: Sequence[tuple[str, str]] = (),
        end: bool = True,
    ) -> int:
        """Start a call: its headers (te None: none sent), then body as it is (any framing);
        end: the client's half of the call ends with it. Its stream id."""
        request = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", "127.0.0.1"),
            ("content-type", "application/grpc"),
        ]
        if te is not None:
            request.append(("te", te))
        with self._changed:
            stream_id = self.conn.get_next_available_stream_id()
            self.conn.send_headers(stream_id, [*request, *headers])
            self.replies[stream_id] = Reply()
            self._queue(stream_id, body, end)
        return stream_id

    def call(
        self,
        path: str,
        message: bytes,
        *,
        compressed: bool = False,
        encoding: str = "gzip",
        metadata: dict[str, str] | None = None,
        end: bool = True,
    ) -> int:
        """Start a call with one message (compressed: its flag set and grpc-encoding sent).
        Its stream id."""
        headers = [("grpc-encoding", encoding)] if compressed else []
        headers += list((metadata or {}).items())
        return self.open(path, framed(message, flag=int(compressed)), headers=headers, end=end)

    def send(self, stream_id: int, data: bytes, *, end: bool = False) -> None:
        """More bytes on an open call, after whatever it has still to send."""
        with self._changed:
            self._queue(stream_id, data, end)

    def send_message(self, stream_id: int, message: bytes, *, end: bool = False) -> None:
        """Another message on an open call (bidirectional calls)."""
        self.send(stream_id, framed(message), end=end)

    def reset(self, stream_id: int) -> None:
        with self._changed:
            self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            self._flush()

    def wait(self, stream_id: int, timeout_s: float = 30, *, messages: int | None = None) -> Reply:
        """The call's reply once it is over (or holds that many answer messages); TimeoutError
        past timeout_s, ConnectionError when the connection ends first."""
        reply = self.replies[stream_id]
        give_up = time.monotonic() + timeout_s
        with self._changed:
            while not reply.over and (messages is None or len(reply.messages()) < messages):
                if self.closed.is_set():
                    raise ConnectionError(f"the connection ended ({self.ended_by}): {reply}")
                left = give_up - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"stream {stream_id} still open after {timeout_s:g}s: {reply}"
                    )
                self._changed.wait(left)
        return reply

    def close(self) -> None:
        self.closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the pump's read
        self._pump.join(5)
        self.sock.close()

    def _queue(self, stream_id: int, data: bytes, end: bool) -> None:
        left, _ = self._pending.get(stream_id, (memoryview(b""), False))
        self._pending[stream_id] = (memoryview(bytes(left) + data), end)
        self._send_pending()
        self._flush()

    def _send_pending(self) -> None:
        for stream_id, (view, end) in list(self._pending.items()):
            reply = self.replies[stream_id]
            try:
                while not reply.over:
                    if not len(view):
                        if end:
                            self.conn.end_stream(stream_id)
                            end = False
                        break
                    room = min(
                        self.conn.local_flow_control_window(stream_id),
                        len(view),
                        self.conn.max_outbound_frame_size,
                    )
                    if room <= 0:
                        break  # until the server's window update
                    last = end and room == len(view)
                    self.conn.send_data(stream_id, bytes(view[:room]), end_stream=last)
                    view, end = view[room:], end and not last
            except h2.exceptions.StreamClosedError:
                view, end = view[:0], False  # answered (refused) before the body was all sent
            if reply.over or not (len(view) or end):
                del self._pending[stream_id]
            else:
                self._pending[stream_id] = (view, end)

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def _run(self) -> None:
        while not self.closed.is_set():
            try:
                data = self.sock.recv(1 << 20)
            except OSError as err:
                self.ended_by = self.ended_by or repr(err)
                break
            if not data:
                self.ended_by = self.ended_by or "the server closed the connection"
                break
            with self._changed:
                try:
                    self._receive(data)
                    self._send_pending()
                    self._flush()
                except (h2.exceptions.ProtocolError, OSError) as err:
                    # h2 refuses the frames of calls still answered after a GOAWAY
                    self.ended_by = self.ended_by or repr(err)
                    break
                finally:
                    self._changed.notify_all()
        with self._changed:
            self.closed.set()
            self._changed.notify_all()

    def _receive(self, data: bytes) -> None:
        """Frame by frame, so that whatever h2 refuses (after a GOAWAY) leaves the events of
        the frames before it seen."""
        received, start = self._received + data, 0
        while len(received) - start >= FRAME_HEADER:
            end = start + FRAME_HEADER + int.from_bytes(received[start : start + 3], "big")
            if len(received) < end:
                break
            for event in self.conn.receive_data(received[start:end]):
                self._on(event)
            start = end
        self._received = received[start:]

    def _on(self, event: h2.events.Event) -> None:
        stream_id = getattr(event, "stream_id", None)
        reply = self.replies.get(stream_id) if stream_id else None
        if isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = event
            self.ended_by = repr(event)
            self.closed.set()  # h2 takes no more frames on it
        elif reply is None:
            return
        elif isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
            reply.headers.update({k.decode(): v.decode() for k, v in event.headers})
        elif isinstance(event, h2.events.DataReceived):
            reply.body += event.data
            if self._read:
                self.conn.acknowledge_received_data(event.flow_controlled_length, stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            reply.ended = True
        elif isinstance(event, h2.events.StreamReset):
            reply.reset = event.error_code


def call(
    port: int,
    path: str,
    body: bytes,
    *,
    te: str | None = "trailers",
    headers: Sequence[tuple[str, str]] = (),
    end: bool = True,
    wait_s: float = 20,
) -> Reply:
    """One call on a connection of its own (gRPC core's header table cannot carry a fault from
    one call to the next), until it is over."""
    connection = RawGrpc(port)
    try:
        return connection.wait(connection.open(path, body, te=te, headers=headers, end=end), wait_s)
    finally:
        connection.close()


def exchange(
    port: int, path: str, headers: Headers, sent: Sequence[Message], *, lockstep: bool = False
) -> Reply:
    """A call on a connection of its own: the messages, then the end of the client's half;
    the reply as it stands when the call is over or no more comes. lockstep: each message once
    the one before it is answered (or the call is over), so that a stream's answers, which come
    in completion order, come in the messages' order."""
    connection = RawGrpc(port)
    try:
        stream = connection.open(path, te=headers.te, headers=headers.pairs, end=False)
        reply = connection.replies[stream]
        for i, message in enumerate(sent):
            answered = len(reply.messages())
            connection.send(stream, message.framed(), end=not lockstep and i == len(sent) - 1)
            if lockstep:
                with contextlib.suppress(TimeoutError):
                    connection.wait(stream, ANSWER_WAIT_S, messages=answered + 1)
        if lockstep or not sent:
            connection.send(stream, b"", end=True)
        with contextlib.suppress(TimeoutError):
            connection.wait(stream, 2 * ANSWER_WAIT_S)
        return reply
    finally:
        connection.close()
