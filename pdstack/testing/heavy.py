"""Test support (not a test double): what every heavy suite (real vLLM engines, Docker stacks)
shares. One place for the heavy-run lock and for the Docker prerequisites check.

The lock serialises heavy runs on a 2-core machine: two pytest processes (or a pytest and a
hand-started benchmark) must not run engines at the same time. It is re-entrant within one
process, so a session-wide holder (the e2e suite) and per-module holders (the vLLM and
upgrade suites) never deadlock in one pytest run. ``PDSTACK_HEAVY_LOCK`` names the lock file
(default ``/tmp/pdstack-heavy.lock``); ``PDSTACK_HEAVY_LOCK_HELD=1`` says the caller already
holds it (e.g. ``flock /tmp/pdstack-heavy.lock pytest ...``).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

HEAVY_LOCK = os.environ.get("PDSTACK_HEAVY_LOCK") or "/tmp/pdstack-heavy.lock"
# the images .ci/install-docker.sh builds, that the CPU stacks under test run
CPU_STACK_IMAGES = ("pdstack/engine-cpu:dev", "pdstack/proxy:dev")
DOCKER_HINT = "run .ci/install.sh (or .ci/install-docker.sh) first"

_held = 0  # how deep this process is inside heavy_lock()


@contextlib.contextmanager
def heavy_lock() -> Iterator[None]:
    """Hold the heavy-run lock (re-entrant within this process)."""
    global _held
    if _held or os.environ.get("PDSTACK_HEAVY_LOCK_HELD"):
        _held += 1
        try:
            yield
        finally:
            _held -= 1
        return
    with open(HEAVY_LOCK, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        _held = 1
        try:
            yield
        finally:
            _held = 0
            fcntl.flock(handle, fcntl.LOCK_UN)


def require_docker(images: Iterable[str], hint: str = DOCKER_HINT) -> None:
    """FAIL (never skip) unless the Docker CLI, a running engine, Compose v2 and ``images``
    are all there, naming what is missing and how to get it."""
    import pytest  # test support only: keep the package importable without pytest

    if shutil.which("docker") is None:
        pytest.fail(f"docker CLI missing: {hint}", pytrace=False)
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.fail(f"Docker engine not running: {hint}", pytrace=False)
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.fail(f"docker compose v2 missing: {hint}", pytrace=False)
    for image in images:
        if (
            subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode
            != 0
        ):
            pytest.fail(f"image {image} missing: {hint}", pytrace=False)


def netns_lab() -> ModuleType:
    """``tests/lab/lab.py`` (the namespaced test lab), loaded once per process under the
    name ``pdstack_netns_lab`` whichever test folder asks first (``tests`` is no package)."""
    name = "pdstack_netns_lab"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "tests" / "lab" / "lab.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def container_pids(container: str, env: Mapping[str, str] | None = None) -> list[int]:
    """All host PIDs of one container (``docker top``; ``env``: e.g. another DOCKER_HOST)."""
    res = subprocess.run(
        ["docker", "top", container, "-eo", "pid"], capture_output=True, text=True, check=True,
        env=dict(env) if env is not None else None,
    )
    return [int(x) for x in res.stdout.split()[1:] if x.isdigit()]


def http_json(method: str, url: str, body: Any = None, key: str = "",
              timeout: float = 120.0) -> Any:
    """One HTTP call of a heavy test against a real stack: the JSON answer (or the text,
    e.g. /metrics); an HTTP error status fails with the body in the message."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read().decode()
    except urllib.error.HTTPError as exc:
        raise AssertionError(
            f"{method} {url} answered {exc.code}: {exc.read().decode(errors='replace')[:800]}"
        ) from None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw
