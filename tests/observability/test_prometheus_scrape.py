"""A real Prometheus scrapes the server's /metrics, and PromQL sees the traffic."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bench.harness import free_port
from service.client import AttentionClient
from tests.harness.server_process import ServerProcess

PROMETHEUS = shutil.which("prometheus")
# CI installs Prometheus (apt) and sets this, so a missing binary fails there instead of skipping.
REQUIRED = os.environ.get("ATTENTION_REQUIRE_PROMETHEUS") == "1"


@pytest.fixture(scope="module")
def prometheus(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if PROMETHEUS is None:
        if REQUIRED:
            pytest.fail("prometheus is not installed (apt-get install prometheus)")
        pytest.skip("prometheus binary not installed; .ci/run installs it")
    folder = tmp_path_factory.mktemp("prometheus")
    config = folder / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: attention\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{server.metrics_port}']}}]\n"
    )
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address={address}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(folder / "log").open("w"),
    )
    try:
        yield f"http://{address}"
    finally:
        process.terminate()
        process.wait(30)


def _query(base: str, promql: str) -> list[dict]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return json.load(reply)["data"]["result"]
    except OSError:
        return []  # not up yet


def _poll(base: str, promql: str, predicate, timeout_s: float = 60) -> list[dict]:
    give_up = time.monotonic() + timeout_s
    while not predicate(result := _query(base, promql)):
        if time.monotonic() > give_up:
            raise TimeoutError(f"{promql} -> {result}")
        time.sleep(0.2)
    return result


def test_prometheus_scrapes_request_latency_and_batching(
    prometheus: str, client: AttentionClient, tmp_path: Path
) -> None:
    _poll(prometheus, 'up{job="attention"}', lambda r: r and r[0]["value"][1] == "1")
    for seq in (4, 8, 16):
        client.attend(np.ones((seq, 32), np.float32), model="causal")
    served = _poll(
        prometheus,
        'sum(attention_requests_total{model="causal",code="OK"})',
        lambda r: r and float(r[0]["value"][1]) >= 3,
    )
    assert float(served[0]["value"][1]) >= 3
    _poll(
        prometheus,
        'histogram_quantile(0.99, sum by (le) (attention_request_duration_seconds_bucket{model="causal"}))',
        lambda r: r and 0 < float(r[0]["value"][1]) < 10,
    )
    ready = _query(prometheus, 'attention_model_ready{model="causal"}')
    assert [float(sample["value"][1]) for sample in ready] == [1.0]


def test_the_process_id_metrics_files_are_named_by_is_renewed_in_a_forked_child() -> None:
    """Metrics remember the process id (asking the kernel at every write cost 8% of the
    worker's CPU); a forked child must still write files of its own."""
    from service.observability import metrics

    assert metrics._process_identifier() == os.getpid()
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: report what it would name its files by, and leave
        os.write(write_end, str(metrics._process_identifier()).encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(child, 0)
    assert int(os.read(read_end, 32)) == child
