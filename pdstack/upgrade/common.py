"""What every step of ``pdstack upgrade`` shares: its error, its log line, JSON over HTTP,
and waiting for a condition."""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any


class UpgradeError(RuntimeError):
    """A step failed; the message names the engine and the step."""


def log(message: str) -> None:
    print(f"[upgrade {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _http(
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        status = exc.code
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


def wait_for(
    what: str, check: Callable[[], bool], timeout_s: float, interval_s: float = 0.25
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if check():
            return
        if time.monotonic() > deadline:
            raise UpgradeError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)

