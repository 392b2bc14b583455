"""The orchestrator's hands: start our server or the echo server (pinned or not), run the
load generator and the in-process limit as pinned subprocesses, and keep every result row."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import echo_model, h2load
from bench.harness import loopback_server
from bench.launcher import REPO_ROOT, Pinning, Service
from bench.payloads import REST


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Everything a run is configured with (the orchestrator's flags, resolved)."""

    model_repository: Path
    model: str
    model_path: Path  # newest version's model.onnx
    embed_dim: int
    num_heads: int
    duration_s: float
    warmup_s: float
    inprocess_seconds: float  # per measured in-process point
    mixed_count: int  # sequences drawn for the in-process mixed-length run
    concurrency: int  # the headline concurrency
    api: str  # the unary API; its streaming twin is api + "_stream"
    channels: int
    max_outstanding: int  # open loop bound
    max_batch_size: int
    max_seq_len: int
    provider: str  # auto | cpu | cuda, for the server and the in-process limit
    server_flags: tuple[str, ...]  # passed through to python -m service, before a scenario's
    pinning: Pinning
    ready_timeout_s: float = 300.0


# What a consumer reads from a load row; a failed run carries each of them as None.
MEASURED_KEYS = (
    "window_s",
    "requests_per_s",
    "sequences_per_s",
    "p50_ms",
    "p90_ms",
    "p99_ms",
    "p99.9_ms",
    "mean_ms",
    "client_cpu_utilization",
    "server_cpu_s",
    "server_cpu_ms_per_request",
    "server_cpu_ms_per_sequence",
    "server_cpu_utilization",
    "server_cpu_by_process_s",
    "server_cpu_us_per_request_by_process",
    "server_cpu_us_per_request_by_thread",
    "client_cpu_us_per_request",
    "server_metrics",
    "response_timing",
)


def failed_result(reason: str) -> dict[str, Any]:
    """The row of a load run that did not finish: nothing measured (None), nothing counted,
    and why; every consumer reads it as "not measured"."""
    return {
        **dict.fromkeys(MEASURED_KEYS),
        "requests": 0,
        "errors": {},
        "rejected": 0,
        "failed": reason,
    }


def failed_inprocess(reason: str, threads: int) -> dict[str, Any]:
    """The row of an in-process run that did not finish: no limit, no points, and why."""
    return {
        "sequences_per_s": None,
        "best": None,
        "points": [],
        "threads": threads,
        "failed": reason,
    }


def flag_name(token: str) -> str | None:
    """--max-batch-size of "--max-batch-size" or "--max-batch-size=8"; None for a value."""
    return token.split("=", 1)[0] if token.startswith("--") else None


def overridden_flags(passthrough: Sequence[str], scenario: Sequence[str]) -> list[str]:
    """The passthrough flags a scenario sets itself (its own win: they define the scenario)."""
    own = {name for name in map(flag_name, scenario) if name}
    return [name for name in dict.fromkeys(map(flag_name, passthrough)) if name in own]


def log(message: str) -> None:
    print(f"[bench] {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


@dataclass
class Runner:
    config: BenchConfig
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    scratch: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-")))

    # -- servers ----------------------------------------------------------------------------

    def server_command(
        self, flags: Sequence[str], pinning: Pinning, repository: Path | None = None
    ) -> list[str]:
        """The passthrough flags first, the scenario's flags last: the last of a repeated
        flag wins, and a scenario's flags define it (batching off stays off)."""
        c = self.config
        return [
            *pinning.prefix(pinning.server_cpus),
            *loopback_server(repository or c.model_repository),
            "--intra-op-threads",
            str(pinning.server_threads),
            "--provider",
            c.provider,
            *c.server_flags,
            *flags,
        ]

    def note(self, message: str) -> None:
        """A line for the report's notes (once), logged as it happens."""
        log(f"note: {message}")
        if message not in self.notes:
            self.notes.append(message)

    @contextmanager
    def server(
        self,
        name: str,
        flags: Sequence[str],
        pinning: Pinning,
        env: dict[str, str] | None = None,
    ) -> Iterator[Service]:
        """Our server with the passthrough flags, then this scenario's, ready to take load."""
        for flag in overridden_flags(self.config.server_flags, flags):
            self.note(
                f"{name}: the scenario's own {flag} ({' '.join(flags)}) overrides "
                f"--server-flag {flag} for this server"
            )
        with Service(name, self.server_command(flags, pinning), env=env) as service:
            service.wait_ready(self.config.ready_timeout_s)
            log(f"{name}: pid {service.pid} on {service.target} {' '.join(flags)}")
            yield service

    def echo_repository(self) -> Path:
        """A model repository holding the zero-compute echo model under the measured model's
        name, d and h (bench/echo_model.py), made once per run."""
        c = self.config
        repository = self.scratch / "echo-repository"
        if not (repository / c.model).is_dir():
            echo_model.write_repository(repository, c.model, c.embed_dim, c.num_heads)
        return repository

    @contextmanager
    def echo(self, pinning: Pinning, flags: Sequence[str] = ()) -> Iterator[Service]:
        """The echo floor: the real server, with every flag the measured server gets, serving
        the echo model, so floor and server differ only by the model."""
        command = self.server_command(flags, pinning, self.echo_repository())
        with Service("echo", command) as service:
            service.wait_ready(self.config.ready_timeout_s)
            log(f"echo: pid {service.pid} on {service.target} {' '.join(flags)}")
            yield service

    # -- measurements -----------------------------------------------------------------------

    def load(
        self,
        service: Service,
        *,
        group: str,
        target: str,
        name: str,
        api: str,
        seq: str,
        pinning: Pinning,
        concurrency: int = 0,
        rate: float = 0.0,
        weights: float = 0.0,
        model: str = "",
        embed_dim: int = 0,
        channels: int = 0,
    ) -> dict[str, Any]:
        """One load generator run against service; the result becomes a row. channels (0 =
        the run's --channels) other than the run's shows in the row's load label."""
        c = self.config
        out = self.scratch / f"load-{len(self.rows)}.json"
        command = [
            *pinning.prefix(pinning.client_cpus),
            sys.executable,
            "-m",
            "bench.loadgen",
            "--target",
            service.http_target if api == REST else service.target,
            "--api",
            api,
            "--seq",
            seq,
            "--model",
            model or c.model,
            "--embed-dim",
            str(embed_dim or c.embed_dim),
            "--concurrency",
            str(concurrency or c.concurrency),
            "--rate",
            str(rate),
            "--max-outstanding",
            str(c.max_outstanding),
            "--weights-fraction",
            str(weights),
            "--duration-s",
            str(c.duration_s),
            "--warmup-s",
            str(c.warmup_s),
            "--channels",
            str(channels or c.channels),
            "--cpu-pid",
            str(service.pid),
            "--metrics-url",
            service.metrics_url,
            "--label",
            f"{group}/{name}",
            "--progress-s",
            "10" if c.duration_s >= 30 else "0",
            "--json",
            str(out),
            *(f"--cpu-process={role}={pid}" for role, pid in service.children.items()),
        ]
        load = f"rate={rate:.0f}" if rate else f"c={concurrency or c.concurrency}"
        if channels and channels != c.channels:
            load += f" ch={channels}"
        try:
            subprocess.run(command, cwd=REPO_ROOT, check=True, timeout=c.duration_s * 4 + 300)
            result = json.loads(out.read_text())
        except (subprocess.SubprocessError, OSError, ValueError) as err:
            # One failed run (a server that died, say) costs its row, not the whole run.
            self.note(f"{group}/{name} {api} seq={seq} {load} failed: {err}")
            result = failed_result(str(err))
        self._check_spread(result, f"{group}/{name} seq={seq}")
        return self._keep(
            result,
            group=group,
            target=target,
            name=name,
            api=api,
            seq=seq,
            load=load,
            pinned=pinning.pinned,
        )

    def keep_failed(
        self, *, group: str, target: str, name: str, seqs: Sequence[str], reason: str
    ) -> None:
        """One FAILED row per length for a server that could not be set up or started."""
        self.note(f"{name}: not measured: {reason}")
        for seq in seqs:
            self._keep(
                failed_result(reason),
                group=group,
                target=target,
                name=name,
                api="v2",
                seq=seq,
                load=f"c={self.config.concurrency}",
                pinned=self.config.pinning.pinned,
            )

    def h2load_ready(self) -> bool:
        """Whether h2load is installed; if not, a note says how to get it (its rows skipped)."""
        if h2load.find() is not None:
            return True
        self.note(f"h2load not found: its rows were skipped; install it with {h2load.INSTALL_HINT}")
        return False

    def h2load_row(
        self,
        service: Service,
        *,
        group: str,
        target: str,
        name: str,
        seq: str,
        shape: h2load.Shape,
        pinning: Pinning,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> dict[str, Any]:
        """One h2load run against service (bench/h2load.py), pinned as the load generator is,
        with the load generator's request bytes (and metadata on every call); a failed check
        is a FAILED row."""
        c = self.config
        server = h2load.Target(service.target, service.pid, service.children, service.metrics_url)
        client = tuple(pinning.prefix(pinning.client_cpus))
        plan = h2load.Plan(shape, c.duration_s, c.warmup_s, client, metadata=metadata)
        message = h2load.request_message(int(seq), c.embed_dim, c.model)
        try:
            tool = h2load.find() or "h2load"
            measured = h2load.measure(tool, server, message, plan, self.scratch / "h2load")
            result = {**dict.fromkeys(MEASURED_KEYS), **measured}
        except (h2load.H2loadError, OSError) as err:
            self.note(f"{group}/{name} seq={seq} {shape.label} FAILED: {err}")
            result = {**failed_result(str(err)), "h2load": getattr(err, "raw", {})}
        labels = {"group": group, "target": target, "name": name, "seq": seq}
        return self._keep(result, **labels, api="v2", load=shape.label, pinned=pinning.pinned)

    def _check_spread(self, result: dict[str, Any], label: str) -> None:
        """A note when the kernel's SO_REUSEPORT hash left a front end nearly idle (it spreads
        connections, not calls), so a --frontends N row is not read as N front ends' work."""
        each = result.get("server_cpu_by_process_s") or {}
        fronts: dict[str, float] = {}
        for role, seconds in each.items():
            if role.startswith("frontend-"):  # a gateway is its front end's: frontend-N-gateway
                front = "-".join(role.split("-")[:2])
                fronts[front] = fronts.get(front, 0.0) + seconds
        total = sum(fronts.values())
        if len(fronts) > 1 and total > 0 and min(fronts.values()) < 0.1 * total:
            shares = ", ".join(f"{role} {s / total:.0%}" for role, s in sorted(fronts.items()))
            self.note(f"{label}: front ends unevenly loaded (CPU {shares})")

    def inprocess(
        self, *, group: str, seq: str, pinning: Pinning, weights: bool = False
    ) -> dict[str, Any]:
        """The in-process limit, pinned like the server, with the server's thread count."""
        c = self.config
        out = self.scratch / f"inprocess-{len(self.rows)}.json"
        command = [
            *pinning.prefix(pinning.server_cpus),
            sys.executable,
            "-m",
            "bench.inprocess",
            "--model",
            str(c.model_path),
            "--threads",
            str(pinning.server_threads),
            "--provider",
            c.provider,
            "--seq",
            seq,
            "--max-batch-size",
            str(c.max_batch_size),
            "--count",
            str(c.mixed_count),
            "--seconds",
            str(c.inprocess_seconds),
            "--json",
            str(out),
            *(["--weights"] if weights else []),
        ]
        try:
            subprocess.run(command, cwd=REPO_ROOT, check=True, timeout=1800)
            result = json.loads(out.read_text())
        except (subprocess.SubprocessError, OSError, ValueError) as err:
            self.note(f"{group} in-process seq={seq} failed: {err}")
            result = failed_inprocess(str(err), pinning.server_threads)
        name = "in-process" + (" +weights" if weights else "")
        return self._keep(
            result,
            group=group,
            target="in-process",
            name=name,
            api="-",
            seq=seq,
            load="-",
            pinned=pinning.pinned,
        )

    def _keep(self, result: dict[str, Any], **labels: Any) -> dict[str, Any]:
        """Store a result as a row; the scenario's labels (seq as text) win over its keys."""
        row = {**result, **labels}
        self.rows.append(row)
        name, target = row["name"], row["target"]
        who = name if name.startswith(target) else f"{target} {name}"
        log(f"{row['group']}/{who} {row['api']} seq={row['seq']} {row['load']}: {describe(row)}")
        return row


def describe(row: dict[str, Any]) -> str:
    """A row in a few words for the log: throughput, p99, what failed where."""
    if row.get("failed"):
        return "FAILED (not measured)"
    text = f"{row['sequences_per_s']:.1f} seq/s"
    if "p99_ms" in row:
        text += (
            f", p99 {row['p99_ms']:.1f} ms, failed by the server {sum(row['errors'].values())}"
            f" {row['errors'] or ''}".rstrip()
        )
        if row.get("config", {}).get("loop") == "open":
            text += f", rejected by the load generator {row.get('rejected', 0)}"
    return text
