"""Which measurements a run makes, grouped so each server configuration starts once."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Callable

from bench import h2load
from bench.harness import free_port
from bench.launcher import REPO_ROOT, UNPINNED, Service, built, cpu_set
from bench.otlp_sink import OtlpSink
from bench.payloads import REST, SHM, family
from bench.report import (
    BESIDE_FEATURES,
    FEATURE_ROUNDS,
    FRONTENDS,
    GO_FLOOR,
    GROUPING_OFF,
    GROUPING_OFF_FALLBACK,
    GROUPING_ON,
    GROUPING_ON_LOOSE,
    GRPC_FLOOR,
    H2LOAD,
    LOOSE_PADDING,
    MIXED,
    RESTRICTED,
    SEQS,
    TRACING_ON,
    TRACING_SAMPLED,
    Row,
    find,
    one_caller_name,
    process_cpu_us,
    unpinned_h2load_name,
    unpinned_name,
)
from bench.runner import Runner, log
from bench.tracing_off import CALLS, hooks_cpu_us

GROUPS = ("headline", "batching", "mixed", "weights", "open", "shm", "unpinned", H2LOAD, "peers")
STANDARD = tuple(g for g in GROUPS if g != "peers")
OPEN_FRACTIONS = (0.5, 0.8, 1.0, 1.2)
UNPINNED_CHANNELS = 8  # connections of the --frontends runs: 2 front ends both get some
BATCHING_CONCURRENCY = (1, 16)  # and the headline concurrency, measured in "headline"
LENGTH_GROUPING_FLAG = "--length-grouping"


def capacity_of(row: Row) -> float:
    """Requests/s of a closed-loop run; 0.0 (no capacity known) when the run failed."""
    value = row.get("requests_per_s")
    return float(value) if value else 0.0


@functools.cache
def server_has_flag(flag: str) -> bool:
    """Whether `python -m service --help` lists flag (asked once per run)."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "service", "--help"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (subprocess.SubprocessError, OSError):
        return False
    return flag in done.stdout.split() or f"{flag} " in done.stdout


def grouping_off(has_flag: bool) -> tuple[str, list[str], str]:
    """(row name, server flags, note) of the mixed-lengths "grouping off" server: candidates
    first-come, only max_batch_size, the caps and the loose padding bound apply (as in the
    "grouping on, pad 0.5" row it is compared with). A server without the flag gets the old
    approximation, and the report says so."""
    if has_flag:
        return GROUPING_OFF, [LENGTH_GROUPING_FLAG, "off", *LOOSE_PADDING], ""
    note = (
        f"mixed: the server has no {LENGTH_GROUPING_FLAG} flag yet, so 'grouping off' ran "
        "as --max-padding-ratio 1.0, which still sorts candidates by length (not first-come): "
        f"its row is '{GROUPING_OFF_FALLBACK}', so grouping on / off is not against first-come"
    )
    return GROUPING_OFF_FALLBACK, ["--max-padding-ratio", "1.0"], note


def limits(r: Runner, groups: set[str]) -> None:
    """In-process limits, pinned as the server is."""
    pinning = r.config.pinning
    if groups & {"headline", "batching", "weights", "open", "shm", H2LOAD, "peers"}:
        for seq in SEQS:
            r.inprocess(group="headline", seq=seq, pinning=pinning)
    if "weights" in groups:
        r.inprocess(group="weights", seq="128", pinning=pinning, weights=True)
    if "mixed" in groups:
        r.inprocess(group="mixed", seq=MIXED, pinning=pinning)


def headline_apis(unary: str) -> tuple[str, ...]:
    """The headline's APIs: unary and streaming gRPC, and REST beside the V2 ones."""
    return (unary, f"{unary}_stream", *((REST,) if family(unary) == "v2" else ()))


def with_rest(flags: list[str]) -> list[str]:
    """A free HTTP/REST port for a server the REST rows call (the bench's default is none)."""
    return [*flags, "--http-port", str(free_port())]


def echo(r: Runner, groups: set[str]) -> None:
    """The protocol floor for each API the headline measures."""
    if "headline" not in groups:
        return
    unary = r.config.api
    with r.echo(r.config.pinning, with_rest([])) as service:
        for seq in SEQS:
            for api in headline_apis(unary):
                r.load(
                    service,
                    group="headline",
                    target="echo",
                    name="echo",
                    api=api,
                    seq=seq,
                    pinning=r.config.pinning,
                )
        # Beside the c=1 target: the server without the model, for one caller.
        r.load(
            service,
            group="headline",
            target="echo",
            name=one_caller_name("echo"),
            api=unary,
            seq=SEQS[0],
            concurrency=1,
            pinning=r.config.pinning,
        )


def grpc_floor(r: Runner, groups: set[str]) -> None:
    """A bare grpc.aio server answering V2 ModelInfer with its input (bench/grpc_floor.py):
    what the gRPC library itself costs, under the echo floor; with h2load, the floor of its
    rows."""
    headline = "headline" in groups and family(r.config.api) == "v2"
    if not headline and H2LOAD not in groups:
        return
    pinning = r.config.pinning
    command = [*pinning.prefix(pinning.server_cpus), sys.executable, "-m", "bench.grpc_floor"]
    with Service(GRPC_FLOOR, command) as service:
        service.wait_ready(r.config.ready_timeout_s)
        log(f"{GRPC_FLOOR}: pid {service.pid} on {service.target}")
        if headline:
            for seq in SEQS:
                r.load(
                    service,
                    group="headline",
                    target=GRPC_FLOOR,
                    name=GRPC_FLOOR,
                    api=r.config.api,
                    seq=seq,
                    pinning=pinning,
                )
            # Beside the c=1 target: what the load generator's client and gRPC alone take.
            r.load(
                service,
                group="headline",
                target=GRPC_FLOOR,
                name=one_caller_name(GRPC_FLOOR),
                api=r.config.api,
                seq=SEQS[0],
                concurrency=1,
                pinning=pinning,
            )
        if H2LOAD in groups:
            h2load_rows(r, service, target=GRPC_FLOOR, name=GRPC_FLOOR)


def go_floor(r: Runner, groups: set[str]) -> None:
    """A bare Go net/http HTTP/2 server answering V2 ModelInfer with its input (bench/h2floor/,
    built by `make h2floor`), measured with h2load: what Go's HTTP/2 server and a handler cost
    per call, the floor under the gateway's CPU and one caller's wait."""
    if H2LOAD not in groups or not r.h2load_ready():
        return
    pinning = r.config.pinning
    command = [*pinning.prefix(pinning.server_cpus), str(built("h2floor")), "-port", "0"]
    with Service(GO_FLOOR, command) as service:
        service.wait_ready(r.config.ready_timeout_s)
        log(f"{GO_FLOOR}: pid {service.pid} on {service.target}")
        h2load_rows(r, service, target=GO_FLOOR, name=GO_FLOOR)


def h2load_rows(
    r: Runner,
    service: Service,
    *,
    target: str,
    name: str,
    streams_only: bool = False,
    metadata: tuple[tuple[str, str], ...] = (),
) -> None:
    """h2load against service at seq 16 and 128: one caller (unless streams_only), and the
    headline concurrency as streams on one connection; skipped (with a note) where h2load is
    not installed."""
    if not r.h2load_ready():
        return
    for seq in SEQS:
        for shape in h2load.shapes(r.config.concurrency)[1 if streams_only else 0 :]:
            labels = {"group": H2LOAD, "target": target, "name": name, "seq": seq}
            r.h2load_row(
                service, **labels, shape=shape, pinning=r.config.pinning, metadata=metadata
            )


BENCH_KEY = ("x-bench-key", "bench-only-key-0123456789")


def fast_path_features(r: Runner, groups: set[str]) -> None:
    """What tracing (1% and every call sampled, spans exported to a sink) and a checked
    inference key cost the gateway's fast path, measured with h2load in FEATURE_ROUNDS
    rounds that alternate each feature's server with a default one (the ratios' base):
    measured one after the other, a drift of the host over minutes was read as a cost."""
    if H2LOAD not in groups or not r.h2load_ready():
        return
    pinning = r.config.pinning
    cpus = cpu_set(pinning.client_cpus) if pinning.client_cpus else None
    header, key = BENCH_KEY
    with OtlpSink(cpus) as sink:
        exporting = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint}
        exporting["OTEL_EXPORTER_OTLP_PROTOCOL"] = "http/protobuf"
        servers: list[tuple[str, list[str], dict[str, str] | None, tuple[tuple[str, str], ...]]]
        servers = [
            (BESIDE_FEATURES, [], None, ()),
            *(
                (name, ["--tracing", "on"], {**exporting, **sampler}, ())
                for name, sampler in TRACED.items()
            ),
            (RESTRICTED, ["--restricted-api", f"inference:{header}={key}"], None, (BENCH_KEY,)),
        ]
        for _ in range(FEATURE_ROUNDS):
            for name, flags, env, metadata in servers:
                with r.server(name, flags, pinning, env) as service:
                    h2load_rows(
                        r, service, target="server", name=name, streams_only=True, metadata=metadata
                    )


def default_server(r: Runner, groups: set[str]) -> None:
    """Everything measured against the server with its default flags (batching on)."""
    if not groups & {"headline", "batching", "mixed", "weights", "open", H2LOAD, "peers"}:
        return
    pinning, unary = r.config.pinning, r.config.api
    flags = with_rest([]) if "headline" in groups else []
    with r.server("batching on", flags, pinning) as service:
        load = functools.partial(r.load, service, target="server", pinning=pinning, api=unary)
        capacity = fixed_lengths(load, groups, unary)
        if groups & {"mixed", "peers"}:  # the peers compare mixed lengths too
            load(group="mixed", name=GROUPING_ON, seq=MIXED)
        if "weights" in groups:
            load(group="weights", name="weights", seq="128", weights=1.0)
        if "open" in groups:
            open_loop(load, capacity)
        if H2LOAD in groups:
            h2load_rows(r, service, target="server", name="server")


def fixed_lengths(load: Callable[..., Row], groups: set[str], unary: str) -> float:
    """The default server at seq 16 and 128; returns the closed-loop capacity (requests/s)
    at seq 16, 0.0 when that run failed."""
    capacity = 0.0
    for seq in SEQS:
        if groups & {"headline", "batching", "weights", "open", "peers"}:
            row = load(group="headline", name="server", seq=seq)
            capacity = capacity or capacity_of(row)  # seq 16 comes first
        if "headline" in groups:
            for api in headline_apis(unary)[1:]:
                load(group="headline", name="server", seq=seq, api=api)
        if "batching" in groups:
            for concurrency in BATCHING_CONCURRENCY:
                load(group="batching", name="batching on", seq=seq, concurrency=concurrency)
    if "headline" in groups and "batching" not in groups:
        # The c=1 latency target, also where the batching group does not run.
        load(group="headline", name="server", seq=SEQS[0], concurrency=1)
    return capacity


def open_loop(load: Callable[..., object], capacity_per_s: float) -> None:
    """Poisson arrivals at fractions of the closed-loop capacity just measured."""
    if capacity_per_s <= 0:
        log("open loop skipped: the closed-loop capacity run failed")
        return
    for fraction in OPEN_FRACTIONS:
        load(
            group="open",
            name=f"{fraction:.0%} of capacity",
            seq=SEQS[0],
            rate=fraction * capacity_per_s,
        )


TRACED = {  # the server's name in the rows, and its sampler
    TRACING_SAMPLED: {
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.01",
    },
    TRACING_ON: {"OTEL_TRACES_SAMPLER": "always_on"},
}


def tracing_on(r: Runner, groups: set[str]) -> None:
    """The default server with tracing on, 1% of requests and every request sampled, their
    spans exported (to a sink on the load generator's CPUs), at each length."""
    if "headline" not in groups:
        return
    pinning = r.config.pinning
    cpus = cpu_set(pinning.client_cpus) if pinning.client_cpus else None
    for name, sampler in TRACED.items():
        with OtlpSink(cpus) as sink:
            env = {
                "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                **sampler,
            }
            with r.server(name, ["--tracing", "on"], pinning, env) as service:
                for seq in SEQS:
                    r.load(
                        service,
                        group="headline",
                        target="server",
                        name=name,
                        api=r.config.api,
                        seq=seq,
                        pinning=pinning,
                    )
            if not sink.exports:
                r.note(f"{name}: the server exported no spans")
    tracing_off_cost(r)


def tracing_off_cost(r: Runner) -> None:
    """Tracing off: the request path's tracing calls, timed here, against the default
    server's front-end CPU per request at seq 16 (measured in this run)."""
    hooks_us = hooks_cpu_us()
    plain = find(
        r.rows,
        group="headline",
        target="server",
        name="server",
        api=r.config.api,
        seq=SEQS[0],
        load="c=64",
    )
    frontend_us = process_cpu_us(plain)[0] if plain else None
    share = ""
    if frontend_us:
        share = f", {hooks_us / frontend_us:.2%} of the front end's {frontend_us:.0f} us"
    r.note(
        f"tracing off: the request path's tracing calls cost {hooks_us:.2f} us of CPU per "
        f"request (timed over {CALLS} calls){share}"
    )


def client_shared_memory(r: Runner, groups: set[str]) -> None:
    """A server with --client-shared-memory on: V2 ModelInfer with the tensors in the message
    and in client shared memory, side by side on the same server."""
    if "shm" not in groups:
        return
    pinning = r.config.pinning
    with r.server("client shared memory", ["--client-shared-memory", "on"], pinning) as service:
        for seq in SEQS:
            for api in ("v2", SHM):
                r.load(
                    service,
                    group="shm",
                    target="server",
                    name="client shm on",
                    api=api,
                    seq=seq,
                    pinning=pinning,
                )


def other_servers(r: Runner, groups: set[str]) -> None:
    """Batching off, length grouping off, and the unpinned server."""
    pinning, unary = r.config.pinning, r.config.api
    if "batching" in groups:
        with r.server("batching off", ["--max-batch-size", "1"], pinning) as service:
            for seq in SEQS:
                for concurrency in (*BATCHING_CONCURRENCY, r.config.concurrency):
                    r.load(
                        service,
                        group="batching",
                        target="server",
                        name="batching off",
                        api=unary,
                        seq=seq,
                        concurrency=concurrency,
                        pinning=pinning,
                    )
    if "mixed" in groups:
        off_name, off_flags, note = grouping_off(server_has_flag(LENGTH_GROUPING_FLAG))
        if note:
            r.note(note)
        for name, flags in ((GROUPING_ON_LOOSE, list(LOOSE_PADDING)), (off_name, off_flags)):
            with r.server(name, flags, pinning) as service:
                r.load(
                    service,
                    group="mixed",
                    target="server",
                    name=name,
                    api=unary,
                    seq=MIXED,
                    pinning=pinning,
                )
    if "unpinned" in groups:
        unpinned(r, with_h2load=H2LOAD in groups)


def unpinned(r: Runner, *, with_h2load: bool = False) -> None:
    """Everything on every core: the in-process limit, the echo floor and the server with one
    and with two front ends (each row also shows the load generator's CPU). Every run here
    opens UNPINNED_CHANNELS connections: the kernel spreads connections, not calls, over the
    front ends, and one connection would keep all but one of them idle. With h2load, each
    server again with h2load as the client over as many connections: the Python load
    generator takes most of a core at these rates, so the echo floor's h2load row is the
    better estimate, on the host measured, of what the front of the stack can feed a model
    that costs nothing."""
    channels = max(r.config.channels, UNPINNED_CHANNELS)
    h2load_shape = spread(r.config.concurrency, channels)
    with_h2load = with_h2load and r.h2load_ready()
    if with_h2load and h2load_shape.in_flight != r.config.concurrency:
        r.note(
            f"unpinned h2load rows: {h2load_shape.label} keeps {h2load_shape.in_flight} calls"
            f" in flight where the load generator keeps {r.config.concurrency}"
        )
    for seq in SEQS:
        r.inprocess(group="unpinned", seq=seq, pinning=UNPINNED)
    for frontends in FRONTENDS:
        flags = ["--frontends", str(frontends)]
        servers = {
            "echo": r.echo(UNPINNED, flags),  # started only when entered, one at a time
            "server": r.server(unpinned_name(frontends), flags, UNPINNED),
        }
        for target, start in servers.items():
            with start as service:
                for seq in SEQS:
                    r.load(
                        service,
                        group="unpinned",
                        target=target,
                        name=unpinned_name(frontends, target),
                        api=r.config.api,
                        seq=seq,
                        pinning=UNPINNED,
                        channels=channels,
                    )
                if with_h2load:
                    for seq in SEQS:
                        r.h2load_row(
                            service,
                            group="unpinned",
                            target=target,
                            name=unpinned_h2load_name(frontends, target),
                            seq=seq,
                            shape=h2load_shape,
                            pinning=UNPINNED,
                        )


def spread(concurrency: int, connections: int) -> h2load.Shape:
    """h2load's shape for concurrency calls over up to that many connections: as many streams
    on each as it takes (more in flight than asked only where they do not divide evenly)."""
    used = max(1, min(connections, concurrency))
    return h2load.Shape(used, -(-max(1, concurrency) // used))


def run(r: Runner, groups: set[str]) -> None:
    limits(r, groups)
    echo(r, groups)
    grpc_floor(r, groups)
    go_floor(r, groups)
    default_server(r, groups)
    fast_path_features(r, groups)
    tracing_on(r, groups)
    client_shared_memory(r, groups)
    other_servers(r, groups)
    if "peers" in groups:
        peers(r, shm="shm" in groups, with_h2load=H2LOAD in groups)


def peers(r: Runner, *, shm: bool = False, with_h2load: bool = False) -> None:
    """MLServer and Triton, each in its own virtualenv (imported only when asked). A peer that
    cannot be set up costs its rows (FAILED, with the reason), not the run."""
    from bench.peers import mlserver, triton

    try:
        mlserver.run(r)
    except (subprocess.SubprocessError, OSError, RuntimeError) as err:
        reason = " | ".join(str(err).strip().splitlines()[-3:])[:400]
        r.keep_failed(group="peers", target="mlserver", name="mlserver", seqs=SEQS, reason=reason)
    triton.run(r, shm=shm, with_h2load=with_h2load)
