"""``pdstack preflight`` against the namespaced lab: three nodes with real sshd, faults
injected with iptables / ip link inside node namespaces.  Each fault must produce its
specific message, within its timeout, and every run must end well under 30 s."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from pfhelpers import REPO, run_preflight_cli

from pdstack.plan import make_plan
from pdstack.topology import load_topology

pytestmark = pytest.mark.netns

FAST = ("--timeout", "2", "--ssh-timeout", "4")


def plan_edges(inv: Path) -> list[Any]:
    return make_plan(load_topology(inv)).edges


def test_healthy_lab_passes(lab_inventory: Path, clean_lab: Any) -> None:
    run = run_preflight_cli(clean_lab, lab_inventory, *FAST, "--throughput", "0.5")
    assert run.rc == 0, run.explain()
    rep = run.report
    assert rep is not None and rep["ok"] and rep["exit_code"] == 0
    assert rep["summary"]["fail"] == 0 and rep["summary"]["warn"] == 0
    edges = run.checks(kind="edge")
    assert len(edges) == len(plan_edges(lab_inventory)) == 23  # 8 of them KV events
    for c in edges:
        assert c["status"] == "ok"
        # answered by the listener preflight started, not by something else
        assert c["detail"]["connect"]["listener"] == "probe"
        assert c["detail"]["listener"]["status"] == "listening"
    assert len(run.checks(kind="path_mtu", status="ok")) == 6  # every ordered node pair
    assert [c["status"] for c in run.checks(kind="resources")] == ["ok"] * 3  # 1 GiB L1
    assert {n: v["reachable"] for n, v in rep["nodes"].items()} == {
        "node1": True, "node2": True, "node3": True}
    assert rep["nodes"]["node2"]["facts"]["hostname"] == "node2"
    # one TCP stream per (src, dst) node pair joined by a NIXL edge
    tput = run.checks(kind="throughput")
    assert {(c["src"], c["dst"]) for c in tput} == {
        ("node1", "node3"), ("node2", "node1"), ("node2", "node3"), ("node3", "node1")}
    for c in tput:
        t = c["detail"]["throughput"]
        assert c["status"] == "ok" and t["mbit_per_s"] > 0
        assert t["bytes_sent"] == t["bytes_received"] > 0
    assert run.wall_s < 30


def test_human_table_names_the_culprit(lab_inventory: Path, clean_lab: Any) -> None:
    clean_lab.drop("node3", 8101)
    run = run_preflight_cli(clean_lab, lab_inventory, *FAST, json_out=False)
    assert run.rc == 1, run.explain()
    assert "FAIL" in run.stdout and "proxy->decode-0 http" in run.stdout
    assert ("FAIL node1 -> node3 10.77.0.3:8101 (proxy->decode-0 http): timed out after 2.0s"
            in run.stderr), run.explain()


def test_drop_on_one_port_times_out(lab_inventory: Path, clean_lab: Any) -> None:
    clean_lab.drop("node1", 5600)  # node1's prefiller NIXL side channel
    run = run_preflight_cli(clean_lab, lab_inventory, *FAST)
    assert run.rc == 1, run.explain()
    fails = run.failures()
    assert {(c["src"], c["dst"], c["port"]) for c in fails} == {
        ("node2", "node1", 5600), ("node3", "node1", 5600)}
    for c in fails:
        assert c["kind"] == "edge" and c["cause"] == "timeout"
        assert c["purpose"] == "decode-0->prefill-0 nixl side channel"
        assert c["message"] == (
            f"{c['src']} -> node1 10.77.0.1:5600 (decode-0->prefill-0 nixl side channel): "
            "timed out after 2.0s (filtered by a firewall DROP, or no route)")
        assert 1.9 <= c["elapsed_s"] <= 2.6  # within its timeout
    assert run.wall_s < 30


def test_reject_is_refused_at_once(lab_inventory: Path, clean_lab: Any) -> None:
    clean_lab.reject("node3", 8100)
    # a stale / foreign copy of the probe under the expected name is replaced, not run
    digest = hashlib.sha256((REPO / "scripts" / "pdstack_probe.py").read_bytes()).hexdigest()
    cached = f"/tmp/pdstack_probe-{digest[:12]}.py"
    assert clean_lab.ssh("node3", f"echo 'raise SystemExit(3)' > {cached}").returncode == 0
    run = run_preflight_cli(clean_lab, lab_inventory, *FAST)
    assert run.rc == 1, run.explain()
    assert clean_lab.ssh("node3", f"sha256sum {cached}").stdout.startswith(digest)
    [c] = run.failures()
    assert (c["src"], c["dst"], c["port"], c["purpose"], c["cause"]) == (
        "node1", "node3", 8100, "proxy->prefill-0 http", "refused")
    assert "connection refused (nothing listening, or a firewall REJECT)" in c["message"]
    assert c["elapsed_s"] < 1.0


def test_decoder_on_b_cannot_reach_side_channel_on_a(lab_inventory: Path,
                                                     clean_lab: Any) -> None:
    # node1 (A) drops only node2's (B) packets to its NIXL side channel
    clean_lab.drop("node1", 5600, src="node2")
    run = run_preflight_cli(clean_lab, lab_inventory, *FAST)
    assert run.rc == 1, run.explain()
    [c] = run.failures()
    assert c["message"] == (
        "node2 -> node1 10.77.0.1:5600 (decode-0->prefill-0 nixl side channel): "
        "timed out after 2.0s (filtered by a firewall DROP, or no route)")
    # the same port from node3 is fine: the culprit is the B->A path, not the listener
    [ok] = run.checks(kind="edge", src="node3", dst="node1", port=5600)
    assert ok["status"] == "ok"


def test_link_down_names_the_node(lab_inventory: Path, clean_lab: Any) -> None:
    clean_lab.link_down("node2")
    run = run_preflight_cli(clean_lab, lab_inventory, *FAST)
    assert run.rc == 1, run.explain()
    [ssh] = run.checks(kind="ssh", status="fail")
    assert ssh["node"] == "node2" and ssh["cause"] == "ssh_unreachable"
    assert ssh["message"].startswith("node2 (root@10.77.0.2:22): ssh unreachable")
    from_b = run.checks(kind="edge", src="node2")
    assert from_b and all(c["cause"] == "src_unreachable" for c in from_b)
    to_b = run.checks(kind="edge", src="node1", dst="node2")
    assert to_b and all(c["status"] == "fail" and c["cause"] in ("timeout", "host_unreachable")
                        for c in to_b)
    assert all("node2 unreachable over SSH" in c["message"] for c in to_b)
    # the other nodes are unaffected
    assert all(c["status"] == "ok" for c in run.checks(kind="edge", src="node3", dst="node1"))
    assert run.report is not None and run.report["nodes"]["node2"]["reachable"] is False
    assert run.wall_s < 30


def test_mtu_9000_configured_on_a_1500_path(clean_lab: Any, tmp_path: Path) -> None:
    inv = clean_lab.write_inventory(tmp_path / "inv", node_vars={
        n: {"pdstack_mtu": 9000} for n in ("node1", "node2", "node3")})
    # the hosts were set to jumbo frames, the "switch" (bridge ports) was not
    for n in clean_lab.nodes:
        clean_lab.set_mtu(n, 9000, path=False)
    run = run_preflight_cli(clean_lab, inv, *FAST)
    assert run.rc == 1, run.explain()
    assert all(c["status"] == "ok" for c in run.checks(kind="interface_mtu"))
    mtu = run.checks(kind="path_mtu")
    assert len(mtu) == 6
    for c in mtu:
        assert c["status"] == "fail" and c["cause"] == "mtu"
        assert "MTU 9000 fails at size 8972" in c["message"], c["message"]
        assert "1" + "-byte" not in c["message"]
    # TCP still connects (small packets), so edges pass: the culprit is only the MTU
    assert all(c["status"] == "ok" for c in run.checks(kind="edge"))


def test_mtu_9000_configured_on_1500_interfaces(clean_lab: Any, tmp_path: Path) -> None:
    inv = clean_lab.write_inventory(tmp_path / "inv", node_vars={"node2": {"pdstack_mtu": 9000}})
    run = run_preflight_cli(clean_lab, inv, *FAST)
    assert run.rc == 1, run.explain()
    [iface] = run.checks(kind="interface_mtu", status="fail")
    assert iface["message"] == "node2: eth0 MTU 1500 is below the configured pdstack_mtu 9000"
    # node2 -> others only at the common MTU (min of both ends: 1500): fine
    assert all(c["status"] == "ok" for c in run.checks(kind="path_mtu"))


def test_jumbo_path_passes(clean_lab: Any, tmp_path: Path) -> None:
    inv = clean_lab.write_inventory(tmp_path / "inv", node_vars={
        n: {"pdstack_mtu": 9000} for n in ("node1", "node2", "node3")})
    clean_lab.set_path_mtu(9000)
    run = run_preflight_cli(clean_lab, inv, *FAST)
    assert run.rc == 0, run.explain()
    mtu = run.checks(kind="path_mtu")
    assert len(mtu) == 6 and all("MTU 9000 ok (DF ping of 8972 bytes)" in c["message"]
                                 for c in mtu)


def test_every_edge_filtered_finishes_under_30s(lab_inventory: Path, clean_lab: Any) -> None:
    for n in clean_lab.nodes:  # everything but SSH dropped, ICMP too
        clean_lab.node_run(n, ["iptables", "-I", "INPUT", "-p", "tcp", "!", "--dport", "22",
                               "-j", "DROP"])
        clean_lab.drop_icmp(n)
    run = run_preflight_cli(clean_lab, lab_inventory)  # default timeouts (3 s, ssh 5 s)
    assert run.rc == 1, run.explain()
    edges = run.checks(kind="edge")
    assert len(edges) == 23 and all(c["cause"] == "timeout" for c in edges)
    ucx = run.checks(kind="ucx")
    assert len(ucx) == 4 and all(c["cause"] == "timeout" for c in ucx)
    assert all(c["status"] == "warn" and c["cause"] == "icmp_blocked"
               for c in run.checks(kind="path_mtu"))
    assert run.wall_s < 30, run.wall_s
    assert run.report is not None and run.report["duration_s"] < 15


def test_address_rdma_and_listen_problems(clean_lab: Any, tmp_path: Path) -> None:
    # node3 also carries a documentation-range address (198.51.100.0/24: not RFC 1918, and
    # no route to it anywhere, so nothing leaves the namespaces)
    clean_lab.node_run("node3", ["ip", "addr", "add", "198.51.100.3/32", "dev", "eth0"])
    try:
        inv = clean_lab.write_inventory(tmp_path / "inv", node_vars={
            "node1": {"pdstack_private_address": "10.77.0.9"},       # on no interface
            "node2": {"pdstack_rdma": True},                         # no /dev/infiniband here
            "node3": {"pdstack_private_address": "198.51.100.3"},    # not private
        }, group_vars={"pdstack_lmcache": {"l1_size_gb": 4096, "chunk_size": 256}})
        run = run_preflight_cli(clean_lab, inv, *FAST)
    finally:
        clean_lab.node_run("node3", ["ip", "addr", "del", "198.51.100.3/32", "dev", "eth0"],
                           check=False)
    assert run.rc == 1, run.explain()
    msgs = [c["message"] for c in run.failures()]
    assert any(m.startswith("node1: private address 10.77.0.9 is on no interface (has: "
                            "10.77.0.1 on eth0") for m in msgs), msgs
    assert "node1: cannot listen on 10.77.0.9:8100: address not on any interface" in msgs
    [rdma] = run.checks(kind="rdma")
    assert rdma["status"] == "fail" and rdma["cause"] == "rdma_absent" and rdma["node"] == "node2"
    assert rdma["message"].startswith("node2: RDMA expected (pdstack_rdma: true) but absent")
    [addr] = run.checks(kind="address", node="node3", status="fail")
    assert addr["cause"] == "address_not_private"
    assert addr["message"].startswith("node3: address 198.51.100.3 is not private")
    # a 4 TiB LMCache L1 fits no node of this machine
    mem = run.checks(kind="resources")
    assert {c["node"] for c in mem} == {"node1", "node2", "node3"}
    assert all(c["status"] == "fail" and c["cause"] == "memory" and
               "LMCache L1 of 4096 GiB does not fit" in c["message"] for c in mem)
    # the other nodes have no route to 198.51.100.3: refused locally, no packet sent
    to3 = run.checks(kind="edge", src="node1", dst="node3")
    assert to3 and all(c["cause"] == "network_unreachable" for c in to3)


def test_ssh_auth_failure(clean_lab: Any, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong_key"
    import subprocess
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(wrong)],
                   check=True)
    inv = clean_lab.write_inventory(tmp_path / "inv", node_vars={
        "node3": {"ansible_ssh_private_key_file": str(wrong)}})
    run = run_preflight_cli(clean_lab, inv, *FAST)
    assert run.rc == 1
    [c] = run.checks(kind="ssh", status="fail")
    assert c["node"] == "node3" and c["cause"] == "ssh_auth"
    assert "ssh authentication failed" in c["message"]
    assert run.wall_s < 20


def test_library_call_in_the_controller_namespace(clean_lab: Any, tmp_path: Path) -> None:
    """run_preflight(plan) -> PreflightReport, as the Ansible role uses it."""
    inv = clean_lab.write_inventory(tmp_path / "inv")
    clean_lab.reject("node2", 6000)
    code = (
        "import json, sys\n"
        "from pdstack.plan import make_plan\n"
        "from pdstack.topology import load_topology\n"
        "from pdstack.preflight import run_preflight\n"
        f"r = run_preflight(make_plan(load_topology({str(inv)!r})), timeout=2, ssh_timeout=4)\n"
        "print(json.dumps({'ok': r.ok, 'exit': r.exit_code,\n"
        "                  'fail': [c.message for c in r.failures]}))\n"
    )
    proc = clean_lab.ctl_run([sys.executable, "-c", code], timeout=60, env=None)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out == {"ok": False, "exit": 1, "fail": [
        "node2 -> node2 10.77.0.2:6000 (decode-0->lmcache zmq): connection refused "
        "(nothing listening, or a firewall REJECT)"]}


def test_local_node_without_ssh(clean_lab: Any, tmp_path: Path) -> None:
    """A single-node inventory with ansible_connection local (inventory/local-cpu): the
    probe runs as a local process.  Run inside a node namespace so its listeners cannot
    collide with anything on this shared machine."""
    proc = clean_lab.node_run("node1", [
        sys.executable, "-m", "pdstack.cli", "preflight", "-i",
        str(REPO / "inventory" / "local-cpu"), "--json", "--timeout", "2"], check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["nodes"]["local"]["ssh_target"].startswith("local")
    edges = [c for c in rep["checks"] if c["kind"] == "edge"]
    assert edges and all(c["status"] == "ok" and c["dst_address"] == "127.0.0.1"
                         for c in edges)


def test_host_key_checking(clean_lab: Any, tmp_path: Path) -> None:
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    wrong = tmp_path / "wrong_known_hosts"  # node3's address with node1's host key
    line = next(ln for ln in clean_lab.known_hosts.read_text().splitlines()
                if ln.startswith("10.77.0.1 "))
    wrong.write_text(line.replace("10.77.0.1 ", "10.77.0.3 ", 1) + "\n")
    inv = clean_lab.write_inventory(tmp_path / "inv", node_vars={
        "node1": {"ansible_ssh_common_args":
                  f"-o UserKnownHostsFile={empty} -o StrictHostKeyChecking=yes"},
        "node2": {"ansible_ssh_common_args": f"-o UserKnownHostsFile={empty}"},
        "node3": {"ansible_ssh_common_args": f"-o UserKnownHostsFile={wrong}"},
    })
    run = run_preflight_cli(clean_lab, inv, *FAST)
    assert run.rc == 1, run.explain()
    by_node = {c["node"]: c for c in run.checks(kind="ssh")}
    assert by_node["node1"]["status"] == "fail" and by_node["node1"]["cause"] == "host_key"
    assert "StrictHostKeyChecking=yes" in by_node["node1"]["message"]
    # unknown but not strict: accepted, and said so
    assert by_node["node2"]["status"] == "warn"
    assert "is in no known_hosts file; accepted for this run" in by_node["node2"]["message"]
    # a known host presenting another key is never accepted
    assert by_node["node3"]["status"] == "fail" and by_node["node3"]["cause"] == "host_key"
    assert "host key mismatch" in by_node["node3"]["message"]


def test_firewall_with_only_the_planned_ports_breaks_ucx(lab_inventory: Path,
                                                          clean_lab: Any) -> None:
    """Every planned port open on node1, nothing else: the side channel connects, but
    UCX's TCP data path (an ephemeral port) would not."""
    planned = {e.port for e in plan_edges(lab_inventory) if e.dst_node == "node1"}
    clean_lab.allow_only("node1", planned)
    run = run_preflight_cli(clean_lab, lab_inventory, *FAST)
    assert run.rc == 1, run.explain()
    assert all(c["status"] == "ok" for c in run.checks(kind="edge"))
    fails = run.failures()
    assert {(c["kind"], c["src"], c["dst"]) for c in fails} == {
        ("ucx", "node2", "node1"), ("ucx", "node3", "node1")}
    for c in fails:
        assert c["cause"] == "timeout"
        assert c["purpose"] == "decode-0->prefill-0 UCX data path (ephemeral port)"
        assert "UCX over TCP needs the nodes' ephemeral ports open" in c["message"]
    assert all(c["status"] == "ok" for c in run.checks(kind="ucx", dst="node3"))
