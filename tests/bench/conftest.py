"""Fake engines in their own processes (the load generator must not share their loop)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pdstack.testing.http import wait_http
from pdstack.testing.ports import free_port

REPO = Path(__file__).resolve().parents[2]


FakeFactory = Callable[..., str]


@pytest.fixture
def fake_engine() -> Iterator[FakeFactory]:
    """``fake_engine(ttft_ms=.., itl_ms=.., output_tokens=..)`` -> base URL of a fake
    engine (pdstack.testing.fake_engine) running as a separate process."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(ttft_ms: float = 0.0, itl_ms: float = 0.0, output_tokens: int = 16,
              name: str | None = None, record: bool = False) -> str:
        port = free_port()
        cmd = [sys.executable, "-m", "pdstack.testing.fake_engine", "--port", str(port),
               "--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms),
               "--output-tokens", str(output_tokens)] + ([] if record else ["--no-record"])
        if name:
            cmd += ["--name", name]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health")
        return url

    yield start
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
