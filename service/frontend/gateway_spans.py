"""The spans of calls the gateway answered (--tracing on): the gateway samples each call as
this process's sampler would and sends a record of each sampled one (service/ipc/
span_record.py) to the Unix socket here; a thread makes the call's spans from it with
the OpenTelemetry SDK, so the server has one exporter and one configuration."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from pathlib import Path

import grpc

from service.frontend.status import SERVER_FAULTS
from service.ipc import span_record
from service.ipc.records import Done
from service.observability import tracing

log = logging.getLogger(__name__)
POLL_S = 0.25  # how soon the thread sees stop()
READ_BYTES = 1 << 16
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def gateway_call(record: span_record.SpanRecord) -> tracing.GatewayCall:
    """The spans' terms of a record: the attributes the Python path gives the same call."""
    code = _CODES.get(record.code, grpc.StatusCode.UNKNOWN)
    service, _, method = record.method.partition("/")
    attributes: dict[str, object] = {
        "rpc.system": "grpc",
        "rpc.service": service,
        "rpc.method": method,
        "rpc.grpc.status_code": code.value[0],
    }
    if record.model:
        attributes |= {
            "attention.model": record.model,
            "attention.model_version": record.model_version,
            "attention.sequences": record.sequences,
            "attention.sequence_length": record.length,
        }
    return tracing.GatewayCall(
        trace_id=record.trace_id,
        span_id=record.span_id,
        parent_span_id=record.parent_span_id,
        parent_flags=record.parent_flags,
        trace_state=record.trace_state,
        name=record.method,
        received_ns=record.received_ns,
        answered_ns=record.answered_ns,
        code=code.name,
        error=code in SERVER_FAULTS,
        attributes=attributes,
        batch=None if record.done is None else _batch(record.done),
    )


def _batch(done: Done) -> tracing.Batch:
    return tracing.Batch(
        queue_s=done.queue_s,
        compute_s=done.compute_s,
        started_at=done.started_at,
        batch_size=done.batch_size,
        padding=done.padding,
        batch_id=done.batch_id,
        tags=tracing.tags_from_numbers(done.tags),
    )


class SpanSink:
    """Listens on path; start() before the gateway starts, stop() after it stopped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._thread = threading.Thread(target=self._serve, name="gateway-spans", daemon=True)

    def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a previous front end's, gone with it
        self._listener.bind(str(self.path))
        self._listener.listen(4)
        self._listener.settimeout(POLL_S)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            with connection:
                self._read(connection)

    def _read(self, connection: socket.socket) -> None:
        """Records until the gateway goes (or sends something malformed: then it reconnects
        and only the records in between are lost)."""
        connection.settimeout(POLL_S)
        buffer = bytearray()
        while True:
            try:
                chunk = connection.recv(READ_BYTES)
            except TimeoutError:
                if self._stop.is_set():
                    return  # and nothing more came: what was sent is read
                continue
            except OSError:
                return
            if not chunk:
                return
            buffer += chunk
            try:
                used = self._records(buffer)
            except ValueError as err:
                log.warning("tracing: a malformed span record from the gateway (%s)", err)
                return
            del buffer[:used]

    @staticmethod
    def _records(buffer: bytearray) -> int:
        """Makes the spans of every whole record in buffer; the bytes used."""
        at, view = 0, memoryview(buffer)
        try:
            while len(buffer) - at >= span_record.LENGTH.size:
                (size,) = span_record.LENGTH.unpack_from(buffer, at)
                if size > span_record.MAX_RECORD_BYTES:
                    raise ValueError(f"a record of {size} bytes")
                end = at + span_record.LENGTH.size + size
                if end > len(buffer):
                    break
                body = view[at + span_record.LENGTH.size : end]
                at = end
                try:  # its length was sound: a bad body loses this record, not the stream
                    record = span_record.unpack(body)
                except ValueError as err:
                    log.warning("tracing: a malformed span record from the gateway (%s)", err)
                    continue
                finally:
                    body.release()
                try:
                    tracing.record_gateway_call(gateway_call(record))
                except Exception:  # one bad span must not end the others
                    log.exception("tracing: a gateway call's spans could not be made")
        finally:
            view.release()
        return at
