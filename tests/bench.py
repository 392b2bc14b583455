"""Benchmark: python -m tests.bench [--model-repository models] [--quick]

Prints throughput and ratios measured in this one run: the server against in-process
ONNX Runtime on the same model, and dynamic batching on against off. The load generator
shares the machine with the server, as a sidecar client would.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from service.client import AsyncAttentionClient
from tests.server_process import ServerProcess


@dataclass(frozen=True)
class Run:
    label: str
    seq: int
    concurrency: int
    requests_per_s: float
    p50_ms: float
    mean_batch: float


def in_process(model: Path, seq: int, requests: int, d: int) -> float:
    """Requests/s of plain ONNX Runtime, one sequence per call, no server."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((1, seq, d), dtype=np.float32)
    feeds = {"embeddings": x, "key_padding_mask": np.zeros((1, seq), bool)}
    for _ in range(10):
        session.run(["output"], feeds)
    started = time.perf_counter()
    for _ in range(requests):
        session.run(["output"], feeds)
    return requests / (time.perf_counter() - started)


async def load(
    target: str, seq: int, d: int, requests: int, concurrency: int
) -> tuple[float, float, float]:
    x = np.random.default_rng(1).standard_normal((seq, d), dtype=np.float32)
    gate = asyncio.Semaphore(concurrency)
    async with AsyncAttentionClient(target) as client:

        async def one() -> tuple[float, int]:
            async with gate:
                started = time.perf_counter()
                result = await client.attend(x)
                return time.perf_counter() - started, result.batch_size

        await asyncio.gather(*(one() for _ in range(min(requests, 4 * concurrency))))  # warm
        started = time.perf_counter()
        results = await asyncio.gather(*(one() for _ in range(requests)))
        wall = time.perf_counter() - started
    return (
        requests / wall,
        statistics.median(r[0] for r in results) * 1000,
        statistics.mean(r[1] for r in results),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", type=Path, default=Path("models"))
    parser.add_argument("--model", default="mha")
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    args = parser.parse_args()
    model = (
        max((args.model_repository / args.model).iterdir(), key=lambda p: int(p.name))
        / "model.onnx"
    )
    d = int(
        ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
        .get_modelmeta()
        .custom_metadata_map["embed_dim"]
    )
    scale = 0.2 if args.quick else 1.0
    budget = {16: int(1500 * scale), 128: int(400 * scale)}
    print(f"model {model} d={d}; machine: {os.cpu_count()} CPUs; client and server share them")
    runs: list[Run] = []
    baseline = {seq: in_process(model, seq, budget[seq], d) for seq in budget}
    for label, flags in (
        ("batching off", ("--max-batch-size", "1")),
        ("batching on", ("--max-batch-size", "32")),
    ):
        with ServerProcess(args.model_repository, *flags) as server:  # default queue delay
            for seq in budget:
                for concurrency in (1, 16, 64):
                    rps, p50, batch = asyncio.run(
                        load(server.target, seq, d, budget[seq], concurrency)
                    )
                    runs.append(Run(label, seq, concurrency, rps, p50, batch))
    print(f"\n{'config':<14}{'seq':>5}{'conc':>6}{'req/s':>10}{'p50 ms':>9}{'mean batch':>12}")
    for seq in budget:
        print(f"{'in-process ORT':<14}{seq:>5}{1:>6}{baseline[seq]:>10.1f}{'':>9}{1:>12}")
        for run in (r for r in runs if r.seq == seq):
            print(
                f"{run.label:<14}{seq:>5}{run.concurrency:>6}{run.requests_per_s:>10.1f}{run.p50_ms:>9.2f}{run.mean_batch:>12.1f}"
            )
    print("\nratios (same run):")
    for seq in budget:
        pick = {(r.label, r.concurrency): r.requests_per_s for r in runs if r.seq == seq}
        print(
            f"  seq {seq:>3}: server (batching on, c=1) / in-process ORT = {pick[('batching on', 1)] / baseline[seq]:.2f}; "
            f"server (batching on, c=64) / in-process ORT = {pick[('batching on', 64)] / baseline[seq]:.2f}; "
            f"batching on / off at c=64 = {pick[('batching on', 64)] / pick[('batching off', 64)]:.2f}"
        )


if __name__ == "__main__":
    main()
