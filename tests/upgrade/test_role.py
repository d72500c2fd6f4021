"""The engine_upgrade Ansible role, run by ansible-playbook against the real proxy with
fake engines (``pdstack.testing.fake_engine`` test double). No engine container is
started: one run finds every engine already at the target, one fails at compose."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import REPO

CURRENT = "rev1@pdstack/engine-cpu:dev"  # compose/cpu/.env's generation
SAME = {"prefill-0": CURRENT, "decode-0": CURRENT, "decode-1": CURRENT}


def run_role(node: dict[str, Any], revision: str, project: str) -> subprocess.CompletedProcess:
    stack: Path = node["dir"]
    plan = json.loads(subprocess.run(
        [str(REPO / ".venv" / "bin" / "pdstack"), "plan", "-i",
         str(REPO / "inventory" / "local-cpu"), "--json"],
        capture_output=True, text=True, check=True).stdout)
    port = node["proxy"].rsplit(":", 1)[1]
    for svc in plan["nodes"]["local"]["services"]:
        if svc["kind"] == "proxy":
            svc["healthcheck_url"] = f"http://127.0.0.1:{port}/health"
    (stack / "plan.json").write_text(json.dumps(plan))
    secrets_file = stack / "secrets.env"
    secrets_file.write_text(f"HF_TOKEN=x\nPDSTACK_ADMIN_TOKEN={node['token']}\n")
    secrets_file.chmod(0o600)
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(REPO / "ansible" / "roles"),
           "ANSIBLE_LOCAL_TEMP": str(stack / ".ansible-tmp"),
           # interpreter discovery may find a broken pyenv shim on this machine kind
           "ANSIBLE_PYTHON_INTERPRETER": "/usr/bin/python3"
           if Path("/usr/bin/python3").exists() else sys.executable}
    env.pop("PDSTACK_ADMIN_TOKEN", None)
    extra = {"plan_file": str(stack / "plan.json"), "stack_dir": str(stack),
             "secrets_file": str(secrets_file), "project": project,
             "model_revision": revision, "script": str(stack / "pdstack_upgrade.py")}
    return subprocess.run(
        [str(REPO / ".venv" / "bin" / "ansible-playbook"),
         "-i", str(REPO / "inventory" / "local-cpu"),
         str(REPO / "tests" / "upgrade" / "role_upgrade.yml"), "-e", json.dumps(extra)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.parametrize("node", [SAME], indirect=True)
def test_role_runs_every_engine_in_order_and_changes_nothing_at_the_target(
    node: dict[str, Any],
) -> None:
    before = (node["dir"] / ".env").read_text()
    proc = run_role(node, "rev1", "pdstack-upgrade-roletest")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert node["token"] not in out
    order = [line.rsplit("(item=local/", 1)[1].rstrip(")")
             for line in proc.stdout.splitlines() if "engine.yml for local" in line]
    assert order == ["decode-1", "prefill-0", "decode-0"], proc.stdout
    runs = proc.stdout.count("TASK [engine_upgrade : Drain, recreate, verify")
    assert runs == 3, proc.stdout
    recap = proc.stdout.split("PLAY RECAP")[1]
    assert "failed=0" in recap and "rescued=0" in recap
    # only the script's directory (new in this test's temp dir) and the script's copy (with
    # kvmodes.py and naming.py beside it, one task) changed: every engine was already at the
    # target
    assert "changed=2 " in recap, recap
    assert (node["dir"] / ".env").read_text() == before
    assert all(not b["drained"] for b in node["admin"].listing()["backends"])


@pytest.mark.docker  # the role runs `docker compose stop/up` (no image is started)
@pytest.mark.parametrize("node", [SAME], indirect=True)
def test_role_rolls_back_undrains_and_stops_when_compose_fails(node: dict[str, Any]) -> None:
    stack: Path = node["dir"]
    # decode-1's image does not exist and may not be pulled: `compose up` fails at once
    (stack / "compose.yaml").write_text(
        "services:\n  decode-1:\n    image: pdstack/missing-for-upgrade-test:never\n"
        "    pull_policy: never\n    command: [\"${DECODE_1_MODEL}\"]\n")
    before = (stack / ".env").read_text()
    proc = run_role(node, "rev2", "pdstack-upgrade-roletest")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert node["token"] not in out
    assert "local/decode-1: upgrade failed; the run stops here" in out
    assert "docker compose up failed" in out
    assert proc.stdout.count("TASK [engine_upgrade : Drain, recreate, verify") == 1  # stopped
    assert "TASK [engine_upgrade : Undrain the engine" in proc.stdout
    assert "rescued=1" in proc.stdout.split("PLAY RECAP")[1]
    assert (stack / ".env").read_text() == before  # old lines restored
    backends = {b["name"]: b for b in node["admin"].listing()["backends"]}
    assert not backends["local/decode-1"]["drained"]
    assert backends["local/decode-1"]["generation"] == CURRENT
