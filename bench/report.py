"""The one table and the ratios, computed from the rows of one run (pure: rows in, text out)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from bench.stats import stack_ceiling

Row = dict[str, Any]
SEQS = ("16", "128")
MIXED = "uniform:16:256"
# Names of the mixed-lengths server rows (the ratios find them by these).
GROUPING_ON = "grouping on"
# Grouping on and off compared at one loose padding bound (a GPU's auto), where grouping
# decides how much is padded: at a CPU's auto bound (0.05) both pad almost nothing.
LOOSE_PADDING = ("--max-padding-ratio", "0.5")
GROUPING_ON_LOOSE = "grouping on, pad 0.5"
GROUPING_OFF = "grouping off, pad 0.5"  # --length-grouping off: first-come
# A server without --length-grouping: --max-padding-ratio 1.0, which still sorts by length.
GROUPING_OFF_FALLBACK = "grouping ~off (pad 1.0)"
FRONTENDS = (1, 2)  # --frontends of the unpinned runs
GRPC_FLOOR = "grpc floor"  # a bare grpc.aio server answering with its input (bench/grpc_floor.py)
# A bare Go net/http HTTP/2 server answering likewise (bench/h2floor/): the gateway's floor.
GO_FLOOR = "go http2 floor"
HEAD_TO_HEAD = "rounds"  # group of the rows of our server and Triton measured side by side
# Rounds of it per length; even, so each server goes first as often as the other.
HEAD_TO_HEAD_ROUNDS = 4
ONE_CALLER = "one caller"  # ends the names of the floors' c=1 rows (latencies, not capacities)
TRACING_ON = "tracing on"  # the default server with every request traced and exported
TRACING_SAMPLED = "tracing on, 1% sampled"  # parentbased_traceidratio 0.01
RESTRICTED = "inference key checked"  # --restricted-api inference:..., calls carry the key
# The default server measured in rounds with the features' servers (their ratios' base).
BESIDE_FEATURES = "server, beside the features"
FEATURE_ROUNDS = 2  # servers alternated, so the host's drift lands on every one alike
H2LOAD = "h2load"  # group of the rows measured with h2load (bench/h2load.py)
BESIDE_TRITON = "server, beside triton"  # our h2load rows measured next to Triton's


def unpinned_name(frontends: int, what: str = "server") -> str:
    """The row name of an unpinned run (the ratios find them by it)."""
    return f"{what} --frontends {frontends}"


H2LOAD_SUFFIX = ", h2load"


def unpinned_h2load_name(frontends: int, what: str = "server") -> str:
    """The row name of an unpinned run with h2load as the client."""
    return f"{unpinned_name(frontends, what)}{H2LOAD_SUFFIX}"


def by_h2load(row: Row) -> bool:
    """Whether h2load, not the load generator, was the row's client (its own group's rows,
    and the unpinned group's)."""
    return row["group"] == H2LOAD or row["name"].endswith(H2LOAD_SUFFIX)


def round_name(who: str, round_: int) -> str:
    """A side-by-side row's name: which server, which round (ratios pair rows by round)."""
    return f"{who}, round {round_}"


def round_of(name: str) -> str:
    """The round part of a side-by-side row's name ("round 3")."""
    return name.rpartition(", ")[2]


def one_caller_name(name: str) -> str:
    """The name of a floor's c=1 row, beside its c=64 rows named name."""
    return f"{name}, {ONE_CALLER}"


def find(rows: Iterable[Row], **criteria: Any) -> Row | None:
    """The first row whose fields equal every criterion."""
    return next((r for r in rows if all(r.get(k) == v for k, v in criteria.items())), None)


def seq_per_s(row: Row | None) -> float | None:
    return row.get("sequences_per_s") if row else None


def failed(row: Row | None) -> bool:
    """A row whose run did not finish (its measured keys are None)."""
    return bool(row and row.get("failed"))


def measured(row: Row | None) -> Row | None:
    """The row, or None where its run failed: either way a ratio reads "not measured"."""
    return None if row is None or failed(row) else row


def entry(name: str, value: float | None, target: str = "", met: bool | None = None) -> Row:
    """One line of the ratios block; target (e.g. ">= 1.3") and met for the targets."""
    return {"name": name, "value": value, "target": target, "met": met}


def at_least(value: float | None, goal: float) -> bool | None:
    return None if value is None else value >= goal


def at_most(value: float | None, goal: float) -> bool | None:
    return None if value is None else value <= goal


def ceiling_name(echo_name: str) -> str:
    """The name of the ceiling row made from the echo row of that name."""
    return (
        "stack ceiling" if echo_name == "echo" else f"ceiling ({echo_name.removeprefix('echo ')})"
    )


def ceiling_rows(rows: list[Row]) -> list[Row]:
    """A stack-ceiling row for each echo row that has an in-process limit of the same group
    and pinning beside it (the echo floor's one-caller row is a latency, not a ceiling); an
    echo row measured with h2load gives a ceiling named after it, read against the server's
    h2load rows."""
    made = []
    for echo in (r for r in rows if r["target"] == "echo" and not r["name"].endswith(ONE_CALLER)):
        limit = find(
            rows,
            group=echo["group"],
            target="in-process",
            name="in-process",
            seq=echo["seq"],
            pinned=echo["pinned"],
        )
        if limit is None:
            continue
        both = (seq_per_s(echo), seq_per_s(limit))
        value = None if None in both else stack_ceiling(*both)  # type: ignore[arg-type]
        made.append(
            {
                "group": echo["group"],
                "target": "ceiling",
                "name": ceiling_name(echo["name"]),
                "api": echo["api"],
                "seq": echo["seq"],
                "load": "-",
                "pinned": echo["pinned"],
                "sequences_per_s": value,
            }
        )
    return made


def _num(value: Any, digits: int = 1, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value * scale:.{digits}f}"


def _percent(fraction: Any) -> str:
    text = _num(fraction, 0, 100)
    return text if text == "-" else f"{text}%"


def _server_side(row: Row) -> tuple[Any, Any, Any, Any]:
    """(mean batch, queue ms, compute ms per batch, padding) from /metrics or the responses."""
    metrics = row.get("server_metrics")
    if metrics and metrics.get("batches"):
        return (
            metrics["mean_batch_size"],
            metrics["mean_queue_ms"],
            metrics["mean_compute_ms_per_batch"],
            metrics["mean_padding_ratio"],
        )
    timing = row.get("response_timing")
    if timing:
        sizes = timing["requests_by_batch_size"]
        total = sum(sizes.values())
        mean = sum(int(size) * n for size, n in sizes.items()) / total if total else None
        return mean, timing["mean_queue_ms"], timing["mean_compute_ms"], None
    return None, None, None, None


CONFIG_WIDTH = 33  # "triton b=32 delay=1000us, round 4"
COLUMNS = (
    ("group", 9, "<"),
    ("target", 10, "<"),
    ("config", CONFIG_WIDTH, "<"),
    ("api", 16, "<"),
    ("seq", 14, "<"),
    ("load", 10, "<"),
    ("seq/s", 9, ">"),
    ("p50 ms", 8, ">"),
    ("p99 ms", 8, ">"),
    ("p99.9", 8, ">"),
    ("batch", 6, ">"),
    ("queue", 7, ">"),
    ("compute", 8, ">"),
    ("pad", 5, ">"),
    ("CPU ms/seq", 11, ">"),
    ("fe us/rq", 9, ">"),  # CPU of the front-end processes, summed, per request
    ("wk us/rq", 9, ">"),  # CPU of the worker process per request
    ("lg us/rq", 9, ">"),  # CPU of the load generator per request
    ("err", 6, ">"),  # failed by the server (a gRPC status other than OK)
    ("rej", 6, ">"),  # rejected by the load generator (open loop at --max-outstanding)
    ("client", 7, ">"),
)


def process_cpu_us(row: Row) -> tuple[Any, Any]:
    """(front ends summed, worker) CPU us per request of one of our server's load rows; None
    where the row has no per-process figures (a peer, a failed run)."""
    each = row.get("server_cpu_us_per_request_by_process") or {}
    fronts = [value for role, value in each.items() if role.startswith("frontend-")]
    return (sum(fronts) if fronts else None), each.get("worker")


def _line(cells: Iterable[str]) -> str:
    return " ".join(
        f"{c:{align}{width}}" for c, (_, width, align) in zip(cells, COLUMNS, strict=True)
    )


def _inprocess_lines(row: Row) -> list[list[str]]:
    head = [row["group"], "in-process"]
    if failed(row) or not row.get("best"):
        return [[*head, f"{row['name']} FAILED"[:CONFIG_WIDTH], "-", row["seq"], "-", *["-"] * 15]]
    if "strategies" in row:  # mixed lengths: every way of running them, * on the best
        return [
            [
                *head,
                f"{name}{' *' if name == row['best'] else ''}"[:CONFIG_WIDTH],
                "-",
                row["seq"],
                "-",
                _num(s["sequences_per_s"]),
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                _num(s["padding_ratio"], 2),
                _num(_inprocess_cpu(s, row["threads"]), 3),
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
            ]
            for name, s in row["strategies"].items()
        ]
    best = row["best"]
    cpu = _inprocess_cpu(best, row["threads"])
    return [
        [
            *head,
            f"{row['name']} b={best['batch_size']}",
            "-",
            row["seq"],
            "-",
            _num(best["sequences_per_s"]),
            "-",
            "-",
            "-",
            str(best["batch_size"]),
            "-",
            _num(best["ms_per_batch"], 2),
            "-",
            _num(cpu, 3),
            *["-"] * 6,
        ]
    ]


def _inprocess_cpu(point: Row, threads: int) -> float | None:
    """CPU ms per sequence of an in-process point: measured, or (older results) estimated as
    every thread busy for the whole run."""
    if point.get("cpu_ms_per_sequence") is not None:
        return float(point["cpu_ms_per_sequence"])
    return 1000 / point["sequences_per_s"] * threads if threads else None


def _load_line(row: Row) -> list[str]:
    batch, queue, compute, pad = _server_side(row)
    front, worker = process_cpu_us(row)
    if failed(row):
        errors = rejected = "FAIL"
    else:
        errors = str(sum((row.get("errors") or {}).values()))
        rejected = str(row.get("rejected") or 0)
    return [
        row["group"],
        row["target"],
        row["name"][:CONFIG_WIDTH],
        row["api"],
        row["seq"],
        row["load"],
        _num(row.get("sequences_per_s")),
        _num(row.get("p50_ms"), 2),
        _num(row.get("p99_ms"), 2),
        _num(row.get("p99.9_ms"), 2),
        _num(batch),
        _num(queue, 2),
        _num(compute, 2),
        _num(pad, 2),
        _num(row.get("server_cpu_ms_per_sequence"), 3),
        _num(front, 0),
        _num(worker, 0),
        _num(row.get("client_cpu_us_per_request"), 0),
        errors,
        rejected,
        _percent(row.get("client_cpu_utilization")),
    ]


def format_table(rows: list[Row]) -> str:
    """One line per measurement (in-process mixed runs expand to one line per strategy)."""
    lines = [_line(name for name, _, _ in COLUMNS)]
    for row in rows:
        if row["target"] == "in-process":
            lines += [_line(cells) for cells in _inprocess_lines(row)]
        elif row["target"] == "ceiling":
            lines.append(
                _line(
                    [
                        row["group"],
                        "ceiling",
                        row["name"],
                        row["api"],
                        row["seq"],
                        "-",
                        _num(row["sequences_per_s"]),
                        *["-"] * 14,
                    ]
                )
            )
        else:
            lines.append(_line(_load_line(row)))
    return "\n".join(lines)
