"""An OTLP/HTTP endpoint that accepts every export and keeps nothing: the collector of the
benchmark's "tracing on" server, so the row measures the server's tracing work (spans made,
batched, serialized and sent) and not a collector's. Its thread runs on the load
generator's CPUs, off the measured server's."""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Accept(BaseHTTPRequestHandler):
    server: OtlpSink

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.server.received_bytes += length
        self.server.exports += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return None  # one line per export would only be noise


class OtlpSink(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, cpus: set[int] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Accept)
        self.received_bytes = 0
        self.exports = 0
        self._cpus = cpus
        self._thread = threading.Thread(target=self._serve, daemon=True, name="otlp-sink")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def _serve(self) -> None:
        if self._cpus:
            os.sched_setaffinity(threading.get_native_id(), self._cpus)
        self.serve_forever(poll_interval=0.2)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Request threads inherit nothing: pin each to the same CPUs as the sink.
        thread = threading.Thread(target=self._pinned, args=(request, client_address), daemon=True)
        thread.start()

    def _pinned(self, request: Any, client_address: Any) -> None:
        if self._cpus:
            os.sched_setaffinity(threading.get_native_id(), self._cpus)
        self.process_request_thread(request, client_address)

    def __enter__(self) -> OtlpSink:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()
