"""The KV modes (pdstack.kvmodes): planner, ad-hoc table and proxy registry agree on every
mode's pairing rule; the nixl+l1 / colocated+l1 engine configs; share_gpu validation."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml

from pdstack import kvmodes, topology
from pdstack.cli import main
from pdstack.plan import BackendTable, Plan, make_plan
from pdstack.proxy.backends import BackendRegistry, BackendState, derive_kv_path
from pdstack.testing.cases import named_cases
from pdstack.topology import TopologyError, load_topology

LMCACHE_ZMQ = 6000


def _write(
    tmp: Path,
    kv_mode: str,
    nodes: dict[str, list[dict]],
    profile: str = "gpu",
    extra_vars: dict | None = None,
) -> Path:
    """An inventory: node name -> engine dicts (GPU ids filled in per node when absent);
    the first node runs the proxy."""
    inv = tmp / f"inv-{kv_mode.replace('+', '-')}-{len(nodes)}-{profile}"
    (inv / "group_vars").mkdir(parents=True)
    gv = {
        "pdstack_deployment_name": inv.name,
        "pdstack_profile": profile,
        "pdstack_kv_mode": kv_mode,
        "pdstack_engine_image": "pdstack/engine:test",
        "pdstack_model": {"name": "org/model", "served_name": "m", "max_model_len": 4096},
        **(extra_vars or {}),
    }
    (inv / "group_vars" / "all.yml").write_text(yaml.safe_dump(gv))
    hosts = {}
    for i, (name, engines) in enumerate(nodes.items()):
        filled = []
        for j, eng in enumerate(engines):
            eng = dict(eng)
            if profile == "gpu":
                eng.setdefault("gpus", [j])
            filled.append(eng)
        gpus = {g for e in filled for g in e.get("gpus", [])}
        hosts[name] = {
            "pdstack_private_address": f"10.0.0.{i + 1}",
            "pdstack_gpu_count": (max(gpus) + 1) if gpus else 0,
            "pdstack_engines": filled,
        }
        if profile == "gpu":  # sizes the native KV tier of gpu colocated engines (25 %)
            hosts[name]["pdstack_host_memory_gb"] = 256
        if i == 0:
            hosts[name]["pdstack_proxy"] = True
    doc = {"all": {"children": {"pdstack_nodes": {"hosts": hosts}}}}
    (inv / "hosts.yml").write_text(yaml.safe_dump(doc))
    return inv


def _layouts(mode: kvmodes.KvMode) -> dict[str, dict[str, list[dict]]]:
    if not mode.disaggregated:
        return {
            "one node": {"n1": [{"role": "colocated"}, {"role": "colocated"}]},
            "two nodes": {
                "n1": [{"role": "colocated"}, {"role": "colocated"}],
                "n2": [{"role": "colocated"}],
            },
        }
    pd = [{"role": "prefill"}, {"role": "decode"}, {"role": "decode"}]
    return {
        "one node": {"n1": pd},
        # every node has both roles: also valid for same-node-only modes (shared-l1)
        "two nodes": {"n1": pd, "n2": [{"role": "prefill"}, {"role": "decode"}]},
    }


CASES = [(name, layout) for name in kvmodes.NAMES for layout in ("one node", "two nodes")]


def _plan(tmp: Path, kv_mode: str, nodes: dict[str, list[dict]]) -> Plan:
    return make_plan(load_topology(_write(tmp, kv_mode, nodes)))


def _state(b: dict) -> BackendState:
    return BackendState(name=b["name"], role=b["role"], node=b["node"], url=b["url"])


def test_topology_literal_is_the_mode_list() -> None:
    assert typing.get_args(topology.KvMode) == kvmodes.NAMES
    assert set(kvmodes.NAMES) == set(kvmodes.MODES)
    for name, mode in kvmodes.MODES.items():
        assert mode.name == name
        assert kvmodes.get(name) is mode
    with pytest.raises(kvmodes.UnknownKvMode, match="nixl\\+l1"):
        kvmodes.get("mooncake")


@pytest.mark.parametrize(("kv_mode", "layout"), CASES, ids=[f"{m}-{lay}" for m, lay in CASES])
def test_plan_adhoc_and_proxy_agree_on_pairings(
    tmp_path: Path, kv_mode: str, layout: str
) -> None:
    mode = kvmodes.get(kv_mode)
    plan = _plan(tmp_path, kv_mode, _layouts(mode)[layout])
    table = plan.backend_table.model_dump(mode="json")
    backends = {b["name"]: b for b in table["backends"]}
    planned = {(p.prefill, p.decode): p.kv_path for p in plan.backend_table.pairings}

    # the planner's pairings are the mode's rule applied to every P x D
    expected = {}
    for p in (b for b in backends.values() if b["role"] == "prefill"):
        for d in (b for b in backends.values() if b["role"] == "decode"):
            path = mode.kv_path(same_node=p["node"] == d["node"])
            if path is not None:
                expected[(p["name"], d["name"])] = path
    assert planned == expected
    if mode.disaggregated:
        assert planned, "a P/D plan without pairings"
        if layout == "two nodes":
            crossing = [k for k in planned if backends[k[0]]["node"] != backends[k[1]]["node"]]
            assert bool(crossing) == mode.cross_node
    else:
        assert planned == {}
        assert {b["role"] for b in backends.values()} == {"colocated"}

    # the proxy's registry keeps exactly the planner's pairings, and derives the same path
    reg = BackendRegistry.from_table(table)
    assert reg.mode is mode
    got = {(p, d): path for p, decs in reg.pairings.items() for d, path in decs.items()}
    assert got == planned
    for (p, d), path in planned.items():
        assert derive_kv_path(kv_mode, _state(backends[p]), _state(backends[d])) == path

    # the admin API's upsert (rolling upgrade) re-derives the same pairings
    reg2 = BackendRegistry.from_table({**table, "pairings": []})
    for b in table["backends"]:
        if b["role"] == "prefill":
            reg2.upsert({**b, "name": b["name"] + "-new"})
    for (p, d), path in planned.items():
        assert reg2.pairings[p + "-new"][d] == path

    # BackendTable.adhoc (flags): everything on one node, so every pair uses the same-node
    # path, and the proxy agrees
    n_pre = sum(b["role"] == "prefill" for b in backends.values()) or 1
    n_dec = sum(b["role"] == "decode" for b in backends.values()) or 1
    pre_urls = [f"http://127.0.0.1:{9000 + i}" for i in range(n_pre)]
    dec_urls = [f"http://127.0.0.1:{9100 + i}" for i in range(n_dec)]
    adhoc = BackendTable.adhoc(pre_urls, dec_urls, kv_mode)
    adhoc_reg = BackendRegistry.from_table(adhoc)
    if mode.disaggregated:
        same = mode.kv_path(same_node=True)
        assert same is not None
        assert len(adhoc.pairings) == n_pre * n_dec
        assert {p.kv_path for p in adhoc.pairings} == {same}
        assert {b.node for b in adhoc.backends} == {"local"}
        ahb = {b.name: b.model_dump() for b in adhoc.backends}
        for p in adhoc.pairings:
            assert adhoc_reg.pairings[p.prefill][p.decode] == p.kv_path
            assert derive_kv_path(kv_mode, _state(ahb[p.prefill]), _state(ahb[p.decode])) == same
    else:
        assert adhoc.pairings == []
        assert [b.role for b in adhoc.backends] == ["colocated"] * (n_pre + n_dec)
        assert adhoc_reg.pairings == {}


def _lmcache_budgets(profile: str) -> dict[str, float]:
    """The LMCache MP client's budgets the planner sets on the cpu profile (pdstack/plan_engine.py:
    a blocking RPC to a killed server gives up after 1 s, the outage is seen within 2 s)."""
    if profile == "cpu":
        return {"lmcache.mp.mq_timeout": 1.0, "lmcache.mp.heartbeat_interval": 1.0}
    return {}


def _engines(plan: Plan, node: str) -> dict[str, object]:
    return {s.name: s for s in plan.nodes[node].services if s.kind == "engine"}


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_nixl_l1_engine_configs(tmp_path: Path, profile: str) -> None:
    pd = [{"role": "prefill"}, {"role": "decode"}]
    inv = _write(tmp_path, "nixl+l1", {"n1": pd}, profile=profile)
    plan = make_plan(load_topology(inv))
    node = plan.nodes["n1"]
    services = {s.name: s for s in node.services}
    assert set(services) == {"lmcache", "prefill-0", "decode-0", "proxy"}
    pre, dec = services["prefill-0"], services["decode-0"]

    nixl_extra = {"kv_buffer_device": "cpu"} if profile == "cpu" else {}
    assert pre.kv_transfer_config == {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_producer", **nixl_extra},
                {
                    "kv_connector": "LMCacheMPConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "lmcache.mp.host": "tcp://10.0.0.1",
                        "lmcache.mp.port": LMCACHE_ZMQ,
                        **_lmcache_budgets(profile),
                    },
                },
            ]
        },
        "kv_load_failure_policy": "fail",
    }
    assert dec.kv_transfer_config == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        **nixl_extra,
        "kv_load_failure_policy": "fail",
    }
    # the command line carries exactly that config
    import json

    for svc in (pre, dec):
        arg = svc.command[svc.command.index("--kv-transfer-config") + 1]
        assert json.loads(arg) == svc.kv_transfer_config
        assert svc.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.1"
        assert "nixl_side_channel" in svc.ports
    # the LMCache server is there; only the prefiller depends on / talks to it
    assert services["lmcache"].kind == "lmcache"
    assert pre.depends_on == ["lmcache"]
    assert dec.depends_on == []
    purposes = {e.purpose for e in plan.edges}
    assert "prefill-0->lmcache zmq" in purposes
    assert "decode-0->lmcache zmq" not in purposes
    assert "decode-0->prefill-0 nixl side channel" in purposes
    assert [(p.prefill, p.decode, p.kv_path) for p in plan.backend_table.pairings] == [
        ("n1/prefill-0", "n1/decode-0", "nixl")
    ]


def test_nixl_l1_across_nodes(tmp_path: Path) -> None:
    """A decoder-only node talks NIXL only; the prefill node keeps its LMCache tier."""
    inv = _write(tmp_path, "nixl+l1", {"n1": [{"role": "prefill"}], "n2": [{"role": "decode"}]})
    plan = make_plan(load_topology(inv))
    pre = plan.nodes["n1"].service("prefill-0")
    dec = plan.nodes["n2"].service("decode-0")
    assert pre.kv_transfer_config is not None and dec.kv_transfer_config is not None
    assert pre.kv_transfer_config["kv_connector"] == "MultiConnector"
    assert dec.kv_transfer_config["kv_connector"] == "NixlConnector"
    assert [p.kv_path for p in plan.backend_table.pairings] == ["nixl"]
    assert "lmcache" in {s.name for s in plan.nodes["n1"].services}
    # no engine on n2 uses a tier: no LMCache server (its L1 would be host RAM for nothing)
    assert "lmcache" not in {s.name for s in plan.nodes["n2"].services}
    assert not [e for e in plan.edges if e.dst_node == "n2" and "lmcache" in e.purpose]


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_colocated_l1_engines_use_the_node_tier(tmp_path: Path, profile: str) -> None:
    nodes = {"n1": [{"role": "colocated"}, {"role": "colocated"}], "n2": [{"role": "colocated"}]}
    plan = make_plan(load_topology(_write(tmp_path, "colocated+l1", nodes, profile=profile)))
    assert plan.backend_table.pairings == []
    for name, node in plan.nodes.items():
        services = {s.name: s for s in node.services}
        assert services["lmcache"].kind == "lmcache", name
        lm_cmd = services["lmcache"].command
        assert lm_cmd[lm_cmd.index("--host") + 1] == node.private_address
        engines = _engines(plan, name)
        assert engines
        for svc in engines.values():
            assert svc.kv_transfer_config == {  # type: ignore[attr-defined]
                "kv_connector": "LMCacheMPConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "lmcache.mp.host": f"tcp://{node.private_address}",
                    "lmcache.mp.port": LMCACHE_ZMQ,
                    **_lmcache_budgets(profile),
                },
            }
            assert svc.depends_on == ["lmcache"]  # type: ignore[attr-defined]
            assert not any(k.startswith("VLLM_NIXL") for k in svc.env)  # type: ignore[attr-defined]
    # plain colocated without a tier: no connector, no server
    plain = make_plan(load_topology(_write(tmp_path / "plain", "colocated", nodes,
                                           extra_vars={"pdstack_kv_tier": "none"})))
    for node in plain.nodes.values():
        assert "lmcache" not in {s.name for s in node.services}
        for svc in node.services:
            assert svc.kv_transfer_config is None and "--kv-transfer-config" not in svc.command


def test_colocated_l1_refuses_pd_roles(tmp_path: Path) -> None:
    inv = _write(tmp_path, "colocated+l1", {"n1": [{"role": "prefill"}, {"role": "decode"}]})
    with pytest.raises(TopologyError) as err:
        load_topology(inv)
    assert any(
        p.field == "n1.pdstack_engines[0].role" and "use role colocated" in p.message
        for p in err.value.problems
    ), err.value


# ------------------------------------------------------------------ share_gpu

def _two_on_gpu0(a: dict, b: dict) -> dict[str, list[dict]]:
    return {"n1": [{"role": "prefill", "gpus": [0], **a}, {"role": "decode", "gpus": [0], **b}]}


KV = 10 * 2**30
SHARE_ERRORS = [
    ("neither shares", {}, {}, "n1.pdstack_engines[1].gpus", "share_gpu: true"),
    (
        "only one shares",
        {"share_gpu": True, "kv_cache_bytes": KV},
        {},
        "n1.pdstack_engines[1].gpus",
        "GPU 0 already used by pdstack_engines[0]",
    ),
    (
        "no KV size",
        {"share_gpu": True},
        {"share_gpu": True, "kv_cache_bytes": KV},
        "n1.pdstack_engines[0].kv_cache_bytes",
        "share_gpu: true needs a fixed kv_cache_bytes",
    ),
]


@named_cases(("a", "b", "field", "message"), SHARE_ERRORS)
def test_share_gpu_validation(tmp_path: Path, capsys, a, b, field, message) -> None:
    inv = _write(tmp_path, "nixl", _two_on_gpu0(a, b))
    with pytest.raises(TopologyError) as err:
        load_topology(inv)
    hit = [p for p in err.value.problems if p.field == field and message in p.message]
    assert hit, f"no problem {field!r} / {message!r} in:\n{err.value}"
    out = tmp_path / "out"
    assert main(["render", "-i", str(inv), "-o", str(out)]) == 2
    stderr = capsys.readouterr().err
    assert field in stderr and message in stderr
    assert not out.exists()


def test_share_gpu_engines_plan(tmp_path: Path) -> None:
    share = {"share_gpu": True, "kv_cache_bytes": KV}
    plan = make_plan(load_topology(_write(tmp_path, "nixl+l1", _two_on_gpu0(share, share))))
    engines = _engines(plan, "n1")
    assert set(engines) == {"prefill-0", "decode-0"}
    for svc in engines.values():
        assert svc.gpu_ids == [0]  # type: ignore[attr-defined]
        cmd = svc.command  # type: ignore[attr-defined]
        assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(KV)
    assert plan.nodes["n1"].service("lmcache").gpu_ids == [0]
    ports = [p for s in plan.nodes["n1"].services for p in s.ports.values()]
    assert len(ports) == len(set(ports))


def test_share_gpu_on_cpu_profile_is_harmless(tmp_path: Path) -> None:
    """share_gpu is about GPU ids; on the cpu profile it only needs the fixed KV size."""
    inv = _write(
        tmp_path,
        "nixl",
        {"n1": [{"role": "prefill", "share_gpu": True}, {"role": "decode"}]},
        profile="cpu",
    )
    with pytest.raises(TopologyError, match=r"n1\.pdstack_engines\[0\]\.kv_cache_bytes"):
        load_topology(inv)
