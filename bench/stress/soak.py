"""Soak: a bounded long run (about 100k requests over both APIs: mixed lengths, some asking
for the weights, some bad). Every answer must carry the status its request calls for, and
resident memory must stay flat after warm-up: the least-squares slope of RSS against
requests served, in MiB per 10k requests."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from bench.calls import UnaryCaller, open_channels
from bench.launcher import Service
from bench.payloads import Payload, attend_body, v2_body
from bench.stats import Lengths
from bench.stress.common import Figures, ServerSpec, metric, ms, rss_mib, slope_per
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.inference import grpc_service_pb2 as v2


@dataclass(frozen=True, kw_only=True)
class SoakConfig:
    server: ServerSpec
    model: str = "mha"
    embed_dim: int = 512
    requests: int = 100_000
    seq: str = "uniform:8:64"
    weights_fraction: float = 0.1
    bad_fraction: float = 0.05
    concurrency: int = 16
    channels: int = 4
    sample_every: int = 1000  # requests between RSS samples
    warmup_fraction: float = 0.2  # of the requests, left out of the slope
    max_slope_mib_per_10k: float = 2.0
    seed: int = 0


@dataclass(frozen=True)
class Item:
    api: str
    body: bytes
    expected: str  # the status code this request must get


def _bad_items(model: str, d: int) -> list[Item]:
    """One of each kind of bad request, per API, with the code docs/api.md documents."""
    nan = np.ones((4, d), np.float32)
    nan[1, 2] = np.nan
    infer = v2.ModelInferRequest(model_name=model, raw_input_contents=[b"\0" * 12])
    infer.inputs.add(name="embeddings", datatype="FP32", shape=[1, 1, d])
    wrong_type = v2.ModelInferRequest(model_name=model, raw_input_contents=[b"\0" * 4 * d])
    wrong_type.inputs.add(name="embeddings", datatype="INT8", shape=[1, 1, d])
    return [
        Item(
            "attention",
            attend_body(np.ones((1, 3, d // 2), np.float32), False, model),
            "INVALID_ARGUMENT",
        ),
        Item(
            "attention",
            pb.AttendRequest(
                model=model, embeddings=pb.Tensor(shape=[4, d], data=nan.tobytes())
            ).SerializeToString(),
            "INVALID_ARGUMENT",
        ),
        Item("attention", attend_body(np.ones((1, 3, d), np.float32), False, "nope"), "NOT_FOUND"),
        Item("attention", b"\xff\xff\xff garbage", "INVALID_ARGUMENT"),
        Item("v2", infer.SerializeToString(), "INVALID_ARGUMENT"),
        Item("v2", wrong_type.SerializeToString(), "INVALID_ARGUMENT"),
        Item("v2", v2_body(np.ones((1, 3, d), np.float32), False, "nope"), "NOT_FOUND"),
    ]


def plan(config: SoakConfig, size: int = 1 << 14) -> list[Item]:
    """The requests, drawn up front and cycled: good ones of mixed lengths on both APIs
    (some with weights), bad ones mixed in."""
    rng = np.random.default_rng(config.seed)
    lengths = Lengths.parse(config.seq).draw(rng, size)
    bad = _bad_items(config.model, config.embed_dim)
    good: dict[tuple[int, bool, str], Item] = {}
    items = []
    for length, draw in zip(lengths, rng.random((size, 3)), strict=True):
        if draw[0] < config.bad_fraction:
            items.append(bad[int(draw[1] * len(bad))])
            continue
        key = (
            int(length),
            bool(draw[1] < config.weights_fraction),
            "v2" if draw[2] < 0.5 else "attention",
        )
        if key not in good:
            x = rng.standard_normal((1, key[0], config.embed_dim), np.float32)
            encode = attend_body if key[2] == "attention" else v2_body
            good[key] = Item(key[2], encode(x, key[1], config.model), "OK")
        items.append(good[key])
    return items


async def _scenario(config: SoakConfig, service: Service) -> Figures:
    items = plan(config)
    channels = open_channels(service.target, config.channels)
    callers = [
        {api: UnaryCaller(channel, api, 60) for api in ("attention", "v2")} for channel in channels
    ]
    indexes = itertools.count()
    done = 0
    codes: Counter[str] = Counter()
    mismatches: list[str] = []
    latencies: list[float] = []
    rss: list[tuple[int, float]] = [(0, rss_mib(service.pid))]

    async def worker(caller: dict[str, UnaryCaller]) -> None:
        nonlocal done
        while (index := next(indexes)) < config.requests:
            item = items[index % len(items)]
            started = time.perf_counter()
            outcome = await caller[item.api].call(Payload.of(item.body))
            if item.expected == "OK":
                latencies.append(time.perf_counter() - started)
            codes[f"{item.api} {outcome.code}"] += 1
            if outcome.code != item.expected and len(mismatches) < 1000:
                mismatches.append(f"{item.api} {outcome.code} (expected {item.expected})")
            done += 1
            if done % config.sample_every == 0:
                rss.append((done, rss_mib(service.pid)))

    started = time.monotonic()
    try:
        await asyncio.gather(
            *(worker(callers[i % len(callers)]) for i in range(config.concurrency))
        )
    finally:
        for channel in channels:
            await channel.close()
    seconds = time.monotonic() - started
    warm = [(n, mib) for n, mib in rss if n >= config.warmup_fraction * config.requests]
    slope = slope_per([n for n, _ in warm], [mib for _, mib in warm], 10_000)
    return {
        "requests": done,
        "duration_s": seconds,
        "requests_per_s": done / seconds,
        "by_api_and_code": dict(sorted(codes.items())),
        "status_mismatches": len(mismatches),
        "mismatch_examples": mismatches[:5],
        "ok_p50_ms": ms(latencies, 50),
        "ok_p99_ms": ms(latencies, 99),
        "rss_start_mib": rss[0][1],
        "rss_after_warmup_mib": warm[0][1] if warm else float("nan"),
        "rss_final_mib": rss[-1][1],
        "rss_max_mib": max(mib for _, mib in rss),
        "rss_slope_mib_per_10k_after_warmup": slope,
        "rss_samples": [(n, round(mib, 1)) for n, mib in rss],
        "queue_depth_end": metric(service.metrics_url, "attention_queue_depth_requests"),
    }


def failed_checks(figures: Figures, config: SoakConfig) -> list[str]:
    checks = {
        "every request got the status it calls for": figures["status_mismatches"] == 0,
        f"RSS slope after warm-up <= {config.max_slope_mib_per_10k:g} MiB per 10k requests": (
            figures["rss_slope_mib_per_10k_after_warmup"] <= config.max_slope_mib_per_10k
        ),
        "queue empty at the end": figures["queue_depth_end"] == 0,
    }
    return [name for name, passed in checks.items() if not passed]


def run(config: SoakConfig) -> Figures:
    service = config.server.start("soak")
    try:
        figures = asyncio.run(_scenario(config, service))
        figures["server_alive"] = service.process.poll() is None
    finally:
        service.stop()
    figures["failed_checks"] = failed_checks(figures, config)
    return figures
