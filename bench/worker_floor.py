"""The least a Python worker loop costs per request: a process that reads INFER messages
from a socket, runs the model on the input in shared memory, copies the output back, checks
that it is finite and writes a DONE, with the worker's own codec, model class and session
options and nothing else (no event loop, batcher, metrics or statistics). A stand-in front
end in a second process sends one request at a time. Against `python -m bench.worker_alone
--burst 1` (the whole worker fed the same way) it tells how much of the worker's CPU per
lone request any loop in Python pays, and how much is the worker's own. Pin the two
processes to different CPUs:

    python -m bench.worker_floor --model-repository models --seq 16 --cpu 1 --client-cpu 0
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from service.ipc import channel
from service.ipc.records import Done, InferRequest, Message
from service.ipc.slab import HEADER_BYTES, Slab
from service.worker.engine.onnx_model import CPU, OnnxModel, warm_up_shapes
from service.worker.engine.repository import discover

SLAB_BYTES = 16 << 20
WARMUP = 500
READ_BYTES = 1 << 16


def _load(repository: Path, name: str) -> OnnxModel:
    versions = [v for v in discover(repository) if v.name == name]
    if not versions:
        raise SystemExit(f"no version of {name!r} under {repository}")
    model = OnnxModel(max(versions, key=lambda v: v.version), [CPU], 1)
    model.warm_up(warm_up_shapes(CPU, 32, 512))
    model.choose_output_graph(32, 512)
    return model


def _serve(sock: socket.socket, slab: Slab, model: OnnxModel) -> dict[str, Any]:
    """The loop: until the stand-in closes its end. Timed after WARMUP requests."""
    framer = channel.Framer()
    served = 0
    started_cpu = 0.0
    run_ns = 0
    while True:
        data = sock.recv(READ_BYTES)
        if not data:
            break
        for message in framer.feed(data):
            assert isinstance(message, InferRequest)
            assert message.input_offset is not None
            assert message.output_offset is not None
            if served == WARMUP:
                started_cpu, run_ns = time.thread_time(), 0
            dtype = np.dtype(message.dtype)
            embeddings = slab.array(message.input_offset, message.shape, dtype)
            mask = np.zeros(message.shape[:2], dtype=bool)
            before = time.perf_counter_ns()
            output, _ = model.run(embeddings, mask, False)
            run_ns += time.perf_counter_ns() - before
            target = slab.array(message.output_offset, message.shape, dtype)
            np.copyto(target, output)
            if not np.isfinite(target).all():
                raise SystemExit("the model's output is not finite")
            sock.sendall(channel.encode(Done(message.request_id, 0.0, 0.0, 1, 0.0, 0.0, served)))
            served += 1
    measured = served - WARMUP
    return {
        "requests": measured,
        "loop_cpu_us_per_request": round((time.thread_time() - started_cpu) / measured * 1e6, 1),
        "onnx_runtime_run_us_in_place": round(run_ns / measured / 1e3, 1),
    }


def _send(
    sock: socket.socket, slab: Slab, model_key: str, shape: tuple[int, ...], count: int
) -> float:
    """count requests, one at a time; the requests per second."""
    framer = channel.Framer()
    nbytes = int(np.prod(shape)) * 4
    values = np.random.default_rng(0).standard_normal(shape, np.float32)
    np.copyto(slab.array(HEADER_BYTES, shape, np.dtype("<f4")), values)
    started = time.monotonic()
    for request_id in range(1, count + 1):
        infer = InferRequest(
            request_id=request_id,
            model_key=model_key,
            with_weights=False,
            shape=shape,
            dtype="<f4",
            deadline=None,
            input_offset=HEADER_BYTES,
            output_offset=HEADER_BYTES + nbytes,
        )
        sock.sendall(channel.encode(infer))
        answers: list[Message] = []
        while not answers:
            answers = framer.feed(sock.recv(READ_BYTES))
    return count / (time.monotonic() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.worker_floor", description=__doc__)
    add = parser.add_argument
    add("--model-repository", type=Path, default=Path("models"))
    add("--model", default="mha")
    add("--seq", type=int, default=16)
    add("--requests", type=int, default=4000, help="measured, after the warm-up")
    add("--cpu", type=int, default=1, help="the loop's CPU")
    add("--client-cpu", type=int, default=0, help="the stand-in's CPU")
    args = parser.parse_args(argv)
    loop_end, client_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    slab = Slab.create(SLAB_BYTES, "worker-floor")
    child = os.fork()
    if child == 0:  # the loop: the model is loaded here, after the fork
        client_end.close()
        os.sched_setaffinity(0, {args.cpu})
        model = _load(args.model_repository, args.model)
        loop_end.sendall(json.dumps([model.key, model.spec.embed_dim]).encode() + b"\n")
        result = _serve(loop_end, slab, model)
        loop_end.sendall(json.dumps(result).encode())
        loop_end.close()
        os._exit(0)
    loop_end.close()
    os.sched_setaffinity(0, {args.client_cpu})
    hello = b""
    while not hello.endswith(b"\n"):
        hello += client_end.recv(READ_BYTES)
    model_key, embed_dim = json.loads(hello)
    shape = (1, args.seq, int(embed_dim))
    rate = _send(client_end, slab, model_key, shape, WARMUP + args.requests)
    client_end.shutdown(socket.SHUT_WR)
    report = b""
    while chunk := client_end.recv(READ_BYTES):
        report += chunk
    os.waitpid(child, 0)
    result = {
        "model": model_key,
        "seq": args.seq,
        **json.loads(report),
        "requests_per_s": round(rate, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
