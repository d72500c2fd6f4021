"""Two real nodes (issue 25): ``site.yml`` deploys the cross-node P/D stack of
``inventory/lab-2node`` onto two lab hosts, each with its own Docker engine in its own
network namespace.

Shape (the seed's cross-node runbook scaled to CPU, kv_mode ``shared-l1+nixl``):
  node1 10.77.0.1: proxy, prefill-0, decode-0, LMCache MP server (+ metrics gate)
  node2 10.77.0.2: decode-0, its LMCache MP server (+ metrics gate)
Each node runs ``dockerd`` inside its own network, mount and UTS namespaces
(``Lab.start_docker``: the machine's images cloned by hard links, ~3 s a node), so every
container (``network_mode: host``) lives on its node's eth0 and traffic between nodes
crosses the lab bridge.  Ansible reaches the nodes over real SSH and finds each node's own
``/run/docker.sock``: the inventory points it nowhere else (no DOCKER_HOST, no
in-container health check, unlike a lab node driving the machine's daemon).

The tests run in file order on one module-wide lab (pytest keeps a module's order):
1. a firewall on node1 dropping node2's packets to the NIXL side channel stops site.yml at
   the preflight, naming host, port and purpose; no container exists on either node;
2. check mode on the fresh nodes shows a diff and writes nothing; site.yml deploys both
   nodes (compose files equal ``pdstack render``, secrets file 0600, each node's engine
   runs exactly its planned services, every engine serves, the proxy is healthy); a second
   run changes nothing; no canary secret shows up in any HTTP answer or process argument on
   node1, nor in the LMCache services' environment (issue 27).
Not here yet (README, "Several nodes"): KV moved by NIXL between the two nodes' engines
through the proxy (in containers, vLLM CPU's pull NixlConnector takes ~30 s per handoff over
UCX TCP, so the proxy's wedge detector ejects the decoder), node loss under traffic and
``upgrade.yml`` across the nodes.
Heavy: holds the heavy-run lock (``pdstack.testing.heavy``) for the whole module.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from anshelpers import REPO, VENV_BIN, Lab, node_path, playbook

from pdstack.testing.canaries import canaries, check_stack
from pdstack.testing.heavy import CPU_STACK_IMAGES, heavy_lock, http_json, require_docker

pytestmark = [pytest.mark.netns, pytest.mark.docker]

INVENTORY = REPO / "inventory" / "lab-2node"
PREFIX = "pdlab2"
SECRETS = canaries("2n7c1d")
ADMIN = SECRETS["PDSTACK_ADMIN_TOKEN"]
CLIENT_KEY = SECRETS["PDSTACK_API_KEYS"]
ENGINE_KEY = SECRETS["VLLM_API_KEY"]
PROXY = "http://10.77.0.1:8000"
ENGINES = {"node1/prefill-0": "http://10.77.0.1:8100", "node1/decode-0": "http://10.77.0.1:8101",
           "node2/decode-0": "http://10.77.0.2:8100"}




# --------------------------------------------------------------------------- the lab


@dataclass
class TwoNodes:
    lab: Lab
    inv: Path
    plan: dict[str, Any]
    state: dict[str, Any]


def _inventory(lab: Lab, dest: Path) -> Path:
    inv = lab.write_inventory(dest, source=INVENTORY,
                              group_vars={"stack_secrets": SECRETS, "stack_pull": "never"})
    return inv


def _plan(inv: Path) -> dict[str, Any]:
    out = subprocess.run([str(VENV_BIN / "pdstack"), "plan", "-i", str(inv), "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodes]:
    require_docker(CPU_STACK_IMAGES)
    lab = Lab(prefix=PREFIX, n=2)
    with heavy_lock():
        lab.up()
        try:
            took = {node: lab.start_docker(node) for node in lab.nodes}
            print("\nnode Docker engines up: "
                  + ", ".join(f"{n} {s:.1f}s" for n, s in took.items()))
            inv = _inventory(lab, tmp_path_factory.mktemp("inv2") / "lab-2node")
            with lab.in_ctl():
                yield TwoNodes(lab, inv, _plan(inv), {})
        finally:
            if os.environ.get("PDSTACK_KEEP_LAB") == "1":  # for a developer's look
                print(f"\nPDSTACK_KEEP_LAB=1: lab {PREFIX} left up; DOCKER_HOST per node: "
                      + ", ".join(lab.docker_host(n) for n in lab.nodes))
            else:
                for node in lab.nodes:
                    lab.stop_docker(node)
                lab.down()


def logs(lab: Lab, node: str, service: str, tail: int = 400) -> str:
    """A service's container log, from the node's own Docker engine."""
    dh = ["docker", "-H", lab.docker_host(node)]
    ids = subprocess.run([*dh, "ps", "-aq", "--filter",
                          f"label=com.docker.compose.service={service}"],
                         capture_output=True, text=True, timeout=60).stdout.split()
    if not ids:
        return f"(no {service} container on {node})"
    out = subprocess.run([*dh, "logs", "--tail", str(tail), ids[0]], capture_output=True,
                         text=True, timeout=60)
    return out.stdout + out.stderr


@pytest.fixture
def nodes(two_nodes: TwoNodes, request: pytest.FixtureRequest) -> Iterator[TwoNodes]:
    failed_before = request.session.testsfailed
    two_nodes.lab.clear_faults()
    try:
        yield two_nodes
    finally:
        two_nodes.lab.clear_faults()
        if request.session.testsfailed > failed_before and two_nodes.state.get("deployed"):
            lines = [ln for ln in logs(two_nodes.lab, "node1", "proxy").splitlines()
                     if " INFO " not in ln]
            print("\n--- node1/proxy log, all but INFO (last 60):\n" + "\n".join(lines[-60:]))


# --------------------------------------------------------------------------- 1. preflight


def test_blocked_nixl_side_channel_stops_site_yml_at_preflight(nodes: TwoNodes) -> None:
    lab = nodes.lab
    edge = next(e for e in nodes.plan["edges"] if "nixl side channel" in e["purpose"])
    assert (edge["src_node"], edge["dst_node"]) == ("node2", "node1"), edge
    lab.drop("node1", edge["port"], src="node2")
    run = playbook(lab, "site.yml", nodes.inv, timeout=600)
    assert run.rc != 0, run.tail()
    line = (f"node2 -> node1 {edge['dst_address']}:{edge['port']} ({edge['purpose']}): "
            "no answer within 3s: packets are dropped")
    assert line in run.out, run.tail(200)
    assert "private network preflight failed:" in run.out
    assert "TASK [stack" not in run.out  # the play stopped at the preflight
    for node in lab.nodes:  # nothing started on either node
        ps = lab.ssh(node, "docker ps -aq")
        assert ps.returncode == 0 and ps.stdout.strip() == "", (node, ps.stdout, ps.stderr)
    print(f"\nblocked side channel: site.yml stopped at preflight in {run.seconds:.1f}s")


# --------------------------------------------------------------------------- 2. deploy


def test_site_yml_deploys_both_nodes_idempotently(nodes: TwoNodes, tmp_path: Path) -> None:
    lab, inv = nodes.lab, nodes.inv
    stack_dir = f"/opt/pdstack/{nodes.plan['deployment']}"
    check = playbook(lab, "site.yml", inv, "--check", "--diff", timeout=900)
    assert check.rc == 0, check.tail(150)
    assert check.changed() > 0, check.tail(150)
    assert "+++ after" in check.out  # --diff shows what would change
    for node in lab.nodes:  # ... and nothing was written
        assert not node_path(lab, node, stack_dir).exists(), node
        assert not node_path(lab, node, "/etc/pdstack/secrets.env").exists(), node
    up = playbook(lab, "site.yml", inv, timeout=1500)
    assert up.rc == 0, up.tail(150)
    assert up.changed() > 0
    rendered = tmp_path / "r"
    subprocess.run([str(VENV_BIN / "pdstack"), "render", "-i", str(inv), "-o", str(rendered)],
                   capture_output=True, text=True, check=True)
    for node in lab.nodes:
        got = node_path(lab, node, f"{stack_dir}/compose.yaml").read_text()
        assert got == (rendered / node / "compose.yaml").read_text(), node
        secrets = node_path(lab, node, "/etc/pdstack/secrets.env")
        assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
        # each node's containers run on the node's own engine
        ps = lab.ssh(node, "docker ps --format '{{.Label \"com.docker.compose.service\"}}'")
        assert ps.returncode == 0, (node, ps.stderr)
        want = {s["name"] for s in nodes.plan["nodes"][node]["services"]}
        want |= {"lmcache-metrics"} if "lmcache" in want else set()  # its metrics gate
        assert set(ps.stdout.split()) == want, (node, ps.stdout)
    for name, url in ENGINES.items():  # each engine serves (with its own key)
        root = http_json("GET", f"{url}/v1/models", key=ENGINE_KEY)["data"][0]["root"]
        assert root == "/models/tiny-llama/rev1", (name, root)
    health = http_json("GET", f"{PROXY}/health", timeout=10)
    assert health["status"] == "ok", health
    # node1's own pair answers through the proxy (shared L1 on node1, no NIXL hop: node2's
    # decoder drained meanwhile, see the module docstring)
    drain = f"{PROXY}/admin/backends/node2/decode-0"
    http_json("POST", f"{drain}/drain", key=ADMIN)
    try:
        answer = http_json("POST", f"{PROXY}/v1/completions",
                      {"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True},
                      key=CLIENT_KEY)
    finally:
        http_json("POST", f"{drain}/undrain", key=ADMIN)
    assert answer["usage"]["completion_tokens"] == 4, answer
    nodes.state["deployed"] = True
    again = playbook(lab, "site.yml", inv, timeout=900)
    assert again.rc == 0, again.tail(150)
    assert again.changed() == 0, again.tail(150)
    # no canary in any HTTP answer or process argument on node1 (proxy, engines, LMCache)
    report = check_stack(node_path(lab, "node1", stack_dir), SECRETS, host="10.77.0.1",
                         bearer=ENGINE_KEY, docker_host=lab.docker_host("node1"))
    print(f"\ncheck mode (fresh) {check.seconds:.0f}s, site.yml {up.seconds:.0f}s, again "
          f"{again.seconds:.0f}s (changed=0); canaries: {report.answered} HTTP answers on "
          f"ports {report.ports}, processes {report.processes}: {report.leaks or 'clean'}")
    assert not report.leaks, report.leaks
    assert report.answered >= 20, f"only {report.answered} HTTP answers: nothing checked"
    assert set(report.processes) == {"prefill-0", "decode-0", "lmcache", "lmcache-metrics",
                                     "proxy"}, report.processes
