"""A real Prometheus scrapes the server's /metrics, and PromQL sees the traffic."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from service.client import AttentionClient
from tests.harness.prometheus import poll, query, scraping
from tests.harness.server_process import ServerProcess


@pytest.fixture(scope="module")
def prometheus(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with scraping(server.metrics_port, tmp_path_factory.mktemp("prometheus")) as base:
        yield base


@pytest.mark.gateway_off_heavy
def test_prometheus_scrapes_request_latency_and_batching(
    prometheus: str, client: AttentionClient, tmp_path: Path
) -> None:
    poll(prometheus, 'up{job="attention"}', lambda r: r and r[0]["value"][1] == "1")
    for seq in (4, 8, 16):
        client.attend(np.ones((seq, 32), np.float32), model="causal")
    served = poll(
        prometheus,
        'sum(attention_requests_total{model="causal",code="OK"})',
        lambda r: r and float(r[0]["value"][1]) >= 3,
    )
    assert float(served[0]["value"][1]) >= 3
    poll(
        prometheus,
        'histogram_quantile(0.99, sum by (le) (attention_request_duration_seconds_bucket{model="causal"}))',
        lambda r: r and 0 < float(r[0]["value"][1]) < 10,
    )
    ready = query(prometheus, 'attention_model_ready{model="causal"}')
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
