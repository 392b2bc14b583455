"""The worker's parts for one request at a time, in this process: ONNX Runtime's run of a
batch of one, and the batcher around it (merge, split, checks, scheduling, metrics) fed one
request at a time on an event loop, with the model and threads a worker uses. Against
`python -m bench.worker_alone --burst 1` (the whole worker, with its link), it tells where a
lone request's CPU goes. Pin it to one CPU:

    taskset -c 1 python -m bench.worker_parts --model-repository models --model mha --seq 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np

from service.worker.batching.batcher import Batcher
from service.worker.batching.protocol import BatchLimits
from service.worker.engine.onnx_model import CPU, OnnxModel, warm_up_shapes
from service.worker.engine.repository import discover

WARMUP = 300


def _cpu_us_per_call(call, count: int) -> float:
    started = time.thread_time()
    for _ in range(count):
        call()
    return (time.thread_time() - started) / count * 1e6


async def _batcher_us_per_request(model: OnnxModel, x: np.ndarray, count: int) -> float:
    batcher = Batcher(
        BatchLimits(max_batch_size=32, max_queue_delay_s=0.0, max_queue_size=1024, live_caps=True)
    )
    batcher.compute_short_batches_inline(0.05)  # as the worker on a CPU
    batcher.time_costs_with(time.thread_time)
    await batcher.start()
    out = np.empty_like(x)

    async def one_at_a_time(n: int) -> None:
        for _ in range(n):
            await batcher.enqueue(model, x, with_weights=False, deadline=None, into=(out, None))

    try:
        await one_at_a_time(WARMUP)
        started = time.thread_time()
        await one_at_a_time(count)
        return (time.thread_time() - started) / count * 1e6
    finally:
        await batcher.stop(timeout_s=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repository", type=Path, default=Path("models"))
    parser.add_argument("--model", default="mha")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    versions = [v for v in discover(args.model_repository) if v.name == args.model]
    if not versions:
        parser.error(f"no version of {args.model!r} under {args.model_repository}")
    model = OnnxModel(max(versions, key=lambda v: v.version), [CPU], 1)
    model.warm_up(warm_up_shapes(CPU, 32, 512))
    model.choose_output_graph(32, 512)
    x = np.random.default_rng(0).standard_normal((1, args.seq, model.spec.embed_dim))
    x = x.astype(model.spec.dtype)
    mask = np.zeros((1, args.seq), dtype=bool)
    _cpu_us_per_call(lambda: model.run(x, mask, False), WARMUP)
    run_us = _cpu_us_per_call(lambda: model.run(x, mask, False), args.requests)
    batcher_us = asyncio.run(_batcher_us_per_request(model, x, args.requests))
    print(
        json.dumps(
            {
                "model": model.key,
                "seq": args.seq,
                "requests": args.requests,
                "onnx_runtime_run_us": round(run_us, 1),
                "batcher_one_at_a_time_us": round(batcher_us, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
