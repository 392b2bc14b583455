"""Write tests/golden/metrics/: the multiprocess files prometheus-client itself writes for the
gateway's series, and what they were written from. The gateway writes the same files in Go
(service/gateway/metrics.go); its tests (service/gateway/metrics_golden_test.go) compare:

- the layout, byte for byte: the gateway's file writer, given each file's entries (its keys
  and values, in order), writes every byte of prometheus-client's file (the used size, the
  padding, each entry's length, key, spaces to 8 bytes, value and timestamp; the file's size);
- the series: the gateway's own calls (a finished call, in-flight changes, a refusal...),
  with the spec its front end passes it, write the same series with the same values into
  files of the same names (the same kind, this process's id) as prometheus-client's metrics
  write for the same events.

- <kind>_<pid>.db: the files, as prometheus-client's MultiProcessValue names and writes them
  (process id PID), from metrics made like the gateway's (service/observability/metrics.py);
- samples.json: the process id, the spec (service/frontend/gateway.py's metrics_spec()), the
  calls (in the gateway's terms), and each file's entries as prometheus-client reads them.

    python -m scripts.golden_metrics            # rewrite the files (make golden)
    python -m scripts.golden_metrics --check    # exit 1 when a file differs from what this writes
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, values
from prometheus_client.mmap_dict import MmapedDict

from scripts import golden_files
from service.frontend import gateway
from service.observability import metrics

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden" / "metrics"
SAMPLES_JSON = "samples.json"
PID = 4242
# The events, as the gateway's metrics calls take them.
CALLS: list[dict[str, Any]] = [
    {"call": "finished", "model": "mha", "api": metrics.Api.V2, "code": "OK", "seconds": 0.0003},
    {"call": "finished", "model": "mha", "api": metrics.Api.V2, "code": "OK", "seconds": 0.002},
    {"call": "finished", "model": "mha", "api": metrics.Api.V2, "code": "OK", "seconds": 100.0},
    {
        "call": "finished",
        "model": "causal",
        "api": metrics.Api.ATTENTION,
        "code": "RESOURCE_EXHAUSTED",
        "seconds": 0.00004,
    },
    {"call": "in_flight", "api": metrics.Api.V2, "delta": 1},
    {"call": "in_flight", "api": metrics.Api.V2, "delta": 1},
    {"call": "in_flight", "api": metrics.Api.ATTENTION, "delta": 1},
    {"call": "in_flight", "api": metrics.Api.V2, "delta": -1},
    {"call": "in_flight", "api": metrics.Api.ATTENTION, "delta": -1},
    {"call": "undelivered", "delta": 4096},
    {"call": "undelivered", "delta": -1024},
    {"call": "refused", "scope": metrics.Scope.SERVER},
    {"call": "refused", "scope": metrics.Scope.CONNECTION},
    {"call": "refused", "scope": metrics.Scope.SERVER},
    {"call": "restricted_denial", "group": gateway.ANSWERED_GROUPS[0]},
]


def _like(metric: Any) -> Any:
    """A metric made as metric is (name, help, labels, buckets, gauge mode), unregistered."""
    name, documentation, labels = metric._name, metric._documentation, metric._labelnames
    if isinstance(metric, Histogram):
        return Histogram(name, documentation, labels, buckets=metric._upper_bounds, registry=None)
    if isinstance(metric, Gauge):
        mode = metric._multiprocess_mode
        return Gauge(name, documentation, labels, multiprocess_mode=mode, registry=None)
    return Counter(name, documentation, labels, registry=None)


def _record(calls: list[dict[str, Any]]) -> None:
    """Each call, as prometheus-client's metrics record it (the Python front end's way)."""
    requests, duration = _like(metrics.REQUESTS), _like(metrics.REQUEST_DURATION)
    in_flight, undelivered = _like(metrics.IN_FLIGHT), _like(metrics.UNDELIVERED_BYTES)
    refusals, denials = _like(metrics.UNDELIVERED_REFUSALS), _like(metrics.RESTRICTED_DENIALS)
    for call in calls:
        kind = call["call"]
        if kind == "finished":
            requests.labels(model=call["model"], api=call["api"], code=call["code"]).inc()
            duration.labels(model=call["model"], api=call["api"]).observe(call["seconds"])
        elif kind == "in_flight":
            in_flight.labels(api=call["api"]).inc(call["delta"])
        elif kind == "undelivered":
            undelivered.inc(call["delta"])
        elif kind == "refused":
            refusals.labels(scope=call["scope"]).inc()
        else:
            assert kind == "restricted_denial", kind
            denials.labels(group=call["group"]).inc()


def render() -> dict[str, bytes]:
    """Every golden file by its name: prometheus-client's files, and samples.json."""
    with tempfile.TemporaryDirectory() as folder:
        before = (os.environ.get("PROMETHEUS_MULTIPROC_DIR"), values.ValueClass)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
        values.ValueClass = values.MultiProcessValue(process_identifier=lambda: PID)
        try:
            _record(CALLS)
        finally:
            values.close_all_multiprocess_files()
            values.ValueClass = before[1]
            if before[0] is None:
                del os.environ["PROMETHEUS_MULTIPROC_DIR"]
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = before[0]
        files = {path.name: path.read_bytes() for path in sorted(Path(folder).glob("*.db"))}
        entries = {
            name: [
                {"key": key, "value": value, "timestamp": timestamp}
                for key, value, timestamp, _ in MmapedDict.read_all_values_from_file(
                    str(Path(folder) / name)
                )
            ]
            for name in files
        }
    samples = {"pid": PID, "spec": gateway.metrics_spec(), "calls": CALLS, "files": entries}
    files[SAMPLES_JSON] = (json.dumps(samples, indent=1, ensure_ascii=False) + "\n").encode()
    return files


def main(argv: list[str] | None = None) -> int:
    return golden_files.main(
        argv,
        description=__doc__.splitlines()[0],
        default_out=GOLDEN,
        render=render,
        module="scripts.golden_metrics",
    )


if __name__ == "__main__":
    sys.exit(main())
