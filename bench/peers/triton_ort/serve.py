"""NVIDIA Triton (from nvidia-pytriton) serving the bench's ONNX graph: run by bench/peers/
triton.py with the Triton virtualenv's interpreter, so it imports nothing from this repository.

    python serve.py --model PATH --name mha --embed-dim 512 --threads 1 \
        --max-batch-size 32 --max-queue-delay-us 1000 [--max-queue-size 64] \
        --grpc-port N --http-port N --metrics-port N

Triton's C++ gRPC front end and dynamic batcher; the graph runs in this process's Python
callable with one ONNX Runtime session. The input is declared [-1, d] under max_batch_size, so
a request is [n, seq, d] with any seq, and the batcher merges only requests of equal shape
(no ragged batching: that would need the callable to pad and mask, which is our server's
job, not the peer's). Triton's system shared memory is open to clients, as in Triton itself.
--max-queue-size bounds the dynamic batcher's queue (its default queue policy); Triton refuses
a request that finds it full."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

import numpy as np
import onnxruntime as ort
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, QueuePolicy, Tensor
from pytriton.triton import DEFAULT_PROTECTED_ENDPOINTS, Triton, TritonConfig, TritonSecurityConfig


def session(model: str, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def make_infer(sess: ort.InferenceSession) -> Any:
    @batch
    def infer(embeddings: np.ndarray) -> dict[str, np.ndarray]:
        # One shape per batch (Triton's batcher merges equal shapes only): nothing is padding.
        mask = np.zeros(embeddings.shape[:2], dtype=bool)
        (output,) = sess.run(["output"], {"embeddings": embeddings, "key_padding_mask": mask})
        return {"output": output}

    return infer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add = parser.add_argument
    add("--model", required=True)
    add("--name", default="mha")
    add("--embed-dim", type=int, required=True)
    add("--threads", type=int, default=1)
    add("--max-batch-size", type=int, default=32)
    add("--max-queue-delay-us", type=int, default=0)
    add("--max-queue-size", type=int, default=0, help="requests queued at most (0: unbounded)")
    add("--grpc-port", type=int, required=True)
    add("--http-port", type=int, required=True)
    add("--metrics-port", type=int, required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # SIGTERM (the bench's stop) leaves through the context manager, which stops tritonserver.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    config = TritonConfig(
        grpc_address="127.0.0.1",
        grpc_port=args.grpc_port,
        http_address="127.0.0.1",
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        allow_gpu_metrics=False,
        exit_on_error=True,
    )
    # PyTriton restricts Triton's shared-memory protocol to callers holding a token it makes
    # up; Triton itself allows it by default. Lifted here (the server listens on loopback
    # only) so the bench's shared-memory clients can register regions as with Triton.
    security = TritonSecurityConfig(
        restricted_endpoints=[e for e in DEFAULT_PROTECTED_ENDPOINTS if e != "shared-memory"]
    )
    d = args.embed_dim
    with Triton(config=config, security_config=security) as triton:
        triton.bind(
            model_name=args.name,
            infer_func=make_infer(session(args.model, args.threads)),
            inputs=[Tensor(name="embeddings", dtype=np.float32, shape=(-1, d))],
            outputs=[Tensor(name="output", dtype=np.float32, shape=(-1, d))],
            config=ModelConfig(
                max_batch_size=args.max_batch_size,
                batcher=DynamicBatcher(
                    max_queue_delay_microseconds=args.max_queue_delay_us,
                    default_queue_policy=QueuePolicy(max_queue_size=args.max_queue_size)
                    if args.max_queue_size
                    else None,
                ),
            ),
            strict=False,
        )
        triton.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
