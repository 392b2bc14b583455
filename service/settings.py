"""Server settings: one frozen, validated object. Precedence: defaults < environment < flags.

Every flag ``--some-flag`` also reads the environment variable ``ATTENTION_SOME_FLAG``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ENV_PREFIX = "ATTENTION_"
AUTO = "auto"
# Ratio flags (0..1) that also take auto (the value is then chosen where it is used): one
# list for their validation and their documentation.
RATIO_OR_AUTO = ("max_padding_ratio",)
PROVIDERS = ("auto", "cuda", "cpu")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
ON_OFF = ("on", "off")
CPU_ARENAS = ("bounded", "on", "off")
FUSED_ATTENTION = ("auto", "on", "off")
MODEL_CONTROL_MODES = ("none", "poll", "explicit")  # Triton's names
GRPC_COMPRESSION = ("identity", "gzip")
# Fields whose secrets never reach a log line (describe() shows them redacted).
SECRET_FIELDS = ("restricted_api",)
VERSION_POLICY = re.compile(r"all|latest:[1-9][0-9]{0,5}")
# Flags with a fixed set of values: --help shows them and argparse refuses the rest.
CHOICES: dict[str, tuple[str, ...]] = {
    "provider": PROVIDERS,
    "event_loop": EVENT_LOOPS,
    "length_grouping": ON_OFF,
    "live_batch_caps": ON_OFF,
    "intra_op_spinning": ON_OFF,
    "cpu_arena": CPU_ARENAS,
    "malloc_reuse": ON_OFF,
    "cuda_tf32": ON_OFF,
    "fused_attention": FUSED_ATTENTION,
    "model_control_mode": MODEL_CONTROL_MODES,
    "tracing": ON_OFF,
    "grpc_compression": GRPC_COMPRESSION,
    "repository_follow_symlinks": ON_OFF,
    "client_shared_memory": ON_OFF,
    "grpc_gateway": ("auto", "on", "off"),
    "log_format": LOG_FORMATS,
}


def _doc(text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": text}, **kwargs)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Everything the server is configured with; built once in __main__ and passed down."""

    host: str = _doc(
        "address to bind the gRPC, HTTP/REST and metrics ports to: 0.0.0.0 = every IPv4 "
        "interface (and, on the gRPC port, every IPv6 one where the host has IPv6: gRPC binds "
        "0.0.0.0 as a dual-stack socket), 127.0.0.1 = this machine only; IPv6 literals with or "
        "without brackets",
        default="0.0.0.0",
    )
    grpc_port: int = _doc(
        "gRPC port of both APIs, health and reflection (0 = pick a free one)", default=8001
    )
    metrics_port: int = _doc("Prometheus /metrics HTTP port (0 = pick a free one)", default=8002)
    http_port: int = _doc(
        "HTTP/REST port of the Open Inference Protocol (KServe V2 REST, as Triton serves it); "
        "Triton's default; 0 = no HTTP/REST endpoint. TLS as on the gRPC port",
        default=8000,
    )
    model_repository: Path = _doc(
        "folder laid out as <name>/<version>/model.onnx", default=Path("models")
    )
    default_model: str = _doc("model used when a request names none", default="mha")
    model_control_mode: str = _doc(
        "none: read the repository once at start; poll: rescan it every --repository-poll-s, "
        "loading (and warming) new versions before they take traffic and unloading removed "
        "ones after their queued requests finish; explicit: load and unload only through the "
        "V2 repository API (RepositoryModelLoad / RepositoryModelUnload)",
        default="none",
    )
    repository_poll_s: float = _doc(
        "seconds between repository scans in --model-control-mode poll", default=15.0
    )
    version_policy: str = _doc(
        "versions served of each model: all, or latest:N (the N newest that load; a version "
        "that fails to load never displaces a working one)",
        default="all",
    )
    load_model: tuple[str, ...] = _doc(
        "in --model-control-mode explicit, a model to load at start (repeat the flag for "
        "more; the environment variable takes a comma-separated list); none named = all",
        default=(),
    )
    max_batch_size: int = _doc("most sequences in one ONNX Runtime call", default=32)
    max_queue_delay_ms: float = _doc(
        "longest the oldest request waits for its batch to fill; 0 = close as soon as a "
        "compute slot is free (batches still grow while the previous one computes)",
        default=0.0,
    )
    max_queue_size: int = _doc(
        "requests waiting (all models); beyond it RESOURCE_EXHAUSTED", default=1024
    )
    max_seq_len: int = _doc("longest sequence accepted (positions)", default=512)
    max_padding_ratio: str = _doc(
        "most padding a batch may carry when grouping different lengths: a number in 0..1, or "
        "auto: 0.05 where models run on a CPU (which spends a padded position's compute in "
        "full, so mixed lengths run faster the less a batch pads), 0.5 on a GPU (which "
        "computes a batch's positions side by side, so larger batches pay there)",
        default=AUTO,
    )
    length_grouping: str = _doc(
        "on: a batch takes the oldest request, then those closest to it in length (less "
        "padding); off: first come, first served (for comparison)",
        default="on",
    )
    batch_cap_budget_s: float = _doc(
        "seconds per model version spent at warm-up timing batch sizes per sequence length, so no "
        "batch costs more per sequence than a smaller one would; 0 = no caps, every batch "
        "may reach --max-batch-size",
        default=3.0,
    )
    live_batch_caps: str = _doc(
        "on: after warm-up, each length's batch cap follows the measured cost of the batches "
        "the worker runs (now and then trying the next size up and down); off: the caps "
        "measured at warm-up stay; no effect with --batch-cap-budget-s 0",
        default="on",
    )
    max_queue_bytes: int = _doc(
        "bytes of embeddings waiting (all models); beyond it RESOURCE_EXHAUSTED (an empty "
        "queue still takes one request of any legal size); 0 = a quarter of the memory the "
        "process may use (its cgroup limit, else the machine's) divided by 3, since a queued "
        "request holds about 3 bytes of memory per payload byte",
        default=0,
    )
    max_inflight_batches: int = _doc("batches computing at once, all models together", default=4)
    max_inflight_batches_per_model: int = _doc(
        "batches computing at once per model version; 1 keeps a CPU's cores on one batch of a "
        "model, while other models still get their own slot (a small model never waits "
        "behind a large one's batch)",
        default=1,
    )
    max_stream_inflight_requests: int = _doc(
        "unanswered requests one stream (AttendStream, ModelStreamInfer) may have; at the "
        "bound the server reads no more from that stream until one is answered "
        "(back-pressure, not an error)",
        default=256,
    )
    max_stream_pending_bytes: int = _doc(
        "bytes of answers one stream may have computed but not yet taken by its client; "
        "beyond it the server reads no more from that stream until the client catches up "
        "(back-pressure; one larger answer still goes out)",
        default=64 << 20,
    )
    intra_op_threads: int = _doc(
        "ONNX Runtime threads per session (0 = all cores on CPU, 1 under CUDA, where they only "
        "launch kernels and copy)",
        default=0,
    )
    intra_op_spinning: str = _doc(
        "on: ONNX Runtime's idle threads spin (lowest latency on dedicated cores); off: they "
        "sleep, leaving the cores to the event loop that shares them",
        default="off",
    )
    cpu_arena: str = _doc(
        "bounded: ONNX Runtime's CPU arena keeps the memory of ordinary batches for the next "
        "ones and gives back what a large batch took (8 MiB of input or more, 2 MiB with "
        "the weights, or 32 MiB of attention scores) once it ends; on: the arena keeps the "
        "largest batch's memory for good; off: no arena, every batch faults its "
        "intermediates' pages in again (slower)",
        default="bounded",
    )
    provider: str = _doc(
        "execution provider: auto (CUDA if usable, else CPU), cuda, cpu", default="auto"
    )
    cuda_tf32: str = _doc(
        "on: CUDA float32 matrix products on TF32 tensor cores (faster, ~1e-3 relative error; "
        "the load-time golden check then allows 5e-3 x max|output|); off: full float32 "
        "(~1e-6; golden check 1e-4 x max|output|)",
        default="off",
    )
    gpu_mem_fraction: float = _doc(
        "fraction of the GPU's memory ONNX Runtime's CUDA arenas may take together, split "
        "evenly over the sessions loaded at start (2-3 graphs per version); a batch that needs "
        "more than its session's share fails alone; 0 = no limit",
        default=0.8,
    )
    fused_attention: str = _doc(
        "output-only requests on model.fused.onnx (ONNX's Attention op): auto = on CUDA when "
        "it passes the golden check and is faster than the unfused graph at warm-up; on = "
        "whenever it passes the golden check (any provider); off = never",
        default="auto",
    )
    event_loop: str = _doc(
        "asyncio event loop: auto (uvloop when installed, else asyncio's), uvloop, asyncio",
        default="auto",
    )
    malloc_reuse: str = _doc(
        "on: glibc malloc keeps freed memory for reuse (an arena's free top is trimmed past "
        "8 MiB), so each request's buffers do not fault fresh pages in (allocations of 8 MiB "
        "or more that freed memory cannot hold still go straight back to the kernel); off: "
        "glibc's defaults",
        default="on",
    )
    grace_period_s: float = _doc(
        "most seconds from SIGTERM to exit: the NOT_SERVING period, then finishing accepted "
        "requests; what is not done by then fails with UNAVAILABLE",
        default=30.0,
    )
    shutdown_not_serving_s: float = _doc(
        "after SIGTERM, seconds of reporting NOT_SERVING while still serving, so load "
        "balancers and Kubernetes endpoints stop sending here first (within the grace period)",
        default=2.0,
    )
    log_level: str = _doc(
        f"log level of every process, one of {', '.join(LOG_LEVELS)} (any case); changes at "
        "run time through Triton's logging extension (v2/logging, LogSettings)",
        default="INFO",
    )
    log_format: str = _doc(
        "text: one line per record, 'TIME LEVEL [PROCESS] LOGGER: MESSAGE'; json: one JSON "
        "object per line with time (RFC 3339, UTC), level, process (supervisor, worker, "
        "frontend-K, gateway-K), logger, message, and trace_id, span_id and request_id inside "
        "a request where known; every process, the gateways included; changes at run time "
        "like the level",
        default="text",
    )
    tls_cert: Path | None = _doc(
        "PEM certificate chain: serve TLS on the gRPC port (with --tls-key); reread when the "
        "file changes (no restart); unset = plaintext. The metrics port stays plain HTTP",
        default=None,
    )
    tls_key: Path | None = _doc("PEM private key of --tls-cert (unencrypted)", default=None)
    tls_client_ca: Path | None = _doc(
        "PEM CA certificate(s): mutual TLS, every client must present a certificate signed by "
        "one of them (needs --tls-cert)",
        default=None,
    )
    max_connection_age_s: float = _doc(
        "seconds before a client connection is asked to reconnect (HTTP/2 GOAWAY; gRPC spreads it "
        "by +-10 percent), so clients re-resolve DNS and reach pods added since; calls in flight "
        "then get --grace-period-s to finish; 0 = connections live forever",
        default=300.0,
    )
    frontends: int = _doc(
        "gRPC front-end processes sharing the gRPC port (SO_REUSEPORT); each decodes, "
        "validates and encodes on its own core while one worker process batches for all",
        default=1,
    )
    shared_memory_bytes: int = _doc(
        "bytes of shared memory per front end for the tensors of its requests in flight "
        "(inputs and answers); when full, RESOURCE_EXHAUSTED; pages are taken only when "
        "written and go back after a spike or once idle; 0 = twice the queue's byte bound "
        "split between the front ends, at least 64 MiB",
        default=0,
    )
    grpc_gateway: str = _doc(
        "on: each front end's gRPC port is served by a native gateway (Go) that answers plain "
        "V2 ModelInfer and Attend calls and the health calls itself, through its own shared "
        "memory of --shared-memory-bytes, and hands every other call to the front end's Python "
        "process; off: Python serves the port; auto: on when the gateway's executable is "
        "found (make setup and the container image build it), else off. Python serves the "
        "port also while tracing is on with a propagator other than W3C tracecontext",
        default="auto",
    )
    grpc_gateway_binary: str = _doc(
        "the gateway's executable: a path, or a command on PATH (one not found stops the "
        "server at start, unless --grpc-gateway is off); empty = attention-gateway beside the "
        "Python interpreter (where make setup builds it), else on PATH",
        default="",
    )
    max_restarts: int = _doc(
        "restarts of a dead worker or front end the supervisor makes within "
        "--restart-window-s; one more and the server exits non-zero (the orchestrator then "
        "restarts the pod). Each front end restarts its gRPC gateway as often; one more and "
        "the front end exits (and is restarted)",
        default=5,
    )
    restart_window_s: float = _doc("seconds over which --max-restarts counts", default=60.0)
    watchdog_timeout_s: float = _doc(
        "seconds a worker or front end may go without its heartbeat (sent from its event "
        "loop every second) before the supervisor kills it as hung, failing its calls in "
        "flight at once and restarting it (a front end's gRPC gateway likewise, killed by "
        "its front end); 0 = no watchdog",
        default=10.0,
    )

    tracing: str = _doc(
        "on: export OpenTelemetry traces (a span per request, with its queue wait and compute) "
        "over OTLP, configured by the standard OTEL_* variables (OTEL_EXPORTER_OTLP_ENDPOINT, "
        "OTEL_EXPORTER_OTLP_PROTOCOL grpc | http/protobuf, OTEL_TRACES_SAMPLER[_ARG], "
        "OTEL_SERVICE_NAME); off: the request path makes a few calls that return at once "
        "(about 1 µs per request)",
        default="off",
    )
    tracing_max_queue_spans: int = _doc(
        "finished spans waiting for the exporter; beyond it new spans are dropped (never "
        "waited for), so a slow or unreachable collector neither slows nor grows the server",
        default=2048,
    )
    client_shared_memory: str = _doc(
        "on: Triton's system shared-memory extension, for clients on the same host "
        "(SystemSharedMemoryRegister etc., /v2/systemsharedmemory/...; inputs and outputs "
        "referenced by shared_memory_region/offset/byte_size); keys name objects under "
        "/dev/shm only; the worker holds the regions, so any front end serves them. off: "
        "those calls answer UNIMPLEMENTED",
        default="off",
    )
    max_client_shared_memory_regions: int = _doc(
        "client shared-memory regions registered at once; one more is RESOURCE_EXHAUSTED",
        default=64,
    )
    max_client_shared_memory_bytes: int = _doc(
        "total bytes of the client shared-memory regions registered at once; beyond it "
        "registration is RESOURCE_EXHAUSTED",
        default=4 << 30,
    )

    max_undelivered_bytes: int = _doc(
        "memory answers may hold (all calls and streams of this front end), reserved from "
        "admission until gRPC has taken them (a client that does not read holds them in the "
        "send buffers) or the call ended; each answer counts twice its size (gRPC Python's "
        "copy and core's); a call that would pass it gets RESOURCE_EXHAUSTED at once (an "
        "empty budget still takes one answer of any legal size)",
        default=1 << 30,
    )
    max_undelivered_bytes_per_connection: int = _doc(
        "the share of --max-undelivered-bytes one client connection may hold (a connection "
        "holding nothing may still take one answer while the total has room), so one "
        "connection cannot take the whole budget",
        default=512 << 20,
    )
    grpc_compression: str = _doc(
        "compressed request messages: identity = refused (UNIMPLEMENTED, the client should send "
        "them uncompressed); gzip = gzip accepted (deflate refused as identity refuses it), "
        "inflated at most to the receive limit (beyond it RESOURCE_EXHAUSTED), at the cost of "
        "that inflation's CPU per message",
        default="identity",
    )
    restricted_api: tuple[str, ...] = _doc(
        "GROUPS:KEY=VALUE, as Triton's --grpc-restricted-protocol: calls in the comma-separated "
        "groups (model-repository, shared-memory, statistics, model-config, metadata, "
        "inference, health, logging) need the header KEY with VALUE, else PERMISSION_DENIED; VALUE "
        "@/path reads it from a file (a mounted Secret); repeat the flag for more (the "
        "environment variable takes a ;-separated list)",
        default=(),
    )
    repository_follow_symlinks: str = _doc(
        "on: a model or version folder that is a symbolic link out of the repository is "
        "loaded; off: it is refused with a load error (links within the repository are fine)",
        default="off",
    )
    max_metadata_bytes: int = _doc(
        "bound on a gRPC call's header block (its metadata), counted as gRPC does: each "
        "header's name and value plus 32 bytes; a block of this size or more is refused "
        "RESOURCE_EXHAUSTED (gRPC's own default refused some between 8 and 16 KiB at random)",
        default=16384,
    )
    max_connection_idle_s: float = _doc(
        "seconds a client connection may go without any call open before it is closed "
        "(HTTP/2 GOAWAY; on the HTTP/REST port, a connection with no request open), so "
        "connections that sent nothing do not hold descriptors; 0 = never",
        default=60.0,
    )
    http_header_timeout_s: float = _doc(
        "seconds an HTTP/REST client has to send a request's headers, counted from its "
        "connection's accept, or from the first byte of a later request on it; beyond it the "
        "connection is closed (with a 408 when part of a request came); also the longest a "
        "request's body may pause (no byte of it for this long: 408 and closed); 0 = no limit",
        default=10.0,
    )
    max_json_request_bytes: int = _doc(
        "largest JSON part of an HTTP/REST request body (binary tensors after it, as "
        "Inference-Header-Content-Length tells, do not count); beyond it 413 (before the body "
        "is read when its length is declared): send tensors as binary data instead. JSON "
        "beyond 64 KiB is decoded off the event loop, in pieces",
        default=16 << 20,
    )
    max_json_answer_bytes: int = _doc(
        "largest JSON answer of the HTTP/REST port, as estimated before computing (26 bytes "
        "a value of the outputs asked for as JSON); beyond it 400, saying to ask for binary "
        "outputs (the binary_data output parameter, or binary_data_output). JSON answers "
        "beyond 64 KiB are encoded off the event loop, in pieces",
        default=64 << 20,
    )

    def __post_init__(self) -> None:
        problems = [
            f"{flag_name(name)} ({env_name(name)}) must be {expectation}, "
            + ("but it is unset" if getattr(self, name) is None else f"got {getattr(self, name)!r}")
            for name, valid, expectation in self._rules()
            if not valid
        ]
        if problems:
            raise ValueError("invalid settings: " + "; ".join(problems))

    def _rules(self) -> list[tuple[str, bool, str]]:
        return [
            ("grpc_port", 0 <= self.grpc_port <= 65535, "0..65535"),
            ("metrics_port", 0 <= self.metrics_port <= 65535, "0..65535"),
            ("http_port", 0 <= self.http_port <= 65535, "0..65535 (0 = off)"),
            ("tracing", self.tracing in ON_OFF, "on or off"),
            ("tracing_max_queue_spans", self.tracing_max_queue_spans >= 1, ">= 1"),
            ("max_batch_size", self.max_batch_size >= 1, ">= 1"),
            ("max_queue_delay_ms", self.max_queue_delay_ms >= 0, ">= 0"),
            ("max_queue_size", self.max_queue_size >= 1, ">= 1"),
            ("max_seq_len", self.max_seq_len >= 1, ">= 1"),
            *(
                (name, _ratio_or_auto(getattr(self, name)), "auto or a number in 0..1")
                for name in RATIO_OR_AUTO
            ),
            ("length_grouping", self.length_grouping in ("on", "off"), "on or off"),
            ("live_batch_caps", self.live_batch_caps in ON_OFF, "on or off"),
            ("batch_cap_budget_s", 0 <= self.batch_cap_budget_s <= 600, "in 0..600"),
            ("max_queue_bytes", self.max_queue_bytes >= 0, ">= 0"),
            ("max_inflight_batches", self.max_inflight_batches >= 1, ">= 1"),
            (
                "max_inflight_batches_per_model",
                1 <= self.max_inflight_batches_per_model <= self.max_inflight_batches,
                "at least 1 and at most --max-inflight-batches",
            ),
            ("max_stream_inflight_requests", self.max_stream_inflight_requests >= 1, ">= 1"),
            ("max_stream_pending_bytes", self.max_stream_pending_bytes >= 1, ">= 1"),
            ("intra_op_threads", self.intra_op_threads >= 0, ">= 0"),
            ("intra_op_spinning", self.intra_op_spinning in ("on", "off"), "on or off"),
            ("cpu_arena", self.cpu_arena in CPU_ARENAS, f"one of {CPU_ARENAS}"),
            ("provider", self.provider in PROVIDERS, f"one of {PROVIDERS}"),
            ("cuda_tf32", self.cuda_tf32 in ON_OFF, "on or off"),
            ("gpu_mem_fraction", 0 <= self.gpu_mem_fraction <= 1, "in 0..1"),
            ("fused_attention", self.fused_attention in FUSED_ATTENTION, "auto, on or off"),
            ("event_loop", self.event_loop in EVENT_LOOPS, f"one of {EVENT_LOOPS}"),
            ("malloc_reuse", self.malloc_reuse in ("on", "off"), "on or off"),
            ("grace_period_s", self.grace_period_s >= 0, ">= 0"),
            ("shutdown_not_serving_s", self.shutdown_not_serving_s >= 0, ">= 0"),
            ("log_level", self.log_level.upper() in LOG_LEVELS, f"one of {LOG_LEVELS}"),
            ("log_format", self.log_format in LOG_FORMATS, f"one of {LOG_FORMATS}"),
            (
                "model_control_mode",
                self.model_control_mode in MODEL_CONTROL_MODES,
                f"one of {MODEL_CONTROL_MODES}",
            ),
            ("repository_poll_s", 0 < self.repository_poll_s <= 86400, "in (0, 86400]"),
            (
                "version_policy",
                VERSION_POLICY.fullmatch(self.version_policy) is not None,
                "all or latest:N (N a positive integer)",
            ),
            (
                "load_model",
                not self.load_model or self.model_control_mode == "explicit",
                "empty unless --model-control-mode is explicit",
            ),
            ("tls_cert", self.tls_key is None or self.tls_cert is not None, "set with --tls-key"),
            ("tls_key", self.tls_cert is None or self.tls_key is not None, "set with --tls-cert"),
            (
                "tls_cert",
                self.tls_client_ca is None or self.tls_cert is not None,
                "set with --tls-client-ca (mutual TLS runs over TLS)",
            ),
            ("max_connection_age_s", self.max_connection_age_s >= 0, ">= 0"),
            ("frontends", 1 <= self.frontends <= 64, "in 1..64"),
            ("shared_memory_bytes", self.shared_memory_bytes >= 0, ">= 0"),
            ("max_restarts", self.max_restarts >= 0, ">= 0"),
            ("restart_window_s", self.restart_window_s > 0, "> 0"),
            ("watchdog_timeout_s", self.watchdog_timeout_s >= 0, ">= 0"),
            ("max_undelivered_bytes", self.max_undelivered_bytes >= 1, ">= 1"),
            (
                "max_undelivered_bytes_per_connection",
                1 <= self.max_undelivered_bytes_per_connection <= self.max_undelivered_bytes,
                "at least 1 and at most --max-undelivered-bytes",
            ),
            ("grpc_compression", self.grpc_compression in GRPC_COMPRESSION, "identity or gzip"),
            ("repository_follow_symlinks", self.repository_follow_symlinks in ON_OFF, "on or off"),
            ("max_connection_idle_s", self.max_connection_idle_s >= 0, ">= 0"),
            ("http_header_timeout_s", self.http_header_timeout_s >= 0, ">= 0"),
            ("max_json_request_bytes", self.max_json_request_bytes >= 1, ">= 1"),
            # Below ~1 KiB a plain call's own headers (path, authority, te, ...) do not fit.
            ("max_metadata_bytes", self.max_metadata_bytes >= 1024, ">= 1024"),
            ("max_json_answer_bytes", self.max_json_answer_bytes >= 1, ">= 1"),
            ("client_shared_memory", self.client_shared_memory in ON_OFF, "on or off"),
            ("grpc_gateway", self.grpc_gateway in CHOICES["grpc_gateway"], "auto, on or off"),
            (
                "grpc_gateway_binary",
                self.grpc_gateway == "off" or _executable_or_empty(self.grpc_gateway_binary),
                "an executable file or a command on PATH, or empty (the one beside the Python "
                "interpreter, else on PATH)",
            ),
            (
                "max_client_shared_memory_regions",
                1 <= self.max_client_shared_memory_regions <= 4096,
                "in 1..4096",
            ),
            ("max_client_shared_memory_bytes", self.max_client_shared_memory_bytes >= 1, ">= 1"),
        ]

    @property
    def max_queue_delay_s(self) -> float:
        return self.max_queue_delay_ms / 1000.0

    def padding_ratio(self, auto: float) -> float:
        """--max-padding-ratio as a number: auto stands for the value given (the worker's
        for the device its models run on)."""
        return auto if self.max_padding_ratio == AUTO else float(self.max_padding_ratio)


def _ratio_or_auto(text: str) -> bool:
    if text == AUTO:
        return True
    try:
        value = float(text)
    except ValueError:
        return False
    return 0 <= value <= 1  # NaN is neither


def _executable_or_empty(path: str) -> bool:
    """A path to an executable file, a command found on PATH (as the gateway is run), or ''."""
    return not path or shutil.which(path) is not None


def shown_default(value: object) -> str:
    """A default as --help shows it, as docs/configuration.md does: unset, none, empty."""
    if value is None:
        return "unset"
    if value == ():
        return "none"
    return "empty" if value == "" else str(value)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _optional_path(text: str) -> Path | None:
    return Path(text) if text else None  # an empty variable leaves the option off


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list from the environment, e.g. ATTENTION_LOAD_MODEL=mha,small."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _specs(text: str) -> tuple[str, ...]:
    """A ;-separated list from the environment: each item holds commas of its own."""
    return tuple(item.strip() for item in text.split(";") if item.strip())


# Environment converters for fields whose list items may hold commas.
ENV_CONVERTERS: dict[str, Callable[[str], Any]] = {"restricted_api": _specs}


def _repeatable(kind: Any) -> bool:
    """A tuple field is a flag given once per value (action="append")."""
    return kind == "tuple[str, ...]"


def _converter(kind: Any) -> Callable[[str], Any]:
    converters: dict[str, Callable[[str], Any]] = {
        "int": int,
        "float": float,
        "Path": Path,
        "str": str,
        "Path | None": _optional_path,
        "tuple[str, ...]": _names,
    }
    return converters[kind if isinstance(kind, str) else kind.__name__]


def _from_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for spec in fields(Settings):
        raw = environ.get(env_name(spec.name))
        if raw is None:
            continue
        try:
            values[spec.name] = ENV_CONVERTERS.get(spec.name, _converter(spec.type))(raw)
        except ValueError as err:
            raise ValueError(f"{env_name(spec.name)}={raw!r} is not a valid {spec.type}") from err
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m service",
        description="Serve multi-head self-attention ONNX models over gRPC with dynamic batching.",
        epilog=f"Every flag also reads an environment variable: --grpc-port from "
        f"{env_name('grpc_port')}, and so on ({ENV_PREFIX}<FLAG_IN_CAPITALS>). "
        "Precedence: defaults < environment < flags.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for spec in fields(Settings):
        parser.add_argument(
            flag_name(spec.name),
            type=str if _repeatable(spec.type) else _converter(spec.type),
            action="append" if _repeatable(spec.type) else "store",
            choices=CHOICES.get(spec.name),
            default=argparse.SUPPRESS,
            help=f"{spec.metadata['help']} [env {env_name(spec.name)}; default "
            f"{shown_default(spec.default)}]",
        )
    return parser


def load_settings(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Defaults, overridden by the environment, overridden by flags."""
    parser = build_parser()
    flags = {
        name: tuple(value) if isinstance(value, list) else value
        for name, value in vars(parser.parse_args(argv)).items()
    }
    try:
        values = {**_from_environment(os.environ if environ is None else environ), **flags}
        return Settings(**values)
    except ValueError as err:
        parser.error(str(err))
        raise  # unreachable: parser.error exits


def describe(settings: Settings) -> str:
    shown = {
        name: ("<redacted>" if name in SECRET_FIELDS and value else value)
        for name, value in dataclasses.asdict(settings).items()
    }
    return " ".join(f"{k}={v}" for k, v in shown.items())
