"""Process groups of ``pdstack launch``: /proc reading, pid files, start and signal.

Each service runs in its own process group (``setsid``) and has a pid file
``<log-dir>/<svc>.pid`` (a :class:`PidRecord`) that holds enough to find that group again,
safely: the leader's start time tells a reused pid apart.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from subprocess import DEVNULL, STDOUT, Popen

from pdstack.launch.prepare import Prepared


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, pgrp, start time in clock ticks) of a live process, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    rest = raw[raw.rindex(")") + 2 :].split()
    state, pgrp, start = rest[0], int(rest[2]), int(rest[19])
    return state, pgrp, start


def _alive(pid: int, start_ticks: int | None = None) -> bool:
    st = _proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return start_ticks is None or st[2] == start_ticks


def group_members(pgid: int, not_before_ticks: int = 0) -> list[int]:
    """Live processes of process group ``pgid`` started no earlier than the leader was."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        st = _proc_stat(int(entry.name))
        if st and st[0] not in ("Z", "X") and st[1] == pgid and st[2] >= not_before_ticks:
            out.append(int(entry.name))
    return out


@dataclass
class PidRecord:
    """What ``<svc>.pid`` holds: enough to find the process group again, safely."""

    service: str
    pid: int
    pgid: int
    start_ticks: int
    started_at: float
    log: str

    @classmethod
    def read(cls, path: Path) -> PidRecord | None:
        try:
            data = json.loads(path.read_text())
            return cls(**{k: data[k] for k in cls.__dataclass_fields__})
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None

    def write(self, path: Path) -> None:
        tmp = path.with_suffix(".pid.tmp")
        tmp.write_text(json.dumps(self.__dict__) + "\n")
        os.replace(tmp, path)

    def leader_alive(self) -> bool:
        return _alive(self.pid, self.start_ticks)

    def members(self) -> list[int]:
        return group_members(self.pgid, self.start_ticks)

    def alive(self) -> bool:
        """The leader or any member of its group still runs."""
        return self.leader_alive() or bool(self.members())


def start_process(p: Prepared) -> Popen[bytes]:
    """Start ``p`` in a new session, output appended to its log after a header line, and
    write its pid file."""
    with p.log.open("ab") as log:
        header = (
            f"=== pdstack launch {time.strftime('%Y-%m-%dT%H:%M:%S%z')} "
            f"{p.name}: {' '.join(p.argv)}\n"
        )
        log.write(header.encode())
        log.flush()
        proc = Popen(
            p.argv,
            env=p.env,
            stdin=DEVNULL,
            stdout=log,
            stderr=STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    st = _proc_stat(proc.pid)
    PidRecord(
        service=p.name,
        pid=proc.pid,
        pgid=proc.pid,
        start_ticks=st[2] if st else 0,
        started_at=time.time(),
        log=str(p.log),
    ).write(p.pidfile)
    return proc


def kill_group(rec: PidRecord, sig: signal.Signals) -> None:
    """``sig`` to the record's process group; with its leader gone, to its members only."""
    if rec.leader_alive():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(rec.pgid, sig)
        return
    # leader gone (pgid may be reused only by a new session): signal our members only
    for pid in rec.members():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
