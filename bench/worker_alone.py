"""The worker alone: its CPU per request when a stand-in front end feeds it over its real
channel, with no gRPC and no front end in the way.

The stand-in connects to a running server's worker as one more front end (its own slab,
the same control messages), sends bursts of --burst requests and waits for their answers.
A burst of K becomes one batch of K (they arrive together), so the figures at K = 1 and at
a large K tell the worker's cost per batch from its cost per request. Pin the server to one
CPU and this to another, or the stand-in's own CPU hides the worker's:

    taskset -c 1 python -m service --model-repository R --grpc-port 0 --metrics-port 0 &
    taskset -c 0 python -m bench.worker_alone --supervisor-pid PID --burst 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import cputime
from service.app import run_dir
from service.ipc import channel
from service.ipc.records import Done, Fail, Hello, InferRequest, Models
from service.ipc.slab import HEADER_BYTES, Slab
from service.worker_socket import socket_path

SLAB_BYTES = 64 << 20
PEERCRED = struct.Struct("3i")  # pid, uid, gid
WARMUP_BURSTS = 200


def worker_socket(supervisor_pid: int) -> Path:
    """The worker's socket in the run directory the supervisor with that pid made."""
    found = run_dir.of_supervisor(supervisor_pid)
    if found is None:
        raise SystemExit(f"no run directory of a supervisor with pid {supervisor_pid}")
    return socket_path(found)


class StandIn:
    """One front end's end of the channel: a slab holding --burst inputs and outputs."""

    def __init__(
        self, reader: channel.Reader, writer: channel.Writer, slab: Slab, worker_pid: int
    ) -> None:
        self._reader, self._writer, self._slab = reader, writer, slab
        self.worker_pid = worker_pid
        self._ids = iter(range(1, 1 << 62))

    @classmethod
    async def connect(cls, path: Path) -> tuple[StandIn, Models]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(path))
        credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
        worker_pid = PEERCRED.unpack(credentials)[0]  # who listens: the worker
        slab = Slab.create(SLAB_BYTES, "worker-alone")
        channel.send_hello(sock, Hello(name="worker-alone", pid=os.getpid()), [slab.fd])
        sock.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        stand_in = cls(channel.Reader(reader), channel.Writer(writer), slab, worker_pid)
        welcome = (await stand_in._reader.read())[0]
        if not isinstance(welcome, Models):
            raise SystemExit(f"the worker's first message was {welcome!r}, not its models")
        return stand_in, welcome

    async def burst(self, model: str, size: int, seq: int, embed_dim: int) -> None:
        """size requests of [1, seq, d], each in its own place, then every answer."""
        nbytes = seq * embed_dim * 4
        waiting = set()
        for i in range(size):
            request_id = next(self._ids)
            waiting.add(request_id)
            self._writer.send(
                InferRequest(
                    request_id=request_id,
                    model_key=model,
                    with_weights=False,
                    shape=(1, seq, embed_dim),
                    dtype="<f4",
                    deadline=time.monotonic() + 60,
                    input_offset=HEADER_BYTES + 2 * i * nbytes,
                    output_offset=HEADER_BYTES + (2 * i + 1) * nbytes,
                )
            )
        while waiting:
            for message in await self._reader.read():
                if isinstance(message, Fail):
                    raise SystemExit(f"the worker failed a request: {message.error.message}")
                if isinstance(message, Done):
                    waiting.discard(message.request_id)

    def fill(self, size: int, seq: int, embed_dim: int) -> None:
        values = np.random.default_rng(0).standard_normal((1, seq, embed_dim), np.float32)
        for i in range(size):
            offset = HEADER_BYTES + 2 * i * seq * embed_dim * 4
            np.copyto(self._slab.array(offset, values.shape, np.dtype("<f4")), values)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    stand_in, welcome = await StandIn.connect(worker_socket(args.supervisor_pid))
    served = welcome.models[0]
    model, embed_dim = served.key, served.spec.embed_dim
    if 2 * args.burst * args.seq * embed_dim * 4 > SLAB_BYTES:
        raise SystemExit("--burst x --seq does not fit the stand-in's slab")
    stand_in.fill(args.burst, args.seq, embed_dim)
    worker = stand_in.worker_pid
    for _ in range(WARMUP_BURSTS):
        await stand_in.burst(model, args.burst, args.seq, embed_dim)
    cpu_before, started = cputime.process_cpu_s(worker), time.monotonic()
    for _ in range(args.rounds):
        await stand_in.burst(model, args.burst, args.seq, embed_dim)
    cpu_after, ended = cputime.process_cpu_s(worker), time.monotonic()
    requests = args.rounds * args.burst
    return {
        "model": model,
        "seq": args.seq,
        "burst": args.burst,
        "requests": requests,
        "worker_cpu_us_per_request": (cpu_after - cpu_before) / requests * 1e6,
        "requests_per_s": requests / (ended - started),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.worker_alone", description=__doc__)
    add = parser.add_argument
    add("--supervisor-pid", type=int, required=True, help="pid of the running server")
    add("--burst", type=int, default=8, help="requests sent together (one batch)")
    add("--seq", type=int, default=16, help="sequence length")
    add("--rounds", type=int, default=2000, help="measured bursts")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = asyncio.run(measure(parse_args(argv)))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
