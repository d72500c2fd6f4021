"""A newcomer's first day, the light parts: the documented one-line CLI install from a fresh
clone puts `pdstack` on PATH (and its commands work from there, tables uncut when piped),
and the quickstart's stack checks: a second stack renders beside the first, and a taken
port is named with the process that holds it."""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from pdstack.quickstart import (
    QuickstartError,
    check_free,
    project_name,
    proxy_url,
    stack_ports,
    variant_stack,
)

ROOT = Path(__file__).resolve().parents[2]


def _install_line() -> str:
    """The documented install command (the one line with `pipx install`, in the getting-started
    page the README links to)."""
    doc = ROOT / "docs" / "getting-started.md"
    lines = [ln.split("#")[0].strip() for ln in doc.read_text().splitlines()
             if ln.strip().startswith("pipx install")]
    assert len(lines) == 1, f"{doc.name} should document one pipx install line, has {lines}"
    return lines[0]


def test_fresh_clone_install_line_puts_pdstack_on_path(tmp_path: Path) -> None:
    if shutil.which("pipx") is None:
        pytest.fail("pipx missing: run .ci/install.sh (apt-get install pipx)", pytrace=False)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    bin_dir = tmp_path / "bin"
    env = {**os.environ, "PIPX_HOME": str(tmp_path / "pipx"), "PIPX_BIN_DIR": str(bin_dir),
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    r = subprocess.run(_install_line(), shell=True, cwd=clone, env=env, capture_output=True,
                       text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    found = shutil.which("pdstack", path=env["PATH"])
    assert found == str(bin_dir / "pdstack"), found

    def pdstack(*args: str) -> str:
        res = subprocess.run(["pdstack", *args], cwd=clone, env=env, capture_output=True,
                             text=True, timeout=120, check=False)
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout

    assert "b200x2: ok: 2 node(s)" in pdstack("validate", "-i", "inventory/b200x2")
    table = pdstack("plan", "-i", "inventory/b200x2")  # piped: no terminal
    assert "nixl_side_channel=5600" in table and "MultiConnector" in table, table
    assert "…" not in table, "a piped `pdstack plan` cut a cell"
    # the installed command runs the clone's code (editable), not this checkout's
    where = subprocess.run([str(Path(found).resolve().parent / "python"), "-c",
                            "import pdstack; print(pdstack.__file__)"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(clone)), where


def test_second_stack_renders_beside_the_first_with_its_own_project_and_ports(
    tmp_path: Path,
) -> None:
    stack = variant_stack("cpu2", 1000, out_root=tmp_path)
    first = ROOT / "compose" / "cpu"
    assert project_name(stack) == "pdstack-cpu2" != project_name(first)
    assert stack_ports(stack) == [p + 1000 for p in stack_ports(first)]
    assert proxy_url(stack) == "http://127.0.0.1:9000"
    with pytest.raises(QuickstartError, match="PDSTACK_QUICKSTART_NAME"):
        variant_stack("Bad Name", 1000, out_root=tmp_path / "bad")


def test_taken_port_is_named_with_its_process(tmp_path: Path) -> None:
    if shutil.which("ss") is None or shutil.which("docker") is None:
        pytest.fail("ss (iproute2) and the docker CLI are needed: run .ci/install.sh",
                    pytrace=False)
    # an offset whose ports are all free now, below the ephemeral range (32768+) that other
    # tests' clients and free_port() draw from (a fixed 41000 collided once under xdist)
    for offset in random.Random().sample(range(12000, 22000, 10), 50):
        stack = variant_stack("holdtest", offset, out_root=tmp_path / str(offset))
        try:
            check_free(stack)
            break
        except QuickstartError:
            continue
    port = int(proxy_url(stack).rsplit(":", 1)[1])
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        with pytest.raises(QuickstartError) as info:
            check_free(stack)
    text = str(info.value)
    assert f"port {port}:" in text and f"pid {os.getpid()}" in text, text
    assert "PDSTACK_PORT_OFFSET" in text, text
    assert re.search(r"project pdstack-holdtest", text), text
    check_free(stack)  # free again: no error
