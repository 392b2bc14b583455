"""python -m bench.gpu_check: the first proof of the CUDA path, one command (bench/gpu.sh).

Runs the server's own engine (service/worker/engine) on the GPU and reports: the providers of every
session (float32, float16); driver, wheels and libraries found; float32 parity with TF32 off
and on; float16 parity and non-finite counts at 1x/4x/16x/64x inputs; fused vs unfused
output graph; 1 vs 2 batches in flight; the first largest-shape run and GPU memory; then the
server with --provider cuda under load. It never falls back to CPU: no usable CUDA, or any
session on CPU, fails it. --dry-run does all of it on CPU with small shapes and the GPU-only
parts skipped, so CI keeps it from rotting. Needs no torch (the reference is numpy float64).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from bench import gpu_probe
from bench.harness import loopback_server, metric_samples
from bench.launcher import Service
from service.worker.engine import cuda, fused
from service.worker.engine.cuda import CPU, CUDA, CudaOptions
from service.worker.engine.onnx_model import BrokenModel, OnnxModel
from service.worker.engine.repository import VersionFiles, discover

Report = dict[str, Any]


class CheckFailed(RuntimeError):
    """A GPU check that must hold did not."""


def _load(files: VersionFiles, providers: list[str], **kwargs: Any) -> OnnxModel:
    return OnnxModel(files, providers, 0, **kwargs)


def _load_with_fused(
    files: VersionFiles,
    providers: list[str],
    cuda_options: CudaOptions,
    fused_errors: dict[str, str],
) -> OnnxModel:
    """The version with its fused graph held to the golden check; a fused graph that cannot
    load or run here is recorded and the version loaded without it, so the rest of the check
    still measures (the fused graph is optional; the contract's graphs are not)."""
    try:
        return _load(files, providers, fused="on", cuda=cuda_options)
    except BrokenModel as err:
        fused_errors[files.name] = str(err)
    try:
        return _load(files, providers, fused="off", cuda=cuda_options)
    except BrokenModel as err:
        raise CheckFailed(f"{files.name}: {err}") from err


def check_environment(dry_run: bool) -> tuple[list[str], Report]:
    probe = cuda.probe_driver()
    report = {
        "onnxruntime": ort.__version__,
        "onnxruntime_cuda_build": cuda.version_text(cuda.required_cuda_version()),
        "available_providers": ort.get_available_providers(),
        "driver": probe.describe() if probe.usable else probe.reason,
        "gpu_memory_total_gib": round(probe.total_memory_bytes / (1 << 30), 1),
        "wheels": gpu_probe.nvidia_wheels(),
    }
    if dry_run:
        return [CPU], report
    return cuda.choose_providers("cuda"), report  # CudaUnavailable names the cause


def check_sessions(model: OnnxModel, providers: list[str]) -> dict[str, list[str]]:
    """Each session's providers; under CUDA, a session without it is a failure (ONNX Runtime
    creates the session on CPU, with only a logged warning, when the CUDA provider cannot
    load, e.g. a CUDA or cuDNN library that is not found)."""
    found = {name: s.get_providers() for name, s in model._sessions().items()}
    if CUDA in providers:
        on_cpu = [name for name, names in found.items() if names[0] != CUDA]
        if on_cpu:
            raise CheckFailed(
                f"{model.key}: graphs {on_cpu} run on CPU, not CUDA: {found}; the CUDA "
                f"provider did not load (ONNX Runtime's warning above says why; CUDA "
                f"libraries mapped: {sorted(gpu_probe.loaded_libraries())})"
            )
    return found


def parity(
    model: OnnxModel,
    reference: gpu_probe.Reference,
    batches: list[tuple[int, int]],
    scale: float = 1.0,
    *,
    fused_graph: bool = False,
) -> Report:
    """Worst errors over padded batches of the output-only graph (or the fused one)."""
    rng = np.random.default_rng(11)
    worst: Report = {"nonfinite": 0, "max_abs": 0.0, "relative": 0.0, "max_ref": 0.0}
    session = model._fused if fused_graph else model._plain
    assert session is not None
    for batch, seq in batches:
        x, mask = gpu_probe.padded_batch(rng, batch, seq, model.spec.embed_dim, scale)
        sent = x.astype(model.spec.dtype)
        feeds = {"embeddings": sent, "key_padding_mask": mask}
        (got,) = session.run(["output"], feeds)
        with np.errstate(invalid="ignore"):
            found = gpu_probe.errors(got, reference(sent, mask), mask)
        worst["nonfinite"] += found["nonfinite"]
        for key in ("max_abs", "relative", "max_ref"):
            worst[key] = float(np.nanmax([worst[key], found[key]]))
    return worst


def first_largest_run(files: VersionFiles, providers: list[str], shape: tuple[int, int]) -> Report:
    before = gpu_probe.gpu_memory_used_mib()
    model = _load(files, providers, fused="off")
    check_sessions(model, providers)  # before minutes of measuring the CPU by mistake
    loaded = gpu_probe.gpu_memory_used_mib()
    feeds = model._inputs(*shape)
    started = time.perf_counter()
    model._plain.run(["output"], feeds)
    first_s = time.perf_counter() - started
    second_s = fused.best_seconds(partial(model._plain.run, ["output"], feeds), repeats=3)
    if model._full is not None:
        model._full.run(None, feeds)
    after = gpu_probe.gpu_memory_used_mib()
    return {
        "shape": list(shape),
        "first_run_s": first_s,
        "warm_run_s": second_s,
        "gpu_memory_mib": {
            "before_load": before,
            "after_load": loaded,
            "after_largest_runs": after,
        },
    }


def compare_fused(
    model: OnnxModel,
    files: VersionFiles,
    providers: list[str],
    reference: gpu_probe.Reference,
    shapes: list[tuple[int, int]],
    big: tuple[int, int],
) -> Report:
    """The fused output graph's error and speed against the unfused one, and what the
    server's --fused-attention auto would decide from them."""
    if model._fused is None:
        return {"error": f"{model.key}: no usable model.fused.onnx"}
    timings = []
    for batch, seq in fused.comparison_shapes(*big):
        feeds = model._inputs(batch, seq)
        unfused_s = fused.best_seconds(partial(model._plain.run, ["output"], feeds))
        fused_s = fused.best_seconds(partial(model._fused.run, ["output"], feeds))
        timings.append(fused.Timing(batch, seq, unfused_s, fused_s))
    use, why = fused.decide("auto", timings)
    chosen = [
        (name, CudaOptions().provider_options()) if name == CUDA else name for name in providers
    ]
    folder = Path(tempfile.mkdtemp(prefix="gpu-check-profile-"))
    feeds = model._inputs(2, 16)
    placement = {
        name: gpu_probe.node_providers(path, chosen, feeds, folder)
        for name, path in (
            ("unfused", files.output_graph),
            ("fused", files.output_graph.parent / fused.FUSED_GRAPH),
        )
    }
    if CUDA in providers and gpu_probe.compute_ops_on(placement["fused"], CPU):
        # The server's auto mode decides by timing alone; a CPU op would make it slower, but
        # this check says so outright.
        use, why = False, f"compute ops on CPU: {gpu_probe.compute_ops_on(placement['fused'], CPU)}"
    return {
        "parity": parity(model, reference, shapes, fused_graph=True),
        "server_would_use_it": use,
        "why": why,
        "ops_ran_on": placement,
    }


def inflight(model: OnnxModel, shape: tuple[int, int], calls: int) -> Report:
    """Sequences/s with one thread calling run() against two threads at once."""
    feeds = model._inputs(*shape)
    model.run(feeds["embeddings"], feeds["key_padding_mask"], False)

    def work(count: int) -> None:
        for _ in range(count):
            model.run(feeds["embeddings"], feeds["key_padding_mask"], False)

    rates = {}
    for threads in (1, 2):
        pool = [threading.Thread(target=work, args=(calls // threads,)) for _ in range(threads)]
        started = time.perf_counter()
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
        rates[f"{threads}_inflight_seq_per_s"] = calls * shape[0] / (time.perf_counter() - started)
    return {"shape": list(shape), **rates}


def server_scenarios(
    repository: Path, model: str, d: int, provider: str, short: bool, log_file: Path | None
) -> Report:
    """The server with --provider PROVIDER: p50 of one seq-128 request at a time, and
    sequences/s with 64-sequence requests (the benchmark's GPU scenarios). Its whole log goes
    to log_file, passed or failed: a failure's cause is often far above the log's tail."""
    command = [
        *loopback_server(repository),
        "--default-model",
        model,
        "--provider",
        provider,
        "--max-batch-size",
        "64",
        "--batch-cap-budget-s",
        "0",
        "--log-level",
        "INFO",
        # The check's repository links to the exported models (its own, trusted).
        "--repository-follow-symlinks",
        "on",
    ]
    report: Report = {}
    with Service("server", command) as server:
        try:
            _measure_server(server, report, model, d, short)
        finally:
            if log_file is not None:
                server.stop()
                log_file.write_text(server.log_tail(len(server.lines)))
    return report


def _measure_server(server: Service, report: Report, model: str, d: int, short: bool) -> None:
    seconds = "1" if short else "10"
    server.wait_ready(180)
    log = server.log_tail(200)
    wanted = ("golden check", "graph", "CUDA usable", "loaded", "serving")
    report["server_log"] = [
        line.strip()[-160:] for line in log.splitlines() if any(w in line for w in wanted)
    ][:8]
    for name, flags in (
        ("one_request_seq128", ["--concurrency", "1", "--sequences-per-request", "1"]),
        ("requests_of_64_seq128", ["--concurrency", "4", "--sequences-per-request", "64"]),
    ):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.loadgen",
                "--target",
                server.target,
                "--api",
                "attention",
                "--model",
                model,
                "--embed-dim",
                str(d),
                "--seq",
                "128",
                "--duration-s",
                seconds,
                "--warmup-s",
                "1" if short else "3",
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        result = json.loads(done.stdout)
        if result.get("errors"):
            raise CheckFailed(f"server scenario {name}: errors {result['errors']}")
        report[name] = {
            k: result[k] for k in ("sequences_per_s", "p50_ms", "p99_ms") if k in result
        }
    # After the load: the GPU has worked, and every process has used CPU.
    report["metrics"] = system_series(server.metrics_port)


# The GPU series the server exposes from NVML (Triton's nv_gpu_* equivalents), and the
# process series every role has.
GPU_SERIES = (
    "attention_gpu_utilization_ratio",
    "attention_gpu_memory_used_bytes",
    "attention_gpu_memory_total_bytes",
    "attention_gpu_power_usage_watts",
)
PROCESS_SERIES = ("attention_process_cpu_seconds_total", "attention_process_resident_memory_bytes")
ROLES = ("supervisor", "worker", "frontend-0")


def system_series(metrics_port: int) -> dict[str, dict[str, float]]:
    """The server's attention_gpu_* and attention_process_* samples: {name: {labels: value}}."""
    found: dict[str, dict[str, float]] = {}
    for (name, labels), value in metric_samples(f"http://127.0.0.1:{metrics_port}/metrics").items():
        if name.startswith(("attention_gpu_", "attention_process_")):
            found.setdefault(name, {})[",".join(f"{k}={v}" for k, v in labels)] = value
    return found


def judge_series(series: dict[str, dict[str, float]] | None, gpu: bool) -> list[str]:
    """Every role's CPU and memory; with a GPU, its NVML series, used memory within total
    (nothing to judge when the server was not reached)."""
    if series is None:
        return []
    failures = [
        f"no {name} for process {role}"
        for name in PROCESS_SERIES
        for role in ROLES
        if f"process={role}" not in series.get(name, {})
    ]
    if not gpu:
        return failures
    missing = [name for name in GPU_SERIES if not series.get(name)]
    if missing:
        failures.append(
            f"no GPU series {missing} from the server (NVML: is nvidia-ml-py "
            "installed, and libnvidia-ml.so.1 found?)"
        )
    used, total = series.get(GPU_SERIES[1], {}), series.get(GPU_SERIES[2], {})
    for gpu_labels, value in total.items():
        if not 0 < used.get(gpu_labels, -1) <= value:
            failures.append(f"GPU memory used {used.get(gpu_labels)} not within total {value}")
    for gpu_labels, ratio in series.get(GPU_SERIES[0], {}).items():
        if not 0 <= ratio <= 1:
            failures.append(f"GPU utilization {ratio} ({gpu_labels}) is not a ratio")
    return failures


def _print(title: str, value: Any) -> None:
    print(f"== {title}: {json.dumps(value, default=str)}", flush=True)


def run(args: argparse.Namespace, report: Report) -> None:
    """Fill report section by section (each printed as it comes), so a failure part way
    still leaves what was measured before it."""
    report["dry_run"] = args.dry_run
    providers, env = check_environment(args.dry_run)
    report["environment"] = env
    _print("environment", env)
    found = {files.name: files for files in discover(args.models)}
    missing = {args.fp32_model, args.fp16_model} - set(found)
    if missing:
        raise CheckFailed(f"no model {sorted(missing)} in {args.models} (found {sorted(found)})")
    fp32, fp16 = found[args.fp32_model], found[args.fp16_model]
    big = (args.max_batch_size, args.max_seq_len)
    report["first_largest_run"] = first_largest_run(fp32, providers, big)
    _print("first largest-shape run and GPU memory", report["first_largest_run"])
    report["libraries_loaded"] = gpu_probe.loaded_libraries()
    _print("libraries loaded", report["libraries_loaded"])
    shapes = [(4, 64), (2, args.max_seq_len), (8, 128)]
    fused_errors: dict[str, str] = {}
    off = _load_with_fused(fp32, providers, CudaOptions(use_tf32=False), fused_errors)
    half = _load_with_fused(fp16, providers, CudaOptions(), fused_errors)
    if fused_errors:
        report["fused_load_errors"] = fused_errors
        _print("fused graphs that cannot be used", fused_errors)
    report["providers"] = {
        "float32": check_sessions(off, providers),
        "float16": check_sessions(half, providers),
    }
    _print("providers", report["providers"])
    ref32, ref16 = (
        gpu_probe.numpy_reference(fp32.output_graph),
        gpu_probe.numpy_reference(fp16.output_graph),
    )
    report["float32_parity"] = {"tf32_off": parity(off, ref32, shapes)}
    if CUDA in providers:
        on = _load(fp32, providers, fused="off", cuda=CudaOptions(use_tf32=True))
        report["float32_parity"]["tf32_on"] = parity(on, ref32, shapes)
        del on
    _print("float32 parity", report["float32_parity"])
    report["float16_parity"] = {f"{s}x": parity(half, ref16, shapes, s) for s in (1, 4, 16, 64)}
    _print("float16 parity", report["float16_parity"])
    report["fused"] = compare_fused(off, fp32, providers, ref32, shapes, big)
    if half._fused is not None:
        report["fused"]["float16_parity_1x"] = parity(half, ref16, shapes, fused_graph=True)
    _print("fused vs unfused output graph", report["fused"])
    report["inflight"] = inflight(off, (min(32, big[0]), min(128, big[1])), args.inflight_calls)
    _print("1 vs 2 batches in flight", report["inflight"])
    # The in-process limit for the server's 64-sequence scenario: same engine, same options.
    inprocess = inflight(off, (64, 128), max(4, args.inflight_calls // 4))
    off_dim = off.spec.embed_dim
    del off, half
    provider = "cpu" if args.dry_run else "cuda"
    log_file = args.json.with_name("gpu-server.log") if args.json else None
    report["server"] = server_scenarios(
        args.models, args.fp32_model, off_dim, provider, args.dry_run, log_file
    )
    server_rate = report["server"]["requests_of_64_seq128"]["sequences_per_s"]
    report["server"]["inprocess_64x128_seq_per_s"] = inprocess["1_inflight_seq_per_s"]
    report["server"]["server_over_inprocess"] = server_rate / inprocess["1_inflight_seq_per_s"]
    _print(f"server --provider {provider}", report["server"])


def judge(report: Report) -> list[str]:
    """What must hold; a list of failures (empty = pass)."""
    failures = []
    tf32_off = report["float32_parity"]["tf32_off"]
    if tf32_off["nonfinite"] or not tf32_off["relative"] <= 1e-4:
        failures.append(f"float32 (TF32 off) relative error {tf32_off['relative']:.2e} > 1e-4")
    for scale in ("1x", "4x"):
        half = report["float16_parity"][scale]
        if half["nonfinite"] or not half["relative"] <= 1e-2:
            failures.append(
                f"float16 at {scale}: relative {half['relative']:.2e}, "
                f"{half['nonfinite']} non-finite"
            )
    if not report["dry_run"]:
        for graph, placement in report["fused"].get("ops_ran_on", {}).items():
            on_cpu = gpu_probe.compute_ops_on(placement, CPU)
            if on_cpu:
                failures.append(
                    f"{graph} graph: {on_cpu} ran on CPU under CUDA (no CUDA kernel "
                    "for this node, or the provider refused it)"
                )
    failures += judge_series(report.get("server", {}).get("metrics"), gpu=not report["dry_run"])
    for name, error in report.get("fused_load_errors", {}).items():
        failures.append(f"fused graph of {name} not usable: {error}")
    fused_parity = report["fused"].get("parity")
    if fused_parity and (fused_parity["nonfinite"] or not fused_parity["relative"] <= 1e-4):
        failures.append(f"fused graph relative error {fused_parity['relative']:.2e} > 1e-4")
    fused_half = report["fused"].get("float16_parity_1x")
    if fused_half and (fused_half["nonfinite"] or not fused_half["relative"] <= 1e-2):
        failures.append(f"fused float16 graph relative error {fused_half['relative']:.2e} > 1e-2")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__)
    parser.add_argument("--models", type=Path, required=True, help="model repository")
    parser.add_argument("--fp32-model", default="mha")
    parser.add_argument("--fp16-model", default="mha16")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--inflight-calls", type=int, default=40)
    parser.add_argument("--dry-run", action="store_true", help="CPU, GPU-only parts skipped")
    parser.add_argument("--json", type=Path, help="write the whole report here")
    args = parser.parse_args(argv)
    started = time.monotonic()
    report: Report = {}
    try:
        run(args, report)
        failures = judge(report)
    except (
        CheckFailed,
        cuda.CudaUnavailable,
        BrokenModel,
        RuntimeError,
        subprocess.SubprocessError,
    ) as err:
        # What was measured before the failure still goes to the JSON: a device run is scarce.
        failures = [f"stopped: {type(err).__name__}: {err}"]
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    report["failures"] = failures
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    for failure in failures:
        print(f"GPU CHECK FAILED: {failure}", file=sys.stderr)
    mode = "DRY RUN on CPU (GPU parts skipped)" if args.dry_run else "GPU"
    print(f"== {mode}: {'FAILED' if failures else 'passed'} in {report['elapsed_s']} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
