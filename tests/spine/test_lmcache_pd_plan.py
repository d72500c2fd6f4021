"""kv_mode lmcache-pd in the planner: per-rank receiver ports, env, backend table, edges."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pdstack.cli import main
from pdstack.plan import make_plan
from pdstack.ports import make_node_ports
from pdstack.topology import TopologyError, load_topology

REPO = Path(__file__).resolve().parents[2]


def _to_int_list(value: str) -> list[int]:
    """LMCache 0.5.x's env converter for pd_peer_init_port / pd_peer_alloc_port
    (lmcache/v1/config_base.py ``_to_int_list``): comma-separated ints."""
    return [int(p) for p in value.split(",") if p.strip()]


def _inventory(tmp_path: Path, ports: dict | None = None) -> Path:
    """Two 8-GPU nodes, TP 2 everywhere: n1 = proxy + P + D + D, n2 = P + D."""
    inv = tmp_path / "lmpd-tp2"
    (inv / "group_vars").mkdir(parents=True)
    gv = yaml.safe_load((REPO / "inventory/a100x2-lmcache-pd/group_vars/all.yml").read_text())
    gv["pdstack_deployment_name"] = "lmpd-tp2"
    gv["pdstack_tensor_parallel"] = {"prefill": 2, "decode": 2}
    if ports:
        gv["pdstack_ports"] = ports
    (inv / "group_vars/all.yml").write_text(yaml.safe_dump(gv))

    def eng(role: str, gpus: list[int]) -> dict:
        return {"role": role, "gpus": gpus}

    hosts = {
        "n1": {"pdstack_private_address": "10.0.0.1", "pdstack_gpu_count": 8,
               "pdstack_proxy": True,
               "pdstack_engines": [eng("prefill", [0, 1]), eng("decode", [2, 3]),
                                   eng("decode", [4, 5])]},
        "n2": {"pdstack_private_address": "10.0.0.2", "pdstack_gpu_count": 8,
               "pdstack_engines": [eng("prefill", [0, 1]), eng("decode", [2, 3])]},
    }
    doc = {"all": {"children": {"pdstack_nodes": {"hosts": hosts}}}}
    (inv / "hosts.yml").write_text(yaml.safe_dump(doc))
    return inv


def test_tp2_decoders_get_distinct_per_rank_ports_and_env(tmp_path):
    topo = load_topology(_inventory(tmp_path))
    plan = make_plan(topo)
    table = {b.name: b for b in plan.backend_table.backends}
    # n1: prefill-0 (TP 2) holds 7300..7303, decode-0 7304..7307, decode-1 7308..7311
    assert table["n1/decode-0"].lmcache_pd.model_dump() == {
        "host": "10.0.0.1", "init_ports": [7304, 7306], "alloc_ports": [7305, 7307]}
    assert table["n1/decode-1"].lmcache_pd.model_dump() == {
        "host": "10.0.0.1", "init_ports": [7308, 7310], "alloc_ports": [7309, 7311]}
    assert table["n2/decode-0"].lmcache_pd.model_dump() == {
        "host": "10.0.0.2", "init_ports": [7304, 7306], "alloc_ports": [7305, 7307]}
    assert table["n1/prefill-0"].lmcache_pd is None
    assert plan.backend_table.lmcache_pd_notify.model_dump() == {"host": "10.0.0.1", "port": 7299}

    for node in topo.nodes:
        ports = list(make_node_ports(topo, node).values())
        assert len(ports) == len(set(ports)), f"collision on {node.name}: {ports}"
        for svc in plan.nodes[node.name].services:
            if svc.kind != "engine":
                continue
            if svc.role == "decode":
                rx = table[f"{node.name}/{svc.name}"].lmcache_pd
                assert svc.env["LMCACHE_PD_ROLE"] == "receiver"
                assert svc.env["LMCACHE_PD_PEER_HOST"] == node.private_address
                assert _to_int_list(svc.env["LMCACHE_PD_PEER_INIT_PORT"]) == rx.init_ports
                assert _to_int_list(svc.env["LMCACHE_PD_PEER_ALLOC_PORT"]) == rx.alloc_ports
                assert "," in svc.env["LMCACHE_PD_PEER_INIT_PORT"]  # "7304,7306"
            else:
                assert svc.env["LMCACHE_PD_ROLE"] == "sender"
                assert svc.env["LMCACHE_PD_PROXY_HOST"] == "10.0.0.1"
                assert svc.env["LMCACHE_PD_PROXY_PORT"] == "7299"
                assert "LMCACHE_PD_PEER_INIT_PORT" not in svc.env
    proxy = next(s for s in plan.nodes["n1"].services if s.kind == "proxy")
    assert proxy.ports["lmcache_pd_notify"] == 7299
    assert make_node_ports(topo, topo.node("n1"))["proxy lmcache-pd notify"] == 7299
    assert "proxy lmcache-pd notify" not in make_node_ports(topo, topo.node("n2"))


def test_edges_cover_every_rank_and_the_notify_path(tmp_path):
    topo = load_topology(_inventory(tmp_path))
    plan = make_plan(topo)
    edges = {(e.src_node, e.dst_node, e.port): e for e in plan.edges}
    assert len(edges) == len(plan.edges), "edges are deduplicated"
    for p_node in ("n1", "n2"):
        e = edges[(p_node, "n1", 7299)]
        assert e.purpose == "lmcache-pd notify" and e.dst_address == "10.0.0.1"
        for dst, ports in (("n1", range(7304, 7312)), ("n2", range(7304, 7308))):
            for port in ports:
                assert (p_node, dst, port) in edges, (p_node, dst, port)
    assert "rank 1" in edges[("n2", "n1", 7306)].purpose
    # the proxy PULLs; nothing else targets the notify port on other nodes
    assert not [e for e in plan.edges if e.port == 7299 and e.dst_node != "n1"]
    # every edge's port is bound on its destination node
    for e in plan.edges:
        assert e.port in make_node_ports(topo, topo.node(e.dst_node)).values(), e


def test_single_tp_numbers_unchanged_and_render(tmp_path):
    plan = make_plan(load_topology(REPO / "inventory/a100x2-lmcache-pd"))
    (node,) = plan.nodes.values()
    dec = next(s for s in node.services if s.role == "decode")
    assert dec.env["LMCACHE_PD_PEER_INIT_PORT"] == "7302"  # base + 2 * engine index 1
    assert dec.env["LMCACHE_PD_PEER_ALLOC_PORT"] == "7303"
    out = tmp_path / "lmpd"
    assert main(["render", "-i", str(REPO / "inventory/a100x2-lmcache-pd"), "-o", str(out)]) == 0
    data = json.loads((out / "backends.json").read_text())
    assert data["lmcache_pd_notify"] == {"host": "10.0.0.31", "port": 7299}
    (d,) = [b for b in data["backends"] if b["role"] == "decode"]
    assert d["lmcache_pd"] == {"host": "10.0.0.31", "init_ports": [7302], "alloc_ports": [7303]}
    from pdstack.proxy.backends import BackendRegistry

    reg = BackendRegistry.from_table(data)
    assert reg.backends[d["name"]].lmcache_pd == d["lmcache_pd"]


def test_other_modes_keep_their_backend_json():
    for inv in ("local-cpu", "a100x3", "a100x2-nixl"):
        text = make_plan(load_topology(REPO / "inventory" / inv)).backend_table.model_dump_json()
        assert "lmcache_pd" not in text


def test_notify_port_collision_is_reported(tmp_path):
    # base 8101 puts the notify port on 8100, prefill-0's HTTP port on the proxy node
    with pytest.raises(TopologyError, match="port 8100"):
        load_topology(_inventory(tmp_path, ports={"lmcache_pd_base": 8101}))


def test_every_lmcache_pd_engine_gets_the_same_hash_seed(tmp_path: Path) -> None:
    """LMCache keys PD chunks with Python's hash(): without one PYTHONHASHSEED on both
    sides the decoder never finds what the prefiller pushed (LMCache logs an ERROR)."""
    plan = make_plan(load_topology(_inventory(tmp_path)))
    engines = [s for n in plan.nodes.values() for s in n.services if s.kind == "engine"]
    assert {s.role for s in engines} == {"prefill", "decode"}
    for svc in engines:
        assert svc.env.get("PYTHONHASHSEED") == "0", (svc.name, svc.env)
        assert svc.env.get("LMCACHE_SAVE_UNFULL_CHUNK") == "True", (svc.name, svc.env)


def test_lmcache_pd_on_the_cpu_profile_is_refused(tmp_path: Path, capsys) -> None:
    inv = tmp_path / "local-cpu"
    import shutil

    shutil.copytree(REPO / "inventory" / "local-cpu", inv)
    gv_file = inv / "group_vars" / "all.yml"
    gv = yaml.safe_load(gv_file.read_text())
    gv["pdstack_kv_mode"] = "lmcache-pd"
    gv_file.write_text(yaml.safe_dump(gv))
    out = tmp_path / "out"
    assert main(["render", "-i", str(inv), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pdstack_kv_mode" in err and "needs GPUs" in err, err
    assert not out.exists()
