"""Stand-ins for ``vllm serve``, ``lmcache server`` and ``pdstack proxy`` in launch tests.

Real processes with real sockets (stdlib only, fast to start).  Each parses the planned
command line like the real program would (host, ports, connector config, backends file),
checks what must be true when it starts, records what it saw in
``$FAKE_RECORD_DIR/<program>-<port>.json``, and serves:

- vllm: HTTP ``/health`` (200) on ``--port``; it also forks a grandchild (``sleep``) in
  its process group, as vLLM's engine core does, so a stop must take the whole group.
  It refuses to start (exit 4) when its ``--kv-transfer-config`` names an LMCache server
  that does not accept connections yet.
- lmcache (run through ``fakemods/lmcache``, as the plan's API shim runs it): TCP on
  ``--port`` and HTTP on the unix socket uvicorn was given (``$FAKE_LMCACHE_API``).
- pdstack proxy: HTTP ``/health`` on ``--port``; refuses to start (exit 5) unless every
  backend in ``--backends`` answers ``/health``.

Faults, by port, from the environment: ``FAKE_CRASH_PORT`` (print ``boom`` and exit 3),
``FAKE_UNHEALTHY_PORT`` (``/health`` answers 503), ``FAKE_IGNORE_TERM_PORT`` (ignore
SIGTERM), ``FAKE_STARTUP_DELAY`` (seconds before listening); at run time, by process: the
file ``$FAKE_RECORD_DIR/hang-<pid>`` makes that process's ``/health`` hang (a wedged
engine's API server). The vllm stand-in also serves ``/metrics`` (idle counters), so the
engine watchdog sees it answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from pdstack.secrets import ALL_SECRETS


def opt(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def ports_from_env(key: str) -> set[int]:
    return {int(p) for p in os.environ.get(key, "").split(",") if p}


class Health(http.server.BaseHTTPRequestHandler):
    status = 200
    metrics = False

    def do_GET(self) -> None:
        if self.path == "/health" and hang_file().exists():
            time.sleep(60)  # a hung API server: /health never answers
        if self.path == "/metrics" and self.metrics:
            code, body = 200, b"vllm:num_requests_running 0.0\nvllm:prompt_tokens_total 0.0\n"
        else:
            code = self.status if self.path == "/health" else 404
            body = b"ok" if code == 200 else b"no"
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def hang_file() -> Path:
    """While ``$FAKE_RECORD_DIR/hang-<pid>`` exists, this process's ``/health`` hangs."""
    return Path(os.environ["FAKE_RECORD_DIR"]) / f"hang-{os.getpid()}"


def serve_http(host: str, port: int, status: int, metrics: bool = False) -> Server:
    handler = type("H", (Health,), {"status": status, "metrics": metrics})
    server = Server((host, port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def serve_http_unix(path: str) -> UnixServer:
    class H(Health):
        def address_string(self) -> str:
            return "unix"

    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = UnixServer(path, H)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def can_connect(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), 1.0):
            return True
    except OSError:
        return False


def main() -> int:
    prog, argv = sys.argv[1], sys.argv[2:]
    host = opt(argv, "--host", "127.0.0.1") or "127.0.0.1"
    port = int(opt(argv, "--port", "0") or 0)
    record: dict[str, object] = {
        "prog": prog,
        "argv": argv,
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "sid": os.getsid(0),
        "started_at": time.time(),
        "env": {k: os.environ.get(k) for k in (
            "CUDA_VISIBLE_DEVICES", "VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_NO_USAGE_STATS",
            "FAKE_EXTRA", "PYTHONPATH",
        )},
        "hf_token_sha256": hashlib.sha256(os.environ["HF_TOKEN"].encode()).hexdigest()
        if "HF_TOKEN" in os.environ else None,
        # which secrets reached this process's environment (names only)
        "secrets": sorted(k for k in ALL_SECRETS if k in os.environ),
    }
    print(f"fake {prog} starting on {host}:{port}", flush=True)
    if port in ports_from_env("FAKE_IGNORE_TERM_PORT"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if port in ports_from_env("FAKE_CRASH_PORT"):
        time.sleep(0.3)
        print("boom: crashing on purpose", flush=True)
        return 3
    time.sleep(float(os.environ.get("FAKE_STARTUP_DELAY", "0")))

    servers: list[object] = []
    status = 503 if port in ports_from_env("FAKE_UNHEALTHY_PORT") else 200
    if prog == "vllm":
        ktc = json.loads(opt(argv, "--kv-transfer-config", "null") or "null") or {}
        extra = ktc.get("kv_connector_extra_config", {})
        if "lmcache.mp.port" in extra:
            lm_host = str(extra["lmcache.mp.host"]).removeprefix("tcp://")
            up = can_connect(lm_host, int(extra["lmcache.mp.port"]))
            record["lmcache_up_at_start"] = up
            if not up:
                print("lmcache server not reachable", flush=True)
                return 4
        child = subprocess.Popen(["sleep", "300"])
        record["grandchild"] = child.pid
        servers.append(serve_http(host, port, status, metrics=True))
    elif prog == "lmcache":
        tcp = socket.create_server((host, port))
        api = os.environ.get("FAKE_LMCACHE_API", "")
        record["api"] = api
        if api.startswith("/"):
            record["api_folder_mode"] = oct(os.stat(os.path.dirname(api)).st_mode & 0o777)
            servers += [tcp, serve_http_unix(api)]
        else:
            servers += [tcp]
    elif prog == "pdstack":
        backends_file = opt(argv, "--backends")
        assert backends_file
        table = json.loads(Path(backends_file).read_text())
        record["backends"] = table
        ok = {}
        for b in table["backends"]:
            try:
                with urllib.request.urlopen(b["url"] + "/health", timeout=2) as r:
                    ok[b["name"]] = r.status == 200
            except OSError:
                ok[b["name"]] = False
        record["backends_healthy_at_start"] = ok
        if not all(ok.values()):
            print(f"backends not healthy: {ok}", flush=True)
            return 5
        servers.append(serve_http(host, port, status))
    record["listening_at"] = time.time()
    out = Path(os.environ["FAKE_RECORD_DIR"]) / f"{prog}-{port}.json"
    out.write_text(json.dumps(record))
    print(f"fake {prog} listening on {host}:{port}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
