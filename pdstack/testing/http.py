"""Test support: waiting for a server that a test (or a benchmark) started to answer, and
posting JSON to it."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any


def wait_http(url: str, timeout: float = 20.0,
              proc: subprocess.Popen[bytes] | None = None) -> None:
    """Return once ``url`` answers 200; TimeoutError after ``timeout`` seconds, and
    RuntimeError as soon as ``proc`` (the server's process, when given) has exited."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready after {timeout} s")
        time.sleep(0.1)


def post_json(url: str, body: dict[str, Any], timeout: float = 20.0) -> tuple[int, Any]:
    """POST ``body`` as JSON: (status, the JSON answer), error answers included."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
