"""SteadyClientProcess (the two-node lab's client on "a machine of its own"): a process of its
own at real-time priority that reports every outcome, against a stub OpenAI server (stdlib,
named as such) in this process."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pdstack.testing.steady import SteadyClientProcess


class _StubCompletions(BaseHTTPRequestHandler):
    seen_keys: list[str] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _StubCompletions.seen_keys.append(self.headers.get("Authorization", ""))
        if body["stream"]:
            payload = (b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n')
            kind = "text/event-stream"
        else:
            payload = json.dumps({"choices": [{"text": "a"}]}).encode()
            kind = "application/json"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("X-Request-Id", "stub")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


def test_steady_client_process_reports_every_outcome_with_this_process_clock() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StubCompletions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        t0 = time.monotonic()
        client = SteadyClientProcess(f"http://127.0.0.1:{server.server_port}", workers=1,
                                     max_tokens=4, pause_s=0.05, timeout_s=5, api_key="k-1")
        client.start()
        time.sleep(1.0)
        client.stop()
        t1 = time.monotonic()
    finally:
        server.shutdown()
    assert client.sent >= 5 and not client.failed, client.outcomes[:3]
    assert {o.stream for o in client.outcomes} == {True, False}
    assert all(t0 <= o.started <= t1 for o in client.outcomes)  # one monotonic clock
    assert set(_StubCompletions.seen_keys) == {"Bearer k-1"}
