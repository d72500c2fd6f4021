"""Health of ``pdstack launch``'s services: a service's check, waiting for a stage to pass
it while its processes are watched, and the last lines of a log for the reason."""

from __future__ import annotations

import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from subprocess import Popen
from urllib.parse import urlparse

from pdstack.launch.prepare import Prepared

TAIL_LINES = 40


def check_health(url: str | None, timeout: float = 3.0) -> bool:
    """``tcp://host:port``: the port accepts connections; ``http(s)://``: answers 200."""
    if not url:
        return True
    parsed = urlparse(url)
    if parsed.scheme == "tcp":
        try:
            with socket.create_connection((parsed.hostname or "", parsed.port or 0), timeout):
                return True
        except OSError:
            return False
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(data.splitlines()[-lines:])


def wait_healthy(stage: list[Prepared], children: Mapping[str, Popen[bytes]],
                 timeout: float, say: Callable[[str], None]) -> Prepared | None:
    """Wait until every service of ``stage`` is healthy; the first whose process (in
    ``children``) exits, or that times out, is returned (None = all healthy)."""
    pending = {p.name: p for p in stage}
    t0 = time.monotonic()
    while pending:
        for name, p in list(pending.items()):
            proc = children.get(name)
            if proc is not None and proc.poll() is not None:
                say(f"{name} exited with code {proc.returncode} while starting; "
                    f"last lines of {p.log}:\n{tail(p.log)}")
                return p
            if check_health(p.service.healthcheck_url, timeout=2.0):
                say(f"{name} healthy after {time.monotonic() - t0:.1f} s "
                    f"({p.service.healthcheck_url})")
                del pending[name]
        if not pending:
            break
        if time.monotonic() - t0 > timeout:
            p = next(iter(pending.values()))
            say(f"{', '.join(pending)} not healthy after {timeout:.0f} s; "
                f"last lines of {p.log}:\n{tail(p.log)}")
            return p
        time.sleep(0.5)
    return None
