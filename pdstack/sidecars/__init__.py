"""pdstack's sidecars: small standard-library programs the rendered stacks run in the engine
image (which has Python), each a module of this package run with ``python3 -m``:

- :mod:`pdstack.sidecars.watchdog` is an engine's container healthcheck: ``/health`` must
  pass, and the engine must make progress while it holds requests; a wedged engine's
  container is ended (its restart policy starts it again). ``pdstack launch`` runs it in its
  ``dry`` mode (it reports; the launcher restarts).
- :mod:`pdstack.sidecars.lmcache_socket` runs ``lmcache server`` with its unauthenticated HTTP
  API on a unix socket, not a TCP port (and, in the Compose stacks, its data port too).
- :mod:`pdstack.sidecars.metrics_gate` serves ``GET /metrics`` of that API, and nothing else,
  on an address Prometheus reaches.

The Compose stacks mount this package read-only at ``/opt/pdstack/pdstack`` with
``PYTHONPATH=/opt/pdstack`` (pdstack/render.py); this module (stdlib only) holds what the
planner, the renderer and ``pdstack launch`` need to know about them: their commands, paths
and settings.
"""

from __future__ import annotations

import json
from pathlib import Path

WATCHDOG = "pdstack.sidecars.watchdog"
LMCACHE_SOCKET = "pdstack.sidecars.lmcache_socket"
METRICS_GATE = "pdstack.sidecars.metrics_gate"

# what the containers run from pdstack, relative to the package folder: these programs and the
# vLLM plugins (pdstack/vllm_engine_auth.py, vllm_offload_fix.py, vllm_kv_xfer_fix.py), all
# stdlib (+ vLLM)
PACKAGE = Path(__file__).resolve().parent.parent
CONTAINER_FILES = ("__init__.py", "vllm_engine_auth.py", "vllm_offload_fix.py",
                   "vllm_kv_xfer_fix.py", "sidecars/__init__.py", "sidecars/watchdog.py",
                   "sidecars/lmcache_socket.py", "sidecars/metrics_gate.py")
# the plugins' dist-infos (their vllm.general_plugins entry points), in the package: a folder
# an engine's PYTHONPATH names beside the package's parent, where vLLM's plugin loader finds them
PLUGINS_DIR = "vllm_plugins"
# where the Compose stacks mount the package (read-only), and the PYTHONPATH that finds it
CONTAINER_ROOT = "/opt/pdstack"
CONTAINER_PACKAGE = f"{CONTAINER_ROOT}/pdstack"
CONTAINER_PYTHONPATH = CONTAINER_ROOT
ENGINE_PYTHONPATH = f"{CONTAINER_ROOT}:{CONTAINER_PACKAGE}/{PLUGINS_DIR}"


def container_files() -> dict[str, str]:
    """What the containers need of the package, by path relative to it: a stack that leaves
    this checkout carries these (its ``pdstack/`` folder), one inside it mounts the package."""
    files = {rel: (PACKAGE / rel).read_text() for rel in CONTAINER_FILES}
    for path in sorted((PACKAGE / PLUGINS_DIR).glob("*.dist-info/*")):
        files[path.relative_to(PACKAGE).as_posix()] = path.read_text()
    return files


# LMCache's HTTP API socket, in the LMCache server's and its metrics gate's containers (a
# volume only those two mount); `pdstack launch` puts it in its log folder
LMCACHE_API_SOCKET = "/run/pdstack-lmcache/api.sock"
# LMCache's data (ZMQ) endpoint in the Compose stacks: ipc://SOCKET:PORT in a volume only the
# LMCache server and the node's engines mount, no TCP port (pdstack.sidecars.lmcache_socket
# binds it there when its environment names it; the engines' lmcache.mp.host points at it)
LMCACHE_DATA_SOCKET = "/run/pdstack-lmcache-data/mp.sock"
LMCACHE_DATA_ENV = "PDSTACK_LMCACHE_DATA_SOCKET"

WATCHDOG_STATE = "/tmp/pdstack-watchdog.json"

# seconds an engine may hold requests with no progress (or fail /health once it answered)
# before its watchdog restarts it, by profile: no single step of a healthy engine comes near it
ENGINE_WEDGE_S = {"gpu": 120, "cpu": 30}


def engine_wedge_s(profile: str) -> int:
    return ENGINE_WEDGE_S["gpu" if profile == "gpu" else "cpu"]


def engine_watchdog_args(url: str, wedge_s: float, state: str, name: str,
                         model: str) -> list[str]:
    """The watchdog's arguments after ``python3 -m`` :data:`WATCHDOG` (add ``dry`` to report
    without killing: ``pdstack launch`` does the restart itself)."""
    return [url, f"{wedge_s:g}", state, name, model]


def watchdog_verdict(output: str) -> str | None:
    """Why the watchdog found its engine wedged, from its output (its ``restart``
    line: ``pdstack-watchdog: NAME wedged: WHY: restarting its container``); None if not."""
    for line in output.splitlines():
        if line.startswith("pdstack-watchdog:") and " wedged: " in line:
            return line.split(" wedged: ", 1)[1].removesuffix(": restarting its container")
    return None


def engine_healthcheck(url: str, wedge_s: float, name: str, model: str) -> list[str]:
    """The engine container's healthcheck ``test`` (exec form)."""
    return ["CMD", "python3", "-m", WATCHDOG,
            *engine_watchdog_args(url, wedge_s, WATCHDOG_STATE, name, model)]


def metrics_gate_command(host: str, port: int, upstream: str) -> list[str]:
    """The gate's command; ``upstream``: ``unix:SOCKET`` or an ``http://`` URL."""
    return ["python3", "-m", METRICS_GATE, host, str(port), upstream]


def lmcache_on_socket_command(socket_path: str, lmcache_args: list[str]) -> list[str]:
    """``lmcache ARGS`` (``server ...``) with its HTTP API on ``socket_path``."""
    return ["python3", "-m", LMCACHE_SOCKET, socket_path, *lmcache_args]


def lmcache_api_socket(command: list[str]) -> str | None:
    """The API socket of an LMCache server's command (None: not one of these)."""
    if command[:3] == ["python3", "-m", LMCACHE_SOCKET]:
        return command[3]
    return None


def lmcache_data_endpoint(port: int, socket_path: str = LMCACHE_DATA_SOCKET) -> str:
    """The ZMQ endpoint LMCache binds and its engines connect to when its data port is on
    ``socket_path`` (the connectors join ``lmcache.mp.host`` and ``lmcache.mp.port`` with
    a colon, so the socket file is named ``PATH:PORT``)."""
    return f"ipc://{socket_path}:{port}"


def engine_on_data_socket(command: list[str], socket_path: str = LMCACHE_DATA_SOCKET) -> list[str]:
    """An engine's command with every ``lmcache.mp.host`` of its ``--kv-transfer-config``
    (a MultiConnector's too) on ``ipc://socket_path``: it reaches the node's LMCache server
    through the socket, not a TCP port (a command without one is returned unchanged)."""
    if "--kv-transfer-config" not in command:
        return command
    at = command.index("--kv-transfer-config") + 1
    config = json.loads(command[at])
    changed = False

    def walk(node: object) -> None:
        nonlocal changed
        if isinstance(node, dict):
            extra = node.get("kv_connector_extra_config")
            if isinstance(extra, dict) and "lmcache.mp.host" in extra:
                extra["lmcache.mp.host"] = f"ipc://{socket_path}"
                changed = True
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(config)
    if not changed:
        return command
    out = list(command)
    out[at] = json.dumps(config, separators=(",", ":"))
    return out
