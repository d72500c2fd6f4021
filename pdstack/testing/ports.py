"""Test support: the one place tests get a free TCP port.

``bind(("127.0.0.1", 0))`` hands out a port from the kernel's ephemeral range, the same range
every outgoing connection and every ``get_open_port()`` inside vLLM draws from. A port found
free that way and handed to an engine seconds later is regularly taken by then (CI, 2026-12-02:
vLLM's NIXL handshake listener died with "Address already in use" on such a port and the
engine never became ready). So ports come from below the ephemeral range, where the kernel
never hands anything out by itself, and each one is claimed machine-wide (a file created
with O_EXCL under ``CLAIMS``) so that two pytest-xdist workers never get the same port.
Claims older than ``CLAIM_TTL_S`` are stale (a killed run) and are taken over.
"""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

CLAIMS = Path(os.environ.get("PDSTACK_PORT_CLAIMS", "/tmp/pdstack-port-claims"))
CLAIM_TTL_S = 3 * 3600
FLOOR = 20000  # below: well-known services a test machine may run
DEFAULT_EPHEMERAL = (32768, 60999)


def ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def _candidates() -> tuple[int, int]:
    lo, hi = ephemeral_range()
    if lo - FLOOR >= 2000:
        return FLOOR, lo - 1
    return hi + 1, 65535  # an unusual range set low: use the ports above it


def _bindable(port: int) -> bool:
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def _claim(port: int) -> bool:
    CLAIMS.mkdir(parents=True, exist_ok=True)
    path = CLAIMS / str(port)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        try:
            if time.time() - path.stat().st_mtime < CLAIM_TTL_S:
                return False
            path.unlink()
        except OSError:
            return False
        return _claim(port)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def free_port() -> int:
    """A TCP port nothing listens on, outside the ephemeral range, claimed for this run."""
    lo, hi = _candidates()
    rng = random.Random()
    for _ in range(500):
        port = rng.randint(lo, hi)
        if _bindable(port) and _claim(port):
            return port
    raise RuntimeError(f"no free TCP port in {lo}-{hi} after 500 tries ({CLAIMS})")
