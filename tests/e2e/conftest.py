"""Shared helpers for the Docker Compose end-to-end tests (marker ``docker``).

Prerequisites come from ``.ci/install.sh`` (which calls ``.ci/install-docker.sh``): a running
Docker engine, Compose v2 and the images ``pdstack/engine-cpu:dev`` + ``pdstack/proxy:dev``.
A missing one FAILS the test with that hint; nothing is skipped.
"""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdstack.quickstart import stack_ports  # noqa: F401  (the tests import it from here)
from pdstack.testing.heavy import CPU_STACK_IMAGES, container_pids, heavy_lock
from pdstack.testing.heavy import require_docker as require_docker_images

ROOT = Path(__file__).resolve().parents[2]
CPU_STACK = ROOT / "compose" / "cpu"
IMAGES = CPU_STACK_IMAGES


def require_docker() -> None:
    require_docker_images(IMAGES)


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def http_get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def parse_prometheus(text: str) -> dict[str, float]:
    """``name{labels}`` -> value (labels kept verbatim, sorted as exposed)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?)\s+(\S+)", line)
        if m:
            try:
                out[m.group(1)] = float(m.group(2))
            except ValueError:
                continue
    return out


def metric_sum(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of every series of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def proc_mem_kib(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in KiB; (0, 0) when it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0, 0
    rss = pss = 0
    for line in text.splitlines():
        if line.startswith("Rss:"):
            rss = int(line.split()[1])
        elif line.startswith("Pss:"):
            pss = int(line.split()[1])
    return rss, pss


def stack_memory(stack_dir: Path, project: str | None = None) -> dict[str, tuple[int, int]]:
    """service -> (RSS KiB, PSS KiB) summed over the processes of its container."""
    from pdstack.compose_up import service_states

    out: dict[str, tuple[int, int]] = {}
    for s in service_states(stack_dir, project):
        if s.state != "running":
            continue
        rss = pss = 0
        for pid in container_pids(s.container):
            r, p = proc_mem_kib(pid)
            rss += r
            pss += p
        out[s.service] = (rss, pss)
    return out


def chat_stream(url: str, model: str, messages: list[dict[str, str]], max_tokens: int = 16,
                timeout: float = 120.0) -> tuple[str, int, float]:
    """POST a streaming chat completion; return (text, chunks with content, TTFT seconds)."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens,
                       "stream": True, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    ttft = -1.0
    parts: list[str] = []
    chunks = 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200, r.status
        assert "text/event-stream" in r.headers.get("Content-Type", "")
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            assert "error" not in event, event
            for choice in event.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    if ttft < 0:
                        ttft = time.monotonic() - t0
                    parts.append(piece)
                    chunks += 1
    return "".join(parts), chunks, ttft


@pytest.fixture(scope="session")
def docker_ready() -> Iterator[None]:
    """Docker prerequisites, then the heavy-run lock held for the whole e2e session (taking
    it per test would let other suites in between, with their own stacks on these ports)."""
    require_docker()
    with heavy_lock():
        yield



@pytest.fixture(scope="package")
def cpu_stack(docker_ready: None) -> Iterator[dict[str, float]]:
    """compose/cpu, up once for every module of this package that asks for it (a cold
    ``up --wait`` is ~60 s on 2 cores: one per module cost that again), down after the
    package's last test."""
    from .test_compose_cpu import cpu_stack_up

    with cpu_stack_up() as stack:
        yield stack


# where each module's tests go in the package's run: the failure tests start their own copy
# of the stack on its ports (so before the shared one is up), the stack's faults last (a
# heal test leaves an engine restarting: the data socket test wants every service as up
# brought them)
_STACK_ORDER = ("tests/e2e/test_compose_failures.py::",
                "tests/e2e/test_compose_cpu.py::",
                "tests/e2e/test_lmcache_data_socket.py::",
                "tests/e2e/test_compose_cpu.py::test_heal_")


def _stack_rank(nodeid: str) -> int:
    ranks = [i for i, prefix in enumerate(_STACK_ORDER) if nodeid.startswith(prefix)]
    return ranks[-1] if ranks else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """This package's tests in the order ``_STACK_ORDER`` (a stable sort: a module keeps its
    own order), in the slots they had: no other test moves."""
    slots = [i for i, item in enumerate(items) if item.nodeid.startswith("tests/e2e/")]
    ordered = sorted((items[i] for i in slots), key=lambda item: _stack_rank(item.nodeid))
    for i, item in zip(slots, ordered, strict=True):
        items[i] = item
