"""pdstack.sidecars.watchdog as a program: what it reads from an engine, when it calls the
engine wedged, and the state it keeps between checks. The whole program against the
FakeEngine test double, in a subprocess, is in tests/spine/test_selfheal.py."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdstack import sidecars
from pdstack.sidecars import watchdog
from pdstack.sidecars.watchdog import Down, HttpEngine, assess, held_and_progress

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 1.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0
vllm:generation_tokens_total{engine="0",model_name="m"} 20.0
vllm:request_success_total{engine="0",finished_reason="stop"} 3.0
vllm:request_success_total{engine="0",finished_reason="length"} 1.0
vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 999.0
vllm:kv_cache_usage_perc{engine="0"} 0.5
"""


def test_reads_requests_held_and_progress_from_metrics() -> None:
    # held: running + waiting (each waiting series); progress: the three counters only
    assert held_and_progress(METRICS) == (4.0, 124.0)
    assert held_and_progress("") == (0.0, 0.0)


class Scripted:
    """An engine whose answers a test sets: ``reading`` (or an exception) and the probe's."""

    def __init__(self) -> None:
        self.reading: tuple[float, float] | Exception = (0.0, 0.0)
        self.probe_error: Exception | None = None
        self.probes = 0

    def scrape(self) -> tuple[float, float]:
        if isinstance(self.reading, Exception):
            raise self.reading
        return self.reading

    def probe(self) -> None:
        self.probes += 1
        if self.probe_error is not None:
            raise self.probe_error


def test_an_idle_engine_is_healthy_however_long() -> None:
    engine, state = Scripted(), {}
    for now in (0.0, 100.0, 10_000.0):
        assert assess(state, now, 30, engine) is None
    assert engine.probes == 0 and state["up"] is True


def test_requests_held_without_progress_are_probed_once_past_the_budget() -> None:
    engine, state = Scripted(), {}
    engine.reading = (0.0, 50.0)
    assert assess(state, 0.0, 30, engine) is None  # first reading: progress noted
    engine.reading = (2.0, 50.0)
    assert assess(state, 1.0, 30, engine) is None  # held from now on
    assert (state["held"], state["since"]) == (True, 1.0)
    assert assess(state, 31.0, 30, engine) is None and engine.probes == 0  # within budget
    engine.probe_error = TimeoutError("timed out")
    why = assess(state, 31.5, 30, engine)
    assert engine.probes == 1
    assert why == "requests held, no progress for 30s, a 1-token probe failed (timed out)"


def test_a_probe_that_answers_starts_the_budget_again() -> None:
    engine, state = Scripted(), {}
    engine.reading = (1.0, 7.0)
    assert assess(state, 0.0, 30, engine) is None
    assert assess(state, 40.0, 30, engine) is None and engine.probes == 1
    assert state["held"] is False and state["since"] == 40.0
    # still held: a new budget from here, no probe before it is spent again
    assert assess(state, 41.0, 30, engine) is None
    assert assess(state, 70.0, 30, engine) is None and engine.probes == 1


def test_progress_while_held_is_never_probed() -> None:
    engine, state = Scripted(), {}
    for step in range(10):
        engine.reading = (3.0, float(step))  # tokens keep coming
        assert assess(state, step * 60.0, 30, engine) is None
    assert engine.probes == 0


def test_a_starting_engine_is_down_not_wedged() -> None:
    engine, state = Scripted(), {}
    engine.reading = ConnectionRefusedError("refused")
    for now in (0.0, 1_000.0):
        with pytest.raises(Down, match="refused"):
            assess(state, now, 30, engine)
    assert "down" not in state and not state.get("up")


def test_an_engine_that_answered_then_stopped_is_wedged_after_the_budget() -> None:
    engine, state = Scripted(), {}
    assert assess(state, 0.0, 30, engine) is None
    engine.reading = TimeoutError("timed out")
    with pytest.raises(Down):
        assess(state, 10.0, 30, engine)
    with pytest.raises(Down):
        assess(state, 40.0, 30, engine)  # 30 s down: not more than the budget yet
    assert assess(state, 41.0, 30, engine) == "/health or /metrics failing for 31s (timed out)"
    engine.reading = (0.0, 0.0)  # back: the clock of its failures starts again
    assert assess(state, 42.0, 30, engine) is None and state["down"] is None


def test_state_is_kept_per_boot(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    assert watchdog.load_state(str(path), "111") == {"boot": "111"}  # none yet
    path.write_text(json.dumps({"boot": "111", "up": True, "since": 5.0}))
    assert watchdog.load_state(str(path), "111")["since"] == 5.0
    assert watchdog.load_state(str(path), "222") == {"boot": "222"}  # restarted
    path.write_text("{not json")
    assert watchdog.load_state(str(path), "111") == {"boot": "111"}


def test_dry_restart_reports_in_the_line_launch_reads(capsys: pytest.CaptureFixture[str]) -> None:
    watchdog.restart("decode-0", "requests held, no progress for 31s", dry=True)
    out = capsys.readouterr().out
    assert out == ("pdstack-watchdog: decode-0 wedged: requests held, no progress for 31s: "
                   "restarting its container\n")
    assert sidecars.watchdog_verdict(out) == "requests held, no progress for 31s"
    assert sidecars.watchdog_verdict("pdstack-watchdog: decode-0: /health failed") is None


def test_wrong_arguments_print_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert watchdog.main(["http://x", "30"]) == 2
    assert watchdog.main(["http://x", "30", "/tmp/s", "n", "m", "wet"]) == 2
    assert "Usage: ``python3 -m pdstack.sidecars.watchdog URL" in capsys.readouterr().err


class _Engine(http.server.BaseHTTPRequestHandler):
    """/health, /metrics, /load and /v1/completions, recording what it was sent."""

    seen: list[tuple[str, str, str | None, bytes]] = []
    load: Any = {"server_load": 3}

    def _reply(self, body: bytes, code: int = 200) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.seen.append(("GET", self.path, self.headers.get("Authorization"), b""))
        if self.path == "/metrics":
            self._reply(METRICS.encode())
        elif self.path == "/load":
            self._reply(json.dumps(self.load).encode(), 200 if self.load else 404)
        else:
            self._reply(b"")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append(("POST", self.path, self.headers.get("Authorization"), body))
        self._reply(b"{}")

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture()
def engine_url() -> Iterator[str]:
    _Engine.seen = []
    _Engine.load = {"server_load": 3}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_http_engine_reads_health_metrics_and_load_with_the_key(engine_url: str) -> None:
    engine = HttpEngine(engine_url, "tiny", "sk-engine")
    assert engine.scrape() == (4.0 + 3.0, 124.0)  # the API server's in-flight count too
    assert [(m, p) for m, p, _, _ in _Engine.seen] == [
        ("GET", "/health"), ("GET", "/metrics"), ("GET", "/load")]
    assert {auth for _, _, auth, _ in _Engine.seen} == {"Bearer sk-engine"}
    engine.probe()
    method, path, auth, body = _Engine.seen[-1]
    assert (method, path, auth) == ("POST", "/v1/completions", "Bearer sk-engine")
    assert json.loads(body) == {"model": "tiny", "prompt": [1], "max_tokens": 1}


def test_http_engine_without_load_tracking_or_key(engine_url: str) -> None:
    _Engine.load = None  # /load: 404
    engine = HttpEngine(engine_url, "tiny", None)
    assert engine.scrape() == (4.0, 124.0)
    assert {auth for _, _, auth, _ in _Engine.seen} == {None}
