"""Planner pairing rules and the renderer, over every committed inventory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdstack.cli import main
from pdstack.plan import BackendTable, make_plan
from pdstack.render import render_all
from pdstack.topology import load_topology

REPO = Path(__file__).resolve().parents[2]
INVENTORIES = sorted(p.name for p in (REPO / "inventory").iterdir() if (p / "hosts.yml").is_file())
REQUIRED = {
    "h200x8-tp8", "a100x2-lmcache-pd", "a100x2-nixl", "a100x4-nixl", "a100x2-shared-l1",
    "a100x3", "b200x1", "b200x2", "local-cpu", "sample",
}


def plan_of(name: str):
    return make_plan(load_topology(REPO / "inventory" / name))


def services(plan, node):
    return {s.name: s for s in plan.nodes[node].services}


def test_every_required_inventory_exists():
    assert set(INVENTORIES) >= REQUIRED


def _compose_bin() -> list[str]:
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
    if probe.returncode != 0:
        pytest.fail("docker compose v2 is missing: run .ci/install-docker.sh")
    return ["docker", "compose"]


@pytest.mark.docker  # `docker compose config` (the Compose CLI from .ci/install.sh)
@pytest.mark.parametrize("name", INVENTORIES)
def test_render_every_inventory_and_compose_accepts_it(tmp_path, name):
    out = tmp_path / "build"
    assert main(["render", "-i", str(REPO / "inventory" / name), "-o", str(out)]) == 0
    files = sorted(out.rglob("compose.yaml"))
    assert files
    for f in files:
        r = subprocess.run([*_compose_bin(), "-f", str(f), "config", "-q"],
                           capture_output=True, text=True, cwd=f.parent)
        assert r.returncode == 0, f"{f}: {r.stderr}"
        doc = yaml.safe_load(f.read_text())
        for svc_name, svc in doc["services"].items():
            assert svc.get("init") is True or "<<" in svc, svc_name
        text = f.read_text()
        assert "0.0.0.0" not in text, f"{f} binds a wildcard address"


# the committed stacks and the inventory each is rendered from: compose/gpu is the measured
# default one-node GPU stack (colocated engine, native KV tier, the proxy's KV admission)
COMMITTED_STACKS = (("local-cpu", "cpu"), ("one-gpu", "gpu"))


@pytest.mark.docker  # `docker compose config` (the Compose CLI from .ci/install.sh)
@pytest.mark.parametrize(("inv", "stack"), COMMITTED_STACKS)
def test_compose_accepts_the_committed_stacks(inv, stack):
    d = REPO / "compose" / stack
    r = subprocess.run([*_compose_bin(), "--project-directory", str(d), "-f",
                        str(d / "compose.yaml"), "config", "-q"], capture_output=True, text=True)
    assert r.returncode == 0, f"compose/{stack}: {r.stderr}"


def test_committed_stacks_equal_a_fresh_render():
    for inv, stack in COMMITTED_STACKS:
        assert main(["render", "-i", str(REPO / "inventory" / inv),
                     "-o", str(REPO / "compose" / stack), "--check"]) == 0, (
            f"compose/{stack} is stale: pdstack render -i inventory/{inv} -o compose/{stack}")


def test_compose_gpu_is_the_measured_default_one_gpu_stack():
    """compose/gpu: one colocated engine on vLLM's native CPU tier, the proxy's KV admission,
    no LMCache (results/h200x1-tiers' default), not the runbook's 1P2D shared-L1 stack."""
    services = yaml.safe_load((REPO / "compose" / "gpu" / "compose.yaml").read_text())["services"]
    running = {n for n, s in services.items() if "profiles" not in s}
    assert running == {"engine-0", "proxy"}
    cmd = services["engine-0"]["command"]
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "OffloadingConnector"
    proxy = services["proxy"]["command"]
    assert proxy[proxy.index("--admission") + 1] == "kv"


def test_one_gpu_keeps_the_topology_measured_as_the_default():
    """inventory/one-gpu (compose/gpu) is inventory/h200x1's measured shape with a real model:
    the same services, KV connector (tier size included) and proxy flags."""
    def shape(name: str) -> list[tuple]:
        plan = plan_of(name)
        (node,) = plan.nodes
        out = []
        for s in plan.nodes[node].services:
            cmd = s.command
            proxy_flags = [a for i, a in enumerate(cmd) if a.startswith("--admission")
                           or (i and cmd[i - 1].startswith("--admission"))]
            out.append((s.kind, s.role, json.dumps(s.kv_transfer_config, sort_keys=True),
                        proxy_flags))
        return out

    assert shape("one-gpu") == shape("h200x1")


def test_a100x3_is_one_lmcache_one_prefiller_two_decoders_one_proxy():
    plan = plan_of("a100x3")
    (node,) = plan.nodes
    kinds = [(s.kind, s.role) for s in plan.nodes[node].services]
    assert kinds.count(("lmcache", None)) == 1
    assert kinds.count(("engine", "prefill")) == 1
    assert kinds.count(("engine", "decode")) == 2
    assert kinds.count(("proxy", None)) == 1
    for s in plan.nodes[node].services:
        if s.kind == "engine":
            assert s.kv_transfer_config["kv_connector"] == "LMCacheMPConnector"
            assert s.depends_on == ["lmcache"]
    assert {p.kv_path for p in plan.backend_table.pairings} == {"shared-l1"}


def test_b200x2_lmcache_per_node_and_nixl_only_on_cross_node_pairs():
    plan = plan_of("b200x2")
    n1, n2 = services(plan, "b200-node1"), services(plan, "b200-node2")
    assert "lmcache" in n1 and "lmcache" in n2
    # the prefiller has decoders on the other node -> MultiConnector[Nixl, LMCacheMP]
    pre = n1["prefill-0"].kv_transfer_config
    assert pre["kv_connector"] == "MultiConnector"
    names = [c["kv_connector"] for c in pre["kv_connector_extra_config"]["connectors"]]
    assert names == ["NixlConnector", "LMCacheMPConnector"]
    # the decoder beside the prefiller only needs the node's store
    assert n1["decode-0"].kv_transfer_config["kv_connector"] == "LMCacheMPConnector"
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in n1["decode-0"].env
    # remote decoders pull over NIXL and still share their own node's store
    for d in ("decode-0", "decode-1"):
        assert n2[d].kv_transfer_config["kv_connector"] == "MultiConnector"
        lmc = n2[d].kv_transfer_config["kv_connector_extra_config"]["connectors"][1]
        assert lmc["kv_connector_extra_config"]["lmcache.mp.host"] == "tcp://10.0.1.22"
    paths = {(p.prefill, p.decode): p.kv_path for p in plan.backend_table.pairings}
    assert paths == {
        ("b200-node1/prefill-0", "b200-node1/decode-0"): "shared-l1",
        ("b200-node1/prefill-0", "b200-node2/decode-0"): "nixl",
        ("b200-node1/prefill-0", "b200-node2/decode-1"): "nixl",
    }
    # the side channel is bound to the prefiller node's private address, and the decoder
    # node must reach it
    assert n1["prefill-0"].env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.1.21"
    side = [e for e in plan.edges if "nixl side channel" in e.purpose]
    assert [(e.src_node, e.dst_node, e.port) for e in side] == [
        ("b200-node2", "b200-node1", 5600)]
    # RDMA nodes get /dev/infiniband in compose
    rendered = render_all(load_topology(REPO / "inventory" / "b200x2"), plan)
    assert "/dev/infiniband" in rendered["b200-node2"]["compose.yaml"]
    assert "backends.json" in rendered["b200-node1"]
    assert "backends.json" not in rendered["b200-node2"]


def test_nixl_pairs_every_prefiller_with_every_decoder():
    plan = plan_of("a100x4-nixl")
    assert len(plan.backend_table.pairings) == 4
    assert {p.kv_path for p in plan.backend_table.pairings} == {"nixl"}
    svc = services(plan, "a100-node1")
    ports = {s.ports["nixl_side_channel"] for s in svc.values() if s.kind == "engine"}
    assert ports == {5600, 5601, 5602, 5603}
    # the default tier on GPUs: the prefillers keep reusable KV in host RAM beside NIXL
    # (128 GiB = 25 % of 512, split over the node's 2 prefillers: 64 GiB each)
    assert svc["prefill-0"].kv_transfer_config == {
        "kv_connector": "MultiConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "NixlConnector", "kv_role": "kv_producer"},
            {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"cpu_bytes_to_use": 64 * 2**30}}]}}
    assert svc["decode-1"].kv_transfer_config == {
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer"}


def test_colocated_has_no_pairings_and_the_native_tier():
    plan = plan_of("h200x8-tp8")
    assert plan.backend_table.pairings == []
    engine = services(plan, "h200-node1")["engine-0"]
    # gpu colocated, pdstack_kv_tier unset: vLLM's native tier, 25 % of the 2048 GiB node
    assert engine.kv_transfer_config == {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 512 * 2**30},
    }
    assert "--tensor-parallel-size" in engine.command
    assert engine.command[engine.command.index("--tensor-parallel-size") + 1] == "8"


def test_cpu_profile_uses_cpu_kv_buffer_and_thread_binding():
    plan = plan_of("local-cpu")
    svc = services(plan, "local")
    binds = {n: svc[n].env["VLLM_CPU_OMP_THREADS_BIND"] for n in ("decode-0", "decode-1")}
    assert svc["prefill-0"].env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert binds == {"decode-0": "0", "decode-1": "1"}, "the decoders must not share a core"
    cmd = svc["lmcache"].command
    assert cmd[cmd.index("--supported-transfer-mode") + 1] == "engine_driven"
    # LMCache's deployment guide: one GPU worker per engine sharing the server (3 here)
    assert cmd[cmd.index("--max-gpu-workers") + 1] == "3"
    assert svc["decode-0"].gpu_ids == []


def test_kv_transfer_config_in_command_is_exact_json():
    plan = plan_of("b200x2")
    s = services(plan, "b200-node1")["prefill-0"]
    arg = s.command[s.command.index("--kv-transfer-config") + 1]
    assert json.loads(arg) == s.kv_transfer_config


def test_model_revision_placeholder_and_generation():
    plan = plan_of("local-cpu")
    s = services(plan, "local")["decode-0"]
    assert "/models/tiny-llama/rev1" in s.command
    assert s.generation == "rev1@pdstack/engine-cpu:dev"
    assert {b.generation for b in plan.backend_table.backends} == {s.generation}


def test_adhoc_backend_table():
    t = BackendTable.adhoc(["http://a:1"], ["http://b:2", "http://c:3"], "nixl")
    assert [p.decode for p in t.pairings] == ["local/decode-0", "local/decode-1"]
    assert BackendTable.adhoc(["http://a:1"], [], "colocated").pairings == []


def test_render_replaces_only_stack_files(tmp_path):
    inv = tmp_path / "inv"
    shutil.copytree(REPO / "inventory" / "local-cpu", inv)
    out = tmp_path / "stack"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["render", "-i", str(inv), "-o", str(out)]) == 0
    assert (out / "keep.txt").read_text() == "mine"
    assert (out / "compose.yaml").is_file() and (out / ".env").is_file()
    assert main(["render", "-i", str(inv), "-o", str(out), "--check"]) == 0
    (out / ".env").write_text("tampered\n")
    assert main(["render", "-i", str(inv), "-o", str(out), "--check"]) == 1


def test_cpu_nixl_engines_hide_the_numa_topology_from_vllm():
    """vLLM's NIXL connector on CPU would move every NIXL engine's main thread to the node's
    last core (NUMA_SYSFS_MASK in pdstack/plan_engine.py); only those engines get the mask."""
    plan = plan_of("lab-2node")  # shared-l1+nixl: node1's prefiller and node2's decoder
    node1, node2 = services(plan, "node1"), services(plan, "node2")
    masked = {f"{n}/{s.name}" for n, svc in (("node1", node1), ("node2", node2))
              for s in svc.values() if s.tmpfs}
    assert masked == {"node1/prefill-0", "node2/decode-0"}
    assert node2["decode-0"].tmpfs == ["/sys/devices/system/node:ro,size=4k"]
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in node1["decode-0"].env  # LMCache only
    # GPU engines and CPU engines without NIXL keep the image's view
    for name in ("b200x2", "local-cpu"):
        plan = plan_of(name)
        assert not [s.name for n in plan.nodes.values() for s in n.services if s.tmpfs], name
    text = render_all(load_topology(REPO / "inventory" / "lab-2node"),
                      make_plan(load_topology(REPO / "inventory" / "lab-2node")))
    doc = yaml.safe_load(text["node2"]["compose.yaml"])
    assert doc["services"]["decode-0"]["tmpfs"] == ["/sys/devices/system/node:ro,size=4k"]
    assert "tmpfs" not in yaml.safe_load(text["node1"]["compose.yaml"])["services"]["decode-0"]


def test_validate_and_plan_need_no_dashboard_builder():
    """A GPU host's minimal environment (the lent H200's payload) has no
    grafana_foundation_sdk: `pdstack validate` and `pdstack plan --json` still work there;
    only `render` needs it. With the import blocked, plan prints the planned engine."""
    block = (
        "import builtins, sys\n"
        "real = builtins.__import__\n"
        "def imp(name, *a, **k):\n"
        "    if name.split('.')[0] == 'grafana_foundation_sdk':\n"
        "        raise ImportError('blocked for this test')\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = imp\n"
        "from pdstack.cli import main\n"
        "sys.argv = ['pdstack', *sys.argv[1:]]\n"
        "sys.exit(main())\n"
    )
    for args in (["validate", "-i", "inventory/h200x1"],
                 ["plan", "-i", "inventory/h200x1", "--json"]):
        r = subprocess.run([sys.executable, "-c", block, *args], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, f"{args}: {r.stderr[-800:]}"
    plan = json.loads(r.stdout)
    assert [s["name"] for n in plan["nodes"].values() for s in n["services"]] == ["engine-0",
                                                                                 "proxy"]
    blocked = subprocess.run([sys.executable, "-c", block, "render", "-i", "inventory/h200x1",
                              "-o", "/nonexistent-dir-never-written"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert blocked.returncode != 0 and "blocked for this test" in blocked.stderr
