"""pdstack.sidecars.metrics_gate as a program: GET /metrics of LMCache's API, over its unix
socket or HTTP, and nothing else of it. The gate as the rendered command runs it (a
subprocess) is in tests/spine/test_selfheal.py."""

from __future__ import annotations

import http.server
import socketserver
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdstack.sidecars import metrics_gate

BODY = b"lmcache_mp_hits_total 7\n"


class _Api(http.server.BaseHTTPRequestHandler):
    """LMCache's API as far as the gate goes: /metrics (or a failure), /env with a secret."""

    status = 200
    paths: list[str] = []

    def do_GET(self) -> None:
        self.paths.append(self.path)
        body = BODY if self.path == "/metrics" else b"SECRET=1"
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def address_string(self) -> str:  # a unix socket's peer has no host
        return "unix"

    def log_message(self, format: str, *args: object) -> None:
        pass


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True


def _serve(server: socketserver.BaseServer) -> None:
    threading.Thread(target=server.serve_forever, daemon=True).start()


@pytest.fixture(params=["unix", "http"])
def upstream(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    _Api.status, _Api.paths = 200, []
    server: socketserver.BaseServer
    if request.param == "unix":
        sock = tmp_path / "api.sock"
        server = _UnixServer(str(sock), _Api)
        url = f"unix:{sock}"
    else:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Api)
        url = f"http://127.0.0.1:{server.server_address[1]}/"
    _serve(server)
    try:
        yield url
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture()
def gate(upstream: str) -> Iterator[str]:
    server = metrics_gate.server("127.0.0.1", 0, upstream)
    _serve(server)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _get(url: str, method: str = "GET") -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method, data=b"" if method != "GET" else None)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_scrape_reads_metrics_over_the_socket_or_http(upstream: str) -> None:
    assert metrics_gate.scrape(upstream) == BODY
    assert _Api.paths == ["/metrics"]


def test_the_gate_serves_get_metrics_only(gate: str) -> None:
    assert _get(gate + "/metrics") == (200, BODY)
    assert _get(gate + "/metrics?name=x") == (200, BODY)  # Prometheus' query: ignored
    for path in ("/env", "/run_script", "/cache/clear", "/"):
        code, body = _get(gate + path)
        assert code == 404 and b"SECRET" not in body, path
    assert _get(gate + "/run_script", "POST")[0] == 501
    assert _get(gate + "/cache/clear", "DELETE")[0] == 501
    assert _Api.paths == ["/metrics", "/metrics"]  # nothing else ever reached the API


def test_an_upstream_failure_is_a_502_with_the_reason(gate: str, upstream: str) -> None:
    _Api.status = 500
    code, body = _get(gate + "/metrics")
    assert code == 502 and b"500" in body and BODY not in body


def test_an_upstream_that_is_gone_is_a_502(tmp_path: Path) -> None:
    server = metrics_gate.server("127.0.0.1", 0, f"unix:{tmp_path / 'none.sock'}")
    _serve(server)
    try:
        code, body = _get(f"http://127.0.0.1:{server.server_address[1]}/metrics")
    finally:
        server.shutdown()
        server.server_close()
    assert code == 502 and body.startswith(b"upstream: ")


def test_wrong_arguments_print_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert metrics_gate.main(["127.0.0.1", "9000"]) == 2
    assert "LISTEN_HOST LISTEN_PORT UPSTREAM" in capsys.readouterr().err
