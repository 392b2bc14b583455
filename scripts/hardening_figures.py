"""The reliability table's hardening figures, measured against a real server at the defaults
on 127.0.0.1 (RSS from /proc/PID/status). Bounded: about a minute on two cores.

    python scripts/hardening_figures.py [MODEL_REPOSITORY]   (default: a fresh mha d=512 export)
"""

from __future__ import annotations

import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from export.pipeline import ExportRequest, run_export
from service.client import attend_request
from tests.harness.h2_raw import RawGrpc
from tests.harness.server_process import ServerProcess, peak_rss_bytes, reset_peak_rss, rss_bytes

ATTEND = "/attention.v1.AttentionService/Attend"
ATTEND_STREAM = "/attention.v1.AttentionService/AttendStream"
MIB = 1 << 20


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _gzip_bomb(inflated: int = 1 << 30) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    return b"".join(packer.compress(bytes(1 << 24)) for _ in range(inflated >> 24)) + (
        packer.flush()
    )


def _settle(server: ServerProcess, quiet_s: float = 2.0, timeout_s: float = 120) -> None:
    """Until the batcher has been idle (no sequences computed) for quiet_s."""
    give_up = time.monotonic() + timeout_s
    last, since = -1.0, time.monotonic()
    while time.monotonic() < give_up:
        done = server.metric("attention_batch_size_sequences_sum")
        if done != last:
            last, since = done, time.monotonic()
        elif time.monotonic() - since > quiet_s:
            return
        time.sleep(0.1)


def _slow(server: ServerProcess, label: str, start: Callable[[RawGrpc, bytes], None]) -> None:
    pid = server.process.pid
    x = np.random.default_rng(0).standard_normal((8, 512, 512), dtype=np.float32)
    message = attend_request(x, return_attention_weights=True).SerializeToString()
    before = rss_bytes(pid)
    reset_peak_rss(pid)
    connections = [RawGrpc(server.grpc_port, window=1) for _ in range(6)]
    for connection in connections:
        start(connection, message)
    _settle(server)
    held = server.metric("attention_undelivered_answer_bytes")
    settled, peak = rss_bytes(pid), peak_rss_bytes(pid)
    for connection in connections:
        connection.close()
    time.sleep(1)
    _say(
        f"{label}: RSS {before // MIB} -> {settled // MIB} MiB held "
        f"(+{(settled - before) // MIB}), "
        f"peak {peak // MIB} MiB (+{(peak - before) // MIB}, compute included); "
        f"budget held {held / MIB:.0f} MiB; after the clients left {rss_bytes(pid) // MIB} MiB, "
        f"budget {server.metric('attention_undelivered_answer_bytes') / MIB:.0f} MiB"
    )


def _unary(connection: RawGrpc, message: bytes) -> None:
    for _ in range(4):
        connection.call(ATTEND, message)


def _streams(connection: RawGrpc, message: bytes) -> None:
    for _ in range(4):
        stream = connection.call(ATTEND_STREAM, message, end=False)
        connection.send_message(stream, message)


def main() -> None:
    if len(sys.argv) > 1:
        repository = Path(sys.argv[1])
    else:
        repository = Path(tempfile.mkdtemp()) / "models"
        run_export(ExportRequest(name="mha", embed_dim=512, num_heads=8, out=repository))
    with ServerProcess(repository) as server:
        _slow(server, "24 unary calls 8x512 with weights, 1-byte window", _unary)
        _slow(server, "24 streams x 2 messages 8x512 with weights, 1-byte window", _streams)
        codes = {
            code: server.metric("attention_requests_total", code=code)
            for code in ("OK", "CANCELLED", "RESOURCE_EXHAUSTED")
        }
        _say(f"requests_total by code: {codes}")
    with ServerProcess(repository, "--grpc-compression", "gzip") as server:
        pid = server.process.pid
        bomb = _gzip_bomb()
        before = rss_bytes(pid)
        reset_peak_rss(pid)
        connection = RawGrpc(server.grpc_port)
        state = connection.wait(connection.call(ATTEND, bomb, compressed=True))
        connection.close()
        _say(
            f"1 GiB gzip bomb ({len(bomb) // 1024} KiB sent), --grpc-compression gzip: "
            f"peak RSS +{(peak_rss_bytes(pid) - before) // MIB} MiB; "
            f"grpc-status {state.headers.get('grpc-status')}"
        )


if __name__ == "__main__":
    main()
