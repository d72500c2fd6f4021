"""``pdstack_tenants``: validated with one clear error per bad field (exit 2, nothing
rendered), and carried by the plan to the proxy's backend table."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdstack.cli import main
from pdstack.plan import make_plan
from pdstack.testing.cases import named_cases
from pdstack.topology import TopologyError, load_topology

REPO = Path(__file__).resolve().parents[2]
GOOD = {
    "acme": {"weight": 3, "priority": "interactive", "max_concurrency": 64, "rpm": 600},
    "nightly": {"weight": 1, "priority": "batch", "max_queued": 128, "tpm": 2_000_000},
}


def _inventory(tmp_path: Path, tenants: Any, secrets: dict[str, str] | None = None) -> Path:
    inv = tmp_path / "local-cpu"
    shutil.copytree(REPO / "inventory" / "local-cpu", inv)
    f = inv / "group_vars" / "all.yml"
    doc = yaml.safe_load(f.read_text())
    doc["pdstack_tenants"] = tenants
    if secrets is not None:
        doc["stack_secrets"] = secrets
    f.write_text(yaml.safe_dump(doc))
    return inv


BAD = [
    ("unknown field", {"acme": {"weight": 1, "burst": 5}}, "pdstack_tenants.acme.burst",
     "unknown tenant field"),
    ("negative limit", {"acme": {"rpm": -1}}, "pdstack_tenants.acme.rpm", "greater than 0"),
    ("zero limit", {"acme": {"max_concurrency": 0}}, "pdstack_tenants.acme.max_concurrency",
     "greater than 0"),
    ("weight not a number", {"acme": {"weight": "three"}}, "pdstack_tenants.acme.weight",
     "valid number"),
    ("weight a quoted number", {"acme": {"weight": "3"}}, "pdstack_tenants.acme.weight",
     "valid number"),
    ("zero weight", {"acme": {"weight": 0}}, "pdstack_tenants.acme.weight", "greater than 0"),
    ("limit not an integer", {"acme": {"tpm": 1.5}}, "pdstack_tenants.acme.tpm",
     "valid integer"),
    ("unknown priority", {"acme": {"priority": "urgent"}}, "pdstack_tenants.acme.priority",
     "'interactive' or 'batch'"),
    ("reserved name", {"other": {"weight": 1}}, "pdstack_tenants.other", "not 'other'"),
    ("not a mapping", ["acme"], "pdstack_tenants", "must be a mapping"),
]


@named_cases(("tenants", "field", "message"), BAD)
def test_bad_tenant_field_is_one_clear_error(tmp_path, capsys, tenants, field, message):
    inv = _inventory(tmp_path, tenants)
    with pytest.raises(TopologyError) as err:
        load_topology(inv)
    assert len(err.value.problems) == 1, str(err.value)
    problem = err.value.problems[0]
    assert problem.field == field and message in problem.message, str(problem)
    out = tmp_path / "out"
    assert main(["render", "-i", str(inv), "-o", str(out)]) == 2
    assert field in capsys.readouterr().err
    assert not out.exists()
    assert main(["validate", "-i", str(inv)]) == 2


def test_key_shared_by_two_tenants_is_named_without_the_key(tmp_path, capsys):
    secrets = {"PDSTACK_TENANT_KEYS": "acme:sk-shared-123,nightly:sk-n-1,nightly:sk-shared-123"}
    inv = _inventory(tmp_path, GOOD, secrets)
    assert main(["validate", "-i", str(inv)]) == 2
    err = capsys.readouterr().err
    assert "stack_secrets.PDSTACK_TENANT_KEYS" in err
    assert "entry 3: the same key is also tenant 'acme'" in err
    assert "sk-shared-123" not in err
    inv2 = _inventory(tmp_path / "b", GOOD, {"PDSTACK_TENANT_KEYS": "ghost:sk-1"})
    with pytest.raises(TopologyError) as exc:
        load_topology(inv2)
    assert [p.message for p in exc.value.problems] == [
        "PDSTACK_TENANT_KEYS entry 1: tenant 'ghost' is not in pdstack_tenants "
        "(acme, default, nightly)"
    ]


def test_tenants_reach_the_proxy_backend_table(tmp_path):
    inv = _inventory(tmp_path, GOOD, {"PDSTACK_TENANT_KEYS": "acme:sk-1,nightly:sk-2"})
    plan = make_plan(load_topology(inv))
    table = json.loads(plan.backend_table.model_dump_json())
    assert table["tenants"]["acme"]["weight"] == 3
    assert table["tenants"]["nightly"]["priority"] == "batch"
    out = tmp_path / "out"
    assert main(["render", "-i", str(inv), "-o", str(out)]) == 0
    rendered = json.loads((out / "backends.json").read_text())
    assert rendered["tenants"]["acme"]["rpm"] == 600
    assert "sk-1" not in (out / "compose.yaml").read_text() + (out / "backends.json").read_text()
    # the proxy reads them back from the rendered table
    import argparse

    from pdstack.plan import BackendTable
    from pdstack.proxy.cli import config_from_args, register

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register(sub, "proxy", "")
    env = tmp_path / "secrets.env"
    env.write_text("PDSTACK_TENANT_KEYS=acme:sk-1,nightly:sk-2\n")
    env.chmod(0o600)
    args = parser.parse_args(
        ["proxy", "--backends", str(out / "backends.json"), "--env-file", str(env)]
    )
    config = config_from_args(args, BackendTable.model_validate(rendered))
    assert config.tenants["nightly"].priority == "batch"
    assert config.tenants["acme"].rpm == 600 and config.tenants["acme"].weight == 3
    assert sorted(config.tenant_keys.values()) == ["acme", "nightly"]


def test_no_tenants_leaves_the_rendered_table_as_it_was(tmp_path):
    inv = tmp_path / "local-cpu"
    shutil.copytree(REPO / "inventory" / "local-cpu", inv)
    table = json.loads(make_plan(load_topology(inv)).backend_table.model_dump_json())
    assert "tenants" not in table
