"""The advised deployment as an inventory: the measured curve's template inventory with the
option's nodes and engines, written only once it validates (the code of ``pdstack validate``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from pdstack.advise.curves import AdviseError
from pdstack.advise.sizing import Option
from pdstack.plan import make_plan
from pdstack.topology import Topology, TopologyError, _group_vars, _read_yaml, load_topology


def _node_vars(template: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(all.vars + pdstack_nodes.vars, the first node's vars) of the template's hosts.yml."""
    doc = _read_yaml(template / "hosts.yml", [])
    all_ = doc.get("all") or {}
    group = (all_.get("children") or {}).get("pdstack_nodes") or {}
    hosts = group.get("hosts") or {}
    shared = {**(all_.get("vars") or {}), **(group.get("vars") or {})}
    return shared, dict(next(iter(hosts.values())) or {}) if hosts else {}


def inventory_docs(opt: Option, name: str, gpus_per_node: int) -> tuple[str, str]:
    """(hosts.yml, group_vars/all.yml) text of the advised deployment."""
    tmpl = opt.curve.inventory
    assert tmpl is not None
    topo = load_topology(tmpl)
    engine_extra: dict[str, dict[str, Any]] = {}
    for node in topo.nodes:
        for eng in node.engines:
            spec = eng.model_dump(exclude_defaults=True)
            spec.pop("role", None)
            spec.pop("gpus", None)
            engine_extra.setdefault(eng.role, spec)
    shared_vars, first = _node_vars(tmpl)
    keep = {k: v for k, v in first.items()
            if k in ("pdstack_gpu_model", "pdstack_host_memory_gb", "pdstack_rdma", "pdstack_mtu")}
    hosts: dict[str, Any] = {}
    single = len(opt.nodes) == 1
    for i, engines in enumerate(opt.nodes):
        hv: dict[str, Any] = {}
        if single:
            for k in ("ansible_host", "ansible_connection", "pdstack_private_address"):
                if k in first:
                    hv[k] = first[k]
        if "pdstack_private_address" not in hv:
            hv["ansible_host"] = f"10.0.0.{11 + i}"
            hv["pdstack_private_address"] = f"10.0.0.{11 + i}"
        hv["pdstack_gpu_count"] = gpus_per_node
        hv.update(keep)
        if i == 0:
            hv["pdstack_proxy"] = True
        gpu = 0
        listed = []
        for role, g in engines:
            listed.append({"role": role, "gpus": list(range(gpu, gpu + g)),
                           **engine_extra.get(role, {})})
            gpu += g
        hv["pdstack_engines"] = listed
        hosts[f"node{i + 1}"] = hv
    group: dict[str, Any] = {"hosts": hosts}
    if shared_vars:
        group["vars"] = shared_vars
    c = opt.curve
    head = (f"# Advised by `pdstack advise` for {opt.shape_text()} ({c.label}, knee "
            f"{opt.knee.rate:g} req/s), from {', '.join(c.files)};\n"
            f"# template inventory {tmpl}."
            + ("" if single else " Node addresses are placeholders: put in your nodes'.")
            + "\n")
    hosts_text = head + yaml.safe_dump({"all": {"children": {"pdstack_nodes": group}}},
                                       sort_keys=False, default_flow_style=None, width=100)
    gvars, _ = _group_vars(tmpl, [])
    gvars["pdstack_deployment_name"] = name
    gv_text = ("---\n# Deployment settings as measured (copied from " + str(tmpl) + ").\n"
               + yaml.safe_dump(gvars, sort_keys=False, width=100))
    return hosts_text, gv_text


def write_inventory(opt: Option, out: Path, gpus_per_node: int, force: bool) -> Topology:
    """Write the inventory to ``out`` only once it validates (the code of ``pdstack validate``)."""
    if opt.curve.inventory is None:
        raise AdviseError(
            f"cannot write an inventory for {opt.curve.label!r}: no template inventory (its shape "
            f"came from {opt.curve.shape.source}); pass --topology {opt.curve.label}=INVENTORY"
        )
    if (out / "hosts.yml").exists() and not force:
        raise AdviseError(f"{out}/hosts.yml exists; pass --force to replace it")
    hosts_text, gv_text = inventory_docs(opt, out.name, gpus_per_node)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "group_vars").mkdir()
        (tmp / "hosts.yml").write_text(hosts_text)
        (tmp / "group_vars" / "all.yml").write_text(gv_text)
        try:
            topo = load_topology(tmp)
            make_plan(topo)
        except TopologyError as err:
            raise AdviseError(f"the advised inventory does not validate (nothing written):\n{err}"
                              ) from err
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return load_topology(out)
