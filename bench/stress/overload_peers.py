"""3x overload on this server and on NVIDIA Triton alike, measured the way the field does: a
compiled open-loop load generator (bench/openloop/) that costs its core little and reports its
own lag, and the resident memory of each server's whole process tree.

For each server in turn, started pinned the same way (every server process on --server-cpus
with one ONNX Runtime thread, the load generator on --client-cpus) with its queue bounded to
the same --queue-size, and sent V2 ModelInfer (one sequence of --seq, no weights):

1. capacity: a closed loop of --capacity-concurrency callers for --capacity-s (after a warm-up);
   the OK answers completed within that window, per second. Triton's is measured on a twin
   without the queue bound, because its bound is what makes it stall (below);
2. the burst: Poisson arrivals at --factor x capacity for --overload-s, each call sent at its
   time whatever the answers (an open loop), with V2 ServerReady probed every --probe-every-s
   on a connection of its own and the process tree's RSS sampled every 0.1 s;
3. after: RSS polled until it stays within --plateau-mib for --plateau-s (a plateau), then one
   more call, which must be OK.

    python -m bench.stress.overload_peers [--servers server,triton] [--overload-s 20] ...

prints the figures of both side by side with the targets (printed, never asserted) and writes
bench/results/overload-peers.json.

Triton's bounded queue stalls. A queue policy with max_queue_size turns off the dynamic
batcher's payload prefetching (triton-inference-server/core, scheduler_utils.cc), and then a
request wakes the batcher only if a model instance already waits for work
(RateLimiter::PayloadSlotAvailable); an instance that comes back for work after the request
arrived does not wake it, so the request waits for the batcher's default 500 ms wait
(dynamic_batch_scheduler.cc). A caller whose next request races the instance's return (any
closed loop) meets it often. So Triton's capacity comes from a twin without the bound (its
best), and the bounded server's own closed-loop figure is kept beside it
(capacity_with_queue_bound_rps). Triton runs from its own virtualenv (bench/peers/triton.py
creates it on first use); where it cannot run, its column says why."""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import openloop
from bench.__main__ import newest_model
from bench.cputime import family_cpu_s
from bench.h2load import H2loadError, frame, grpc_check, request_message
from bench.harness import poll_until
from bench.launcher import UNPINNED, Pinning, Service, choose_pinning
from bench.peers import triton
from bench.stress.common import (
    RESULTS,
    Figures,
    RssSampler,
    ServerSpec,
    format_figures,
    ms,
    pin_self,
    rss_by_process,
    rss_mib,
    write_json,
)
from bench.stress.overload import REJECT_OR_OK

SERVERS = ("server", "triton")
OURS_REFUSAL = REJECT_OR_OK[1]  # RESOURCE_EXHAUSTED
# What Triton answers a request that finds its batcher's queue full (code, message).
TRITON_REFUSAL = "UNAVAILABLE"
# Printed beside the figures, never asserted.
GOODPUT_TARGET, REFUSED_P99_TARGET_MS, PROBE_MAX_TARGET_MS = 0.9, 10.0, 20.0


@dataclass(frozen=True, kw_only=True)
class PeerOverloadConfig:
    model_repository: Path = Path("models")
    model: str = "mha"
    embed_dim: int = 512
    seq: int = 64
    queue_size: int = 64
    warmup_s: float = 2.0
    capacity_s: float = 8.0
    capacity_concurrency: int = 32
    overload_s: float = 20.0
    factor: float = 3.0
    deadline_s: float = 10.0
    connections: int = 8
    probe_every_s: float = 0.05
    plateau_s: float = 2.0
    plateau_mib: float = 2.0
    settle_timeout_s: float = 60.0
    triton_queue_delay_us: int = 0
    triton_ready_timeout_s: float = 300.0
    seed: int = 0


def open_load(
    service: Service, config: PeerOverloadConfig, scratch: Path, pinning: Pinning
) -> tuple[openloop.Load, bytes]:
    """The load generator's settings for a started server, and the request it sends (checked
    once over gRPC before any load)."""
    message = request_message(config.seq, config.embed_dim, config.model)
    body_file = scratch / "request.bin"
    body_file.write_bytes(frame(message))
    load = openloop.Load(
        target=service.target,
        body_file=body_file,
        connections=config.connections,
        deadline_s=config.deadline_s,
        pinning=pinning,
    )
    grpc_check(service.target, message)
    return load, message


def closed_loop_capacity(
    service: Service, config: PeerOverloadConfig, scratch: Path, pinning: Pinning = UNPINNED
) -> float:
    """A warm-up, then OK answers per second of a closed loop of capacity_concurrency callers."""
    load, _ = open_load(service, config, scratch, pinning)
    closed = {"concurrency": config.capacity_concurrency}
    openloop.run(load, scratch / "warmup.jsonl", duration_s=config.warmup_s, **closed)
    measured = openloop.run(
        load, scratch / "capacity.jsonl", duration_s=config.capacity_s, **closed
    )
    return capacity_rps(measured, config.capacity_s)


def measure(
    service: Service,
    config: PeerOverloadConfig,
    scratch: Path,
    *,
    refusal: str,
    pinning: Pinning = UNPINNED,
    capacity: float | None = None,
) -> Figures:
    """Capacity (this server's own closed loop, unless given), then the burst at factor x
    capacity, then memory until it plateaus, on a started server; refusal: the status its full
    queue answers."""
    own_capacity = closed_loop_capacity(service, config, scratch, pinning)
    if capacity is None:
        capacity = own_capacity
    load, message = open_load(service, config, scratch, pinning)
    rss_before = rss_mib(service.pid)
    with RssSampler(service.pid) as sampler:
        burst = openloop.run(
            load,
            scratch / "burst.jsonl",
            duration_s=config.overload_s,
            rate=config.factor * capacity,
            probe_every_s=config.probe_every_s,
            seed=config.seed,
        )
    rss_after, plateau_s = settle(service.pid, config)
    try:
        grpc_check(service.target, message)
        after = openloop.OK
    except H2loadError as err:
        after = str(err)
    return {
        **burst_figures(burst, capacity, config, refusal),
        **({} if own_capacity == capacity else {"capacity_with_queue_bound_rps": own_capacity}),
        "rss_before_mib": rss_before,
        "rss_peak_mib": sampler.peak_mib,
        "rss_after_mib": rss_after,
        "rss_plateau_after_s": plateau_s,
        "rss_after_by_process_mib": by_process(service),
        "valid_call_after": after,
        "server_alive": service.process.poll() is None,
    }


def capacity_rps(run: openloop.Run, window_s: float) -> float:
    """OK answers that arrived within the window, per second."""
    done = [c for c in run.calls if c.code == openloop.OK and c.at_s + c.latency_s <= window_s]
    return len(done) / window_s


def burst_figures(
    burst: openloop.Run, capacity: float, config: PeerOverloadConfig, refusal: str
) -> Figures:
    calls = burst.calls
    ok = [c.latency_s for c in calls if c.code == openloop.OK]
    refused = [c for c in calls if c.code == refusal]
    messages = {c.message for c in refused}
    lags = [c.lag_s for c in calls]
    probes = [c.latency_s for c in burst.probes]
    goodput = len(ok) / config.overload_s
    return {
        "capacity_rps": capacity,
        "offered_rps": config.factor * capacity,
        "calls": len(calls),
        "ok": len(ok),
        "goodput_rps": goodput,
        "goodput_of_capacity": goodput / capacity if capacity else math.nan,
        "refused": len(refused),
        "refused_code": refusal,
        "refused_messages": sorted(messages)[:3],
        "refused_p50_ms": ms([c.latency_s for c in refused], 50),
        "refused_p99_ms": ms([c.latency_s for c in refused], 99),
        "accepted_p50_ms": ms(ok, 50),
        "accepted_p99_ms": ms(ok, 99),
        "other_answers": {
            f"{code} {message}".strip(): n
            for (code, message), n in burst.answers().most_common()
            if code not in (openloop.OK, refusal)
        },
        "probes": len(probes),
        "probes_not_ok": sum(1 for c in burst.probes if c.code != openloop.OK),
        "probe_p50_ms": ms(probes, 50),
        "probe_max_ms": max(probes, default=math.nan) * 1000,
        "generator_lag_p99_ms": ms(lags, 99),
        "generator_lag_max_ms": max(lags, default=math.nan) * 1000,
        "generator_late_over_1ms": burst.summary.get("late", 0),
        # The generator's CPU time over its run's wall time: what its core spent on the load.
        "generator_cpu_share": burst.summary.get("cpu_s", math.nan)
        / burst.summary.get("wall_s", math.nan),
    }


def settle(pid: int, config: PeerOverloadConfig) -> tuple[float, float]:
    """RSS once it stayed within plateau_mib for plateau_s, and the seconds polled until then
    (nan, with the last reading, when it kept moving until settle_timeout_s)."""
    readings: list[tuple[float, float]] = []
    started = time.monotonic()

    def read() -> list[tuple[float, float]]:
        readings.append((time.monotonic(), rss_mib(pid)))
        return readings

    def flat(seen: list[tuple[float, float]]) -> bool:
        now = seen[-1][0]
        window = [mib for at, mib in seen if at >= now - config.plateau_s]
        return now - seen[0][0] >= config.plateau_s and max(window) - min(window) <= (
            config.plateau_mib
        )

    try:
        poll_until(read, flat, what="RSS plateau", timeout_s=config.settle_timeout_s, poll_s=0.25)
    except TimeoutError:
        return readings[-1][1], math.nan
    return readings[-1][1], time.monotonic() - started


def by_process(service: Service) -> dict[str, float]:
    """Each member's own RSS (MiB), named by its role (our server's log) or else by its command
    name and pid (Triton's tritonserver and backend stubs; PyTriton's process is the root)."""
    named = {}
    for member in family_cpu_s(service.pid):
        try:
            comm = Path(f"/proc/{member}/comm").read_text().strip()
        except OSError:
            continue
        named[f"{comm} {member}"] = member
    found = rss_by_process(service.pid, {**named, **service.children})
    root = "supervisor" if service.children else "root"
    return {(root if name == "supervisor" else name): mib for name, mib in found.items()}


def run_ours(config: PeerOverloadConfig, pinning: Pinning, scratch: Path) -> Figures:
    spec = ServerSpec(
        repository=config.model_repository,
        flags=("--max-queue-size", str(config.queue_size)),
        pinning=pinning,
    )
    service = spec.start("overload-peers")
    try:
        return measure(service, config, scratch, refusal=OURS_REFUSAL, pinning=pinning)
    finally:
        service.stop()


def run_triton(config: PeerOverloadConfig, pinning: Pinning, scratch: Path) -> Figures:
    try:
        python = triton.ensure_venv()
    except triton.PeerUnavailable as err:
        return {"unavailable": str(err)}
    model_path = newest_model(config.model_repository, config.model).resolve()

    def started(queue_size: int) -> Service:
        command, grpc_port = triton.triton_command(
            python,
            pinning,
            model_path,
            config.model,
            config.embed_dim,
            config.triton_queue_delay_us,
            queue_size,
        )
        return Service("triton", command, grpc_port=grpc_port, cwd=scratch)

    # Capacity from the twin without a queue bound: the bound stalls Triton (module docstring).
    with started(0) as twin:
        twin.wait_ready(config.triton_ready_timeout_s, model=config.model)
        capacity = closed_loop_capacity(twin, config, scratch, pinning)
    with started(config.queue_size) as service:
        service.wait_ready(config.triton_ready_timeout_s, model=config.model)
        return measure(
            service,
            config,
            scratch,
            refusal=TRITON_REFUSAL,
            pinning=pinning,
            capacity=capacity,
        )


RUNNERS: Mapping[str, Callable[[PeerOverloadConfig, Pinning, Path], Figures]] = {
    "server": run_ours,
    "triton": run_triton,
}


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def targets(results: Mapping[str, Figures]) -> list[str]:
    """Each target, per server, with met or MISSED (printed only)."""
    lines = []
    peer = results.get("triton", {})
    peer_goodput = peer.get("goodput_of_capacity", math.nan)
    for name, figures in results.items():
        if "unavailable" in figures or "error" in figures:
            continue
        goodput = figures["goodput_of_capacity"]
        above = name != "server" or not peer or goodput > peer_goodput
        rows = [
            (
                f"goodput >= {GOODPUT_TARGET:g} of capacity"
                + (" and above Triton's" if name == "server" and peer else ""),
                f"{goodput:.3f}",
                goodput >= GOODPUT_TARGET and above,
            ),
            (
                f"refused p99 <= {REFUSED_P99_TARGET_MS:g} ms",
                f"{figures['refused_p99_ms']:.2f} ms",
                figures["refused_p99_ms"] <= REFUSED_P99_TARGET_MS,
            ),
            (
                f"readiness max <= {PROBE_MAX_TARGET_MS:g} ms",
                f"{figures['probe_max_ms']:.2f} ms",
                figures["probe_max_ms"] <= PROBE_MAX_TARGET_MS and not figures["probes_not_ok"],
            ),
            (
                "RSS back to a plateau after the burst",
                f"{figures['rss_after_mib']:.0f} MiB after {figures['rss_plateau_after_s']:.1f} s"
                f" (before {figures['rss_before_mib']:.0f}, peak {figures['rss_peak_mib']:.0f})",
                not math.isnan(figures["rss_plateau_after_s"]),
            ),
        ]
        lines += [f"  {name:<7} {text:<46} {value:<40} {_met(ok)}" for text, value, ok in rows]
    return lines


def side_by_side(results: Mapping[str, Figures]) -> str:
    """One row per figure, one column per server."""
    names = list(results)
    keys = list(dict.fromkeys(key for figures in results.values() for key in figures))

    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.0f}"
        return str(value)

    rows = [("figure", *names)] + [
        (key, *(cell(results[name].get(key, "-")) for name in names)) for key in keys
    ]
    width = max(len(row[0]) for row in rows)
    return "\n".join(
        f"  {row[0]:<{width}}  " + "  ".join(f"{value:<24}" for value in row[1:]) for row in rows
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.stress.overload_peers", description=__doc__
    )
    defaults = PeerOverloadConfig()
    add = parser.add_argument
    add("--servers", default=",".join(SERVERS), help=f"comma list of {', '.join(SERVERS)}")
    add("--model-repository", type=Path, default=defaults.model_repository)
    add("--server-cpus", default="1", help="taskset CPUs of every server process")
    add("--client-cpus", default="0", help="taskset CPUs of the load generator")
    for name in (
        "seq",
        "queue_size",
        "capacity_concurrency",
        "connections",
        "triton_queue_delay_us",
    ):
        add(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in (
        "warmup_s",
        "capacity_s",
        "overload_s",
        "factor",
        "deadline_s",
        "probe_every_s",
        "plateau_s",
        "plateau_mib",
        "settle_timeout_s",
    ):
        add(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    add("--out", type=Path, default=RESULTS, help="folder for overload-peers.json")
    args = parser.parse_args(argv)
    unknown = set(args.servers.split(",")) - set(SERVERS)
    if unknown:
        parser.error(f"unknown servers {sorted(unknown)}; choose from {SERVERS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fields = PeerOverloadConfig.__dataclass_fields__
    config = PeerOverloadConfig(**{k: v for k, v in vars(args).items() if k in fields})
    pinning = choose_pinning(args.server_cpus, args.client_cpus)
    pin_self(pinning)
    openloop.build()
    about = {
        "command": " ".join(["python -m bench.stress.overload_peers", *sys.argv[1:]]),
        "pinning": pinning.describe(),
        "config": asdict(config),
    }
    print(f"overload, two servers: {about}", flush=True)
    results: dict[str, Figures] = {}
    for name in args.servers.split(","):
        print(f"\n[{name}] running ...", flush=True)
        with tempfile.TemporaryDirectory(prefix=f"overload-{name}-") as scratch:
            try:
                results[name] = RUNNERS[name](config, pinning, Path(scratch))
            except (RuntimeError, OSError, H2loadError) as err:
                results[name] = {"error": triton.short(str(err))}
        print(format_figures(f"[{name}]", results[name]), flush=True)
    print("\nside by side\n" + side_by_side(results))
    print("\ntargets (printed, not asserted)\n" + "\n".join(targets(results)))
    path = write_json("overload-peers", {"conditions": about, **results}, args.out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
