"""python -m bench.stress: the long reliability runs (overload, drain under load, vanishing
clients, fuzzing at volume, soak) against real servers, one after another. Prints each
scenario's figures and a summary, writes bench/results/stress-<scenario>.json, exits 1 when
any scenario failed a check. tests/stress runs bounded versions of the same code in CI."""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.launcher import UNPINNED, Pinning, choose_pinning
from bench.stress import drain, fuzz, overload, soak, vanish
from bench.stress.common import RESULTS, Figures, ServerSpec, format_figures, pin_self, write_json

SCENARIOS = ("overload", "drain", "vanish", "fuzz", "soak")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.stress", description=__doc__)
    add = parser.add_argument
    add("--scenarios", default=",".join(SCENARIOS), help=f"comma list of {', '.join(SCENARIOS)}")
    add("--model-repository", type=Path, default=Path("models"), help="served by every server")
    add("--model", default="mha", help="model the requests name")
    add("--embed-dim", type=int, default=512, help="d of --model")
    add(
        "--server-cpus", default="1", help="taskset CPUs of the server (intra-op threads: one each)"
    )
    add("--client-cpus", default="0", help="CPUs of this process, the load generator")
    add("--no-pin", action="store_true", help="run unpinned")
    add("--overload-s", type=float, default=30.0, help="overload: seconds at --overload-factor")
    add("--overload-factor", type=float, default=3.0, help="overload: offered / measured capacity")
    add("--overload-seq", type=int, default=128, help="overload: sequence length")
    add("--overload-deadline-s", type=float, default=10.0, help="overload: each call's deadline")
    add(
        "--overload-queue-size",
        type=int,
        default=256,
        help="overload: the server's --max-queue-size (its queue wait must fit the deadline)",
    )
    add("--drain-callers", type=int, default=64, help="drain: busy callers at SIGTERM")
    add("--vanish-rounds", type=int, default=20, help="vanish: rounds of waves")
    add("--vanish-per-wave", type=int, default=400, help="vanish: unary calls per wave")
    add("--fuzz-requests", type=int, default=10_000, help="fuzz: malformed requests")
    add("--soak-requests", type=int, default=100_000, help="soak: requests")
    add("--soak-seq", default="uniform:8:64", help="soak: lengths, N or uniform:LOW:HIGH")
    add("--out", type=Path, default=RESULTS, help="folder for the JSON results")
    args = parser.parse_args(argv)
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; choose from {SCENARIOS}")
    return args


def _fuzz(args: argparse.Namespace, server: ServerSpec) -> Figures:
    service = server.start("fuzz")
    try:
        return fuzz.run(
            service.target,
            served=[args.model],
            model=args.model,
            embed_dim=args.embed_dim,
            requests=args.fuzz_requests,
        )
    finally:
        service.stop()


def runners(args: argparse.Namespace, server: ServerSpec) -> dict[str, Callable[[], Figures]]:
    common: dict[str, Any] = {"model": args.model, "embed_dim": args.embed_dim}
    queue = ("--max-queue-size", str(args.overload_queue_size))
    return {
        "overload": lambda: overload.run(
            overload.OverloadConfig(
                server=replace(server, flags=(*server.flags, *queue)),
                seq=args.overload_seq,
                overload_s=args.overload_s,
                factor=args.overload_factor,
                deadline_s=args.overload_deadline_s,
                **common,
            )
        ),
        "drain": lambda: drain.run(
            drain.DrainConfig(server=server, callers=args.drain_callers, **common)
        ),
        "vanish": lambda: vanish.run(
            vanish.VanishConfig(
                server=server, rounds=args.vanish_rounds, per_wave=args.vanish_per_wave, **common
            )
        ),
        "fuzz": lambda: _fuzz(args, server),
        "soak": lambda: soak.run(
            soak.SoakConfig(server=server, requests=args.soak_requests, seq=args.soak_seq, **common)
        ),
    }


def conditions(args: argparse.Namespace, pinning: Pinning) -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "pinning": pinning.describe(),
        "model": args.model,
        "command": " ".join(["python -m bench.stress", *sys.argv[1:]]),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pinning = UNPINNED if args.no_pin else choose_pinning(args.server_cpus, args.client_cpus)
    pin_self(pinning)
    server = ServerSpec(repository=args.model_repository, pinning=pinning)
    about = conditions(args, pinning)
    print(f"reliability runs: {about}", flush=True)
    summary = []
    for name in args.scenarios.split(","):
        started = time.monotonic()
        print(f"\n[{name}] running ...", flush=True)
        figures = runners(args, server)[name]()
        figures.setdefault("duration_s", time.monotonic() - started)
        shown = {k: v for k, v in figures.items() if k != "rss_samples"}
        print(format_figures(f"[{name}]", shown), flush=True)
        path = write_json(f"stress-{name}", {"conditions": about, **figures}, args.out)
        failed = figures["failed_checks"]
        summary.append(f"  {name:<9} {'FAILED: ' + '; '.join(failed) if failed else 'passed'}")
        print(f"[{name}] wrote {path}", flush=True)
    print("\nsummary\n" + "\n".join(summary))
    return 1 if any("FAILED" in line for line in summary) else 0


if __name__ == "__main__":
    sys.exit(main())
