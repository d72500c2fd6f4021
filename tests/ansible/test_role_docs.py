"""Each role states its variables three times: ``defaults/main.yml`` (the values),
``meta/argument_specs.yml`` (the spec Ansible checks) and the README's table (what a reader
sees). Nothing runs here: the three must agree, name by name, type and default."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

ROLES_DIR = Path(__file__).resolve().parents[2] / "ansible" / "roles"
ROLES = sorted(p.name for p in ROLES_DIR.iterdir() if (p / "meta" / "argument_specs.yml").is_file())
ROW = re.compile(r"^\| `([a-z0-9_]+)` \| (\w+) \| `(.*)` \| .* \|$")
SHARED = "pdstack"


def _defaults(role: str) -> dict[str, Any]:
    return yaml.safe_load((ROLES_DIR / role / "defaults" / "main.yml").read_text()) or {}


def _spec(role: str) -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load((ROLES_DIR / role / "meta" / "argument_specs.yml").read_text())
    return doc["argument_specs"]["main"]["options"]


def _readme(role: str) -> dict[str, tuple[str, Any]]:
    """Variable -> (type, default) from the README's table; the default cell is YAML with
    ``|`` escaped for Markdown."""
    rows = {}
    for line in (ROLES_DIR / role / "README.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = (m.group(2), yaml.safe_load(m.group(3).replace("\\|", "|")))
    return rows


def test_every_role_has_the_three():
    for role in (p.name for p in ROLES_DIR.iterdir() if p.is_dir()):
        for part in ("defaults/main.yml", "meta/argument_specs.yml", "meta/main.yml",
                     "README.md"):
            assert (ROLES_DIR / role / part).is_file(), f"{role}: no {part}"


@pytest.mark.parametrize("role", ROLES)
def test_defaults_spec_and_readme_agree(role: str) -> None:
    defaults, spec, readme = _defaults(role), _spec(role), _readme(role)
    assert set(defaults) == set(spec) == set(readme), (
        f"{role}: defaults-only {sorted(set(defaults) - set(spec))}, "
        f"spec-only {sorted(set(spec) - set(defaults))}, "
        f"README-only {sorted(set(readme) ^ set(spec))}")
    for name, value in defaults.items():
        # Ansible templates a spec's defaults when it checks the arguments: a default that
        # names a variable the play may not have (topology_plan) stays in defaults/main.yml
        if "default" in spec[name] or "(default in defaults/main.yml)" not in spec[name].get(
                "description", ""):
            assert spec[name].get("default") == value, f"{role}: {name} in argument_specs"
        kind, shown = readme[name]
        assert kind == spec[name]["type"], f"{role}: {name}'s type in README.md"
        assert shown == value, f"{role}: {name}'s default in README.md"


@pytest.mark.parametrize("role", [r for r in ROLES if r != SHARED])
def test_every_role_depends_on_the_shared_defaults(role: str) -> None:
    meta = yaml.safe_load((ROLES_DIR / role / "meta" / "main.yml").read_text())
    assert {"role": SHARED} in meta["dependencies"], role


@pytest.mark.parametrize("role", [r for r in ROLES if r != SHARED])
def test_shared_facts_are_not_defaulted_again(role: str) -> None:
    """The docker host, profile, stack root, secrets file and repository root come from
    pdstack; a role refers to them, it does not restate them."""
    shared = _defaults(SHARED)
    text = "\n".join((ROLES_DIR / role / d / "main.yml").read_text()
                     for d in ("defaults", "tasks") if (ROLES_DIR / role / d / "main.yml").exists())
    for name in shared:
        assert f"{name} | default(" not in text, f"{role}: {name} defaulted again"
    assert "role_path | dirname" not in text and "role_path }}/.." not in text, role
    for value in ("/opt/pdstack", "/etc/pdstack/secrets.env"):
        assert not re.search(rf"^\w+: {re.escape(value)}$", text, flags=re.M), (role, value)
