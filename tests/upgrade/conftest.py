"""Fixtures for the upgrade tests: fake engines (the ``pdstack.testing.fake_engine`` test
double) behind the real proxy (``pdstack proxy``), and a stack directory. No Docker."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdstack.testing.http import post_json
from pdstack.testing.ports import free_port
from pdstack.upgrade import AdminClient

REPO = Path(__file__).resolve().parents[2]
PDSTACK = str(REPO / ".venv" / "bin" / "pdstack")
A, B = "rev1@img", "rev2@img"


def wait_http(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


post = post_json  # POST JSON: (status, answer), for the tests here


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        raw = resp.read().decode()
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


@pytest.fixture
def node(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Fake prefill-0 (rev1), decode-0 (rev1), decode-1 (rev2) behind the real proxy."""
    procs: list[subprocess.Popen] = []
    urls: dict[str, str] = {}
    for name in ("prefill-0", "decode-0", "decode-1"):
        port = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pdstack.testing.fake_engine", "--port", str(port),
             "--name", name, "--output-tokens", "4"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls[name] = f"http://127.0.0.1:{port}"
    gens = getattr(request, "param", {"prefill-0": A, "decode-0": A, "decode-1": B})
    table = {
        "kv_mode": "shared-l1", "served_model_name": "fake",
        "backends": [{"name": f"local/{n}", "role": n.split("-")[0], "node": "local",
                      "url": u, "generation": gens[n]} for n, u in urls.items()],
        "pairings": [{"prefill": "local/prefill-0", "decode": f"local/{d}",
                      "kv_path": "shared-l1"} for d in ("decode-0", "decode-1")],
    }
    (tmp_path / "backends.json").write_text(json.dumps(table))
    token = secrets.token_hex(16)
    (tmp_path / "none.env").write_text("# no secrets here: the token comes from the env\n")
    port = free_port()
    env = {**os.environ, "PDSTACK_ADMIN_TOKEN": token}
    procs.append(subprocess.Popen(
        [PDSTACK, "proxy", "--backends", str(tmp_path / "backends.json"), "--port", str(port),
         "--health-interval", "0.2", "--env-file", str(tmp_path / "none.env")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    proxy = f"http://127.0.0.1:{port}"
    try:
        for u in [*urls.values(), proxy]:
            wait_http(u + "/health")
        admin = AdminClient(proxy, token)
        deadline = time.monotonic() + 20
        while any(b["state"] != "healthy" for b in admin.listing()["backends"]):
            assert time.monotonic() < deadline, admin.listing()
            time.sleep(0.1)
        for name in ("compose.yaml", ".env"):
            shutil.copy(REPO / "compose" / "cpu" / name, tmp_path / name)
        yield {"proxy": proxy, "urls": urls, "admin": admin, "token": token, "dir": tmp_path}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
