"""The h2load rows against their targets, and each server process's CPU per call in them
(pure: rows in, entries and text out)."""

from __future__ import annotations

import statistics
from typing import Any

from bench.h2load import ONE_CALLER
from bench.report import (
    BESIDE_FEATURES,
    BESIDE_TRITON,
    GO_FLOOR,
    GRPC_FLOOR,
    H2LOAD,
    RESTRICTED,
    SEQS,
    TRACING_ON,
    TRACING_SAMPLED,
    Row,
    at_least,
    at_most,
    entry,
    find,
    measured,
)
from bench.stats import ratio

ONE = ONE_CALLER.label
# The targets, as stated: at one caller, and at the headline's streams on one connection.
ONE_CALLER_P50_MS = 0.75  # seq 16
WORKER_OVER_ORT_US = 60.0  # a lone request, over ONNX Runtime's own run of it
GATEWAY_US = {"16": 150.0, "128": 450.0}
OVER_TRITON = 1.3
# Throughput kept with a feature on, against the default server in the same run.
KEPT = {TRACING_SAMPLED: 0.9, TRACING_ON: 0.6, RESTRICTED: 0.95}


def _row(rows: list[Row], pinned: bool, **criteria: Any) -> Row | None:
    return measured(find(rows, group=H2LOAD, pinned=pinned, **criteria))


def _many(rows: list[Row], pinned: bool, target: str, name: str, seq: str) -> Row | None:
    """The row of many streams (any load but one caller) of one server at one length."""
    found = [
        r
        for r in rows
        if r["group"] == H2LOAD
        and r.get("pinned") == pinned
        and r["target"] == target
        and r["name"] == name
        and r["seq"] == seq
        and r["load"] != ONE
    ]
    return measured(found[0]) if found else None


def _cpu_per_call(row: Row | None) -> float | None:
    """A row's server CPU per call, all its processes (us)."""
    cpu_ms = _value(row, "server_cpu_ms_per_request")
    return None if cpu_ms is None else cpu_ms * 1000


def _median_rate(rows: list[Row], pinned: bool, name: str, seq: str) -> float | None:
    """The median requests/s of a server's many-stream rows at one length over its rounds."""
    rates = [
        rate
        for r in rows
        if r["group"] == H2LOAD
        and r.get("pinned") == pinned
        and r["target"] == "server"
        and r["name"] == name
        and r["seq"] == seq
        and r["load"] != ONE
        and (rate := _value(measured(r), "requests_per_s")) is not None
    ]
    return statistics.median(rates) if rates else None


def _value(row: Row | None, key: str) -> float | None:
    value = (row or {}).get(key)
    return None if value is None else float(value)


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def by_kind(row: Row | None) -> dict[str, float]:
    """CPU us per call of a row by kind of process: supervisor, front ends (Python),
    gateways, worker, other; empty where the row has no per-process figures."""
    each = (row or {}).get("server_cpu_us_per_request_by_process") or {}
    kinds: dict[str, float] = {}
    for role, value in each.items():
        if role.endswith("-gateway"):
            kind = "gateways"
        elif role.startswith("frontend-"):
            kind = "front ends"
        else:
            kind = role  # supervisor, worker, other
        kinds[kind] = kinds.get(kind, 0.0) + value
    return kinds


def inprocess_call_cpu_us(rows: list[Row], pinned: bool) -> float | None:
    """ONNX Runtime's CPU for one call of a batch of one at seq 16, in-process (the headline's
    in-process row, pinned as the server is)."""
    limit = measured(find(rows, group="headline", target="in-process", seq="16", pinned=pinned))
    points = [p for p in (limit or {}).get("points") or [] if p.get("batch_size") == 1]
    cpu_ms = points[0].get("cpu_ms_per_sequence") if points else None
    return None if cpu_ms is None else cpu_ms * 1000


def one_caller(rows: list[Row], pinned: bool) -> list[Row]:
    server = _row(rows, pinned, target="server", name="server", seq="16", load=ONE)
    floor = _row(rows, pinned, target=GRPC_FLOOR, seq="16", load=ONE)
    go_floor = _row(rows, pinned, target=GO_FLOOR, seq="16", load=ONE)
    p50 = _value(server, "p50_ms")
    worker = by_kind(server).get("worker")
    gateway = by_kind(server).get("gateways")
    go_floor_cpu = _cpu_per_call(go_floor)
    ort = inprocess_call_cpu_us(rows, pinned)
    extra = _difference(worker, ort)
    floor_p50 = _value(floor, "p50_ms")
    go_floor_p50 = _value(go_floor, "p50_ms")
    out = [
        entry(
            "One caller, seq 16, h2load: p50 (ms)",
            p50,
            f"<= {ONE_CALLER_P50_MS}",
            at_most(p50, ONE_CALLER_P50_MS),
        ),
        entry("One caller, seq 16, h2load: p99 (ms)", _value(server, "p99_ms")),
        entry("One caller, seq 16, h2load: bare gRPC server p50 (ms)", floor_p50),
        entry(
            "One caller, seq 16, h2load: p50 - bare gRPC server's (ms)",
            _difference(p50, floor_p50),
        ),
        entry("One caller, seq 16, h2load: bare Go HTTP/2 server p50 (ms)", go_floor_p50),
        entry(
            "One caller, seq 16, h2load: p50 - bare Go HTTP/2 server's (ms)",
            _difference(p50, go_floor_p50),
        ),
        entry("Worker CPU per lone request (us)", worker),
        entry("ONNX Runtime's run of it, in-process CPU (us)", ort),
        entry(
            "Worker CPU per lone request over ONNX Runtime's (us)",
            extra,
            f"<= {WORKER_OVER_ORT_US:g}",
            at_most(extra, WORKER_OVER_ORT_US),
        ),
        entry("Gateway CPU per lone call (us)", gateway),
        entry("Bare Go HTTP/2 server CPU per lone call (us)", go_floor_cpu),
        entry(
            "Gateway CPU per lone call over the bare Go HTTP/2 server's (us)",
            _difference(gateway, go_floor_cpu),
        ),
    ]
    for seq in SEQS[1:]:
        longer = _row(rows, pinned, target="server", name="server", seq=seq, load=ONE)
        out.append(entry(f"One caller, seq {seq}, h2load: p50 (ms)", _value(longer, "p50_ms")))
    return out


def streams(rows: list[Row], pinned: bool, peers: bool) -> list[Row]:
    out = []
    for seq in SEQS:
        server = _many(rows, pinned, "server", "server", seq)
        label = f"{server['load'].split('m=')[-1]} streams" if server else "many streams"
        gateway = by_kind(server).get("gateways")
        goal = GATEWAY_US[seq]
        out.append(
            entry(
                f"Gateway CPU per call, seq {seq}, {label} (us)",
                gateway,
                f"<= {goal:g}",
                at_most(gateway, goal),
            )
        )
        go_floor = _many(rows, pinned, GO_FLOOR, GO_FLOOR, seq)
        go_floor_cpu = _cpu_per_call(go_floor)
        out += [
            entry(f"Bare Go HTTP/2 server CPU per call, seq {seq}, {label} (us)", go_floor_cpu),
            entry(
                f"Gateway CPU per call over the bare Go HTTP/2 server's, seq {seq}, {label} (us)",
                _difference(gateway, go_floor_cpu),
            ),
        ]
        floor = _many(rows, pinned, GRPC_FLOOR, GRPC_FLOOR, seq)
        out.append(
            entry(
                f"h2load, {label}, seq {seq}: server / bare gRPC server (req/s)",
                ratio(_value(server, "requests_per_s"), _value(floor, "requests_per_s")),
            )
        )
        # Against the default server measured in the same rounds (else the default's row).
        base = _median_rate(rows, pinned, BESIDE_FEATURES, seq)
        if base is None:
            base = _value(server, "requests_per_s")
        for name, goal in KEPT.items():
            kept = ratio(_median_rate(rows, pinned, name, seq), base)
            out.append(
                entry(
                    f"h2load, {label}, seq {seq}: {name} / default (req/s)",
                    kept,
                    f">= {goal:g}",
                    at_least(kept, goal),
                )
            )
        if peers:
            out += against_triton(rows, pinned, seq, server, label)
    return out


def against_triton(
    rows: list[Row], pinned: bool, seq: str, server: Row | None, label: str
) -> list[Row]:
    """Our server beside Triton (measured next to each other), else our own h2load row."""
    triton = [
        r
        for r in rows
        if r["group"] == H2LOAD
        and r["target"] == "triton"
        and r["seq"] == seq
        and r["load"] != ONE
        and r.get("pinned") == pinned
    ]
    peer = measured(triton[0]) if triton else None
    ours = _many(rows, pinned, "server", BESIDE_TRITON, seq) or server
    value = ratio(_value(ours, "requests_per_s"), _value(peer, "requests_per_s"))
    p99 = ratio(_value(ours, "p99_ms"), _value(peer, "p99_ms"))
    return [
        entry(
            f"h2load, {label}, seq {seq}: server / Triton (req/s)",
            value,
            f">= {OVER_TRITON}",
            at_least(value, OVER_TRITON),
        ),
        entry(
            f"h2load, {label}, seq {seq}: server p99 / Triton p99", p99, "<= 1.0", at_most(p99, 1.0)
        ),
    ]


def section(rows: list[Row], pinned: bool = True, peers: bool = False) -> list[Row]:
    """The h2load entries of the ratios block (against Triton only when the peers ran)."""
    return one_caller(rows, pinned) + streams(rows, pinned, peers)


KINDS = ("supervisor", "front ends", "gateways", "worker", "other")


def cpu_table(rows: list[Row]) -> str:
    """Each measured h2load row's CPU per call by process (us), one line each; empty when
    there is none."""
    lines = []
    for row in rows:
        if row["group"] != H2LOAD or not measured(row):
            continue
        kinds = by_kind(row)
        if not kinds:
            continue
        # A server's rows go by the configuration's name (tracing on, ...), a peer's by target.
        who = (
            row["name"]
            if row["target"] == "server" or row["name"].startswith(row["target"])
            else row["target"]
        )
        label = f"{who} seq {row['seq']} {row['load']}"
        cells = [f"{kinds[k]:>11.0f}" if k in kinds else f"{'-':>11}" for k in KINDS]
        lines.append(f"  {label:<50}{''.join(cells)}{sum(kinds.values()):>11.0f}")
    if not lines:
        return ""
    head = f"  {'':<50}{''.join(f'{k:>11}' for k in (*KINDS, 'total'))}"
    return "\n".join([head, *lines])
