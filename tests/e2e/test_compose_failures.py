"""`up --wait` failures name the failing service and show its last log lines (not a generic
timeout): a wrong model path, and a port already taken. Each runs on a copy of compose/cpu
(inventory/local-cpu rendered outside compose/: it carries pdstack's container files) under
its own project name, with only the service under test (and what it depends on)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pdstack.compose_up import ComposeUpError, compose_down, compose_up
from pdstack.plan import make_plan
from pdstack.render import render_all, write_stacks
from pdstack.topology import load_topology

from .conftest import CPU_STACK, port_in_use, stack_ports

pytestmark = pytest.mark.docker

PROJECT = "pdstack-e2e-fail"


@pytest.fixture()
def stack_copy(docker_ready: None, tmp_path: Path) -> Iterator[Path]:
    busy = [p for p in stack_ports(CPU_STACK) if port_in_use(p)]
    if busy:
        pytest.fail(f"ports {busy} are in use (a running stack?): `docker compose "
                    f"--project-directory compose/cpu down` first")
    d = tmp_path / "stack"
    topo = load_topology(CPU_STACK.parents[1] / "inventory" / "local-cpu")
    rendered = render_all(topo, make_plan(topo))
    (node,) = rendered
    write_stacks(rendered, {node: d})
    assert (d / "compose.yaml").read_text() == (CPU_STACK / "compose.yaml").read_text().replace(
        "../../pdstack:", "./pdstack:")
    try:
        yield d
    finally:
        compose_down(d, project=PROJECT, volumes=True)


def _set_env(stack: Path, key: str, value: str) -> None:
    lines = (stack / ".env").read_text().splitlines()
    assert any(line.startswith(key + "=") for line in lines), f"{key} not in .env"
    (stack / ".env").write_text("\n".join(
        f"{key}={value}" if line.startswith(key + "=") else line for line in lines) + "\n")


def _port(stack: Path, service: str) -> str:
    command = yaml.safe_load((stack / "compose.yaml").read_text())["services"][service]["command"]
    return str(command[command.index("--port") + 1])


def _decode_0_fails(stack: Path) -> tuple[ComposeUpError, float]:
    """Start decode-0 and expect compose_up to fail; the error and the seconds it took."""
    t0 = time.monotonic()
    with pytest.raises(ComposeUpError) as info:
        compose_up(stack, project=PROJECT, services=["decode-0"], timeout=600)
    return info.value, time.monotonic() - t0


def test_wrong_model_path_names_service_and_shows_logs(stack_copy: Path) -> None:
    _set_env(stack_copy, "DECODE_0_MODEL", "/models/no-such-model/rev9")
    err, took = _decode_0_fails(stack_copy)
    msg = str(err)
    print(f"\n[e2e] wrong model path failed after {took:.0f} s:\n{msg}")
    assert [s.service for s in err.failing] == ["decode-0"], msg
    assert "failing service(s): decode-0" in msg
    assert "--- last log lines of decode-0 ---" in msg
    assert "no-such-model" in err.logs["decode-0"], err.logs["decode-0"]
    assert took < 300, f"took {took:.0f} s: the failure was not noticed when the engine exited"


def test_port_taken_names_service_and_shows_logs(stack_copy: Path) -> None:
    port = 8101  # decode-0's HTTP port in compose/cpu
    assert _port(stack_copy, "decode-0") == "8101"
    with socket.socket() as blocker:
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blocker.bind(("127.0.0.1", port))
        blocker.listen(1)
        err, took = _decode_0_fails(stack_copy)
    msg = str(err)
    print(f"\n[e2e] port {port} taken failed after {took:.0f} s:\n{msg}")
    assert [s.service for s in err.failing] == ["decode-0"], msg
    assert "--- last log lines of decode-0 ---" in msg
    assert "in use" in err.logs["decode-0"].lower(), err.logs["decode-0"]
    assert took < 300, f"took {took:.0f} s: the failure was not noticed when the engine exited"


def test_crash_looping_proxy_is_reported_not_waited_for(stack_copy: Path) -> None:
    """The proxy has `restart: unless-stopped`: a bad port makes it crash-loop, which a bare
    `up --wait` would sit through until its timeout."""
    port = 8000
    assert _port(stack_copy, "proxy") == "8000"
    with socket.socket() as blocker:
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        blocker.bind(("127.0.0.1", port))
        blocker.listen(1)
        t0 = time.monotonic()
        with pytest.raises(ComposeUpError) as info:
            compose_up(stack_copy, project=PROJECT, services=["proxy"], timeout=600)
        took = time.monotonic() - t0
    msg = str(info.value)
    print(f"\n[e2e] proxy port {port} taken failed after {took:.0f} s:\n{msg}")
    assert "proxy" in [s.service for s in info.value.failing], msg
    assert "--- last log lines of proxy ---" in msg
    assert took < 120, f"took {took:.0f} s"
