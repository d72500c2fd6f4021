"""Test support: waiting for a server that a test (or a benchmark) started to answer."""

from __future__ import annotations

import subprocess
import time
import urllib.request


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
