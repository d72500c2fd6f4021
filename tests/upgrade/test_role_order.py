"""The engine_upgrade role orders a node's engines in Jinja (before any script is on the
node); the rule's home is ``pdstack.naming.upgrade_order``. Both must give the same order
for every mix of roles. Light: plain Jinja2, no ansible-playbook."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml

from pdstack.naming import upgrade_order

TASKS = Path(__file__).resolve().parents[2] / "ansible/roles/engine_upgrade/tasks/main.yml"


def _role_order(services: list[dict[str, Any]]) -> list[str]:
    task = next(t for t in yaml.safe_load(TASKS.read_text())
                if "engine_upgrade_order" in t.get("ansible.builtin.set_fact", {}))
    env = jinja2.Environment()

    def value(template: str, names: dict[str, Any]) -> Any:
        inner = template.strip()
        assert inner.startswith("{{") and inner.endswith("}}"), template
        return env.compile_expression(inner[2:-2].strip())(**names)

    names: dict[str, Any] = {
        "engine_upgrade_plan": {"nodes": {"n1": {"services": services}}},
        "inventory_hostname": "n1",
    }
    for var, template in task["vars"].items():
        names[var] = value(template, names)
    return list(value(task["ansible.builtin.set_fact"]["engine_upgrade_order"], names))


MIXES = [roles for n in range(1, 4)
         for roles in itertools.product(("prefill", "decode", "colocated"), repeat=n)]


@pytest.mark.parametrize("roles", MIXES, ids=lambda r: "-".join(r))
def test_role_orders_engines_as_naming_does(roles: tuple[str, ...]) -> None:
    services = [{"name": f"{role}-{i}", "kind": "engine", "role": role}
                for i, role in enumerate(roles)]
    services.append({"name": "proxy", "kind": "proxy", "role": None})
    want = [s["name"] for s in upgrade_order(services[:-1], lambda s: s["role"])]
    assert _role_order(services) == want
