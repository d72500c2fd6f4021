"""The engine watchdog: an engine container's healthcheck (``pdstack launch`` runs it too, in
its ``dry`` mode). Standard library only: it runs with the engine image's own Python.

``/health`` must pass, and the engine must make progress while it holds requests. It reads
the engine's own ``/metrics`` and ``/load``: requests held are the scheduler's running and
waiting gauges (``vllm:num_requests_running`` / ``vllm:num_requests_waiting*``) plus the API
server's in-flight count (``/load``, ``--enable-server-load-tracking``; the gauges alone
freeze when the engine core stops, so requests that reach a stopped core never show there);
progress is the prompt and generation token and finished-request counters. A request held
with those counters flat for ``WEDGE_S`` seconds is confirmed with one 1-token generation
(4 s deadline); it fails = wedged. So is an engine that once answered and whose ``/health``
or ``/metrics`` fails for ``WEDGE_S`` (a hung API server). Every request it makes carries the
container's ``VLLM_API_KEY`` (``/load`` needs it: pdstack.vllm_engine_auth).

A wedged engine: it writes one line naming the engine to the container's log
(``pdstack-watchdog: NAME wedged: ...``, through PID 1's stdout) and ends every process of the
container but its init (``kill(-1, SIGKILL)`` in the container's PID namespace): the container
exits 137 and its restart policy starts it again, on the node, without a person and without
the Docker socket. Its state is a small JSON file (the container's /tmp), reset when the
container restarts (PID 1's start time).

Usage: ``python3 -m pdstack.sidecars.watchdog URL WEDGE_S STATE_FILE NAME MODEL [dry]``
(``dry``: report, exit 1, kill nothing and write no container log). Exit 0: healthy; 1: not.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Sequence
from typing import Any, Protocol

HELD = ("vllm:num_requests_running", "vllm:num_requests_waiting")
PROGRESS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            "vllm:request_success_total")
PROBE_TIMEOUT_S = 4.0


def held_and_progress(metrics: str) -> tuple[float, float]:
    """(requests the scheduler holds, the sum of the progress counters) from ``/metrics``."""
    held = progress = 0.0
    for line in metrics.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.startswith(HELD):
            held += float(line.rsplit(" ", 1)[1])
        elif name in PROGRESS:
            progress += float(line.rsplit(" ", 1)[1])
    return held, progress


class Engine(Protocol):
    def scrape(self) -> tuple[float, float]:
        """(requests held, progress); raises when ``/health`` or ``/metrics`` fails."""
        ...

    def probe(self) -> None:
        """One 1-token generation; raises when it fails."""
        ...


class HttpEngine:
    """The engine at ``url`` (``http://HOST:PORT``), with ``key`` as its bearer token."""

    def __init__(self, url: str, model: str, key: str | None) -> None:
        self.url, self.model = url, model
        self.auth = {"Authorization": "Bearer " + key} if key else {}

    def _get(self, path: str, timeout: float) -> str:
        req = urllib.request.Request(self.url + path, headers=self.auth)
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return str(r.read().decode())

    def scrape(self) -> tuple[float, float]:
        self._get("/health", 2)
        held, progress = held_and_progress(self._get("/metrics", 2))
        with contextlib.suppress(Exception):  # without load tracking: the gauges only
            held += float(json.loads(self._get("/load", 1)).get("server_load", 0))
        return held, progress

    def probe(self) -> None:
        body = json.dumps({"model": self.model, "prompt": [1], "max_tokens": 1}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", **self.auth})
        with urllib.request.urlopen(req, timeout=PROBE_TIMEOUT_S) as r:
            r.read()


class Down(Exception):
    """``/health`` or ``/metrics`` failed, not (yet) for long enough to call it wedged."""


def assess(state: dict[str, Any], now: float, wedge_s: float, engine: Engine) -> str | None:
    """One check: updates ``state`` (the JSON kept between checks) and returns why the engine
    is wedged, or None when it is healthy; raises :class:`Down` when it is not healthy but
    not wedged (it never answered yet, or has failed for ``wedge_s`` seconds at most)."""
    try:
        held, progress = engine.scrape()
    except Exception as exc:
        if state.get("up"):
            down = state.get("down") or now
            state["down"] = down
            if now - down > wedge_s:
                return f"/health or /metrics failing for {now - down:.0f}s ({exc})"
        raise Down(str(exc)) from exc
    state.update(up=True, down=None)
    if state.get("progress") != progress:
        state.update(progress=progress, since=now, held=held > 0)
        return None
    if held > 0 and not state.get("held"):
        state.update(since=now, held=True)
        return None
    if not state.get("held") or now - state["since"] <= wedge_s:
        return None
    try:
        engine.probe()
    except Exception as exc:
        return (f"requests held, no progress for {now - state['since']:.0f}s, a 1-token probe"
                f" failed ({exc})")
    state.update(since=now, held=False)
    return None


def boot_id() -> str:
    """PID 1's start time: a new one means the container (or launch's engine) restarted."""
    with open("/proc/1/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def load_state(path: str, boot: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError):
        state = {}
    return state if isinstance(state, dict) and state.get("boot") == boot else {"boot": boot}


def restart(name: str, why: str, dry: bool) -> None:
    """Say why, then (not ``dry``) end every process of the container but its init."""
    line = f"pdstack-watchdog: {name} wedged: {why}: restarting its container"
    print(line, flush=True)
    if dry:
        return
    try:
        with open("/proc/1/fd/1", "w") as log:
            log.write(line + "\n")
    except OSError:
        pass
    os.kill(-1, signal.SIGKILL)


def main(argv: Sequence[str]) -> int:
    if len(argv) not in (5, 6) or argv[5:] not in ([], ["dry"]):
        print(__doc__.split("\n\n")[-1].strip(), file=sys.stderr)
        return 2
    url, wedge_s, path, name, model = argv[0], float(argv[1]), *argv[2:5]
    state = load_state(path, boot_id())
    engine = HttpEngine(url, model, os.environ.get("VLLM_API_KEY"))
    try:
        why = assess(state, time.time(), wedge_s, engine)
    except Down as exc:
        print(f"pdstack-watchdog: {name}: /health or /metrics failed: {exc}")
        return 1
    finally:
        with open(path, "w") as f:
            json.dump(state, f)
    if why is None:
        return 0
    restart(name, why, dry=argv[5:] == ["dry"])
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
