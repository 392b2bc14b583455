"""CPU seconds a process (and its live descendants) has used, from /proc/PID/stat."""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def parse_stat(text: str, ticks_per_s: float) -> tuple[int, float]:
    """(parent pid, utime + stime seconds) from one /proc/PID/stat line.

    The command name (field 2) may hold spaces and parentheses, so fields are counted from
    the last ')'."""
    fields = text[text.rindex(")") + 2 :].split()
    # After the name: state(3) ppid(4) ... utime(14) stime(15), here shifted by 3.
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks_per_s


def _ticks() -> float:
    return float(os.sysconf("SC_CLK_TCK"))


def process_cpu_s(pid: int) -> float:
    """utime + stime of one process, in seconds."""
    return parse_stat((PROC / str(pid) / "stat").read_text(), _ticks())[1]


def family_cpu_s(pid: int, proc: Path = PROC) -> dict[int, float]:
    """utime + stime seconds of pid and of each live descendant, by pid, from one pass over
    proc (a /proc, or a fake one in tests). Exited children are not counted; the servers
    measured here keep theirs alive."""
    ticks = _ticks()
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)], used[int(entry.name)] = parse_stat(
                (entry / "stat").read_text(), ticks
            )
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    family = {pid}
    grew = True
    while grew:
        grew = False
        for child, parent in parents.items():
            if parent in family and child not in family:
                family.add(child)
                grew = True
    return {member: used[member] for member in family if member in used}


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of pid and every live descendant (a server with worker processes)."""
    return sum(family_cpu_s(pid).values())


def by_process(
    before: dict[int, float], after: dict[int, float], roles: dict[str, int], root: int
) -> dict[str, float]:
    """CPU seconds each named process used between two family_cpu_s snapshots: the roles
    (worker, frontend-0, ..), "supervisor" (root) and "other" (every other descendant, e.g.
    multiprocessing's resource tracker, or a peer's own children). A process born inside the
    window counts from zero; one gone by its end is left out of every figure."""

    def used(pid: int) -> float:
        return max(0.0, after[pid] - before.get(pid, 0.0))

    named = {role: pid for role, pid in roles.items() if pid != root}
    found = {role: used(pid) for role, pid in named.items() if pid in after}
    if root in after:
        found["supervisor"] = used(root)
    rest = set(after) - set(named.values()) - {root}
    found["other"] = sum(used(pid) for pid in rest)
    return found


def thread_cpu_s(pid: int, proc: Path = PROC) -> dict[int, tuple[str, float]]:
    """Each live thread of pid: {tid: (name, utime + stime seconds)}, from /proc/PID/task/*/stat;
    empty when pid is gone. The name is the thread's comm (gRPC and ONNX Runtime name theirs)."""
    ticks = _ticks()
    found = {}
    try:
        entries = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return {}
    for entry in entries:
        try:
            text = (entry / "stat").read_text()
            found[int(entry.name)] = (
                text[text.index("(") + 1 : text.rindex(")")],
                parse_stat(text, ticks)[1],
            )
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return found


def by_thread(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], pid: int
) -> dict[str, float]:
    """CPU seconds used between two thread_cpu_s snapshots of pid, by thread name summed; the
    main thread (tid = pid: the event loop of our processes) as "main". Threads gone by the
    end are left out; ones born inside the window count from zero."""
    used: dict[str, float] = {}
    for tid, (name, cpu_s) in after.items():
        key = "main" if tid == pid else name
        used[key] = used.get(key, 0.0) + max(0.0, cpu_s - before.get(tid, (name, 0.0))[1])
    return used


def available() -> bool:
    return (PROC / "self" / "stat").exists()
