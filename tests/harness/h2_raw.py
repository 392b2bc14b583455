"""A raw HTTP/2 gRPC client (the h2 library) for what gRPC clients never do on purpose: a
receive window that is never opened, resets after the answer is computed, compressed bodies
of any content, connections that send nothing."""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings


@dataclass
class StreamState:
    headers: dict[str, str] = field(default_factory=dict)  # response headers and trailers
    data: int = 0  # bytes of DATA received
    ended: bool = False
    reset: bool = False


class RawGrpc:
    """One HTTP/2 connection to a gRPC server on 127.0.0.1. window: the receive window this
    client grants per stream (1 = a reader that never reads); it still answers PING and
    SETTINGS (h2 does) so the server sees a live peer. A thread pumps the socket."""

    def __init__(self, port: int, *, window: int = 65535, read: bool = False) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self._read = read  # acknowledge received data (a well-behaved reader)
        self.streams: dict[int, StreamState] = {}
        self._pending: dict[int, list] = {}  # stream id -> [body left to send, end stream]
        self.closed = threading.Event()
        self.ended_by = ""  # why the connection ended, for test failure messages
        self._lock = threading.Lock()
        self._flush()
        self._pump = threading.Thread(target=self._run, daemon=True)
        self._pump.start()

    def call(
        self,
        method: str,
        message: bytes,
        *,
        compressed: bool = False,
        encoding: str = "gzip",
        metadata: dict[str, str] | None = None,
        end: bool = True,
    ) -> int:
        """Start a call with one message; returns its stream id. Large bodies go out as the
        server's flow-control window allows (the pump sends the rest)."""
        with self._lock:
            stream_id = self.conn.get_next_available_stream_id()
            headers = [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", method),
                (":authority", "127.0.0.1"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
            ]
            if compressed:
                headers.append(("grpc-encoding", encoding))
            headers += list((metadata or {}).items())
            self.conn.send_headers(stream_id, headers)
            self.streams[stream_id] = StreamState()
            frame = struct.pack(">BI", int(compressed), len(message)) + message
            self._pending[stream_id] = [memoryview(frame), end]
            self._send_pending()
            self._flush()
        return stream_id

    def send_message(self, stream_id: int, message: bytes, *, end: bool = False) -> None:
        """Another message on an open stream (bidirectional calls)."""
        with self._lock:
            frame = struct.pack(">BI", 0, len(message)) + message
            pending = self._pending.get(stream_id)
            if pending is not None and len(pending[0]):
                pending[0] = memoryview(bytes(pending[0]) + frame)
                pending[1] = end
            else:
                self._pending[stream_id] = [memoryview(frame), end]
            self._send_pending()
            self._flush()

    def reset(self, stream_id: int) -> None:
        with self._lock:
            self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
            self._flush()

    def wait(self, stream_id: int, timeout_s: float = 30) -> StreamState:
        """Until the stream ends (trailers) or is reset; a reader must grant a window."""
        give_up = time.monotonic() + timeout_s
        state = self.streams[stream_id]
        while not (state.ended or state.reset or self.closed.is_set()):
            if time.monotonic() > give_up:
                raise TimeoutError(f"stream {stream_id} still open: {state}")
            time.sleep(0.01)
        return state

    def close(self) -> None:
        self.closed.set()
        with contextlib.suppress(OSError):
            self.sock.close()
        self._pump.join(5)

    def _send_pending(self) -> None:
        for stream_id, pending in list(self._pending.items()):
            view, end = pending
            state = self.streams[stream_id]
            while len(view) and not (state.reset or state.ended):
                try:
                    room = min(
                        self.conn.local_flow_control_window(stream_id),
                        len(view),
                        self.conn.max_outbound_frame_size,
                    )
                    if room <= 0:
                        break
                    last = room == len(view)
                    self.conn.send_data(stream_id, bytes(view[:room]), end_stream=last and end)
                except h2.exceptions.StreamClosedError:
                    break  # answered (refused) before the body was all sent
                view = view[room:]
            if state.reset or state.ended:
                view = view[:0]
            pending[0] = view
            if not len(view):
                del self._pending[stream_id]

    def _flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def _run(self) -> None:
        self.sock.settimeout(None)  # blocking sends: a full send buffer waits, never fails
        while not self.closed.is_set():
            try:
                readable, _, _ = select.select([self.sock], [], [], 0.05)
                if not readable:
                    continue
                data = self.sock.recv(1 << 20)
            except (OSError, ValueError) as err:  # ValueError: closed under select
                self.ended_by = repr(err)
                break
            if not data:
                self.ended_by = "the server closed the connection"
                break
            with self._lock:
                try:
                    events = self.conn.receive_data(data)
                except h2.exceptions.ProtocolError as err:
                    self.ended_by = repr(err)
                    break
                for event in events:
                    self._on(event)
                self._send_pending()
                try:
                    self._flush()
                except OSError as err:
                    self.ended_by = repr(err)
                    break
        self.closed.set()

    def _on(self, event: h2.events.Event) -> None:
        stream_id = getattr(event, "stream_id", None)
        state = self.streams.get(stream_id) if stream_id else None
        if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
            if state is not None:
                state.headers.update({k.decode(): v.decode() for k, v in event.headers})
        elif isinstance(event, h2.events.DataReceived):
            if state is not None:
                state.data += len(event.data)
            if self._read:
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded) and state is not None:
            state.ended = True
        elif isinstance(event, h2.events.StreamReset) and state is not None:
            state.reset = True
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.ended_by = repr(event)
            self.closed.set()


def peak_rss_bytes(pid: int) -> int:
    """VmHWM: the most RSS since start or since reset_peak_rss."""
    return _status_kib(pid, "VmHWM") * 1024


def reset_peak_rss(pid: int) -> None:
    """Start VmHWM again from the current RSS (Linux: writing 5 to clear_refs)."""
    with open(f"/proc/{pid}/clear_refs", "w") as refs:
        refs.write("5")


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)
