"""The ratios the performance targets are stated in, each from rows of the same run."""

from __future__ import annotations

import math
import statistics
from typing import Any

from bench import h2load_report
from bench.payloads import REST, SHM, family
from bench.report import (
    FRONTENDS,
    GROUPING_OFF,
    GROUPING_OFF_FALLBACK,
    GROUPING_ON,
    GROUPING_ON_LOOSE,
    GRPC_FLOOR,
    H2LOAD,
    HEAD_TO_HEAD,
    HEAD_TO_HEAD_ROUNDS,
    MIXED,
    SEQS,
    TRACING_ON,
    TRACING_SAMPLED,
    Row,
    at_least,
    ceiling_name,
    entry,
    failed,
    find,
    measured,
    one_caller_name,
    process_cpu_us,
    round_of,
    seq_per_s,
    unpinned_h2load_name,
    unpinned_name,
)
from bench.stats import ratio


def headline(rows: list[Row], unary: str, pinned: bool = True) -> list[Row]:
    """Rows of the run's own pinning mode (pinned, or all unpinned with --no-pin)."""
    out = []
    for seq in SEQS:
        limit = measured(find(rows, group="headline", target="in-process", seq=seq, pinned=pinned))
        for api in (unary, f"{unary}_stream"):
            server = measured(
                find(rows, group="headline", target="server", api=api, seq=seq, pinned=pinned)
            )
            ceiling = find(
                rows, group="headline", target="ceiling", api=api, seq=seq, pinned=pinned
            )
            value = ratio(seq_per_s(server), seq_per_s(ceiling))
            out.append(
                entry(
                    f"seq {seq} {api}: server / stack ceiling",
                    value,
                    ">= 0.92",
                    at_least(value, 0.92),
                )
            )
            out.append(
                entry(
                    f"seq {seq} {api}: server / in-process",
                    ratio(seq_per_s(server), seq_per_s(limit)),
                )
            )
            echo = measured(
                find(rows, group="headline", name="echo", api=api, seq=seq, pinned=pinned)
            )
            if echo and echo.get("requests") and echo.get("server_cpu_ms_per_request") is not None:
                out.append(
                    entry(
                        f"seq {seq} {api}: echo floor CPU us per request",
                        echo["server_cpu_ms_per_request"] * 1000,
                    )
                )
            if (
                server
                and limit
                and server.get("server_cpu_ms_per_sequence") is not None
                and limit.get("sequences_per_s")
            ):
                out.append(
                    entry(
                        f"seq {seq} {api}: server CPU / in-process CPU per sequence",
                        ratio(
                            server["server_cpu_ms_per_sequence"], 1000 / limit["sequences_per_s"]
                        ),
                    )
                )
    return out


def batching(rows: list[Row], unary: str, pinned: bool = True) -> list[Row]:
    out = []
    for seq in SEQS:
        for load in ("c=1", "c=16", "c=64"):
            on = (
                find(rows, group="headline", target="server", api=unary, seq=seq, load=load)
                if load == "c=64"
                else find(rows, group="batching", name="batching on", seq=seq, load=load)
            )
            on = on if on and on.get("pinned") == pinned else None
            off = find(
                rows, group="batching", name="batching off", seq=seq, load=load, pinned=pinned
            )
            value = ratio(seq_per_s(on), seq_per_s(off))
            out.append(
                entry(f"seq {seq} {load}: batching on / off", value, ">= 1.0", at_least(value, 1.0))
            )
    return out + one_caller(rows, pinned)


C1_LATENCY = "seq 16 c=1: server p50 - in-process call (ms)"


def c1_row(rows: list[Row], pinned: bool) -> Row | None:
    """Our server at seq 16, c=1: the batching group's, else the headline's own."""
    return find(
        rows, group="batching", name="batching on", seq="16", load="c=1", pinned=pinned
    ) or find(rows, group="headline", target="server", seq="16", load="c=1", pinned=pinned)


def one_caller(rows: list[Row], pinned: bool) -> list[Row]:
    """The c=1 target, and beside it the p50 of each layer at one caller: the load
    generator's client with a bare gRPC server, this server with a zero-compute model, this
    server, and the in-process call the target is stated against."""
    limit = measured(find(rows, group="headline", target="in-process", seq="16", pinned=pinned))
    points = (limit or {}).get("points") or []
    call_ms = points[0]["ms_per_batch"] if points else None  # batch size 1: one call

    def p50(row: Row | None) -> float | None:
        value = (measured(row) or {}).get("p50_ms")
        return None if value is None or math.isnan(value) else float(value)

    server = p50(c1_row(rows, pinned))
    extra = None if server is None or call_ms is None else server - call_ms
    out = [entry(C1_LATENCY, extra, "<= 0.5", None if extra is None else extra <= 0.5)]
    for name, label in ((GRPC_FLOOR, "bare gRPC server"), ("echo", "echo floor")):
        floor = find(rows, group="headline", name=one_caller_name(name), pinned=pinned)
        if floor is not None:
            out.append(entry(f"seq 16 c=1: {label} p50 (ms)", p50(floor)))
    if out[1:]:
        out.append(entry("seq 16 c=1: server p50 (ms)", server))
        out.append(entry("seq 16 c=1: in-process call (ms)", call_ms))
    return out


def mixed(rows: list[Row], pinned: bool = True) -> list[Row]:
    default = measured(find(rows, group="mixed", name=GROUPING_ON, pinned=pinned))
    # Grouping on against off at the same, loose, padding bound.
    on = measured(find(rows, group="mixed", name=GROUPING_ON_LOOSE, pinned=pinned))
    off = find(rows, group="mixed", name=GROUPING_OFF, pinned=pinned)
    # A server without --length-grouping ran the fallback (still sorted by length): say so.
    off_name = "off (first-come)"
    if off is None and find(rows, group="mixed", name=GROUPING_OFF_FALLBACK, pinned=pinned):
        off = find(rows, group="mixed", name=GROUPING_OFF_FALLBACK, pinned=pinned)
        off_name = "pad 1.0 (fallback)"
    off = measured(off)
    limit = measured(find(rows, group="mixed", target="in-process", seq=MIXED, pinned=pinned))
    value = ratio(seq_per_s(default), seq_per_s(limit))
    out = [
        entry(f"mixed: grouping on / {off_name}", ratio(seq_per_s(on), seq_per_s(off))),
        entry("mixed: server / best in-process way", value, ">= 0.75", at_least(value, 0.75)),
    ]
    if on is not None:
        out.append(
            entry("mixed: padding bound auto / 0.5", ratio(seq_per_s(default), seq_per_s(on)))
        )
    pad_on, pad_off = (_padding(row) for row in (on, off))
    pad = ratio(pad_on, pad_off)
    out.append(
        entry(
            f"mixed: padding ratio on / {off_name}",
            pad,
            "<= 0.5",
            None if pad is None else pad <= 0.5,
        )
    )
    return out


def _padding(row: Row | None) -> float | None:
    metrics = (row or {}).get("server_metrics") or {}
    return metrics.get("mean_padding_ratio")


def weights(rows: list[Row], unary: str, pinned: bool = True) -> list[Row]:
    with_weights = measured(find(rows, group="weights", target="server", pinned=pinned))
    none = measured(
        find(rows, group="headline", target="server", api=unary, seq="128", pinned=pinned)
    )
    return [
        entry("seq 128: weights / none (seq/s)", ratio(seq_per_s(with_weights), seq_per_s(none)))
    ]


def unpinned(rows: list[Row]) -> list[Row]:
    out = []
    for seq in SEQS:
        limit = measured(find(rows, group="unpinned", target="in-process", seq=seq))
        for frontends in FRONTENDS:
            server = measured(find(rows, group="unpinned", name=unpinned_name(frontends), seq=seq))
            out.append(
                entry(
                    f"unpinned seq {seq} --frontends {frontends}: server / in-process",
                    ratio(seq_per_s(server), seq_per_s(limit)),
                )
            )
        one, two = (
            measured(find(rows, group="unpinned", name=unpinned_name(n), seq=seq))
            for n in FRONTENDS
        )
        for frontends in FRONTENDS:
            label = f"unpinned seq {seq} --frontends {frontends}"
            echo_name = unpinned_h2load_name(frontends, "echo")
            echo = find(rows, group="unpinned", name=echo_name, seq=seq)
            server = find(rows, group="unpinned", name=unpinned_h2load_name(frontends), seq=seq)
            if echo is None and server is None:
                continue  # run without h2load
            ceiling = find(
                rows, group="unpinned", target="ceiling", seq=seq, name=ceiling_name(echo_name)
            )
            h2load_server = seq_per_s(measured(server))
            out += [
                entry(f"{label}: h2load, echo floor req/s", seq_per_s(measured(echo))),
                entry(
                    f"{label}: h2load, server / in-process", ratio(h2load_server, seq_per_s(limit))
                ),
                entry(
                    f"{label}: h2load, server / ceiling", ratio(h2load_server, seq_per_s(ceiling))
                ),
            ]
        value = ratio(seq_per_s(two), seq_per_s(one))
        goal = seq == SEQS[0]  # the target is stated at seq 16
        out.append(
            entry(
                f"unpinned seq {seq}: --frontends 2 / --frontends 1",
                value,
                "> 1.0" if goal else "",
                (None if value is None else value > 1.0) if goal else None,
            )
        )
    return out


# The performance targets against each peer, by sequence length (our server's mixed row is the
# mixed group's "grouping on").
PEER_GOALS = {"triton": {"16": 1.3, "128": 1.3, MIXED: 1.5}, "mlserver": {"16": 3.0, "128": 3.0}}


def best_peer(rows: list[Row], seq: str, target: str | None = None) -> Row | None:
    """The peer configuration (of one kind, if given) with the most sequences/s here."""
    peers = [
        r
        for r in rows
        if r["group"] == "peers"
        and r["seq"] == seq
        and (target is None or r["target"] == target)
        and measured(r)
        and r.get("sequences_per_s")
    ]
    return max(peers, key=lambda r: r["sequences_per_s"], default=None)


def our_server(rows: list[Row], unary: str, seq: str, pinned: bool) -> Row | None:
    if seq == MIXED:
        return measured(find(rows, group="mixed", name=GROUPING_ON, pinned=pinned))
    return measured(
        find(
            rows, group="headline", target="server", api=unary, seq=seq, load="c=64", pinned=pinned
        )
    ) or measured(find(rows, group="headline", target="server", api=unary, seq=seq, pinned=pinned))


def peers(rows: list[Row], unary: str, pinned: bool = True) -> list[Row]:
    out = []
    for target, goals in PEER_GOALS.items():
        for seq, goal in goals.items():
            server = our_server(rows, unary, seq, pinned)
            peer = best_peer(rows, seq, target)
            value = ratio(seq_per_s(server), seq_per_s(peer))
            label = f"seq {seq}" if seq != MIXED else "mixed"
            name = f"{label}: server / {peer['name'] if peer else target} (seq/s)"
            out.append(entry(name, value, f">= {goal}", at_least(value, goal)))
            p99 = ratio((server or {}).get("p99_ms"), (peer or {}).get("p99_ms"))
            strict = target == "triton" and seq != MIXED  # "p99 no worse than Triton's"
            out.append(
                entry(
                    f"{label}: server p99 / {target} p99",
                    p99,
                    "<= 1.0" if strict else "",
                    (None if p99 is None else p99 <= 1.0) if strict else None,
                )
            )
    return out


def head_to_head(rows: list[Row]) -> list[Row]:
    """Our server / Triton from windows next to each other (bench/peers/triton.py), paired by
    round: the median of the rounds' ratios, their range in the name. Printed when the
    rounds did not run too ("not measured"); a verdict only when every round gave a pair."""
    by_round = {
        (r["target"], r["seq"], round_of(r["name"])): r for r in rows if r["group"] == HEAD_TO_HEAD
    }
    out = []
    for seq, goal in PEER_GOALS["triton"].items():
        ratios = []
        for (target, row_seq, round_), ours in by_round.items():
            if target != "server" or row_seq != seq:
                continue
            peer = by_round.get(("triton", seq, round_))
            value = ratio(seq_per_s(measured(ours)), seq_per_s(measured(peer)))
            if value is not None:
                ratios.append(value)
        label = f"seq {seq}" if seq != MIXED else "mixed"
        value = statistics.median(ratios) if ratios else None
        spread = f"{min(ratios):.2f}..{max(ratios):.2f}" if ratios else "none"
        name = f"{label}: server / triton, side by side ({len(ratios)} rounds {spread})"
        complete = len(ratios) >= HEAD_TO_HEAD_ROUNDS
        out.append(entry(name, value, f">= {goal}", at_least(value, goal) if complete else None))
    return out


def open_loop(rows: list[Row], pinned: bool = True) -> list[Row]:
    """Each open-loop rate: what the load generator rejected itself (at --max-outstanding)
    apart from what the server failed (a gRPC status other than OK)."""
    out = []
    for row in rows:
        if row["group"] != "open" or row.get("pinned") != pinned:
            continue
        if failed(row):
            out.append(entry(f"open {row['name']}: not measured (run failed)", None))
            continue
        server_failed = sum((row.get("errors") or {}).values())
        out.append(entry(f"open {row['name']}: p99 ms", row.get("p99_ms")))
        out.append(
            entry(f"open {row['name']}: rejected by load generator", row.get("rejected") or 0)
        )
        out.append(entry(f"open {row['name']}: failed by server", server_failed))
    return out


def frontend_us(row: Row | None) -> float | None:
    """The front ends' CPU per request of a row (None where it has none)."""
    return process_cpu_us(row)[0] if row else None


def protocols(rows: list[Row], unary: str, pinned: bool = True) -> list[Row]:
    """HTTP/REST beside gRPC (throughput, front-end CPU per request), and what tracing every
    request costs."""

    def server(api: str, seq: str, name: str = "server") -> Row | None:
        return measured(
            find(
                rows,
                group="headline",
                target="server",
                name=name,
                api=api,
                seq=seq,
                load="c=64",
                pinned=pinned,
            )
        )

    out = []
    if family(unary) == "v2":
        for seq in SEQS:
            rest, grpc_row = server(REST, seq), server(unary, seq)
            out.append(
                entry(
                    f"seq {seq}: REST / gRPC (seq/s)", ratio(seq_per_s(rest), seq_per_s(grpc_row))
                )
            )
            out.append(
                entry(
                    f"seq {seq}: REST / gRPC front-end CPU per request",
                    ratio(frontend_us(rest), frontend_us(grpc_row)),
                )
            )
    for seq in SEQS:
        floor = measured(
            find(
                rows,
                group="headline",
                name=GRPC_FLOOR,
                api=unary,
                seq=seq,
                load="c=64",
                pinned=pinned,
            )
        )
        echo = measured(
            find(
                rows, group="headline", name="echo", api=unary, seq=seq, load="c=64", pinned=pinned
            )
        )
        floor_ms = floor.get("server_cpu_ms_per_request") if floor else None
        floor_us = None if floor_ms is None else floor_ms * 1000
        out.append(
            entry(
                f"seq {seq}: echo front end / bare gRPC server, CPU per request",
                ratio(frontend_us(echo), floor_us),
            )
        )
        out.append(entry(f"seq {seq}: bare gRPC server (seq/s)", seq_per_s(floor)))
    for seq in SEQS:
        plain = seq_per_s(server(unary, seq))
        for name, goal in ((TRACING_SAMPLED, 0.9), (TRACING_ON, 0.6)):
            value = ratio(seq_per_s(server(unary, seq, name)), plain)
            out.append(
                entry(
                    f"seq {seq}: {name} / tracing off (seq/s)",
                    value,
                    f">= {goal}",
                    at_least(value, goal),
                )
            )
    return out


def shared_memory(rows: list[Row], pinned: bool = True) -> list[Row]:
    """Client shared memory: against in-process ONNX Runtime and against the same server with
    the tensors in the message; Triton's shared-memory path beside it."""
    out = []
    for seq in SEQS:
        limit = measured(find(rows, group="headline", target="in-process", seq=seq, pinned=pinned))

        def row(target: str, api: str, seq: str = seq) -> Row | None:
            found = [
                r
                for r in rows
                if r["group"] == "shm"
                and r["target"] == target
                and r["api"] == api
                and r["seq"] == seq
                and r.get("pinned") == pinned
                and measured(r)
            ]
            return max(found, key=lambda r: r.get("sequences_per_s") or 0, default=None)

        shm, wire, triton = row("server", SHM), row("server", "v2"), row("triton", SHM)
        value = ratio(seq_per_s(shm), seq_per_s(limit))
        out.append(
            entry(f"seq {seq} shm: server / in-process", value, ">= 0.9", at_least(value, 0.9))
        )
        out.append(
            entry(f"seq {seq}: shm / message (seq/s)", ratio(seq_per_s(shm), seq_per_s(wire)))
        )
        for label, each in (("shm", shm), ("message", wire), ("triton shm", triton)):
            cpu = (each or {}).get("server_cpu_ms_per_request")
            out.append(
                entry(
                    f"seq {seq} {label}: server CPU us per request",
                    None if cpu is None else cpu * 1000,
                )
            )
        out.append(
            entry(
                f"seq {seq} shm: server / {triton['name'] if triton else 'triton'}",
                ratio(seq_per_s(shm), seq_per_s(triton)),
            )
        )
    return out


def all_ratios(rows: list[Row], unary: str, groups: set[str], pinned: bool = True) -> list[Row]:
    """Every section the groups asked for, from rows of the run's pinning mode (pinned=False
    for a run that was unpinned, by --no-pin or for want of taskset)."""
    sections: dict[str, Any] = {
        "headline": lambda: headline(rows, unary, pinned) + protocols(rows, unary, pinned),
        "batching": lambda: batching(rows, unary, pinned),
        "mixed": lambda: mixed(rows, pinned),
        "weights": lambda: weights(rows, unary, pinned),
        "open": lambda: open_loop(rows, pinned),
        "shm": lambda: shared_memory(rows, pinned),
        "unpinned": lambda: unpinned(rows),
        "peers": lambda: peers(rows, unary, pinned) + head_to_head(rows),
        H2LOAD: lambda: h2load_report.section(rows, pinned, peers="peers" in groups),
    }
    found = [item for name, make in sections.items() if name in groups for item in make()]
    if "headline" in groups and "batching" not in groups:
        found += one_caller(rows, pinned)
    return found


def targets(entries: list[Row]) -> list[Row]:
    """The entries that state one of the performance targets, for the "Targets" block."""
    return [item for item in entries if item["target"]]


def format_ratios(entries: list[Row]) -> str:
    lines = []
    for item in entries:
        missing = item["value"] is None or math.isnan(item["value"])
        if missing:
            value = "-"
        elif isinstance(item["value"], int):  # a count
            value = str(item["value"])
        else:
            value = f"{item['value']:.2f}"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[item["met"]]
        goal = f"(target {item['target']}: {verdict})" if item["target"] else ""
        lines.append(f"  {item['name']:<62} {value:>8}  {goal}")
    return "\n".join(lines)
