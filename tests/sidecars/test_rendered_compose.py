"""How the rendered stacks run pdstack's sidecars and vLLM plugins: a short command each, the
package mounted from its one home (compose/) or carried as a copy (any other stack), and a
``compose.yaml`` that reads like a hand-written one (no line over 300 characters) for every
inventory under inventory/."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdstack import compose_yaml, sidecars
from pdstack.plan import make_plan, model_path
from pdstack.render import CARRIED, engine_command, package_source, render_all
from pdstack.topology import load_topology

REPO = Path(__file__).resolve().parents[2]
INVENTORIES = sorted(p.name for p in (REPO / "inventory").iterdir()
                     if (p / "hosts.yml").is_file())
MAX_LINE = 300


def _same(rendered: str, planned: str) -> bool:
    """One command argument as rendered and as planned: equal, or the same JSON document
    (a folded one has a space after each ``,`` and ``:``)."""
    if rendered == planned:
        return True
    try:
        return bool(json.loads(rendered) == json.loads(planned))
    except ValueError:
        return False


@pytest.mark.parametrize("inventory", INVENTORIES)
def test_every_rendered_compose_line_is_short_and_reads_back_as_planned(inventory: str) -> None:
    topo = load_topology(REPO / "inventory" / inventory)
    plan = make_plan(topo)
    for node, files in render_all(topo, plan).items():
        text = files["compose.yaml"]
        longest = max(text.splitlines(), key=len)
        assert len(longest) <= MAX_LINE, (inventory, node, longest[:120])
        services = yaml.safe_load(text)["services"]
        for svc in plan.nodes[node].services:
            got = services[svc.name]["command"]
            assert all(isinstance(a, str) for a in got), (inventory, svc.name)
            want = list(svc.command)
            if svc.kind == "engine":
                want = sidecars.engine_on_data_socket(engine_command(svc, model_path(
                    topo.deployment)))
            assert len(got) == len(want), (inventory, svc.name)
            for g, w in zip(got, want, strict=True):
                assert _same(g, w), (inventory, svc.name, g, w)


@pytest.mark.parametrize("text", [
    "8100", "true", "on", "null", "", " lead", "a: b", "#x", "--port", "${DECODE_0_MODEL}",
    '{"max_position_embeddings": 8192}', "it's \"both\"", "line\nbreak", "tab\there",
])
def test_a_value_reads_back_as_the_same_string(text: str) -> None:
    doc = "k:" + compose_yaml.yaml_list([text], 2) + "\nm:" + compose_yaml.yaml_map(
        {"on": text, "PYTHONPATH": text}, 2)
    assert yaml.safe_load(doc) == {"k": [text], "m": {"on": text, "PYTHONPATH": text}}


def test_a_long_json_argument_is_folded_into_short_lines() -> None:
    config = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": f"C{i}", "note": "two  spaces"} for i in range(12)]}}
    arg = json.dumps(config, separators=(",", ":"))
    doc = "command:" + compose_yaml.yaml_list(["--kv-transfer-config", arg], 6)
    assert max(len(line) for line in doc.splitlines()) <= compose_yaml.WIDTH + 8
    assert len(doc.splitlines()) > 5
    (flag, got) = yaml.safe_load(doc)["command"]
    assert flag == "--kv-transfer-config" and json.loads(got) == config
    # a long string that is not JSON stays one (quoted) line: the line test above catches it
    assert "\n" not in compose_yaml.scalar("x" * 200, 6)


def test_stacks_in_compose_mount_the_package_others_carry_it(tmp_path: Path) -> None:
    assert package_source(REPO / "compose" / "cpu") == "../../pdstack"
    assert package_source(REPO / "compose" / "lab" / "node-1") == "../../../pdstack"
    assert package_source(tmp_path / "stack") == package_source(None) == CARRIED
    topo = load_topology(REPO / "inventory" / "local-cpu")
    plan = make_plan(topo)
    (node,) = plan.nodes
    carried = render_all(topo, plan)[node]
    mounted = render_all(topo, plan, {node: REPO / "compose" / "cpu"})[node]
    copies = {rel.removeprefix("pdstack/"): text for rel, text in carried.items()
              if rel.startswith("pdstack/")}
    assert copies == sidecars.container_files()
    assert copies["sidecars/watchdog.py"] == (sidecars.PACKAGE / "sidecars/watchdog.py").read_text()
    assert not any(rel.startswith(("pdstack/", "vllm-plugins/")) for rel in mounted)
    assert mounted["compose.yaml"] == carried["compose.yaml"].replace(
        f"{CARRIED}:", "../../pdstack:")
    assert mounted["compose.yaml"].count("- ../../pdstack:/opt/pdstack/pdstack:ro") == 3
    # the committed stack is that render: it mounts the package, it carries no copy
    assert (REPO / "compose" / "cpu" / "compose.yaml").read_text() == mounted["compose.yaml"]


def test_the_container_files_run_with_nothing_else(tmp_path: Path) -> None:
    """The programs import nothing of pdstack that the stacks do not ship, nor anything
    outside the standard library (LMCache and vLLM aside, imported where they run)."""
    for rel, text in sidecars.container_files().items():
        (tmp_path / "pdstack" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pdstack" / rel).write_text(text)
    plugins = ("pdstack.vllm_offload_fix", "pdstack.vllm_kv_xfer_fix")
    for module in (sidecars.WATCHDOG, sidecars.METRICS_GATE, sidecars.LMCACHE_SOCKET, *plugins):
        run = subprocess.run([sys.executable, "-S", "-c", f"import {module}"],
                             env={"PYTHONPATH": str(tmp_path)}, capture_output=True, text=True,
                             timeout=60, cwd=tmp_path)
        assert run.returncode == 0, (module, run.stderr[-2000:])
        usage = subprocess.run([sys.executable, "-S", "-m", module], capture_output=True,
                               env={"PYTHONPATH": str(tmp_path)}, text=True, timeout=60,
                               cwd=tmp_path)
        if module not in plugins:
            assert usage.returncode == 2 and "Usage:" in usage.stderr, (module, usage.stderr)


def test_the_plugins_entry_points_name_their_register() -> None:
    path = sidecars.PACKAGE / sidecars.PLUGINS_DIR
    found = sorted((ep.name, ep.value) for dist in importlib.metadata.distributions(
        path=[str(path)]) for ep in dist.entry_points if ep.group == "vllm.general_plugins")
    assert found == [("pdstack_engine_auth", "pdstack.vllm_engine_auth:register"),
                     ("pdstack_kv_xfer_fix", "pdstack.vllm_kv_xfer_fix:register"),
                     ("pdstack_offload_fix", "pdstack.vllm_offload_fix:register")]
    for name, value in found:
        module = importlib.import_module(value.split(":")[0])
        assert name == module.PLUGIN_NAME and callable(module.register), value
