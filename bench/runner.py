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

from bench.launcher import REPO_ROOT, Pinning, Service


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
    event_loop: str  # the server's --event-loop, used by the echo server too
    server_flags: tuple[str, ...]  # passed through to python -m service, last
    pinning: Pinning
    ready_timeout_s: float = 300.0


def log(message: str) -> None:
    print(f"[bench] {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


@dataclass
class Runner:
    config: BenchConfig
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    scratch: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-")))

    # -- servers ----------------------------------------------------------------------------

    def server_command(self, flags: Sequence[str], pinning: Pinning) -> list[str]:
        c = self.config
        return [
            *pinning.prefix(pinning.server_cpus), sys.executable, "-m", "service",
            "--host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "0",
            "--model-repository", str(c.model_repository),
            "--intra-op-threads", str(pinning.server_threads),
            "--provider", c.provider, *flags, *c.server_flags,
        ]  # fmt: skip

    @contextmanager
    def server(self, name: str, flags: Sequence[str], pinning: Pinning) -> Iterator[Service]:
        """Our server with these flags (then the passthrough ones), ready to take load."""
        with Service(name, self.server_command(flags, pinning)) as service:
            service.wait_ready(self.config.ready_timeout_s)
            log(f"{name}: pid {service.pid} on {service.target} {' '.join(flags)}")
            yield service

    @contextmanager
    def echo(self, pinning: Pinning) -> Iterator[Service]:
        c = self.config
        command = [
            *pinning.prefix(pinning.server_cpus), sys.executable, "-m", "bench.echo_server",
            "--embed-dim", str(c.embed_dim), "--num-heads", str(c.num_heads),
            "--max-batch-size", str(c.max_batch_size), "--max-seq-len", str(c.max_seq_len),
            "--event-loop", c.event_loop,
        ]  # fmt: skip
        with Service("echo", command) as service:
            service.wait_ready(60)
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
    ) -> dict[str, Any]:
        """One load generator run against service; the result becomes a row."""
        c = self.config
        out = self.scratch / f"load-{len(self.rows)}.json"
        command = [
            *pinning.prefix(pinning.client_cpus), sys.executable, "-m", "bench.loadgen",
            "--target", service.target, "--api", api, "--seq", seq,
            "--model", model or c.model, "--embed-dim", str(embed_dim or c.embed_dim),
            "--concurrency", str(concurrency or c.concurrency), "--rate", str(rate),
            "--max-outstanding", str(c.max_outstanding), "--weights-fraction", str(weights),
            "--duration-s", str(c.duration_s), "--warmup-s", str(c.warmup_s),
            "--channels", str(c.channels), "--cpu-pid", str(service.pid),
            "--metrics-url", service.metrics_url, "--label", f"{group}/{name}",
            "--progress-s", "10" if c.duration_s >= 30 else "0", "--json", str(out),
        ]  # fmt: skip
        load = f"rate={rate:.0f}" if rate else f"c={concurrency or c.concurrency}"
        try:
            subprocess.run(command, cwd=REPO_ROOT, check=True, timeout=c.duration_s * 4 + 300)
            result = json.loads(out.read_text())
        except (subprocess.SubprocessError, OSError, ValueError) as err:
            # One failed run (a server that died, say) costs its row, not the whole run.
            self.notes.append(f"{group}/{name} {api} seq={seq} {load} failed: {err}")
            result = {"sequences_per_s": 0.0, "requests": 0, "errors": {"LOADGEN_FAILED": 1}}
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

    def inprocess(
        self, *, group: str, seq: str, pinning: Pinning, weights: bool = False
    ) -> dict[str, Any]:
        """The in-process limit, pinned like the server, with the server's thread count."""
        c = self.config
        out = self.scratch / f"inprocess-{len(self.rows)}.json"
        command = [
            *pinning.prefix(pinning.server_cpus), sys.executable, "-m", "bench.inprocess",
            "--model", str(c.model_path), "--threads", str(pinning.server_threads),
            "--provider", c.provider, "--seq", seq,
            "--max-batch-size", str(c.max_batch_size), "--count", str(c.mixed_count),
            "--seconds", str(c.inprocess_seconds), "--json", str(out),
            *(["--weights"] if weights else []),
        ]  # fmt: skip
        subprocess.run(command, cwd=REPO_ROOT, check=True, timeout=1800)
        result = json.loads(out.read_text())
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
        p99 = (
            f", p99 {row['p99_ms']:.1f} ms, errors {row['errors'] or 0}" if "p99_ms" in row else ""
        )
        log(
            f"{row['group']}/{row['name']} {row['api']} seq={row['seq']} {row['load']}: "
            f"{row['sequences_per_s']:.1f} seq/s{p99}"
        )
        return row
