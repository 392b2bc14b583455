"""A real Prometheus (Debian's binary) scraping a test server, and PromQL asked of it over its
HTTP API."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.harness import free_port, poll_until, wait_for

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
# CI installs Debian's prometheus package (promtool included) and sets this, so a missing
# binary fails there instead of skipping.
REQUIRED = os.environ.get("ATTENTION_REQUIRE_PROMETHEUS") == "1"

Result = list[dict]  # an instant query's result: [{"metric": {...}, "value": [t, "v"]}, ...]


def need(binary: str | None, name: str) -> str:
    """binary's path; the test skips without it (fails where CI requires it)."""
    if binary is None:
        if REQUIRED:
            pytest.fail(f"{name} is not installed (apt-get install prometheus)")
        pytest.skip(f"{name} not installed; .ci/run installs Debian's prometheus package")
    return binary


@contextmanager
def scraping(metrics_port: int, folder: Path) -> Iterator[str]:
    """A Prometheus scraping 127.0.0.1:metrics_port every second (job attention), ready for
    queries; its base URL. Its configuration, data and log live in folder."""
    binary = need(PROMETHEUS, "prometheus")
    config = folder / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: attention\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n"
    )
    address = f"127.0.0.1:{free_port()}"
    log = folder / "log"
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address={address}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
    )
    try:
        # Ready before the first query: on a busy machine it took longer than a test's first
        # query, which then failed with "connection refused".
        wait_for(lambda: _ready(address, process, log), what="a ready Prometheus", timeout_s=60)
        yield f"http://{address}"
    finally:
        process.terminate()
        process.wait(30)


def _ready(address: str, process: subprocess.Popen, log: Path) -> bool:
    assert process.poll() is None, log.read_text()
    try:
        with urllib.request.urlopen(f"http://{address}/-/ready", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def query(base: str, promql: str) -> Result:
    """An instant query's result ([] while Prometheus does not answer)."""
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return json.load(reply)["data"]["result"]
    except OSError:
        return []  # not up yet


def poll(
    base: str, promql: str, predicate: Callable[[Result], object], timeout_s: float = 60
) -> Result:
    """Query until predicate(result) holds (Prometheus scrapes every second); that result."""
    return poll_until(
        lambda: query(base, promql), predicate, what=promql, timeout_s=timeout_s, poll_s=0.2
    )
