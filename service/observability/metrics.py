"""Every Prometheus metric of the server, declared once, in base units, under one prefix.

Each process (worker, front ends) writes its own series; the supervisor's /metrics sums them
(prometheus-client's multiprocess mode). Gauges say how: livesum adds the live processes'
values, livemax takes the largest."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Final

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics, values
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

PREFIX = "attention"


class Api:
    """The api label's values: which API a call came by, a stream's messages apart from
    unary calls (the Go gateway's are generated from these: scripts/go_wire_contract.py)."""

    ATTENTION: Final = "attention"
    ATTENTION_STREAM: Final = "attention_stream"
    V2: Final = "v2"
    V2_STREAM: Final = "v2_stream"
    REST: Final = "rest"


# In multiprocess mode every write of a value first asks for the process id (os.getpid, a
# system call) to notice a fork; that was 8% of the worker's CPU per request at batches of
# one (py-spy). The id is remembered instead, and renewed in a forked child: distinct in
# processes that run at once, which is what prometheus-client's process_identifier needs.
_pid = os.getpid()


def _process_identifier() -> int:
    return _pid


def _renew_pid() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_renew_pid)
if values.ValueClass is not values.MutexValue:  # multiprocess mode: before any metric exists
    values.ValueClass = values.MultiProcessValue(process_identifier=_process_identifier)

# Sub-millisecond to multi-second: a small CPU batch takes ~100 µs, a long GPU queue seconds.
LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PADDING_RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)

REQUESTS = Counter(
    f"{PREFIX}_requests_total",
    "Finished RPCs by model, API (attention | v2 | ...) and gRPC status code; an answer "
    "computed but never delivered (the client reset the call or its connection closed first) "
    "counts as CANCELLED, not OK.",
    ["model", "api", "code"],
)
REQUEST_DURATION = Histogram(
    f"{PREFIX}_request_duration_seconds",
    "End-to-end server time of an RPC, from handler entry to response.",
    ["model", "api"],
    buckets=LATENCY_BUCKETS_S,
)
QUEUE_DURATION = Histogram(
    f"{PREFIX}_queue_duration_seconds",
    "Time a request waited in the batcher before its batch started computing.",
    ["model"],
    buckets=LATENCY_BUCKETS_S,
)
COMPUTE_DURATION = Histogram(
    f"{PREFIX}_compute_duration_seconds",
    "Time one batch took: pad/merge, ONNX Runtime, split.",
    ["model"],
    buckets=LATENCY_BUCKETS_S,
)
BATCH_SIZE = Histogram(
    f"{PREFIX}_batch_size_sequences",
    "Sequences in each batch sent to ONNX Runtime.",
    ["model"],
    buckets=BATCH_SIZE_BUCKETS,
)
PADDING_RATIO = Histogram(
    f"{PREFIX}_batch_padding_ratio",
    "Fraction of a batch's positions that are padding (0 = none wasted).",
    ["model"],
    buckets=PADDING_RATIO_BUCKETS,
)
BATCHES = Counter(
    f"{PREFIX}_batches_total",
    "ONNX Runtime calls by graph: output | output+attention_weights.",
    ["model", "graph"],
)
DROPPED = Counter(
    f"{PREFIX}_requests_dropped_total",
    "Requests removed from the queue before compute (reason: deadline | cancelled); each is "
    "also a V2 ModelStatistics failure.",
    ["model", "reason"],
)
BATCH_FAILURES = Counter(
    f"{PREFIX}_batch_failures_total",
    "Batches whose ONNX Runtime call (or merge/split) raised; each of their requests got "
    "INTERNAL and the error is logged.",
    ["model"],
)
NONFINITE_OUTPUTS = Counter(
    f"{PREFIX}_nonfinite_outputs_total",
    "Requests failed because their computed output held NaN or inf (inputs too large).",
    ["model"],
)
QUEUE_DEPTH = Gauge(
    f"{PREFIX}_queue_depth_requests",
    "Requests waiting in the batcher, all models.",
    multiprocess_mode="livesum",
)
QUEUE_BYTES = Gauge(
    f"{PREFIX}_queue_bytes",
    "Bytes of embeddings waiting in the batcher, all models (bounded by max_queue_bytes).",
    multiprocess_mode="livesum",
)
IN_FLIGHT = Gauge(
    f"{PREFIX}_inflight_requests",
    "RPCs being handled right now (queued, computing, or writing an answer the client has not "
    "taken yet), all front ends.",
    ["api"],
    multiprocess_mode="livesum",
)
MODEL_LOAD_EVENTS = Counter(
    f"{PREFIX}_model_load_events_total",
    "Model version loads and unloads (action: load | unload) by outcome (success | failure); "
    "a failed load never replaces a served version.",
    ["model", "action", "outcome"],
)

UNDELIVERED_BYTES = Gauge(
    f"{PREFIX}_undelivered_answer_bytes",
    "Memory held by answers from admission until gRPC took them or the call ended: twice "
    "each answer's bytes (bounded by max_undelivered_bytes).",
    multiprocess_mode="livesum",
)
UNDELIVERED_REFUSALS = Counter(
    f"{PREFIX}_undelivered_refusals_total",
    "Calls and stream messages refused with RESOURCE_EXHAUSTED because the undelivered "
    "answers were at their bound (scope: server | connection).",
    ["scope"],
)


class Scope:
    """UNDELIVERED_REFUSALS' scope label's values: the bound that refused the call (the Go
    gateway's are generated from these: scripts/go_frontend_contract.py)."""

    SERVER: Final = "server"
    CONNECTION: Final = "connection"


COMPRESSION_REFUSALS = Counter(
    f"{PREFIX}_compressed_requests_refused_total",
    "Compressed request messages refused with --grpc-compression gzip (reason: too_large = "
    "inflates past the receive limit | corrupt); without it gRPC refuses compressed calls "
    "itself (UNIMPLEMENTED), uncounted here.",
    ["reason"],
)
RESTRICTED_DENIALS = Counter(
    f"{PREFIX}_restricted_api_denials_total",
    "Calls refused with PERMISSION_DENIED by --restricted-api, by API group.",
    ["group"],
)


class OncePerTurn:
    """Runs publish at most once per event-loop turn, however often asked: for gauges that
    change with every request (in multiprocess mode each write costs a few us of locking
    and mmap), written with the value current at the end of the turn."""

    def __init__(self, publish: Callable[[], None]) -> None:
        self._publish = publish
        self._due = False

    def request(self) -> None:
        if self._due:
            return
        try:
            asyncio.get_running_loop().call_soon(self._run)
        except RuntimeError:  # no loop running (stopping): now
            self._publish()
            return
        self._due = True

    def _run(self) -> None:
        self._due = False
        self._publish()


class CountedGauge:
    """A gauge child only this process changes, by inc() and dec(): counted here, written
    once per loop turn (a request in flight is counted twice per request)."""

    def __init__(self, child: Gauge) -> None:
        self._child = child
        self._value = 0.0
        self._writes = OncePerTurn(lambda: self._child.set(self._value))

    def inc(self, amount: float = 1.0) -> None:
        self._value += amount
        self._writes.request()

    def dec(self, amount: float = 1.0) -> None:
        self._value -= amount
        self._writes.request()


# Bound children: labels() takes a lock and builds a key on every call, and a request would
# pay it several times. Label values are bounded (served models, APIs, status codes), so the
# caches are too.
@functools.lru_cache(maxsize=4096)
def requests_counter(model: str, api: str, code: str) -> Counter:
    return REQUESTS.labels(model, api, code)


@functools.lru_cache(maxsize=1024)
def request_duration(model: str, api: str) -> Histogram:
    return REQUEST_DURATION.labels(model, api)


@functools.lru_cache(maxsize=64)
def in_flight(api: str) -> CountedGauge:
    return CountedGauge(IN_FLIGHT.labels(api))


@functools.lru_cache(maxsize=1024)
def queue_duration(model: str) -> Histogram:
    return QUEUE_DURATION.labels(model)


@functools.lru_cache(maxsize=1024)
def batches_counter(model: str, graph: str) -> Counter:
    return BATCHES.labels(model, graph)


@functools.lru_cache(maxsize=1024)
def batch_size(model: str) -> Histogram:
    return BATCH_SIZE.labels(model)


@functools.lru_cache(maxsize=1024)
def padding_ratio(model: str) -> Histogram:
    return PADDING_RATIO.labels(model)


@functools.lru_cache(maxsize=1024)
def compute_duration(model: str) -> Histogram:
    return COMPUTE_DURATION.labels(model)


# (model, version, provider, ready) of each version the worker serves.
ServedRow = tuple[str, str, str, bool]


class ServedSetCollector(Collector):
    """attention_model_ready and attention_engine_info, from the served set the worker last
    reported: an unloaded version's series goes away, which per-process metric files (where
    a removed label set keeps its last value) could not do."""

    def __init__(self) -> None:
        self._rows: tuple[ServedRow, ...] = ()

    def set(self, rows: Iterable[ServedRow]) -> None:
        self._rows = tuple(rows)  # one assignment: a scrape sees the old set or the new one

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rows = self._rows
        ready = GaugeMetricFamily(
            f"{PREFIX}_model_ready",
            "1 when the model version is loaded and warmed up, else 0.",
            labels=["model", "version"],
        )
        engine = GaugeMetricFamily(
            f"{PREFIX}_engine_info",
            "Constant 1; labels show the ONNX Runtime execution provider serving each model "
            "version.",
            labels=["model", "version", "provider"],
        )
        for model, version, provider, is_ready in rows:
            ready.add_metric([model, version], 1.0 if is_ready else 0.0)
            engine.add_metric([model, version, provider], 1.0)
        yield ready
        yield engine


def process_restarts_counter() -> Counter:
    """attention_process_restarts_total, kept by the supervisor (in its own registry)."""
    # Outside multiprocess mode a counter also shows a _created series (its start time), not
    # one of the documented metrics; the supervisor's own metrics do without.
    disable_created_metrics()
    return Counter(
        f"{PREFIX}_process_restarts",
        "Child processes restarted after they died or hung (process: worker | frontend, by "
        "the supervisor; gateway, by its front end); more than --max-restarts within "
        "--restart-window-s ends the server (of a front end's gateway: the front end).",
        ["process"],
        registry=None,
    )


class EveryFamily(Collector):
    """The processes' series, plus an empty family for each metric declared here that has no
    sample yet (no drop has happened, say): a scrape lists every metric, as one process's
    registry would, so dashboards and alerts can name them before the first event."""

    def __init__(self, inner: Collector) -> None:
        self._inner = inner

    def collect(self) -> Iterator[Metric]:
        seen = set()
        for family in self._inner.collect():
            seen.add(family.name)
            yield family
        for declared in list(globals().values()):
            if isinstance(declared, MetricWrapperBase):
                for family in declared.describe():
                    if family.name not in seen:
                        yield family
