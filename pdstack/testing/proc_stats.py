"""Test support (not a test double): what processes cost, read from ``/proc``, for the
benchmarks that report it (benchmarks/proxy_overhead.py, benchmarks/standby_takeover.py)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the command name (field 3 on: state, ppid, ...); None when
    the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(pid: int) -> list[int]:
    """pid and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_seconds(pids: Iterable[int]) -> float:
    """user + system CPU seconds of ``pids`` (all their threads); a process gone counts 0."""
    total = 0
    for pid in pids:
        if (fields := _stat_fields(pid)) is not None:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLK_TCK
