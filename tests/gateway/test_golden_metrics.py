"""The golden multiprocess files of tests/golden/metrics/ (scripts/golden_metrics.py writes
them with prometheus-client's own writer) are current, and prometheus-client's collector reads
them as the events they were written for. The gateway's Go tests
(service/gateway/metrics_golden_test.go) write the same bytes and series with its writer."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

from prometheus_client.multiprocess import MultiProcessCollector

from scripts import golden_metrics
from service.observability import metrics

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = golden_metrics.GOLDEN


def test_the_golden_files_are_what_the_generator_writes() -> None:
    # Its own process: it points prometheus-client at a folder of its own while it writes.
    checked = subprocess.run(
        [sys.executable, "-m", "scripts.golden_metrics", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert checked.returncode == 0, f"run python -m scripts.golden_metrics: {checked.stderr}"


def _samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in MultiProcessCollector(None, path=str(GOLDEN)).collect()
        for sample in family.samples
    }


def test_prometheus_client_reads_the_golden_files_as_the_calls_say() -> None:
    calls = json.loads((GOLDEN / golden_metrics.SAMPLES_JSON).read_text())["calls"]
    assert calls == golden_metrics.CALLS
    by_kind = collections.defaultdict(list)
    for call in calls:
        by_kind[call["call"]].append(call)
    samples = _samples()
    requests = collections.Counter(
        (("api", c["api"]), ("code", c["code"]), ("model", c["model"])) for c in by_kind["finished"]
    )
    family = metrics.REQUESTS._name
    for labels, count in requests.items():
        assert samples[(f"{family}_total", labels)] == count
    durations: dict[tuple[tuple[str, str], ...], list[float]] = collections.defaultdict(list)
    for c in by_kind["finished"]:
        durations[(("api", c["api"]), ("model", c["model"]))].append(c["seconds"])
    family = metrics.REQUEST_DURATION._name
    for labels, seconds in durations.items():
        assert samples[(f"{family}_sum", labels)] == sum(seconds)
        assert samples[(f"{family}_count", labels)] == len(seconds)
    in_flight = collections.Counter()
    for c in by_kind["in_flight"]:
        in_flight[c["api"]] += c["delta"]
    for api, value in in_flight.items():
        assert samples[(metrics.IN_FLIGHT._name, (("api", api),))] == value
    undelivered = sum(c["delta"] for c in by_kind["undelivered"])
    assert samples[(metrics.UNDELIVERED_BYTES._name, ())] == undelivered
    scopes = collections.Counter(c["scope"] for c in by_kind["refused"])
    for scope, count in scopes.items():
        name = f"{metrics.UNDELIVERED_REFUSALS._name}_total"
        assert samples[(name, (("scope", scope),))] == count
    groups = collections.Counter(c["group"] for c in by_kind["restricted_denial"])
    for group, count in groups.items():
        name = f"{metrics.RESTRICTED_DENIALS._name}_total"
        assert samples[(name, (("group", group),))] == count
