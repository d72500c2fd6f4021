"""LMCache's metrics gate: serves ``GET /metrics`` of LMCache's HTTP API on an address others
reach, and nothing else (404), so Prometheus scrapes LMCache through it. LMCache's API
listens on a unix socket (:mod:`pdstack.sidecars.lmcache_socket`) that only this gate shares:
that API also serves ``/run_script``, ``/env``, ``/cache/clear``, unauthenticated. Standard
library only: it runs with the engine image's own Python.

Usage: ``python3 -m pdstack.sidecars.metrics_gate LISTEN_HOST LISTEN_PORT UPSTREAM``, where
``UPSTREAM`` is ``unix:SOCKET`` (the Compose stacks) or an ``http://`` URL.
"""

from __future__ import annotations

import http.client
import http.server
import socket
import sys
import urllib.request
from collections.abc import Sequence

TIMEOUT_S = 10.0


class _OnSocket(http.client.HTTPConnection):
    """HTTP over the unix socket at ``path``."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.path)


def scrape(upstream: str) -> bytes:
    """``GET /metrics`` of ``upstream``; raises OSError when it does not answer 200."""
    upstream = upstream.rstrip("/")
    if not upstream.startswith("unix:"):
        with urllib.request.urlopen(upstream + "/metrics", timeout=TIMEOUT_S) as r:
            return bytes(r.read())
    conn = _OnSocket(upstream.removeprefix("unix:"), TIMEOUT_S)
    try:
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise OSError(f"HTTP {r.status}")
        return body
    finally:
        conn.close()


def gate(upstream: str) -> type[http.server.BaseHTTPRequestHandler]:
    """The request handler: ``GET /metrics`` (query ignored) is ``upstream``'s (502 with
    the reason when it fails), any other path 404, any other method 501."""

    class Gate(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only GET /metrics is served here")
                return
            try:
                body, code = scrape(upstream), 200
            except Exception as exc:
                body, code = f"upstream: {exc}".encode(), 502
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Gate


def server(host: str, port: int, upstream: str) -> http.server.ThreadingHTTPServer:
    """The gate, bound (``port`` 0: any free port); ``serve_forever`` runs it."""
    return http.server.ThreadingHTTPServer((host, port), gate(upstream))


def main(argv: Sequence[str]) -> int:
    if len(argv) != 3:
        print(__doc__.split("\n\n")[-1].strip(), file=sys.stderr)
        return 2
    server(argv[0], int(argv[1]), argv[2]).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
