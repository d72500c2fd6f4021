"""The CPU stack's LMCache data port (ZMQ: STORE, RETRIEVE, CLEAR ... no credentials) is reached
only by the node's engines (issue 54): LMCache listens on no TCP port; from the proxy's and the
metrics gate's containers and from an unprivileged host process a connection to its old port
is refused and its socket is absent or closed; from an engine's container the socket connects
(and the engines use it: the stack's LMCache tests read KV through it)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from pdstack import sidecars

from .test_compose_cpu import (  # the stack's helpers (its fixture, cpu_stack: conftest.py)
    _compose_services,
    _container,
    _lmcache_listeners,
)

pytestmark = pytest.mark.docker

PROBE = """
import json, socket, sys
port, path = int(sys.argv[1]), sys.argv[2]
out = {}
try:
    socket.create_connection(('127.0.0.1', port), 5).close()
    out['tcp'] = 'connected'
except OSError as exc:
    out['tcp'] = type(exc).__name__
try:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(path)
    s.close()
    out['socket'] = 'connected'
except OSError as exc:
    out['socket'] = type(exc).__name__
print(json.dumps(out))
"""


def test_only_engines_reach_lmcaches_data_socket(cpu_stack: dict[str, float]) -> None:
    services = _compose_services()
    cmd = services["lmcache"]["command"]
    port = cmd[cmd.index("--port") + 1]
    path = f"{sidecars.LMCACHE_DATA_SOCKET}:{port}"
    assert _lmcache_listeners() == set()
    got = {}
    for svc in ("decode-0", "prefill-0", "proxy", "lmcache-metrics"):
        run = subprocess.run(["docker", "exec", _container(svc), "python3", "-c", PROBE,
                              port, path], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, (svc, run.stderr[-2000:])
        got[svc] = json.loads(run.stdout)
    mounts = json.loads(subprocess.run(
        ["docker", "inspect", "-f", "{{json .Mounts}}", _container("lmcache")],
        capture_output=True, text=True, timeout=60, check=True).stdout)
    folder = next(m["Source"] for m in mounts
                  if m["Destination"] == str(Path(sidecars.LMCACHE_DATA_SOCKET).parent))
    host = subprocess.run(["/usr/bin/python3", "-c", PROBE, port,
                           str(Path(folder) / Path(path).name)],
                          capture_output=True, text=True, timeout=60, user=65534)
    assert host.returncode == 0, host.stderr
    got["host (nobody)"] = json.loads(host.stdout)
    print(f"\n[lmcache data] {got}")
    for where, res in got.items():
        assert res["tcp"] == "ConnectionRefusedError", (where, res)
    for svc in ("decode-0", "prefill-0"):
        assert got[svc]["socket"] == "connected", got
    for svc in ("proxy", "lmcache-metrics"):
        assert got[svc]["socket"] == "FileNotFoundError", got
    assert got["host (nobody)"]["socket"] == "PermissionError", got
