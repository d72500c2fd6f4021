"""``./quickstart`` run again after client keys were set (issue 54): its request sends the
first client key, every failure is one line on stderr naming the next step (no traceback),
its banner and hints say what is true, and ``pdstack --help`` is plain text."""

from __future__ import annotations

import http.server
import io
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdstack import quickstart as qs

ROOT = Path(__file__).resolve().parents[2]
STACK = ROOT / "compose" / "cpu"


class FakeProxy(http.server.BaseHTTPRequestHandler):
    """Answers like the proxy: 401 without one of ``keys``, else a 2-chunk stream."""

    keys: set[str] = set()
    seen: list[str | None] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        auth = self.headers.get("Authorization")
        type(self).seen.append(auth)
        if self.keys and auth not in {f"Bearer {k}" for k in self.keys}:
            body = json.dumps({"error": {"message": "missing or invalid API key",
                                         "type": "authentication_error"}}).encode()
            self.send_response(401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for piece in ("hello", " world"):
            event = {"choices": [{"delta": {"content": piece}}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def proxy() -> Iterator[tuple[str, type[FakeProxy]]]:
    handler = type("Handler", (FakeProxy,), {"keys": set(), "seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def test_client_key_is_the_first_of_the_api_keys_else_of_the_tenant_keys(tmp_path: Path) -> None:
    proxy_env, node_env = tmp_path / "proxy.env", tmp_path / "secrets.env"
    assert qs.client_key([proxy_env, node_env]) is None  # no file: no key
    node_env.write_text("PDSTACK_TENANT_KEYS=acme:tk-1,nightly:tk-2\n")
    assert qs.client_key([proxy_env, node_env]) == "tk-1"
    node_env.write_text("PDSTACK_TENANT_KEYS=acme:tk-1\nPDSTACK_API_KEYS=' ck-1 ,ck-2'\n")
    assert qs.client_key([proxy_env, node_env]) == "ck-1"
    proxy_env.write_text("VLLM_API_KEY=engine-only\n")  # the proxy's file first: no client key
    assert qs.client_key([proxy_env, node_env]) is None


def test_ask_sends_the_first_client_key(proxy: tuple[str, type[FakeProxy]]) -> None:
    url, handler = proxy
    handler.keys = {"ck-1"}
    out = io.StringIO()
    n, ttft, _ = qs.ask(url, "tiny", "hi", "ck-1", "/etc/pdstack/secrets.env", out=out)
    assert handler.seen == ["Bearer ck-1"]
    assert (n, "hello world" in out.getvalue(), ttft is not None) == (2, True, True)
    handler.keys = set()
    qs.ask(url, "tiny", "hi", None, "x", out=io.StringIO())  # no keys: none sent
    assert handler.seen[-1] is None


def _one_line_failure(argv: list[str], env: dict[str, str]) -> str:
    run = subprocess.run([sys.executable, "-m", "pdstack.quickstart", *argv],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 2, run
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("quickstart: "), run.stderr
    return lines[0]


def _stack_at(tmp_path: Path, url: str) -> Path:
    """compose/cpu's backends.json and a compose.yaml whose proxy listens on ``url``."""
    stack = tmp_path / "stack"
    stack.mkdir()
    (stack / "backends.json").write_text((STACK / "backends.json").read_text())
    host, port = url.removeprefix("http://").split(":")
    (stack / "compose.yaml").write_text(
        'command: ["pdstack", "proxy", "--backends", "b", '
        f'"--host", "{host}", "--port", "{port}"]\n')
    return stack


def test_a_refused_or_missing_key_is_one_line_with_the_next_step(
        proxy: tuple[str, type[FakeProxy]], tmp_path: Path) -> None:
    import os

    url, handler = proxy
    handler.keys = {"ck-1"}
    stack = _stack_at(tmp_path, url)
    node = tmp_path / "secrets.env"
    env = dict(os.environ, QUESTION="hi")
    # keys set on the proxy, none in the files the quickstart reads (the old behaviour: 401)
    line = _one_line_failure(["ask", str(stack), "--secrets", str(node)], env)
    assert "wants a client key (401" in line and "PDSTACK_API_KEYS" in line, line
    assert "./quickstart again" in line
    # a key the proxy does not hold (the proxy not recreated since): named, never shown
    node.write_text("PDSTACK_API_KEYS=stale-key\n")
    line = _one_line_failure(["ask", str(stack), "--secrets", str(node)], env)
    assert "refused the client key" in line and "stale-key" not in line, line
    # the right key: the answer streams
    node.write_text("PDSTACK_API_KEYS=ck-1\n")
    run = subprocess.run([sys.executable, "-m", "pdstack.quickstart", "ask", str(stack),
                          "--secrets", str(node)], capture_output=True, text=True, env=env,
                         timeout=60)
    assert run.returncode == 0 and "hello world" in run.stdout, run
    assert "ck-1" not in run.stdout + run.stderr


def test_no_proxy_and_no_stack_are_one_line_too(tmp_path: Path) -> None:
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    stack = _stack_at(tmp_path, f"http://127.0.0.1:{port}")
    env = dict(os.environ, QUESTION="hi")
    line = _one_line_failure(["ask", str(stack), "--secrets", str(tmp_path / "none")], env)
    assert "no answer from the proxy" in line and f"{stack} ps" in line, line
    line = _one_line_failure(["url", str(tmp_path / "missing")], env)
    assert "run ./quickstart again" in line, line


def test_the_script_says_what_is_true() -> None:
    text = (ROOT / "quickstart").read_text()
    banner = text.split("docker compose up --wait on", 1)[1].split("\n", 1)[0]
    assert "2-5 min" not in banner and "nothing compiles" in banner, banner
    assert "qs ask" in text and "urllib.request.Request" not in text  # the request: qs ask
    assert "ticker" in text  # progress lines while a long install step (the image build) runs
    # every hint naming a program says where it comes from when the quickstart installs none
    hints = text.split("Where to look next", 1)[1]
    assert "prometheus --config.file" not in hints or "apt-get install prometheus" in hints
    assert "tail -40" not in text  # a failure is one line (the log's last), not a log dump


def test_pdstack_help_is_plain_text() -> None:
    from pdstack.cli import SUBCOMMANDS

    markup = re.compile(r"``|:(func|mod|data|class|meth|attr):`|\*\*")
    for argv in (["--help"], *([name, "--help"] for name in SUBCOMMANDS)):
        run = subprocess.run([sys.executable, "-m", "pdstack.cli", *argv], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, (argv, run.stderr[-2000:])
        found = [ln for ln in run.stdout.splitlines() if markup.search(ln)]
        assert not found, (argv, found[:3])
