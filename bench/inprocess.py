"""The in-process limit, its own process: python -m bench.inprocess --model PATH --json OUT.

ONNX Runtime on the server's graph with the server's thread count, no gRPC: at batch sizes
1, 2, 4, .. max for one length (the best is the limit), or, for mixed lengths, the ways a
program holding all the sequences could run them (alone, sorted into batches, first-come)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from bench.stats import Lengths
from service.settings import PROVIDERS
from service.worker.engine.cuda import CUDA, CudaOptions
from service.worker.engine.onnx_model import choose_providers

Feeds = dict[str, np.ndarray]
# ONNX type strings of the graph's inputs -> numpy dtypes (a float16 export takes float16).
ONNX_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(bool)": np.bool_,
}


def session(model: Path, threads: int, provider: str) -> ort.InferenceSession:
    """Options as the server's engine sets them (service/worker/engine/onnx_model.py)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    # The server's own choice (auto = CUDA when usable) and its CUDA options (TF32 off), so
    # both run on the same device with the same arithmetic.
    providers: list[str | tuple[str, dict[str, str]]] = [
        (name, CudaOptions().provider_options()) if name == CUDA else name
        for name in choose_providers(provider)
    ]
    return ort.InferenceSession(str(model), options, providers=providers)


def embed_dim(sess: ort.InferenceSession) -> int:
    return int(sess.get_modelmeta().custom_metadata_map["embed_dim"])


def input_dtypes(sess: ort.InferenceSession) -> dict[str, np.dtype[Any]]:
    """Each graph input's numpy dtype, read from the session (float32 or float16 models)."""
    found = {}
    for node in sess.get_inputs():
        if node.type not in ONNX_DTYPES:
            raise ValueError(f"input {node.name} has type {node.type}, not one the bench feeds")
        found[node.name] = np.dtype(ONNX_DTYPES[node.type])
    return found


def padded_feeds(
    rows: Sequence[np.ndarray], d: int, dtypes: Mapping[str, np.dtype[Any]] | None = None
) -> Feeds:
    """Sequences padded to the longest, key_padding_mask true on the padding (as the server),
    each input in the graph's own dtype (dtypes from input_dtypes; float32 and bool if None)."""
    dtypes = dtypes or {}
    longest = max(len(row) for row in rows)
    x = np.zeros((len(rows), longest, d), dtypes.get("embeddings", np.dtype(np.float32)))
    mask = np.ones((len(rows), longest), dtypes.get("key_padding_mask", np.dtype(np.bool_)))
    for i, row in enumerate(rows):
        x[i, : len(row)] = row
        mask[i, : len(row)] = False
    return {"embeddings": x, "key_padding_mask": mask}


def sorted_groups(lengths: Sequence[int], size: int) -> list[list[int]]:
    """Indices sorted by length, cut into batches of size: the least padding."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + size] for i in range(0, len(order), size)]


def arrival_groups(count: int, size: int) -> list[list[int]]:
    """Indices in arrival order, cut into batches of size: what a naive batcher forms."""
    return [list(range(i, min(i + size, count))) for i in range(0, count, size)]


def padding_ratio(lengths: Sequence[int], groups: Sequence[Sequence[int]]) -> float:
    """Padded positions / all positions computed, over the batches."""
    total = sum(len(group) * max(lengths[i] for i in group) for group in groups)
    real = sum(lengths[i] for group in groups for i in group)
    return (total - real) / total if total else 0.0


def timed(run: Callable[[], int], seconds: float, min_rounds: int = 3) -> tuple[float, float]:
    """(sequences per second, CPU ms per sequence) of run() (which returns the sequences it
    ran), repeated. The CPU is this process's (every ONNX Runtime thread), as /proc counts it
    for the server's processes."""
    run()  # warm: first calls allocate
    rounds = done = 0
    started, cpu_started = time.perf_counter(), time.process_time()
    while rounds < min_rounds or time.perf_counter() - started < seconds:
        done += run()
        rounds += 1
    cpu_s = time.process_time() - cpu_started
    return done / (time.perf_counter() - started), cpu_s / done * 1000 if done else math.nan


def batch_sweep(
    sess: ort.InferenceSession,
    seq: int,
    batch_sizes: Sequence[int],
    outputs: list[str],
    seconds: float,
) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    d, dtypes = embed_dim(sess), input_dtypes(sess)
    points = []
    for batch in batch_sizes:
        feeds = padded_feeds(
            list(rng.standard_normal((batch, seq, d), dtype=np.float32)), d, dtypes
        )

        def run_batch(feeds: Feeds = feeds, batch: int = batch) -> int:
            sess.run(outputs, feeds)
            return batch

        rate, cpu_ms = timed(run_batch, seconds)
        points.append(
            {
                "batch_size": batch,
                "sequences_per_s": rate,
                "ms_per_batch": batch / rate * 1000,
                "cpu_ms_per_sequence": cpu_ms,
            }
        )
    best = max(points, key=lambda p: p["sequences_per_s"])
    return {"seq": seq, "points": points, "best": best, "sequences_per_s": best["sequences_per_s"]}


def mixed(
    sess: ort.InferenceSession, lengths: Lengths, count: int, outputs: list[str], seconds: float
) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    d, dtypes = embed_dim(sess), input_dtypes(sess)
    drawn = [int(n) for n in lengths.draw(rng, count)]
    rows = [rng.standard_normal((n, d), dtype=np.float32) for n in drawn]
    plans = {
        "alone": [[i] for i in range(count)],
        "sorted by length, b=8": sorted_groups(drawn, 8),
        "first-come, b=32": arrival_groups(count, 32),
    }
    strategies = {}
    for name, groups in plans.items():
        batches = [padded_feeds([rows[i] for i in group], d, dtypes) for group in groups]

        def run_all(batches: list[Feeds] = batches) -> int:
            for feeds in batches:
                sess.run(outputs, feeds)
            return count

        rate, cpu_ms = timed(run_all, seconds, min_rounds=1)
        strategies[name] = {
            "sequences_per_s": rate,
            "cpu_ms_per_sequence": cpu_ms,
            "padding_ratio": padding_ratio(drawn, groups),
        }
    best = max(strategies, key=lambda name: strategies[name]["sequences_per_s"])
    return {
        "seq": str(lengths),
        "count": count,
        "strategies": strategies,
        "best": best,
        "sequences_per_s": strategies[best]["sequences_per_s"],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.inprocess", description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="model.onnx of the server")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (0 = all cores)")
    parser.add_argument("--provider", choices=PROVIDERS, default="cpu", help="as the server's")
    parser.add_argument("--seq", default="16", help="N (batch sweep) or uniform:LOW:HIGH (mixed)")
    parser.add_argument("--max-batch-size", type=int, default=32, help="sweep 1, 2, 4, .. this")
    parser.add_argument("--count", type=int, default=256, help="mixed: sequences drawn")
    parser.add_argument("--weights", action="store_true", help="run the weights graph")
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measured point")
    parser.add_argument("--json", type=Path, help="write the result here (else stdout)")
    return parser.parse_args(argv)


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, .. up to limit, and limit itself."""
    sizes = [1 << k for k in range(limit.bit_length()) if 1 << k <= limit]
    return sizes if sizes[-1] == limit else [*sizes, limit]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.model.with_name("model.with_weights.onnx") if args.weights else args.model
    outputs = ["output", "attention_weights"] if args.weights else ["output"]
    sess = session(model, args.threads, args.provider)
    lengths = Lengths.parse(args.seq)
    if lengths.fixed:
        result = batch_sweep(
            sess, lengths.low, powers_of_two(args.max_batch_size), outputs, args.seconds
        )
    else:
        result = mixed(sess, lengths, args.count, outputs, args.seconds)
    result |= {"model": str(model), "threads": args.threads, "provider": sess.get_providers()[0]}
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
