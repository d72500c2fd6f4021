"""Helpers for the Ansible tests: the namespaced lab (tests/lab/lab.py, prefix ``pdans``)
with a second, private fabric, and a runner for ansible-playbook over real SSH.

Each lab node gets two links, like a real GPU cluster:
  eth0  10.77.0.N  management network (Ansible's SSH, ``ansible_host``)
  priv0 10.78.0.N  private fabric      (``pdstack_private_address``: NIXL, LMCache, HTTP)
so a fault on the private fabric (link down, MTU, DROP) leaves SSH working and the
playbook can name the broken host, port and cause.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdstack.testing import heavy

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
ANSIBLE_PLAYBOOK = VENV_BIN / "ansible-playbook"
ANSIBLE_LINT = VENV_BIN / "ansible-lint"
PRIV_NET = "10.78.0"
PRIV_IF = "priv0"

netns_lab = heavy.netns_lab()

Lab = netns_lab.Lab
PREFIX = os.environ.get("PDSTACK_ANSIBLE_LAB_PREFIX", "pdans")
INSTALL_HINT = "run .ci/install-ansible-lab.sh (CI: .ci/install.sh)"


# ------------------------------------------------------------------ the private fabric

def add_private_fabric(lab) -> None:
    """Bridge br1 in the controller namespace, a veth ``priv0`` 10.78.0.N in every node."""
    ctl = lab.ctl
    run = lambda *a: subprocess.run(a, check=True, capture_output=True, text=True)  # noqa: E731
    run("ip", "-n", ctl, "link", "add", "br1", "mtu", str(lab.mtu), "type", "bridge")
    run("ip", "-n", ctl, "link", "set", "br1", "up")
    for i, node in enumerate(lab.nodes, start=1):
        ns = lab.ns(node)
        run("ip", "link", "add", f"q{i}", "mtu", str(lab.mtu), "netns", ctl, "type", "veth",
            "peer", "name", PRIV_IF, "mtu", str(lab.mtu), "netns", ns)
        run("ip", "-n", ctl, "link", "set", f"q{i}", "master", "br1", "up")
        run("ip", "-n", ns, "addr", "add", f"{PRIV_NET}.{i}/24", "dev", PRIV_IF)
        run("ip", "-n", ns, "link", "set", PRIV_IF, "up")


def clear_private_faults(lab) -> None:
    """Undo private-fabric faults: firewalls flushed, priv0 up with the lab MTU."""
    for node in lab.nodes:
        lab.node_run(node, ["iptables", "-F", "INPUT"], check=False)
        lab.node_run(node, ["ip", "link", "set", PRIV_IF, "mtu", str(lab.mtu), "up"], check=False)


def priv_address(node: str) -> str:
    return f"{PRIV_NET}.{int(node.removeprefix('node'))}"


# ------------------------------------------------------------------ prerequisites

# ------------------------------------------------------------------ running playbooks

@dataclass
class Run:
    argv: list[str]
    rc: int
    out: str
    seconds: float

    def recap(self) -> dict[str, dict[str, int]]:
        """PLAY RECAP counters per host (the last recap wins)."""
        hosts: dict[str, dict[str, int]] = {}
        for m in re.finditer(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$", self.out, re.M):
            hosts[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
        return hosts

    def changed(self) -> int:
        return sum(h.get("changed", 0) for h in self.recap().values())

    def failed(self) -> int:
        return sum(h.get("failed", 0) + h.get("unreachable", 0) for h in self.recap().values())

    def tail(self, n: int = 120) -> str:
        return "\n".join(self.out.splitlines()[-n:])


def playbook(lab, play: str, inventory: Path, *args: str, timeout: float = 900,
             cp_dir: Path | None = None) -> Run:
    """ansible-playbook from the repository root inside the lab's controller namespace."""
    env = {**os.environ,
           "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
           "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_SSH_CONTROL_PATH_DIR": str(cp_dir or (lab.base / "ansible-cp")),
           "ANSIBLE_LOCAL_TEMP": str(lab.base / "ansible-tmp"),
           "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
    argv = [str(ANSIBLE_PLAYBOOK), play, "-i", str(inventory), *args]
    t0 = time.monotonic()
    proc = subprocess.run(["ip", "netns", "exec", lab.ctl, *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return Run(argv, proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0)


def lab_fixtures(prefix: str = PREFIX):
    """``(alab, clean_alab)``: the session lab with its private fabric; faults undone."""

    @pytest.fixture(scope="session")
    def alab() -> Iterator[object]:
        missing = netns_lab.missing_prerequisites()
        if missing:
            pytest.fail("netns lab prerequisites missing:\n  " + "\n  ".join(missing)
                        + f"\n({INSTALL_HINT})", pytrace=False)
        the_lab = Lab(prefix=prefix)
        try:
            the_lab.up()
            add_private_fabric(the_lab)
        except Exception as exc:
            the_lab.down()
            pytest.fail(f"lab setup failed: {exc}", pytrace=False)
        try:
            yield the_lab
        finally:
            the_lab.down()

    @pytest.fixture
    def clean_alab(alab) -> Iterator[object]:
        clear_private_faults(alab)
        alab.clear_faults()
        try:
            yield alab
        finally:
            clear_private_faults(alab)
            alab.clear_faults()

    return alab, clean_alab


def write_lab_inventory(lab, dest: Path, node_vars: dict | None = None,
                        group_vars: dict | None = None) -> Path:
    """inventory/lab for this lab: SSH on eth0, pdstack's private address on priv0."""
    nv = {n: {"pdstack_private_address": priv_address(n)} for n in lab.nodes}
    for n, extra in (node_vars or {}).items():
        nv[n].update(extra)
    return lab.write_inventory(dest, node_vars=nv, group_vars=group_vars)


def node_path(lab, node: str, path: str) -> Path:
    """Where a file the node wrote under its overlaid /etc or /opt lands on this machine."""
    top, _, rest = path.lstrip("/").partition("/")
    assert top in ("etc", "opt"), path
    return lab.base / "nodes" / node / f"{top}-upper" / rest
