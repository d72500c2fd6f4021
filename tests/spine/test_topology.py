"""Topology validation: every malformed inventory gets an error naming file and field."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from pdstack.cli import main
from pdstack.testing.cases import named_cases
from pdstack.topology import TopologyError, load_topology

REPO = Path(__file__).resolve().parents[2]


def _copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(REPO / "inventory" / name, dst)
    return dst


def _edit_hosts(inv: Path, fn) -> None:
    doc = yaml.safe_load((inv / "hosts.yml").read_text())
    fn(doc["all"]["children"]["pdstack_nodes"]["hosts"])
    (inv / "hosts.yml").write_text(yaml.safe_dump(doc))


def _edit_engine(host: str, index: int, **fields):
    """A mutation: update engine ``index`` of ``host`` in hosts.yml with ``fields``."""
    return lambda inv: _edit_hosts(inv, lambda h: h[host]["pdstack_engines"][index].update(fields))


def _edit_vars(inv: Path, fn) -> None:
    f = inv / "group_vars" / "all.yml"
    doc = yaml.safe_load(f.read_text())
    fn(doc)
    f.write_text(yaml.safe_dump(doc))


def _set(d: dict, key: str, value) -> None:
    d[key] = value


# (description, base inventory, mutation, substring of the field, substring of the message)
MALFORMED = [
    (
        "GPU index out of range",
        "a100x3",
        _edit_engine("a100-node1", 2, gpus=[3]),
        "a100-node1.pdstack_engines[2].gpus",
        "GPU index 3 out of range",
    ),
    (
        "GPU used twice",
        "a100x3",
        _edit_engine("a100-node1", 2, gpus=[1]),
        "a100-node1.pdstack_engines[2].gpus",
        "GPU 1 already used by pdstack_engines[1]",
    ),
    (
        "TP not matching the GPU list",
        "b200x1",
        _edit_engine("b200-node1", 1, gpus=[4, 5]),
        "b200-node1.pdstack_engines[1].gpus",
        "pdstack_tensor_parallel.decode is 4",
    ),
    (
        "TP not dividing the node's GPUs",
        "a100x3",
        lambda inv: _edit_vars(inv, lambda v: _set(v, "pdstack_tensor_parallel",
                                                   {"prefill": 2, "decode": 1})),
        "pdstack_tensor_parallel.prefill",
        "TP 2 does not divide a100-node1's 3 GPUs",
    ),
    (
        "port collision on a node",
        "a100x3",
        lambda inv: _edit_vars(inv, lambda v: _set(v, "pdstack_ports", {"lmcache_zmq": 8101})),
        "pdstack_ports",
        "port 8101 on a100-node1 used by both",
    ),
    (
        "shared-l1 pairing across nodes",
        "b200x2",
        lambda inv: _edit_vars(inv, lambda v: _set(v, "pdstack_kv_mode", "shared-l1")),
        "b200-node2.pdstack_engines",
        "shared-l1 pairing across nodes",
    ),
    (
        "standby on a prefill engine",
        "a100x3",
        _edit_engine("a100-node1", 0, standby=True),
        "a100-node1.pdstack_engines[0].standby",
        "a prefill engine cannot be a standby",
    ),
    (
        "a role with only standbys",
        "b200x1",
        _edit_engine("b200-node1", 1, standby=True),
        "b200-node1.pdstack_engines[1].standby",
        "every decode engine is a standby",
    ),
    (
        "unknown KV mode",
        "a100x3",
        lambda inv: _edit_vars(inv, lambda v: _set(v, "pdstack_kv_mode", "mooncake")),
        "pdstack_kv_mode",
        "unknown KV mode 'mooncake'",
    ),
    (
        "missing private address",
        "b200x2",
        lambda inv: _edit_hosts(inv, lambda h: h["b200-node2"].pop("pdstack_private_address")),
        "b200-node2.pdstack_private_address",
        "missing private address",
    ),
    (
        "public private address",
        "a100x3",
        lambda inv: _edit_hosts(inv, lambda h: h["a100-node1"].update(
            pdstack_private_address="8.8.8.8")),
        "a100-node1.pdstack_private_address",
        "public address",
    ),
    (
        "no proxy node",
        "a100x3",
        lambda inv: _edit_hosts(inv, lambda h: h["a100-node1"].pop("pdstack_proxy")),
        "pdstack_proxy",
        "exactly one node must set pdstack_proxy",
    ),
    (
        "P/D mode without a decoder",
        "a100x2-nixl",
        lambda inv: _edit_hosts(inv, lambda h: h["a100-node1"]["pdstack_engines"].pop(1)),
        "pdstack_engines",
        "needs at least one decode engine",
    ),
    (
        "lmcache-pd receive buffer too small",
        "a100x2-lmcache-pd",
        lambda inv: _edit_vars(inv, lambda v: _set(v, "pdstack_lmcache",
                                                   {"pd_buffer_size_gb": 0.5})),
        "pdstack_lmcache.pd_buffer_size_gb",
        "decoder would run out of memory",
    ),
    (
        "model field missing",
        "a100x3",
        lambda inv: _edit_vars(inv, lambda v: v["pdstack_model"].pop("served_name")),
        "pdstack_model.served_name",
        "Field required",
    ),
    (
        "misspelt engine field",
        "a100x3",
        _edit_engine("a100-node1", 0, gpu=[0]),
        "a100-node1.pdstack_engines.0.gpu",
        "Extra inputs are not permitted",
    ),
    (
        "LMCache L1 larger than host memory",
        "a100x3",
        lambda inv: _edit_vars(inv, lambda v: _set(v, "pdstack_lmcache", {"l1_size_gb": 600})),
        "pdstack_lmcache.l1_size_gb",
        "does not fit a100-node1's 512 GiB",
    ),
]


@named_cases(("base", "mutate", "field", "message"), MALFORMED)
def test_malformed_inventory_names_the_culprit(tmp_path, capsys, base, mutate, field, message):
    inv = _copy(tmp_path, base)
    mutate(inv)
    with pytest.raises(TopologyError) as err:
        load_topology(inv)
    matching = [p for p in err.value.problems if field in p.field and message in p.message]
    assert matching, f"no problem naming {field!r} / {message!r} in:\n{err.value}"
    assert all(p.file.startswith(str(inv)) for p in err.value.problems)

    # the CLI: exit 2, the message on stderr, nothing written
    out = tmp_path / "out"
    assert main(["render", "-i", str(inv), "-o", str(out)]) == 2
    stderr = capsys.readouterr().err
    assert field in stderr and message in stderr
    assert not out.exists()


def test_several_problems_reported_together(tmp_path):
    inv = _copy(tmp_path, "a100x3")

    def both(h):
        h["a100-node1"]["pdstack_engines"][1]["gpus"] = [7]
        h["a100-node1"]["pdstack_engines"][2]["gpus"] = [0]

    _edit_hosts(inv, both)
    with pytest.raises(TopologyError) as err:
        load_topology(inv)
    msgs = [p.message for p in err.value.problems]
    assert any("GPU index 7 out of range" in m for m in msgs)
    assert any("GPU 0 already used" in m for m in msgs)


def test_missing_hosts_file(tmp_path, capsys):
    assert main(["validate", "-i", str(tmp_path / "nope")]) == 2
    assert "hosts.yml" in capsys.readouterr().err


def test_ansible_connection_and_interpreter_reach_the_plan(tmp_path):
    """Preflight reaches nodes the way Ansible does: ``ansible_connection: local`` runs the
    probe on this machine (no SSH), ``ansible_python_interpreter`` picks its interpreter,
    and Ansible's ``auto`` discovery leaves the choice to the probe (python3)."""
    from pdstack.plan import make_plan
    from pdstack.preflight.transport import LocalTransport, SshTransport, connect

    inv = _copy(tmp_path, "b200x2")
    names: list[str] = []

    def edit(hosts: dict) -> None:
        names.extend(hosts)
        hosts[names[0]].update(ansible_connection="local",
                               ansible_python_interpreter="/opt/py/bin/python3")
        hosts[names[1]].update(ansible_python_interpreter="auto_silent")

    _edit_hosts(inv, edit)
    plan = make_plan(load_topology(inv))
    first, second = plan.nodes[names[0]].ssh, plan.nodes[names[1]].ssh
    assert (first.connection, first.python) == ("local", "/opt/py/bin/python3")
    assert (second.connection, second.python) == ("ssh", None)
    assert isinstance(connect(names[0], first, timeout=1.0), LocalTransport)
    assert SshTransport is not None  # the other node would go over SSH (not dialled here)


def test_unknown_ansible_connection_is_named(tmp_path, capsys):
    inv = _copy(tmp_path, "b200x2")
    _edit_hosts(inv, lambda h: next(iter(h.values())).update(ansible_connection="winrm"))
    assert main(["validate", "-i", str(inv)]) == 2
    err = capsys.readouterr().err
    assert "b200-node1.ansible_connection" in err and "winrm" in err, err
    assert "b200-node2" not in err, err
