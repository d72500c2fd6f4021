"""Every planned engine publishes vLLM KV events to the proxy (issue 56): the planner's
flags, ports, edges and backend table, over every committed inventory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdstack.plan import make_plan
from pdstack.plan_engine import KV_EVENTS_HASH_SEED
from pdstack.topology import load_topology

REPO = Path(__file__).resolve().parents[2]
INVENTORIES = sorted(p.name for p in (REPO / "inventory").iterdir() if (p / "hosts.yml").is_file())
# the baselines: vLLM as its users start it (pdstack_kv_events: false)
NO_EVENTS = ["h200x1-vllm", "h200x1-vllm-native"]


def _flag(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


@pytest.mark.parametrize("inventory", [i for i in INVENTORIES if i not in NO_EVENTS])
def test_every_engine_publishes_to_the_proxy(inventory: str) -> None:
    try:
        plan = make_plan(load_topology(REPO / "inventory" / inventory))
    except Exception as exc:  # inventories that do not load are other tests' business
        pytest.fail(f"{inventory}: {exc}")
    table = plan.backend_table
    assert table.kv_events is not None
    proxy_node = next(n for n in plan.nodes.values() if any(s.kind == "proxy" for s in n.services))
    assert table.kv_events.host == proxy_node.private_address
    proxy = next(s for s in proxy_node.services if s.kind == "proxy")
    assert proxy.ports["kv_events"] == table.kv_events.port
    edges = {(e.src_node, e.dst_node, e.dst_address, e.port) for e in plan.edges}
    backends = {b.name: b for b in table.backends}
    for node in plan.nodes.values():
        for svc in (s for s in node.services if s.kind == "engine"):
            cfg = json.loads(_flag(svc.command, "--kv-events-config"))
            name = f"{node.name}/{svc.name}"
            replay = f"tcp://{node.private_address}:{svc.ports['kv_events_replay']}"
            assert cfg == {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                # no "*": vLLM connects its PUB to the proxy, never binds every interface
                "endpoint": f"tcp://{proxy_node.private_address}:{table.kv_events.port}",
                "replay_endpoint": replay,
                "topic": name,
            }
            assert svc.env["PYTHONHASHSEED"] == KV_EVENTS_HASH_SEED == table.kv_events.hash_seed
            src = backends[name].kv_events
            assert src is not None and (src.topic, src.replay) == (name, replay)
            # preflight proves both directions (it probes every plan edge)
            assert (node.name, proxy_node.name, proxy_node.private_address,
                    table.kv_events.port) in edges
            assert (proxy_node.name, node.name, node.private_address,
                    svc.ports["kv_events_replay"]) in edges


def test_backend_table_json_round_trips_kv_events() -> None:
    from pdstack.plan import BackendTable

    plan = make_plan(load_topology(REPO / "inventory" / "local-cpu"))
    data = json.loads(plan.backend_table.model_dump_json())
    assert data["kv_events"] == {"host": "127.0.0.1", "port": 5557, "hash_seed": "0"}
    assert BackendTable.model_validate(data) == plan.backend_table


@pytest.mark.parametrize("inventory", NO_EVENTS)
def test_pdstack_kv_events_false_plans_none_of_it(inventory: str) -> None:
    """A baseline inventory (``pdstack_kv_events: false``): no flag, no hash seed, no ports,
    no edges, no table entries: vLLM as its users start it."""
    topo = load_topology(REPO / "inventory" / inventory)
    assert topo.deployment.kv_events is False
    plan = make_plan(topo)
    assert plan.backend_table.kv_events is None
    assert all(b.kv_events is None for b in plan.backend_table.backends)
    for node in plan.nodes.values():
        for svc in node.services:
            assert "--kv-events-config" not in svc.command
            assert "PYTHONHASHSEED" not in svc.env
            assert "kv_events" not in svc.ports and "kv_events_replay" not in svc.ports
    assert not [e for e in plan.edges if "kv events" in e.purpose]
