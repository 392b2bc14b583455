"""python -m bench: the standard benchmark set in one run, one table, the ratios, JSON.

The server (and the echo server and the in-process limit) run pinned to --server-cpus with
one intra-op thread per CPU; the load generator runs pinned to --client-cpus. See
docs/benchmarks.md."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import onnxruntime as ort

from bench import h2load_report, ratios, report, scenarios
from bench.launcher import REPO_ROOT, Pinning, choose_pinning
from bench.runner import BenchConfig, Runner, log
from service.settings import load_settings
from service.worker.engine.repository import discover

QUICK = {"duration_s": 1.0, "warmup_s": 0.5, "inprocess_seconds": 0.2, "mixed_count": 32}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    add = parser.add_argument
    add("--model-repository", type=Path, default=Path("models"))
    add("--model", default="mha", help="model name (its newest version is measured)")
    add(
        "--groups",
        default=",".join(scenarios.STANDARD),
        help=f"comma-separated, from {','.join(scenarios.GROUPS)}",
    )
    add("--peers", action="store_true", help="also run the peers group (MLServer, Triton)")
    add("--quick", action="store_true", help="a smoke run: every scenario for about a second")
    add("--duration-s", type=float, default=12.0, help="measured window of each load run")
    add("--warmup-s", type=float, default=3.0, help="unmeasured load before each window")
    add("--inprocess-seconds", type=float, default=1.0, help="per in-process measurement")
    add("--mixed-count", type=int, default=256, help="sequences in the in-process mixed run")
    add("--concurrency", type=int, default=64, help="the headline concurrency")
    add(
        "--api",
        choices=("v2", "attention"),
        default="v2",
        help="unary API of the load runs; streaming runs use its streaming twin",
    )
    add("--channels", type=int, default=1, help="gRPC channels of the load generator")
    add("--max-outstanding", type=int, default=256, help="open loop: bound on calls in flight")
    add("--server-cpus", default="1", help="taskset CPU list of servers and in-process runs")
    add("--client-cpus", default="0", help="taskset CPU list of the load generator")
    add("--no-pin", action="store_true", help="run everything unpinned")
    add(
        "--provider",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="execution provider of the server and the in-process limit",
    )
    add(
        "--server-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="passed to every `python -m service` (repeat; e.g. --server-flag=--max-seq-len=256)",
    )
    add("--json", type=Path, default=Path("bench/results/latest.json"), help="results file")
    add("--plots", type=Path, help="also draw PNG plots into this folder (e.g. docs)")
    add(
        "--markdown",
        type=Path,
        help="also write the printed results as a page (e.g. docs/bench-latest.md)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    unknown = set(args.groups.split(",")) - set(scenarios.GROUPS)
    if unknown:
        parser.error(f"unknown groups {sorted(unknown)}; choose from {scenarios.GROUPS}")
    return args


def newest_model(repository: Path, name: str) -> Path:
    versions = [v for v in discover(repository) if v.name == name]
    if not versions:
        raise SystemExit(f"no model {name!r} under {repository}: run `make export` first")
    return max(versions, key=lambda v: v.version).output_graph


def build_config(args: argparse.Namespace) -> BenchConfig:
    model_path = newest_model(args.model_repository, args.model)
    meta = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    custom = meta.get_modelmeta().custom_metadata_map
    # What the server will run with: its defaults, the environment, then the passthrough flags.
    settings = load_settings(args.server_flag, os.environ)
    pinning = choose_pinning(args.server_cpus, args.client_cpus)
    if args.no_pin:
        pinning = Pinning(None, None, "--no-pin: ran unpinned")
    return BenchConfig(
        model_repository=args.model_repository.resolve(),
        model=args.model,
        model_path=model_path.resolve(),
        embed_dim=int(custom["embed_dim"]),
        num_heads=int(custom["num_heads"]),
        duration_s=args.duration_s,
        warmup_s=args.warmup_s,
        inprocess_seconds=args.inprocess_seconds,
        mixed_count=args.mixed_count,
        concurrency=args.concurrency,
        api=args.api,
        channels=args.channels,
        max_outstanding=args.max_outstanding,
        max_batch_size=settings.max_batch_size,
        max_seq_len=settings.max_seq_len,
        provider=args.provider,
        server_flags=tuple(args.server_flag),
        pinning=pinning,
    )


def machine(config: BenchConfig) -> dict[str, Any]:
    def git(*command: str) -> str:
        done = subprocess.run(["git", *command], cwd=REPO_ROOT, capture_output=True, text=True)
        return done.stdout.strip()

    cpu_model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "python": platform.python_version(),
        "onnxruntime": ort.__version__,
        "grpcio": grpc.__version__,
        "commit": git("rev-parse", "--short", "HEAD"),
        "dirty": bool(git("status", "--porcelain")),
        "model": str(config.model_path),
        "embed_dim": config.embed_dim,
        "num_heads": config.num_heads,
    }


def header(about: dict[str, Any], config: BenchConfig) -> str:
    dirty = " (uncommitted changes)" if about["dirty"] else ""
    return (
        f"machine: {about['cpus']} CPUs ({about['cpu_model']}); model d={config.embed_dim} "
        f"h={config.num_heads}; {about['date']}; commit {about['commit']}{dirty}\n"
        f"pinning: {config.pinning.describe()}; each load window {config.duration_s:g} s "
        f"after {config.warmup_s:g} s of warm-up; provider {config.provider}"
    )


def results_text(
    about: dict[str, Any],
    config: BenchConfig,
    rows: list[dict[str, Any]],
    found: list[dict[str, Any]],
    notes: list[str],
    elapsed_s: float,
) -> str:
    """What a run prints: header, table, ratios, the h2load rows' CPU by process, the
    targets, notes."""
    cpu = h2load_report.cpu_table(rows)
    parts = [
        header(about, config),
        "",
        report.format_table(rows),
        "",
        "ratios (same run):",
        ratios.format_ratios(found),
        *(
            ["", "CPU per call by process, h2load rows (us, from /proc over the run):", cpu]
            if cpu
            else []
        ),
        "",
        "Targets (printed, never asserted):",
        ratios.format_ratios(ratios.targets(found)),
        *(f"note: {note}" for note in notes),
        "",
        f"took {elapsed_s:.0f} s",
    ]
    return "\n".join(parts)


def markdown_page(about: dict[str, Any], command: str, text: str) -> str:
    """The printed results as a documentation page, with date, commit, machine and command."""
    dirty = " (with uncommitted changes)" if about["dirty"] else ""
    return (
        "# Latest benchmark output\n\n"
        f"Written by `{command}` on {about['date']}, commit {about['commit']}{dirty}, "
        f"{about['cpus']} CPUs ({about['cpu_model']}). Method and columns: "
        "[Benchmarks](benchmarks.md).\n\n"
        f"```text\n{text}\n```\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = build_config(args)
    groups = set(args.groups.split(",")) | ({"peers"} if args.peers else set())
    started = time.monotonic()
    runner = Runner(config)
    log(f"groups {sorted(groups)}; {config.pinning.describe()}")
    scenarios.run(runner, groups)
    # Grouped as the scenarios are listed (stable: a group keeps its order of measurement);
    # the peers' side-by-side rounds last.
    order = {group: index for index, group in enumerate((*scenarios.GROUPS, report.HEAD_TO_HEAD))}
    rows = sorted(runner.rows + report.ceiling_rows(runner.rows), key=lambda r: order[r["group"]])
    found = ratios.all_ratios(rows, config.api, groups, pinned=config.pinning.pinned)
    about = machine(config)
    elapsed = time.monotonic() - started
    text = results_text(about, config, rows, found, runner.notes, elapsed)
    print(f"\n{text}")
    document = {
        "machine": about,
        "settings": {k: str(v) for k, v in vars(args).items()},
        "pinning": config.pinning.describe(),
        "rows": rows,
        "ratios": found,
        "notes": runner.notes,
        "elapsed_s": elapsed,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=1, default=str) + "\n")
    log(f"wrote {args.json}")
    if args.markdown:
        command = " ".join(["python -m bench", *(argv if argv is not None else sys.argv[1:])])
        args.markdown.write_text(markdown_page(about, command, text))
        log(f"wrote {args.markdown}")
    if args.plots:
        from bench import plots  # matplotlib only when plots are asked for

        for path in plots.render(document, args.plots):
            log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
