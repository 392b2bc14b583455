"""Overload: offer about 3x the measured capacity for a bounded time. The server must stay up
and SERVING, finish what it accepts within the callers' deadlines, refuse the excess quickly
with RESOURCE_EXHAUSTED, and drain its queue and give memory back once the load stops."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from grpc_health.v1 import health_pb2_grpc

from bench.calls import UnaryCaller, open_channels
from bench.harness import wait_for
from bench.payloads import Payload, attend_body, v2_body
from bench.stats import poisson_arrivals
from bench.stress.common import (
    Figures,
    RssSampler,
    ServerSpec,
    health_status,
    metric,
    ms,
    rss_by_process,
    rss_mib,
)

Sample = tuple[float, str]  # (latency s from issue, code)


@dataclass(frozen=True, kw_only=True)
class OverloadConfig:
    server: ServerSpec
    api: str = "attention"  # or "v2"
    model: str = "mha"
    embed_dim: int = 512
    seq: int = 128
    warmup_s: float = 2.0
    capacity_s: float = 8.0
    capacity_concurrency: int = 32
    overload_s: float = 30.0
    factor: float = 3.0
    deadline_s: float = 10.0
    channels: int = 4
    # How long memory may take to come back once the queue drained (the front end gives its
    # free pages back after its slab has been idle 0.5 s); polled, not slept.
    settle_timeout_s: float = 10.0
    rss_tolerance_mib: float = 64.0
    seed: int = 0


def _body(config: OverloadConfig) -> bytes:
    x = np.random.default_rng(config.seed).standard_normal(
        (1, config.seq, config.embed_dim), dtype=np.float32
    )
    encode = attend_body if config.api == "attention" else v2_body
    return encode(x, False, config.model)


async def _closed_loop(
    callers: list[UnaryCaller], body: bytes, concurrency: int, seconds: float
) -> list[Sample]:
    samples: list[Sample] = []
    stop_at = time.perf_counter() + seconds

    async def loop(caller: UnaryCaller) -> None:
        while (started := time.perf_counter()) < stop_at:
            outcome = await caller.call(Payload.of(body))
            samples.append((time.perf_counter() - started, outcome.code))

    await asyncio.gather(*(loop(callers[i % len(callers)]) for i in range(concurrency)))
    return samples


async def _open_loop(
    callers: list[UnaryCaller], body: bytes, rate: float, seconds: float, seed: int
) -> tuple[list[Sample], float]:
    """Poisson arrivals, no client-side bound: every arrival is sent. Also the worst lag of
    the sender behind its schedule (a lagging client would offer less than it claims)."""
    samples: list[Sample] = []
    tasks: set[asyncio.Task[None]] = set()
    lag = 0.0

    async def one(caller: UnaryCaller) -> None:
        started = time.perf_counter()
        outcome = await caller.call(Payload.of(body))
        samples.append((time.perf_counter() - started, outcome.code))

    start = time.perf_counter()
    for index, due in enumerate(poisson_arrivals(rate, seconds, np.random.default_rng(seed))):
        delay = start + due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = max(lag, -delay)
        task = asyncio.create_task(one(callers[index % len(callers)]))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    while tasks:
        await asyncio.gather(*tasks)
    return samples, lag


SERVING_STATES = ("SERVING", "NOT_SERVING")  # answers; anything else is a failed check


def _longest_run(flags: list[bool]) -> int:
    longest = current = 0
    for flag in flags:
        current = current + 1 if flag else 0
        longest = max(longest, current)
    return longest


async def _watch(
    stub: health_pb2_grpc.HealthStub, url: str, stop: asyncio.Event
) -> tuple[list[tuple[float, str]], float]:
    """Health every 0.25 s (latency, status) and the deepest queue seen on /metrics."""
    checks: list[tuple[float, str]] = []
    deepest = 0.0
    while not stop.is_set():
        started = time.perf_counter()
        status = await health_status(stub)
        checks.append((time.perf_counter() - started, status))
        depth = await asyncio.to_thread(metric, url, "attention_queue_depth_requests")
        deepest = max(deepest, depth)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)
    return checks, deepest


async def _scenario(
    config: OverloadConfig, pid: int, target: str, url: str, roles: Mapping[str, int]
) -> Figures:
    body = _body(config)
    channels = open_channels(target, config.channels)
    try:
        callers = [UnaryCaller(channel, config.api, config.deadline_s) for channel in channels]
        health = health_pb2_grpc.HealthStub(channels[0])
        await _closed_loop(callers, body, config.capacity_concurrency, config.warmup_s)
        measured = await _closed_loop(callers, body, config.capacity_concurrency, config.capacity_s)
        capacity = sum(1 for _, code in measured if code == "OK") / config.capacity_s
        rss_before = rss_mib(pid)
        stop = asyncio.Event()
        watcher = asyncio.create_task(_watch(health, url, stop))
        rate = config.factor * capacity
        with RssSampler(pid) as sampler:
            samples, lag = await _open_loop(callers, body, rate, config.overload_s, config.seed)
            stop.set()
            checks, deepest = await watcher
            drained_s = await asyncio.to_thread(
                wait_for,
                lambda: (
                    metric(url, "attention_queue_depth_requests") == 0
                    and metric(url, "attention_inflight_requests") == 0
                ),
                what="the queue draining",
            )
        after = await health_status(health)
        final = await callers[0].call(Payload.of(body))
    finally:
        for channel in channels:
            await channel.close()
    # Once every connection has closed too: what the server keeps from here on is what stays.
    settled_s = await asyncio.to_thread(_settle, pid, rss_before, config)
    codes = Counter(code for _, code in samples)
    ok = [latency for latency, code in samples if code == "OK"]
    rejected = [latency for latency, code in samples if code == "RESOURCE_EXHAUSTED"]
    return {
        "capacity_rps": capacity,
        "offered_rps": rate,
        "offered": len(samples),
        "sender_max_lag_ms": lag * 1000,
        "accepted_ok": len(ok),
        "rejected_resource_exhausted": len(rejected),
        "other_codes": {code: n for code, n in codes.items() if code not in REJECT_OR_OK},
        "accepted_p50_ms": ms(ok, 50),
        "accepted_p99_ms": ms(ok, 99),
        "accepted_max_ms": max(ok, default=float("nan")) * 1000,
        "deadline_ms": config.deadline_s * 1000,
        "rejected_p50_ms": ms(rejected, 50),
        "rejected_p99_ms": ms(rejected, 99),
        "deepest_queue": deepest,
        "health_checks": len(checks),
        "health_not_serving": sum(1 for _, status in checks if status == "NOT_SERVING"),
        # Checks that got no answer in time, and the longest run of them: a probe with a
        # failure threshold of 2 (the manifests' readiness) fails only on two in a row.
        "health_unanswered": sum(1 for _, status in checks if status not in SERVING_STATES),
        "health_unanswered_in_a_row": _longest_run(
            [status not in SERVING_STATES for _, status in checks]
        ),
        "health_p99_ms": ms([latency for latency, _ in checks], 99),
        "health_after": after,
        "valid_call_after": final.code,
        "queue_drained_s": drained_s,
        "rss_before_mib": rss_before,
        "rss_peak_mib": sampler.peak_mib,
        "rss_final_mib": rss_mib(pid),
        "rss_settled_s": settled_s,
        "rss_final_by_process_mib": rss_by_process(pid, roles),
    }


def _settle(pid: int, rss_before: float, config: OverloadConfig) -> float:
    """Seconds until resident memory came back within the tolerance (nan: it did not)."""
    try:
        return wait_for(
            lambda: rss_mib(pid) - rss_before <= config.rss_tolerance_mib,
            what="resident memory coming back",
            timeout_s=config.settle_timeout_s,
        )
    except TimeoutError:
        return math.nan


REJECT_OR_OK = ("OK", "RESOURCE_EXHAUSTED")


def failed_checks(figures: Figures, config: OverloadConfig) -> list[str]:
    checks = {
        "the excess was refused (RESOURCE_EXHAUSTED > 0)": figures["rejected_resource_exhausted"]
        > 0,
        "only OK and RESOURCE_EXHAUSTED (no deadline missed, nothing else)": not figures[
            "other_codes"
        ],
        "health SERVING throughout and after": figures["health_not_serving"] == 0
        and figures["health_unanswered_in_a_row"] < 2
        and figures["health_after"] == "SERVING",
        "a valid call after the load is OK": figures["valid_call_after"] == "OK",
        f"final RSS within {config.rss_tolerance_mib:g} MiB of before": figures["rss_final_mib"]
        - figures["rss_before_mib"]
        <= config.rss_tolerance_mib,
        "server still running": figures["server_alive"],
    }
    return [name for name, passed in checks.items() if not passed]


def run(config: OverloadConfig) -> Figures:
    """Start the server, measure capacity, overload it, let it drain; figures + failed checks."""
    service = config.server.start("overload")
    try:
        figures = asyncio.run(
            _scenario(config, service.pid, service.target, service.metrics_url, service.children)
        )
        figures["server_alive"] = service.process.poll() is None
    finally:
        service.stop()
    figures["failed_checks"] = failed_checks(figures, config)
    return figures
