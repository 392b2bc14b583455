"""Which measurements a run makes, grouped so each server configuration starts once."""

from __future__ import annotations

import functools
from collections.abc import Callable

from bench.launcher import UNPINNED
from bench.report import MIXED, SEQS
from bench.runner import Runner, log

GROUPS = ("headline", "batching", "mixed", "weights", "open", "unpinned", "peers")
STANDARD = tuple(g for g in GROUPS if g != "peers")
OPEN_FRACTIONS = (0.5, 0.8, 1.0, 1.2)
BATCHING_CONCURRENCY = (1, 16)  # and the headline concurrency, measured in "headline"


def limits(r: Runner, groups: set[str]) -> None:
    """In-process limits, pinned as the server is."""
    pinning = r.config.pinning
    if groups & {"headline", "batching", "weights", "open", "peers"}:
        for seq in SEQS:
            r.inprocess(group="headline", seq=seq, pinning=pinning)
    if "weights" in groups:
        r.inprocess(group="weights", seq="128", pinning=pinning, weights=True)
    if "mixed" in groups:
        r.inprocess(group="mixed", seq=MIXED, pinning=pinning)


def echo(r: Runner, groups: set[str]) -> None:
    """The protocol floor for each API the headline measures."""
    if "headline" not in groups:
        return
    unary = r.config.api
    with r.echo(r.config.pinning) as service:
        for seq in SEQS:
            for api in (unary, f"{unary}_stream"):
                r.load(
                    service,
                    group="headline",
                    target="echo",
                    name="echo",
                    api=api,
                    seq=seq,
                    pinning=r.config.pinning,
                )


def default_server(r: Runner, groups: set[str]) -> None:
    """Everything measured against the server with its default flags (batching on)."""
    if not groups & {"headline", "batching", "mixed", "weights", "open", "peers"}:
        return
    pinning, unary = r.config.pinning, r.config.api
    with r.server("batching on", [], pinning) as service:
        load = functools.partial(r.load, service, target="server", pinning=pinning, api=unary)
        capacity = 0.0
        for seq in SEQS:
            if groups & {"headline", "batching", "weights", "open", "peers"}:
                row = load(group="headline", name="server", seq=seq)
                capacity = capacity or float(row["requests_per_s"])  # seq 16 comes first
            if "headline" in groups:
                load(group="headline", name="server", seq=seq, api=f"{unary}_stream")
            if "batching" in groups:
                for concurrency in BATCHING_CONCURRENCY:
                    load(group="batching", name="batching on", seq=seq, concurrency=concurrency)
        if "mixed" in groups:
            load(group="mixed", name="grouping on", seq=MIXED)
        if "weights" in groups:
            load(group="weights", name="weights", seq="128", weights=1.0)
        if "open" in groups:
            open_loop(load, capacity)


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
        with r.server("grouping off", ["--max-padding-ratio", "1.0"], pinning) as service:
            r.load(
                service,
                group="mixed",
                target="server",
                name="grouping off",
                api=unary,
                seq=MIXED,
                pinning=pinning,
            )
    if "unpinned" in groups:
        for seq in SEQS:
            r.inprocess(group="unpinned", seq=seq, pinning=UNPINNED)
        with r.server("unpinned", [], UNPINNED) as service:
            for seq in SEQS:
                r.load(
                    service,
                    group="unpinned",
                    target="server",
                    name="server unpinned",
                    api=unary,
                    seq=seq,
                    pinning=UNPINNED,
                )


def run(r: Runner, groups: set[str]) -> None:
    limits(r, groups)
    echo(r, groups)
    default_server(r, groups)
    other_servers(r, groups)
    if "peers" in groups:
        from bench.peers import mlserver  # its own virtualenv; imported only when asked

        mlserver.run(r)
