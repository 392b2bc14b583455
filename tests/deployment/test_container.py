"""The serving image for real, with podman: built from the Dockerfile against a local Debian
base and wheelhouse (scripts/build-image-offline.sh), run as uid 10001 on a read-only root,
healthy by its own HEALTHCHECK, called by our client and by tritonclient, scraped, drained
by SIGTERM under load; and the compose pair (server + Prometheus) in one pod.

Marked `container` (not in the default run; `.ci/run` runs them). Skipped only where podman
cannot run; ATTENTION_REQUIRE_PODMAN=1 (set by .ci/run) turns that skip into a failure."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest

from bench.harness import Samples, free_port, metric_samples, metric_sum, wait_for
from service.client import AttentionClient
from tests.harness.prometheus import query as query_prometheus

# The first build on a fresh machine takes minutes (torch in the export stage).
pytestmark = [pytest.mark.container, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
PODMAN = shutil.which("podman")
IMAGE = "localhost/attention-serving:test"
BASE_IMAGE = "localhost/attention-base:bookworm"
REQUIRED = os.environ.get("ATTENTION_REQUIRE_PODMAN") == "1"
# crun refuses some hosts' cgroup layout; limits may be lowered here but not raised.
RUN_FLAGS = ("--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")
D = 512  # the image's default model


def _podman(*args: str, check: bool = True, timeout_s: float = 120) -> str:
    assert PODMAN
    done = subprocess.run(
        [PODMAN, *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: rc {done.returncode}\n{done.stderr}")
    return done.stdout.strip()


def _why_podman_cannot_run() -> str | None:
    if PODMAN is None:
        return "podman is not installed (apt-get install podman runc mmdebstrap)"
    if shutil.which("runc") is None:
        return "runc is not installed (apt-get install runc)"
    info = subprocess.run([PODMAN, "info"], capture_output=True, text=True, check=False)
    if info.returncode != 0:
        return f"podman cannot run here: {info.stderr.strip()[-300:]}"
    exists = subprocess.run([PODMAN, "image", "exists", BASE_IMAGE], check=False)
    if exists.returncode != 0 and shutil.which("mmdebstrap") is None:
        return f"no {BASE_IMAGE} and no mmdebstrap to make it (apt-get install mmdebstrap)"
    return None


def _report(request: pytest.FixtureRequest, line: str) -> None:
    """Print past pytest's capture: CI's log keeps the figures."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n[container] {line}", flush=True)


@pytest.fixture(scope="module")
def image(request: pytest.FixtureRequest) -> str:
    """The serving image, built (layers cached between runs on one machine) and measured."""
    reason = _why_podman_cannot_run()
    if reason:
        if REQUIRED:
            pytest.fail(reason)
        pytest.skip(reason)
    previous = _podman("image", "inspect", "--format", "{{.Id}}", IMAGE, check=False)
    started = time.monotonic()
    # TORCH_INDEX empty: this machine's pip finds torch's CPU wheel in its own find-links and
    # cannot reach download.pytorch.org (each download would first retry it).
    env = {"TORCH_INDEX": "", **os.environ, "IMAGE": IMAGE, "BASE_IMAGE": BASE_IMAGE}
    build = subprocess.run(
        ["bash", str(ROOT / "scripts/build-image-offline.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    build_s = time.monotonic() - started
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    size = int(_podman("image", "inspect", "--format", "{{.Size}}", IMAGE))
    if previous and previous != _podman("image", "inspect", "--format", "{{.Id}}", IMAGE):
        _podman("rmi", previous, check=False)  # the last run's image, untagged now: disk
    # Stage caches of older builds: a day's worth kept, so disk stays bounded on a machine
    # that runs CI again and again (the export stage is rebuilt at most once a day).
    _podman("image", "prune", "--force", "--filter", "until=24h", check=False)
    cached = build.stdout.count("Using cache")
    _report(
        request,
        f"image {IMAGE}: {size / 2**20:.0f} MiB, built in {build_s:.1f} s "
        f"(wheelhouse + base + podman build; {cached} layers from cache)",
    )
    return IMAGE


@dataclass
class Container:
    name: str
    grpc_port: int
    metrics_port: int
    http_port: int = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def logs(self) -> str:
        """The server's log (podman logs replays the container's stderr on its own)."""
        assert PODMAN
        done = subprocess.run(
            [PODMAN, "logs", self.name], capture_output=True, text=True, timeout=30, check=False
        )
        return done.stdout + done.stderr

    def healthy(self) -> bool:
        """Runs the image's own HEALTHCHECK command (no systemd timers here to run it)."""
        assert PODMAN
        done = subprocess.run(
            [PODMAN, "healthcheck", "run", self.name], capture_output=True, check=False
        )
        return done.returncode == 0

    def wait_healthy(self) -> None:
        try:
            wait_for(self.healthy, what="a passing HEALTHCHECK", timeout_s=120, poll_s=0.1)
        except TimeoutError:
            raise AssertionError(self.logs()) from None


def _server_flags(image: str, name: str, *run: str) -> list[str]:
    return [
        "run",
        "--detach",
        "--name",
        name,
        *RUN_FLAGS,
        "--user",
        "10001",
        "--read-only",
        "--tmpfs",
        "/tmp",
        "--env",
        "ATTENTION_GRACE_PERIOD_S=10",
        "--env",
        "ATTENTION_BATCH_CAP_BUDGET_S=0",
        *run,
        image,
    ]


@pytest.fixture
def container(image: str) -> Iterator[Container]:
    """The image as users run it: non-root, read-only, ports on 127.0.0.1 only."""
    box = Container(f"attention-test-{uuid.uuid4().hex[:8]}", free_port(), free_port(), free_port())
    ports = (
        "-p",
        f"127.0.0.1:{box.grpc_port}:8001",
        "-p",
        f"127.0.0.1:{box.metrics_port}:8002",
        "-p",
        f"127.0.0.1:{box.http_port}:8000",
    )
    _podman(*_server_flags(image, box.name, *ports))
    try:
        box.wait_healthy()
        yield box
    finally:
        _podman("rm", "--force", "--time", "0", box.name, check=False)


def _served(metrics: Samples, api: str) -> float:
    return metric_sum(metrics, "attention_requests_total", api=api, code="OK", model="mha")


def test_image_runs_non_root_read_only_and_serves_both_apis(
    container: Container, tmp_path: Path
) -> None:
    config = json.loads(_podman("inspect", container.name))[0]
    assert config["Config"]["User"] == "10001"
    assert config["HostConfig"]["ReadonlyRootfs"] is True
    assert _podman("exec", container.name, "id", "-u") == "10001"
    assert (
        subprocess.run(
            [PODMAN or "podman", "exec", container.name, "touch", "/app/x"],
            capture_output=True,
            check=False,
        ).returncode
        != 0
    )
    no_torch = _podman(
        "exec",
        container.name,
        "python",
        "-c",
        "import importlib.util as u; print(u.find_spec('torch') is None)",
    )
    assert no_torch == "True"

    saved = tmp_path / "answer.npz"
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "service.client",
            "--target",
            container.target,
            "--seq",
            "8",
            "--requests",
            "3",
            "--save",
            str(saved),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "output [8, 512] float32" in cli.stdout, cli.stdout

    import tritonclient.grpc as triton  # heavy; only this test needs it

    x = np.random.default_rng(0).standard_normal((1, 8, D)).astype(np.float32)
    v2 = triton.InferenceServerClient(container.target)
    assert v2.is_server_ready()
    assert v2.is_model_ready("mha")
    inputs = triton.InferInput("embeddings", list(x.shape), "FP32")
    inputs.set_data_from_numpy(x)
    answer = v2.infer("mha", [inputs], outputs=[triton.InferRequestedOutput("output")])
    with AttentionClient(container.target) as client:
        ours = client.attend(x[0])
    np.testing.assert_allclose(answer.as_numpy("output")[0], ours.output, rtol=1e-4, atol=1e-5)

    import tritonclient.http as triton_http

    rest = triton_http.InferenceServerClient(f"127.0.0.1:{container.http_port}")  # port 8000
    try:
        assert rest.is_server_ready()
        inputs = triton_http.InferInput("embeddings", list(x.shape), "FP32")
        inputs.set_data_from_numpy(x, binary_data=True)
        over_rest = rest.infer("mha", [inputs])
    finally:
        rest.close()
    np.testing.assert_allclose(over_rest.as_numpy("output")[0], ours.output, rtol=1e-4, atol=1e-5)

    metrics = metric_samples(f"http://127.0.0.1:{container.metrics_port}/metrics")
    assert _served(metrics, "attention") >= 4  # the CLI's three and ours
    assert _served(metrics, "v2") >= 1
    assert _served(metrics, "rest") >= 1
    assert metrics[("attention_model_ready", (("model", "mha"), ("version", "1")))] == 1


@dataclass
class Load:
    """Clients sending until the server refuses them; every call's fate recorded."""

    target: str
    ok: list[tuple[float, float]] = field(default_factory=list)  # (sent, answered)
    refused: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        x = np.ones((4, 64, D), np.float32)
        with AttentionClient(self.target) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    client.attend(x, timeout_s=30)
                except grpc.RpcError as err:
                    detail = f"{err.code().name}: {err.details()}"
                    # Refused, not accepted: the drain's UNAVAILABLE, or no listener any more.
                    if err.code() == grpc.StatusCode.UNAVAILABLE and any(
                        text in (err.details() or "")
                        for text in ("not accepting", "connect", "Connection refused")
                    ):
                        self.refused.append(detail)
                        return
                    self.lost.append(detail)
                    return
                self.ok.append((started, time.monotonic()))


def test_sigterm_under_load_finishes_every_accepted_request_and_exits_0(
    container: Container, request: pytest.FixtureRequest
) -> None:
    load = Load(container.target)
    threads = [threading.Thread(target=load.run, daemon=True) for _ in range(6)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(load.ok) >= 12, what="12 answers under load", timeout_s=60, poll_s=0.1)
    signalled = time.monotonic()
    _podman("kill", "--signal", "TERM", container.name)
    exit_code = _podman("wait", container.name, timeout_s=60)
    load.stop.set()
    for thread in threads:
        thread.join(35)
    drained = sum(sent < signalled < answered for sent, answered in load.ok)
    _report(
        request,
        f"SIGTERM under load: {drained} requests in flight at the signal completed "
        f"after it; {len(load.ok)} OK, {len(load.refused)} refused, "
        f"{len(load.lost)} lost; exit code {exit_code}",
    )
    assert load.lost == [], load.lost
    assert drained >= 1
    assert exit_code == "0", container.logs()
    assert "draining" in container.logs()


def test_compose_pair_prometheus_scrapes_the_server_and_loads_the_alerts(
    image: str, tmp_path: Path
) -> None:
    """docker-compose.yml's server + Prometheus with the real monitoring/ config (target
    attention:8002, alerts.yml), sharing one network namespace as a pod would (podman's pods
    need an infra container, whose limits cannot be lowered here); `attention` resolves
    there. Prometheus is the host's Debian binary run on our base image."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.fail("prometheus is not installed (apt-get install prometheus)")
    name = f"attention-compose-{uuid.uuid4().hex[:8]}"
    port = free_port()
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost attention\n")
    hosts.chmod(0o644)
    try:
        _podman(*_server_flags(image, name, "-p", f"127.0.0.1:{port}:9090"))
        _podman(
            "run",
            "--detach",
            "--name",
            f"{name}-prometheus",
            "--network",
            f"container:{name}",
            *RUN_FLAGS,
            "--user",
            "65534",
            "--read-only",
            "--tmpfs",
            "/prometheus",
            "-v",
            f"{hosts}:/etc/hosts:ro",
            "-v",
            f"{prometheus}:/usr/local/bin/prometheus:ro",
            "-v",
            f"{ROOT / 'monitoring'}:/etc/prometheus:ro",
            BASE_IMAGE,
            "prometheus",
            "--config.file=/etc/prometheus/prometheus.yml",
            "--storage.tsdb.path=/prometheus",
            "--web.listen-address=:9090",
        )
        base = f"http://127.0.0.1:{port}"

        def scraped(query: str, value: str = "1") -> Callable[[], bool]:
            return lambda: [r["value"][1] for r in query_prometheus(base, query)] == [value]

        try:
            wait_for(scraped('up{job="attention"}'), what="a scrape", timeout_s=120, poll_s=0.1)
            wait_for(
                scraped('attention_model_ready{model="mha"}'), what="a ready model", poll_s=0.1
            )
        except TimeoutError as err:
            logs = Container(f"{name}-prometheus", 0, 0).logs()
            raise AssertionError(f"{err}\n{logs[-3000:]}") from None
        rules: list[dict] = []
        expected = (ROOT / "monitoring" / "alerts.yml").read_text().count("- alert:")

        def evaluated() -> bool:
            with urllib.request.urlopen(f"{base}/api/v1/rules", timeout=5) as reply:
                groups = json.load(reply)["data"]["groups"]
            rules[:] = [rule for group in groups for rule in group["rules"]]
            return len(rules) == expected and all(rule["health"] == "ok" for rule in rules)

        wait_for(evaluated, what="alerts.yml loaded and evaluated", poll_s=0.1)
        firing = [r["name"] for r in rules if r["state"] == "firing"]
        assert "AttentionServerDown" not in firing
        assert "AttentionModelNotReady" not in firing
        assert "AttentionProcessRestarted" not in firing  # its series are 0 from the start
    finally:
        for container in (f"{name}-prometheus", name):
            _podman("rm", "--force", "--time", "0", container, check=False)
