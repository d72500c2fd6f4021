"""A warm standby engine (issue 55) is planned exactly like its role's others (ports, KV
connector, KV events, its service): only the proxy's backend table tells it apart."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from pdstack.plan import make_plan
from pdstack.proxy.backends import BackendRegistry
from pdstack.topology import load_topology

REPO = Path(__file__).resolve().parents[2]


def _inventory(tmp_path: Path, base: str, host: str, standby: list[int]) -> Path:
    """A copy of ``inventory/<base>`` whose engines ``standby`` of ``host`` are standbys."""
    inv = tmp_path / f"{base}-{'-'.join(map(str, standby)) or 'none'}"
    shutil.copytree(REPO / "inventory" / base, inv)
    doc = yaml.safe_load((inv / "hosts.yml").read_text())
    engines = doc["all"]["children"]["pdstack_nodes"]["hosts"][host]["pdstack_engines"]
    for i in standby:
        engines[i]["standby"] = True
    (inv / "hosts.yml").write_text(yaml.safe_dump(doc))
    return inv


def _services(plan) -> dict[str, str]:
    return {f"{n}/{s.name}": s.model_dump_json() for n, node in plan.nodes.items()
            for s in node.services}


def test_a_standby_decoder_is_planned_like_the_others(tmp_path: Path) -> None:
    plain = make_plan(load_topology(_inventory(tmp_path, "a100x3", "a100-node1", [])))
    plan = make_plan(load_topology(_inventory(tmp_path, "a100x3", "a100-node1", [2])))
    # every service (engines, LMCache, proxy) as it would be without the standby
    assert _services(plan) == _services(plain)
    table = json.loads(plan.backend_table.model_dump_json())
    marks = {b["name"]: b.get("standby") for b in table["backends"]}
    assert marks == {"a100-node1/prefill-0": None, "a100-node1/decode-0": None,
                     "a100-node1/decode-1": True}
    # the standby is paired like the other decoder, so it can take its place
    pairs = {(p["prefill"], p["decode"]) for p in table["pairings"]}
    assert ("a100-node1/prefill-0", "a100-node1/decode-1") in pairs
    plain_table = json.loads(plain.backend_table.model_dump_json())
    assert "standby" not in json.dumps(plain_table)  # tables without the key stay as they were
    reg = BackendRegistry.from_table(table)
    assert reg.backends["a100-node1/decode-1"].standby
    assert not reg.backends["a100-node1/decode-0"].standby
    assert [b.name for b in reg.by_role("decode", standbys=True)] == [
        "a100-node1/decode-0", "a100-node1/decode-1"]


def test_a_standby_colocated_engine_is_planned(tmp_path: Path) -> None:
    inv = _inventory(tmp_path, "h200x2-colocated", _first_host("h200x2-colocated"), [1])
    plan = make_plan(load_topology(inv))
    table = plan.backend_table
    standbys = [b.name for b in table.backends if b.standby]
    assert len(standbys) == 1 and standbys[0].endswith("/engine-1")
    node, svc = standbys[0].split("/")
    assert svc in {s.name for s in plan.nodes[node].services if s.kind == "engine"}


def _first_host(base: str) -> str:
    doc = yaml.safe_load((REPO / "inventory" / base / "hosts.yml").read_text())
    return next(iter(doc["all"]["children"]["pdstack_nodes"]["hosts"]))
