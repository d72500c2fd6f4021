"""The netns lab itself: separate hosts over real SSH, and every fault helper really
breaks (and clear_faults really restores) the path it claims to."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdstack.topology import load_topology

pytestmark = pytest.mark.netns

PROBE = str(Path(__file__).resolve().parents[2] / "scripts" / "pdstack_probe.py")


def connect(lab: Any, src: str, dst: str, port: int, timeout: float = 1.0) -> dict[str, Any]:
    out = lab.node_run(src, ["/usr/bin/python3", PROBE, "connect",
                             f"{lab.address(dst)}:{port}", "--timeout", str(timeout)],
                       check=False).stdout
    return json.loads(out)["connect"][0]


def ping(lab: Any, src: str, dst: str, size: int) -> dict[str, Any]:
    out = lab.node_run(src, ["/usr/bin/python3", PROBE, "ping", lab.address(dst),
                             "--size", str(size), "--timeout", "1"], check=False).stdout
    return json.loads(out)


@pytest.fixture
def listener(clean_lab: Any) -> Iterator[Any]:
    """A probe listening on node1:5600 for the test."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", clean_lab.ns("node1"), "/usr/bin/python3", PROBE, "listen",
         "--bind", f"{clean_lab.address('node1')}:5600", "--seconds", "60",
         "--exit-on-stdin-eof"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    assert json.loads(proc.stdout.readline())["binds"][0]["status"] == "listening"
    try:
        yield clean_lab
    finally:
        proc.stdin.close()
        proc.wait(10)


def test_nodes_are_separate_hosts_over_ssh(clean_lab: Any) -> None:
    for node in clean_lab.nodes:
        res = clean_lab.ssh(node, "hostname; cat /etc/hostname; ip -br addr show eth0")
        assert res.returncode == 0, res.stderr
        hostname, etc_hostname, eth0 = res.stdout.splitlines()[:3]
        assert hostname == etc_hostname == node
        assert f"{clean_lab.address(node)}/24" in eth0
    # private /tmp per node
    assert clean_lab.ssh("node1", "echo one > /tmp/pdstack-lab-mark").returncode == 0
    assert clean_lab.ssh("node2", "test -e /tmp/pdstack-lab-mark").returncode == 1
    assert not Path("/tmp/pdstack-lab-mark").exists()
    # the host keeps its own hostname; nothing in the root namespace is on the lab subnet
    assert Path("/etc/hostname").read_text().strip() not in clean_lab.nodes
    root_addrs = subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
    assert f"{clean_lab.net}." not in root_addrs
    # the bridge lives in the controller namespace: the root namespace's FORWARD policy
    # (dockerd sets DROP) does not apply to it
    ctl_fwd = clean_lab.ctl_run(["iptables", "-S", "FORWARD"], check=True).stdout
    assert "-P FORWARD ACCEPT" in ctl_fwd


def test_drop_reject_and_clear(listener: Any) -> None:
    lab = listener
    assert connect(lab, "node2", "node1", 5600)["status"] == "ok"
    lab.drop("node1", 5600)
    t0 = time.monotonic()
    assert connect(lab, "node2", "node1", 5600)["status"] == "timeout"
    assert time.monotonic() - t0 < 3
    lab.clear_faults()
    assert connect(lab, "node2", "node1", 5600)["status"] == "ok"
    lab.reject("node1", 5600)
    assert connect(lab, "node2", "node1", 5600)["status"] == "refused"
    lab.clear_faults()
    lab.drop("node1", 5600, src="node2")
    assert connect(lab, "node2", "node1", 5600)["status"] == "timeout"
    assert connect(lab, "node3", "node1", 5600)["status"] == "ok"


def test_link_down_and_mtu(listener: Any) -> None:
    lab = listener
    lab.link_down("node1")
    assert connect(lab, "node2", "node1", 5600)["status"] in ("timeout", "host_unreachable")
    assert lab.ssh("node1", "true").returncode != 0
    lab.clear_faults()
    assert connect(lab, "node2", "node1", 5600)["status"] == "ok"

    assert ping(lab, "node1", "node2", 1472)["status"] == "ok"
    assert ping(lab, "node1", "node2", 1473)["status"] == "too_big"  # local MTU 1500
    lab.set_mtu("node1", 9000)  # the host only: the path stays at 1500
    assert ping(lab, "node1", "node2", 8972)["status"] == "timeout"
    lab.set_path_mtu(9000)
    assert ping(lab, "node1", "node2", 8972)["status"] == "ok"
    lab.clear_faults()
    r = ping(lab, "node1", "node2", 8972)
    assert r["status"] == "too_big" and r["mtu"] == 1500


def test_write_inventory_points_at_this_lab(clean_lab: Any, tmp_path: Path) -> None:
    inv = clean_lab.write_inventory(tmp_path / "inv", node_vars={"node2": {"pdstack_mtu": 9000}},
                                    group_vars={"pdstack_deployment_name": "labtest"})
    topo = load_topology(inv)
    assert topo.deployment.name == "labtest"
    assert topo.node("node2").mtu == 9000
    for n in topo.nodes:
        assert n.ssh.key_file == str(clean_lab.key_file)
        assert str(clean_lab.known_hosts) in (n.ssh.common_args or "")
    # the key and known_hosts really let a plain ssh client in
    res = clean_lab.ctl_run(["ssh", "-i", str(clean_lab.key_file), "-o", "BatchMode=yes",
                             *(topo.node("node3").ssh.common_args or "").split(),
                             "root@10.77.0.3", "hostname"], check=False)
    assert res.stdout.strip() == "node3", res.stderr
