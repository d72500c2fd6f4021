"""ansible-playbook site.yml / preflight.yml / deploy.yml over real SSH.

Without the lab: syntax check of every entry playbook, ansible-lint's production
profile, and the inventory validation that stops a run before any host is touched.
With the lab (marker ``netns``; tests/lab/netns_lab.sh nodes with their own sshd):
converge, idempotence (``changed=0``), check mode, ``gpu_host`` on GPU-less hosts (fails
unless the CPU profile is set), and a broken private network stopping the play at the
preflight with the host, the port and the cause named.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from anshelpers import (
    ANSIBLE_LINT,
    ANSIBLE_PLAYBOOK,
    PRIV_IF,
    REPO,
    VENV_BIN,
    playbook,
    priv_address,
    write_lab_inventory,
)

ENTRY_PLAYBOOKS = ["site.yml", "upgrade.yml", "ansible/site.yml", "ansible/preflight.yml",
                   "ansible/deploy.yml", "ansible/upgrade.yml"]


def _plan(inventory: Path) -> dict:
    out = subprocess.run([str(VENV_BIN / "pdstack"), "plan", "-i", str(inventory), "--json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def _local_playbook(play: str, inventory: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
    return subprocess.run([str(ANSIBLE_PLAYBOOK), play, "-i", str(inventory), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


def _unreachable_copy(src: Path, dest: Path, edit=None) -> Path:
    """Copy an inventory, pointing every host at a closed local port (nothing leaves)."""
    shutil.copytree(src, dest)
    hosts = yaml.safe_load((dest / "hosts.yml").read_text())
    for hv in hosts["all"]["children"]["pdstack_nodes"]["hosts"].values():
        hv["ansible_host"] = "127.0.0.1"
        hv["ansible_port"] = 1
        hv.pop("ansible_connection", None)
    if edit:
        edit(hosts)
    (dest / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
    return dest


# ---------------------------------------------------------------------------- no lab

SYNTAX_INVENTORIES = ("inventory/b200x2", "inventory/lab", "inventory/local-cpu")


@pytest.fixture(scope="module")
def syntax_all_plays() -> dict[str, subprocess.CompletedProcess]:
    """One ``ansible-playbook --syntax-check`` of every entry playbook per inventory (3
    interpreter starts instead of 18): any failing playbook makes its run exit non-zero."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"}
    return {inv: subprocess.run([str(ANSIBLE_PLAYBOOK), *ENTRY_PLAYBOOKS, "-i", str(REPO / inv),
                                 "--syntax-check"], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=300)
            for inv in SYNTAX_INVENTORIES}


@pytest.mark.parametrize("play", ENTRY_PLAYBOOKS)
def test_syntax_check(play, syntax_all_plays):
    for inv in SYNTAX_INVENTORIES:
        together = syntax_all_plays[inv]
        assert f"playbook: {play}\n" in together.stdout or together.returncode != 0, (
            f"{play} -i {inv} was not checked:\n{together.stdout}\n{together.stderr}")
        if together.returncode == 0:
            continue
        # some playbook failed: check this one alone, so the failure names its playbook
        proc = _local_playbook(play, REPO / inv, "--syntax-check")
        assert proc.returncode == 0, f"{play} -i {inv}:\n{proc.stdout}\n{proc.stderr}"


def test_ansible_lint_production():
    proc = subprocess.run([str(ANSIBLE_LINT), "--profile", "production", "--nocolor",
                           "site.yml", "upgrade.yml", "ansible/"], cwd=REPO,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '')}"})
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert "Profile 'production' was required, and it passed" in proc.stdout + proc.stderr


def test_invalid_inventory_stops_before_any_host(tmp_path):
    def break_it(hosts):
        node = hosts["all"]["children"]["pdstack_nodes"]["hosts"]["b200-node2"]
        node["pdstack_mtu"] = 100

    inv = _unreachable_copy(REPO / "inventory" / "b200x2", tmp_path / "broken", break_it)
    gv = inv / "group_vars" / "all.yml"
    gv.write_text(gv.read_text().replace("pdstack_kv_mode: shared-l1+nixl",
                                         "pdstack_kv_mode: shared-l3"))
    cli = subprocess.run([str(VENV_BIN / "pdstack"), "validate", "-i", str(inv)],
                         capture_output=True, text=True)
    assert cli.returncode == 2
    errors = [line.strip().removeprefix("error: ") for line in cli.stderr.splitlines()
              if line.strip().startswith("error:")]
    assert len(errors) >= 2

    proc = _local_playbook("site.yml", inv)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    for err in errors:  # the very messages of `pdstack validate`
        assert err in out, f"missing {err!r} in:\n{out}"
    assert "unknown KV mode 'shared-l3'" in out
    assert "b200-node2.pdstack_mtu: Input should be greater than or equal to 576" in out
    assert "Gathering Facts" not in out  # no host was touched
    assert "unreachable=1" not in out and "UNREACHABLE" not in out


def test_profile_override_on_the_command_line_is_refused(tmp_path):
    """GPU checks are turned off by the inventory, never by a stray -e."""
    inv = _unreachable_copy(REPO / "inventory" / "b200x2", tmp_path / "b200x2")
    proc = _local_playbook("site.yml", inv, "-e", "pdstack_profile=cpu")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert ("pdstack_profile is cpu here but the inventory files say gpu: set pdstack_profile "
            "in group_vars/all.yml, not with -e") in out.replace("\n", " ").replace("  ", " ")
    assert "Gathering Facts" not in out


# ---------------------------------------------------------------------------- the lab

def _gpu_inventory(lab, dest: Path) -> Path:
    """The lab topology as a GPU deployment: one GPU per engine (the nodes have none)."""
    lab_hosts = yaml.safe_load((REPO / "inventory" / "lab" / "hosts.yml").read_text())
    node_vars = {}
    for name, hv in lab_hosts["all"]["children"]["pdstack_nodes"]["hosts"].items():
        engines = [{"role": e["role"], "gpus": [i]} for i, e in enumerate(hv["pdstack_engines"])]
        node_vars[name] = {"pdstack_gpu_count": len(engines), "pdstack_engines": engines,
                           "pdstack_gpu_model": "NVIDIA H200"}
    return write_lab_inventory(lab, dest, node_vars=node_vars,
                               group_vars={"pdstack_profile": "gpu"})


@pytest.mark.netns
def test_gpu_host_fails_on_hosts_without_gpus(clean_alab, tmp_path):
    lab = clean_alab
    inv = _gpu_inventory(lab, tmp_path / "gpu")
    run = playbook(lab, "ansible/preflight.yml", inv, "--tags", "gpu")
    assert run.rc != 0, run.tail()
    flat = " ".join(run.out.split())
    for node in lab.nodes:
        assert (f"{node}: no NVIDIA GPU usable: `nvidia-smi` not found. The inventory expects "
                f"pdstack_gpu_count=") in flat, run.tail()
    assert "set pdstack_profile: cpu in the inventory's group_vars/all.yml" in flat
    assert "TASK [gpu_host : Fail when the node has no usable NVIDIA driver]" in run.out
    assert "TASK [container_runtime" not in run.out  # stopped right there


@pytest.mark.netns
def test_gpu_host_passes_with_the_cpu_profile(clean_alab, tmp_path):
    lab = clean_alab
    inv = write_lab_inventory(lab, tmp_path / "cpu")
    assert yaml.safe_load((inv / "group_vars" / "all.yml").read_text())["pdstack_profile"] == "cpu"
    run = playbook(lab, "ansible/preflight.yml", inv, "--tags", "gpu")
    assert run.rc == 0, run.tail()
    for node in lab.nodes:
        assert f"{node}: GPU checks off: pdstack_profile is cpu (set in the inventory)" in run.out


@pytest.mark.netns
def test_rdma_expected_but_missing_fails(clean_alab, tmp_path):
    lab = clean_alab
    inv = write_lab_inventory(lab, tmp_path / "rdma", node_vars={"node2": {"pdstack_rdma": True}})
    run = playbook(lab, "ansible/preflight.yml", inv, "--tags", "rdma")
    assert run.rc != 0, run.tail()
    flat = " ".join(run.out.split())
    assert ("node2: the inventory sets pdstack_rdma: true but NIXL would fall back to TCP: "
            "no /dev/infiniband (no RDMA device or driver)") in flat, run.tail()
    for node in ("node1", "node3"):  # reported, not failed
        assert f"{node}: NIXL transport TCP fallback (no /dev/infiniband" in flat
    assert run.recap()["node2"]["failed"] == 1 and run.recap()["node1"]["failed"] == 0


def _edge(plan: dict, purpose_part: str, dst: str) -> dict:
    return next(e for e in plan["edges"] if purpose_part in e["purpose"] and e["dst_node"] == dst)


# faults on distinct edges share one playbook run (each ~15 s here): a drop on node2's LMCache
# port, a drop on node3's NIXL side channel and node2's MTU are reported side by side; a
# link down hides everything else on its node, so it runs alone
FAULT_SETS = [("lmcache-port-drop", "nixl-port-drop", "mtu-mismatch"), ("link-down",)]


def _inject(lab, plan: dict, fault: str) -> list[str]:
    """Break the lab's private network one way; the lines the preflight must print."""
    expect: list[str] = []
    if fault == "lmcache-port-drop":
        e = _edge(plan, "lmcache zmq", "node2")
        lab.drop("node2", e["port"])
        expect.append(f"{e['src_node']} -> node2 {e['dst_address']}:{e['port']} ({e['purpose']}): "
                      "no answer within 3s: packets are dropped")
    elif fault == "nixl-port-drop":
        e = _edge(plan, "nixl side channel", "node3")
        lab.drop("node3", e["port"])
        srcs = sorted({x["src_node"] for x in plan["edges"]
                       if x["dst_node"] == "node3" and x["port"] == e["port"]})
        for src in srcs:
            expect.append(f"{src} -> node3 {e['dst_address']}:{e['port']} (")
        expect.append("nixl side channel): no answer within 3s: packets are dropped")
    elif fault == "link-down":
        lab.node_run("node2", ["ip", "link", "set", PRIV_IF, "down"])
        expect.append(f"interface {PRIV_IF} ({priv_address('node2')}) is down")
        e = _edge(plan, "http", "node2")
        expect.append(f"{e['src_node']} -> node2 {e['dst_address']}:{e['port']} ({e['purpose']}): ")
    elif fault == "mtu-mismatch":
        lab.node_run("node2", ["ip", "link", "set", PRIV_IF, "mtu", "1400"])
        expect.append(f"interface {PRIV_IF} ({priv_address('node2')}) MTU is 1400 but the "
                      "inventory says pdstack_mtu 1500 (MTU mismatch)")
        peer = next(x["src_node"] for x in plan["edges"]
                    if x["dst_node"] == "node2" and x["src_node"] != "node2")
        expect.append(f"{peer} -> node2 {priv_address('node2')}: path MTU below 1500")
    return expect


@pytest.mark.netns
@pytest.mark.parametrize("faults", FAULT_SETS, ids="+".join)
def test_broken_private_network_stops_at_preflight(clean_alab, tmp_path, faults):
    lab = clean_alab
    inv = write_lab_inventory(lab, tmp_path / "inv")
    plan = _plan(inv)
    expect = {fault: _inject(lab, plan, fault) for fault in faults}
    run = playbook(lab, "site.yml", inv, "--tags", "network,stack", "-e", "stack_compose_up=false")
    assert run.rc != 0, run.tail()
    for fault, texts in expect.items():
        for text in texts:
            assert text in run.out, f"{fault}: missing {text!r}\n{run.tail(200)}"
    assert "private network preflight failed:" in run.out
    assert "TASK [private_network : Stop when the private network is broken]" in run.out
    assert "TASK [stack" not in run.out  # the play stopped at the preflight
    print(f"\n{'+'.join(faults)}: stopped at preflight in {run.seconds:.1f}s")
