"""The ratios the issue's targets are stated in, each from rows of the same run."""

from __future__ import annotations

import math
from typing import Any

from bench.report import MIXED, SEQS, Row, find, seq_per_s
from bench.stats import ratio


def entry(name: str, value: float | None, target: str = "", met: bool | None = None) -> Row:
    return {"name": name, "value": value, "target": target, "met": met}


def at_least(value: float | None, goal: float) -> bool | None:
    return None if value is None else value >= goal


def headline(rows: list[Row], unary: str) -> list[Row]:
    out = []
    for seq in SEQS:
        limit = find(rows, group="headline", target="in-process", seq=seq, pinned=True)
        for api in (unary, f"{unary}_stream"):
            server = find(rows, group="headline", target="server", api=api, seq=seq)
            ceiling = find(rows, target="ceiling", api=api, seq=seq, pinned=True)
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
            echo = find(rows, target="echo", api=api, seq=seq, pinned=True)
            if echo and echo.get("requests"):
                out.append(
                    entry(
                        f"seq {seq} {api}: echo server CPU us per request",
                        echo["server_cpu_ms_per_request"] * 1000,
                    )
                )
            if server and limit and server.get("server_cpu_ms_per_sequence") is not None:
                out.append(
                    entry(
                        f"seq {seq} {api}: server CPU / in-process CPU per sequence",
                        ratio(
                            server["server_cpu_ms_per_sequence"], 1000 / limit["sequences_per_s"]
                        ),
                    )
                )
    return out


def batching(rows: list[Row], unary: str) -> list[Row]:
    out = []
    for seq in SEQS:
        for load in ("c=1", "c=16", "c=64"):
            on = (
                find(rows, group="headline", target="server", api=unary, seq=seq, load=load)
                if load == "c=64"
                else find(rows, group="batching", name="batching on", seq=seq, load=load)
            )
            off = find(rows, group="batching", name="batching off", seq=seq, load=load)
            value = ratio(seq_per_s(on), seq_per_s(off))
            out.append(
                entry(f"seq {seq} {load}: batching on / off", value, ">= 1.0", at_least(value, 1.0))
            )
    c1 = find(rows, group="batching", name="batching on", seq="16", load="c=1")
    limit = find(rows, group="headline", target="in-process", seq="16", pinned=True)
    if c1 and limit:
        first = limit["points"][0]["ms_per_batch"]  # batch size 1: one call
        extra = c1["p50_ms"] - first
        out.append(
            entry("seq 16 c=1: server p50 - in-process call (ms)", extra, "<= 0.5", extra <= 0.5)
        )
    return out


def mixed(rows: list[Row]) -> list[Row]:
    on = find(rows, group="mixed", name="grouping on")
    off = find(rows, group="mixed", name="grouping off")
    limit = find(rows, group="mixed", target="in-process", seq=MIXED)
    value = ratio(seq_per_s(on), seq_per_s(limit))
    out = [
        entry("mixed: grouping on / off", ratio(seq_per_s(on), seq_per_s(off))),
        entry("mixed: server / best in-process way", value, ">= 0.75", at_least(value, 0.75)),
    ]
    pad_on, pad_off = (_padding(row) for row in (on, off))
    pad = ratio(pad_on, pad_off)
    out.append(
        entry("mixed: padding ratio on / off", pad, "<= 0.5", None if pad is None else pad <= 0.5)
    )
    return out


def _padding(row: Row | None) -> float | None:
    metrics = (row or {}).get("server_metrics") or {}
    return metrics.get("mean_padding_ratio")


def weights(rows: list[Row], unary: str) -> list[Row]:
    with_weights = find(rows, group="weights", target="server")
    none = find(rows, group="headline", target="server", api=unary, seq="128")
    return [
        entry("seq 128: weights / none (seq/s)", ratio(seq_per_s(with_weights), seq_per_s(none)))
    ]


def unpinned(rows: list[Row]) -> list[Row]:
    out = []
    for seq in SEQS:
        server = find(rows, group="unpinned", target="server", seq=seq)
        limit = find(rows, group="unpinned", target="in-process", seq=seq)
        out.append(
            entry(
                f"unpinned seq {seq}: server / in-process",
                ratio(seq_per_s(server), seq_per_s(limit)),
            )
        )
    return out


def best_peer(rows: list[Row], seq: str) -> Row | None:
    """The peer configuration with the most sequences/s at this length."""
    peers = [r for r in rows if r["group"] == "peers" and r["seq"] == seq]
    return max(peers, key=lambda r: r["sequences_per_s"], default=None)


def peers(rows: list[Row], unary: str) -> list[Row]:
    out = []
    goals = {"16": 2.8, "128": 3.0}
    for seq in SEQS:
        server = find(rows, group="headline", target="server", api=unary, seq=seq)
        peer = best_peer(rows, seq)
        value = ratio(seq_per_s(server), seq_per_s(peer))
        name = f"seq {seq}: server / {peer['name'] if peer else 'peer'} (seq/s)"
        out.append(entry(name, value, f">= {goals[seq]}", at_least(value, goals[seq])))
        p99 = ratio(server and server.get("p99_ms"), peer and peer.get("p99_ms"))
        out.append(
            entry(
                f"seq {seq}: server p99 / peer p99",
                p99,
                "< 1.0",
                None if p99 is None else p99 < 1.0,
            )
        )
    return out


def all_ratios(rows: list[Row], unary: str, groups: set[str]) -> list[Row]:
    sections: dict[str, Any] = {
        "headline": lambda: headline(rows, unary),
        "batching": lambda: batching(rows, unary),
        "mixed": lambda: mixed(rows),
        "weights": lambda: weights(rows, unary),
        "unpinned": lambda: unpinned(rows),
        "peers": lambda: peers(rows, unary),
    }
    return [item for name, make in sections.items() if name in groups for item in make()]


def format_ratios(entries: list[Row]) -> str:
    lines = []
    for item in entries:
        missing = item["value"] is None or math.isnan(item["value"])
        value = "-" if missing else f"{item['value']:.2f}"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[item["met"]]
        goal = f"(target {item['target']}: {verdict})" if item["target"] else ""
        lines.append(f"  {item['name']:<62} {value:>8}  {goal}")
    return "\n".join(lines)
