"""Load generator, its own process: python -m bench.loadgen --target HOST:PORT --json OUT.

Closed loop (--concurrency N callers, each sends its next request when the last returns) or
open loop (--rate R Poisson arrivals per second, at most --max-outstanding in flight; the
rest are counted as rejected). Requests are serialized before the run; only the window after
--warmup-s is measured."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np

from bench import cputime, scrape
from bench.calls import (
    Caller,
    Outcome,
    RestCaller,
    SharedMemoryCaller,
    make_callers,
    open_channels,
)
from bench.payloads import APIS, REST, SHM, Payload, build_payloads
from bench.stats import Lengths, latency_summary_ms, poisson_arrivals

# (completion time, latency s, sequences, outcome); a tuple per request keeps the hot path lean
Sample = tuple[float, float, int, Outcome]


class Plan:
    """The requests to send, drawn up front (length, weights) and cycled."""

    def __init__(
        self,
        payloads: dict[tuple[int, bool], Payload],
        lengths: Lengths,
        weights_fraction: float,
        seed: int,
        size: int = 1 << 14,
    ) -> None:
        rng = np.random.default_rng(seed + 1)
        drawn = lengths.draw(rng, size)
        wants = rng.random(size) < weights_fraction
        self._items = [payloads[int(n), bool(w)] for n, w in zip(drawn, wants, strict=True)]
        self._next = 0

    def next(self) -> Payload:
        item = self._items[self._next]
        self._next = (self._next + 1) % len(self._items)
        return item


@dataclass(frozen=True)
class Mark:
    """The state of the world at one edge of the measured window."""

    at: float
    client_cpu_s: float
    server_cpu: dict[int, float] | None  # pid -> CPU s of the server and its descendants
    metrics: scrape.Snapshot | None
    threads: dict[str, dict[int, tuple[str, float]]]  # role -> thread_cpu_s of its process

    @property
    def server_cpu_s(self) -> float | None:
        return None if self.server_cpu is None else sum(self.server_cpu.values())


def _client_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def take_mark(args: argparse.Namespace, *, opening: bool) -> Mark:
    """Time and CPU readings side by side; the slower scrape outside them, so the window
    between two marks lies inside the interval the scrapes cover."""

    async def metrics() -> scrape.Snapshot | None:
        return (
            await asyncio.to_thread(scrape.scrape, args.metrics_url) if args.metrics_url else None
        )

    before = await metrics() if opening else None
    at, client = time.perf_counter(), _client_cpu_s()
    server = cputime.family_cpu_s(args.cpu_pid) if args.cpu_pid else None
    threads = {role: cputime.thread_cpu_s(pid) for role, pid in args.cpu_process}
    return Mark(at, client, server, before if opening else await metrics(), threads)


async def closed_loop(
    callers: list[Caller], plan: Plan, concurrency: int, stop_at: float, samples: list[Sample]
) -> None:
    async def caller_loop(caller: Caller) -> None:
        while (started := time.perf_counter()) < stop_at:
            payload = plan.next()
            outcome = await caller.call(payload)
            done = time.perf_counter()
            samples.append((done, done - started, payload.sequences, outcome))

    await asyncio.gather(*(caller_loop(callers[i % len(callers)]) for i in range(concurrency)))


async def open_loop(
    callers: list[Caller],
    plan: Plan,
    arrivals: np.ndarray,
    max_outstanding: int,
    samples: list[Sample],
    rejected: list[float],
) -> None:
    """Latency counts from the scheduled arrival, so a slow server cannot hide its queue."""
    in_flight: set[asyncio.Task[None]] = set()

    async def one(caller: Caller, payload: Payload, due: float) -> None:
        outcome = await caller.call(payload)
        done = time.perf_counter()
        samples.append((done, done - due, payload.sequences, outcome))

    for index, due in enumerate(arrivals):
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(in_flight) >= max_outstanding:
            rejected.append(float(due))
            continue
        task = asyncio.create_task(one(callers[index % len(callers)], plan.next(), float(due)))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    if in_flight:
        await asyncio.gather(*in_flight)


async def progress(samples: list[Sample], started: float, every_s: float, label: str) -> None:
    seen = 0
    while True:
        await asyncio.sleep(every_s)
        now, count = time.perf_counter(), len(samples)
        errors = sum(1 for sample in samples[seen:count] if sample[3].code != "OK")
        print(
            f"[loadgen {label}] {now - started:6.1f}s  {(count - seen) / every_s:9.1f} req/s"
            f"  errors {errors}",
            file=sys.stderr,
            flush=True,
        )
        seen = count


def summarize(
    samples: list[Sample],
    rejected: list[float],
    begin: Mark,
    end: Mark,
    roles: dict[str, int] | None = None,
    root: int = 0,
) -> dict[str, Any]:
    """Throughput, latency, errors and server-side figures of the measured window."""
    window = [s for s in samples if begin.at <= s[0] <= end.at]
    ok = [s for s in window if s[3].code == "OK"]
    span_s = end.at - begin.at
    sequences = sum(s[2] for s in ok)
    timings = [s[3].timing for s in ok if s[3].timing is not None]
    result: dict[str, Any] = {
        "window_s": span_s,
        "requests": len(ok),
        "requests_per_s": len(ok) / span_s,
        "sequences_per_s": sequences / span_s,
        **latency_summary_ms([s[1] for s in ok]),
        "errors": dict(Counter(s[3].code for s in window if s[3].code != "OK")),
        "error_examples": {s[3].code: s[3].detail[:200] for s in samples if s[3].code != "OK"},
        "rejected": sum(1 for due in rejected if begin.at <= due <= end.at),
        "client_cpu_utilization": (end.client_cpu_s - begin.client_cpu_s) / span_s,
        "client_cpu_us_per_request": (
            (end.client_cpu_s - begin.client_cpu_s) / len(ok) * 1e6 if ok else math.nan
        ),
    }
    if timings:  # AttentionService responses carry the server's own split
        result["response_timing"] = {
            "mean_queue_ms": float(np.mean([t.queue_us for t in timings])) / 1000,
            "mean_compute_ms": float(np.mean([t.compute_us for t in timings])) / 1000,
            "requests_by_batch_size": dict(sorted(Counter(t.batch_size for t in timings).items())),
        }
    if begin.server_cpu_s is not None and end.server_cpu_s is not None:
        used = end.server_cpu_s - begin.server_cpu_s
        result["server_cpu_s"] = used
        result["server_cpu_ms_per_request"] = used / len(ok) * 1000 if ok else math.nan
        result["server_cpu_ms_per_sequence"] = used / sequences * 1000 if sequences else math.nan
        result["server_cpu_utilization"] = used / span_s
    if begin.server_cpu is not None and end.server_cpu is not None:
        each = cputime.by_process(begin.server_cpu, end.server_cpu, roles or {}, root)
        result["server_cpu_by_process_s"] = each
        result["server_cpu_us_per_request_by_process"] = {
            role: seconds / len(ok) * 1e6 if ok else math.nan for role, seconds in each.items()
        }
    if ok and begin.threads:
        result["server_cpu_us_per_request_by_thread"] = {
            role: {
                name: seconds / len(ok) * 1e6
                for name, seconds in cputime.by_thread(
                    begin.threads[role], end.threads.get(role, {}), pid
                ).items()
            }
            for role, pid in (roles or {}).items()
            if role in begin.threads
        }
    if begin.metrics is not None and end.metrics is not None:
        result["server_metrics"] = scrape.summarize(begin.metrics, end.metrics)
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    lengths = Lengths.parse(args.seq)
    payloads = build_payloads(
        args.api,
        lengths,
        embed_dim=args.embed_dim,
        sequences=args.sequences_per_request,
        weights_fraction=args.weights_fraction,
        model=args.model,
        seed=args.seed,
    )
    plan = Plan(payloads, lengths, args.weights_fraction, args.seed)
    channels: list[grpc.aio.Channel] = []
    session = None
    if args.api == REST:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        callers: list[Caller] = [RestCaller(session, args.target, args.model, args.timeout_s)]
    else:
        channels = open_channels(args.target, args.channels)
        # Connect first: a connection still being set up would read as latency of the first
        # calls.
        await asyncio.wait_for(
            asyncio.gather(*(channel.channel_ready() for channel in channels)), args.timeout_s
        )
        if args.api == SHM:  # one region per caller: a closed loop's caller has one call out
            shapes = {n: [args.sequences_per_request, n, args.embed_dim] for n in lengths.values()}
            callers = [
                await SharedMemoryCaller.open(
                    channels[i % len(channels)], i, shapes, args.model, args.timeout_s
                )
                for i in range(args.concurrency)
            ]
        else:
            callers = make_callers(channels, args.api, args.timeout_s, args.streams_per_channel)
    samples: list[Sample] = []
    rejected: list[float] = []
    started = time.perf_counter()
    begin_at, stop_at = started + args.warmup_s, started + args.warmup_s + args.duration_s

    async def window() -> tuple[Mark, Mark]:
        await asyncio.sleep(begin_at - time.perf_counter())
        begin = await take_mark(args, opening=True)
        await asyncio.sleep(max(0.0, stop_at - time.perf_counter()))
        return begin, await take_mark(args, opening=False)

    edges = asyncio.create_task(window())
    ticker = None
    if args.progress_s > 0 and args.warmup_s + args.duration_s >= 2 * args.progress_s:
        ticker = asyncio.create_task(progress(samples, started, args.progress_s, args.label))
    if args.rate:
        arrivals = poisson_arrivals(args.rate, stop_at - started, np.random.default_rng(args.seed))
        await open_loop(callers, plan, arrivals + started, args.max_outstanding, samples, rejected)
    else:
        await closed_loop(callers, plan, args.concurrency, stop_at, samples)
    begin, end = await edges
    if ticker is not None:
        ticker.cancel()
    for caller in callers:
        await caller.close()
    for channel in channels:
        await channel.close()
    if session is not None:
        await session.close()
    roles = dict(args.cpu_process)
    return {
        "config": config_of(args),
        **summarize(samples, rejected, begin, end, roles, args.cpu_pid),
    }


def config_of(args: argparse.Namespace) -> dict[str, Any]:
    keys = (
        "label",
        "target",
        "api",
        "model",
        "seq",
        "sequences_per_request",
        "weights_fraction",
        "concurrency",
        "rate",
        "max_outstanding",
        "duration_s",
        "warmup_s",
        "channels",
        "streams_per_channel",
    )
    return {key: getattr(args, key) for key in keys} | {"loop": "open" if args.rate else "closed"}


def role_pid(text: str) -> tuple[str, int]:
    """("worker", 123) from "worker=123"."""
    role, _, pid = text.partition("=")
    if not role or not pid.isdigit():
        raise argparse.ArgumentTypeError(f"expected ROLE=PID, got {text!r}")
    return role, int(pid)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__)
    add = parser.add_argument
    add("--target", required=True, help="HOST:PORT of the server")
    add("--api", choices=APIS, default="v2", help="which RPC to call")
    add("--model", default="mha", help="model name sent in each request")
    add("--embed-dim", type=int, default=512, help="d of the model")
    add("--seq", default="16", help="sequence length: N or uniform:LOW:HIGH")
    add("--sequences-per-request", type=int, default=1, help="n in [n, seq, d]")
    add("--weights-fraction", type=float, default=0.0, help="share of requests asking for weights")
    add("--concurrency", type=int, default=1, help="closed loop: callers")
    add("--rate", type=float, default=0.0, help="open loop: Poisson arrivals/s (0 = closed loop)")
    add("--max-outstanding", type=int, default=1024, help="open loop: bound on calls in flight")
    add("--duration-s", type=float, default=10.0, help="measured window")
    add("--warmup-s", type=float, default=2.0, help="load before the window, not measured")
    add("--channels", type=int, default=1, help="gRPC channels (TCP connections)")
    add("--streams-per-channel", type=int, default=1, help="streaming APIs: streams per channel")
    add("--timeout-s", type=float, default=60.0, help="per-call deadline (unary)")
    add("--metrics-url", default="", help="server /metrics to scrape at the window's edges")
    add("--cpu-pid", type=int, default=0, help="server pid whose CPU time to measure")
    add(
        "--cpu-process",
        type=role_pid,
        action="append",
        default=[],
        metavar="ROLE=PID",
        help="a named process of the server (repeat): its CPU is reported apart",
    )
    add("--seed", type=int, default=0)
    add("--progress-s", type=float, default=5.0, help="progress line period on stderr (0 = off)")
    add("--label", default="", help="name of this run in output")
    add("--json", type=Path, help="write the result here (else stdout)")
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.channels < 1 or args.max_outstanding < 1:
        parser.error("--concurrency, --channels and --max-outstanding must be >= 1")
    if not 0.0 <= args.weights_fraction <= 1.0:
        parser.error("--weights-fraction must be in 0..1")
    if args.api == SHM and (args.rate or args.weights_fraction):
        parser.error(
            f"--api {SHM} runs a closed loop (no --rate) of output-only requests "
            "(no --weights-fraction)"
        )
    try:
        Lengths.parse(args.seq)
    except ValueError as err:
        parser.error(str(err))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2, default=float)
    if args.json:
        args.json.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
