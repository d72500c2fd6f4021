"""Defaults the H200 measurements chose (results/h200x1 run 2), as the planner writes them:
KV-aware admission on the gpu profile with a running cap from the engines' own running
limits, and CUDA IPC GET for NIXL engines on GPUs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from pdstack.plan import admission_max_running, make_plan
from pdstack.topology import load_topology

REPO = Path(__file__).resolve().parents[2]


def plan_of(inv: Path | str):
    return make_plan(load_topology(inv if isinstance(inv, Path) else REPO / "inventory" / inv))


def service(plan, kind: str, name: str | None = None):
    return next(
        s for n in plan.nodes.values() for s in n.services
        if s.kind == kind and (name is None or s.name == name)
    )


def proxy_admission_args(plan) -> list[str]:
    cmd = service(plan, "proxy").command
    return cmd[cmd.index("--admission"):] if "--admission" in cmd else []


def with_vars(tmp_path: Path, base: str, **extra) -> Path:
    inv = tmp_path / base
    shutil.copytree(REPO / "inventory" / base, inv)
    path = inv / "group_vars" / "all.yml"
    data = yaml.safe_load(path.read_text())
    data.update(extra)
    path.write_text(yaml.safe_dump(data))
    return inv


@pytest.mark.parametrize(("inventory", "want"), [
    # gpu, the engines start with --max-cudagraph-capture-size 128: capped there
    ("h200x1-nixl", ["--admission", "kv", "--admission-max-running", "128"]),
    ("h200x2-shared-l1", ["--admission", "kv", "--admission-max-running", "128"]),
    # gpu without an explicit running limit: admission, no cap (vLLM's own defaults)
    ("a100x3", ["--admission", "kv"]),
    ("b200x2", ["--admission", "kv"]),
    # cpu: off unless asked
    ("local-cpu", []),
])
def test_proxy_admission_defaults(inventory: str, want: list[str]) -> None:
    assert proxy_admission_args(plan_of(inventory)) == want


def test_explicit_admission_wins_over_the_profile_default(tmp_path: Path) -> None:
    off = with_vars(tmp_path / "a", "h200x1-nixl", pdstack_proxy_admission="off")
    assert proxy_admission_args(plan_of(off)) == []
    on = with_vars(tmp_path / "b", "local-cpu", pdstack_proxy_admission="kv")
    assert proxy_admission_args(plan_of(on))[:2] == ["--admission", "kv"]


def engine_args(tmp_path: Path, prefill: list[str], decode: list[str]) -> Path:
    """h200x1-nixl (its model's extra_args carry --max-cudagraph-capture-size 128) with
    per-engine extra_args."""
    inv = with_vars(tmp_path, "h200x1-nixl")
    hosts_file = inv / "hosts.yml"
    hosts = yaml.safe_load(hosts_file.read_text())
    node = hosts["all"]["children"]["pdstack_nodes"]["hosts"]["h200"]
    for eng in node["pdstack_engines"]:
        eng["extra_args"] = prefill if eng["role"] == "prefill" else decode
    hosts_file.write_text(yaml.safe_dump(hosts))
    return inv


def test_running_cap_is_the_smallest_limit_of_the_gated_engines(tmp_path: Path) -> None:
    # a decoder's own --max-num-seqs=96 is below the model's 128; a prefiller is not gated
    inv = engine_args(tmp_path / "a", ["--max-num-seqs", "8"], ["--max-num-seqs=96"])
    assert admission_max_running(load_topology(inv)) == 96
    assert proxy_admission_args(plan_of(inv))[-1] == "96"
    inv = engine_args(tmp_path / "b", ["--max-num-seqs", "8"], ["--max-num-seqs", "x"])
    assert admission_max_running(load_topology(inv)) == 128


@pytest.mark.parametrize(("inventory", "want"), [
    ("h200x1-nixl", {"prefill-0": "y", "decode-0": "y"}),  # gpu, NIXL pair
    ("h200x2-shared-l1", {}),  # gpu, no NIXL: nothing to set
    ("local-cpu", {}),  # cpu NIXL: no CUDA IPC
])
def test_nixl_engines_on_gpus_get_cuda_ipc_get(inventory: str, want: dict[str, str]) -> None:
    plan = plan_of(inventory)
    got = {
        s.name: s.env["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"]
        for n in plan.nodes.values() for s in n.services
        if s.kind == "engine" and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" in s.env
    }
    assert got == want
