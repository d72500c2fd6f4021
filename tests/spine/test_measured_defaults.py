"""Defaults the H200 measurements chose (results/h200x1 run 2), as the planner writes them:
KV-aware admission on the gpu profile with a running cap from the engines' own running
limits, and CUDA IPC GET for NIXL engines on GPUs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from pdstack.plan import make_plan
from pdstack.plan_proxy import admission_max_running, engine_priority
from pdstack.topology import TopologyError, load_topology

REPO = Path(__file__).resolve().parents[2]


SLO_GPU = ["--admission-ttft-slo", "2"]  # pdstack_ttft_slo_s unset on a GPU


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
    # gpu without an explicit running limit: capped at vLLM's own defaults, CUDA graphs up to
    # 512 running (H200 / B200: max_num_seqs 1024), max_num_seqs 256 elsewhere (A100)
    ("h200x1", ["--admission", "kv", "--admission-max-running", "512", *SLO_GPU]),
    ("h200x1-nixl", ["--admission", "kv", "--admission-max-running", "512", *SLO_GPU]),
    ("h200x2-shared-l1", ["--admission", "kv", "--admission-max-running", "512", *SLO_GPU]),
    ("a100x3", ["--admission", "kv", "--admission-max-running", "256", *SLO_GPU]),
    ("b200x2", ["--admission", "kv", "--admission-max-running", "512", *SLO_GPU]),
    # cpu: on too (a flood drowned its engines: issue 54), with a CPU engine's SLO, and a
    # burst not predicted faster than what the engines served one at a time
    ("local-cpu", ["--admission", "kv", "--admission-ttft-slo", "6",
                   "--admission-burst-growth", "1"]),
])
def test_proxy_admission_defaults(inventory: str, want: list[str]) -> None:
    assert proxy_admission_args(plan_of(inventory)) == want


def test_explicit_admission_wins_over_the_profile_default(tmp_path: Path) -> None:
    off = with_vars(tmp_path / "a", "h200x1-nixl", pdstack_proxy_admission="off")
    assert proxy_admission_args(plan_of(off)) == []
    on = with_vars(tmp_path / "b", "local-cpu", pdstack_proxy_admission="kv")
    assert proxy_admission_args(plan_of(on))[:2] == ["--admission", "kv"]


def test_the_ttft_slo_reaches_the_proxy_and_a_bad_one_names_its_field(tmp_path: Path) -> None:
    slo = with_vars(tmp_path / "a", "h200x1", pdstack_ttft_slo_s=0.8)
    args = proxy_admission_args(plan_of(slo))
    assert args[args.index("--admission-ttft-slo") + 1] == "0.8"
    bad = with_vars(tmp_path / "b", "h200x1", pdstack_ttft_slo_s=-1)
    with pytest.raises(TopologyError) as err:
        load_topology(bad)
    assert "ttft_slo_s" in str(err.value)


def engine_args(tmp_path: Path, prefill: list[str], decode: list[str], **extra) -> Path:
    """h200x1-nixl (an H200: vLLM's defaults run 512 at most in CUDA graphs) with
    per-engine extra_args (and ``extra`` group vars)."""
    inv = with_vars(tmp_path, "h200x1-nixl", **extra)
    hosts_file = inv / "hosts.yml"
    hosts = yaml.safe_load(hosts_file.read_text())
    node = hosts["all"]["children"]["pdstack_nodes"]["hosts"]["h200"]
    for eng in node["pdstack_engines"]:
        eng["extra_args"] = prefill if eng["role"] == "prefill" else decode
    hosts_file.write_text(yaml.safe_dump(hosts))
    return inv


def test_running_cap_is_the_smallest_limit_of_the_gated_engines(tmp_path: Path) -> None:
    # a decoder's own --max-num-seqs=96 is below vLLM's default limit; a prefiller is not gated
    inv = engine_args(tmp_path / "a", ["--max-num-seqs", "8"], ["--max-num-seqs=96"])
    assert admission_max_running(load_topology(inv)) == 96
    args = proxy_admission_args(plan_of(inv))
    assert args[args.index("--admission-max-running") + 1] == "96"
    # an unreadable value: vLLM's default for an H200
    inv = engine_args(tmp_path / "b", ["--max-num-seqs", "8"], ["--max-num-seqs", "x"])
    assert admission_max_running(load_topology(inv)) == 512
    # the CUDA-graph limit of the seed's runs
    inv = engine_args(tmp_path / "c", [], ["--max-cudagraph-capture-size", "128"])
    assert admission_max_running(load_topology(inv)) == 128


def test_the_proxy_sets_priorities_only_when_every_engine_schedules_by_them(
    tmp_path: Path,
) -> None:
    """vLLM's --scheduling-policy priority on every engine (its last value counts) puts
    ``engine_priority`` in the proxy's backend table; one fcfs engine, and it is left out."""
    prio = ["--scheduling-policy", "priority"]
    inv = engine_args(tmp_path / "a", prio, ["--scheduling-policy=fcfs", *prio])
    assert engine_priority(load_topology(inv))
    assert plan_of(inv).backend_table.model_dump()["engine_priority"] is True
    last_fcfs = [*prio, "--scheduling-policy", "fcfs"]
    for i, (pre, dec) in enumerate([(prio, []), ([], prio), (prio, last_fcfs)]):
        inv = engine_args(tmp_path / f"b{i}", pre, dec)
        assert not engine_priority(load_topology(inv))
        assert "engine_priority" not in plan_of(inv).backend_table.model_dump()


@pytest.mark.parametrize(("args", "profile", "gpu", "want"), [
    ([], "gpu", "NVIDIA H200", 512),            # min(1024 seqs, min(2 * 1024, 512) graphs)
    ([], "gpu", "NVIDIA A100-SXM4-80GB", 256),  # A100: 256 seqs
    ([], "gpu", None, 256),                     # unknown GPU: the smaller default
    (["--max-num-seqs", "200"], "gpu", "NVIDIA H200", 200),
    (["--max-num-seqs", "100"], "gpu", "NVIDIA H200", 100),   # graphs up to 200 >= 100
    (["--max-num-seqs", "2048"], "gpu", "NVIDIA B200", 512),  # graphs stop at 512
    (["--enforce-eager"], "gpu", "NVIDIA H200", 1024),        # no graphs: max_num_seqs
    ([], "cpu", None, 0),                                     # cpu: no limit known
    (["--max-num-seqs", "8"], "cpu", None, 8),
])
def test_engine_running_limit_follows_vllm_defaults(args, profile, gpu, want) -> None:
    from pdstack.plan_proxy import engine_running_limit

    assert engine_running_limit(args, profile, gpu) == want


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


def engine_commands(plan) -> dict[str, list[str]]:
    return {
        s.role or s.name: s.command
        for n in plan.nodes.values() for s in n.services if s.kind == "engine"
    }


# a batch tenant beside an interactive one (issue 37's stacks)
BATCH = {"pdstack_tenants": {"chat": {}, "batch": {"priority": "batch"}}}
STEP_FLAGS = ("--max-num-batched-tokens", "--long-prefill-token-threshold")


def test_a_batch_tenant_leaves_the_engine_step_to_vllm(tmp_path: Path) -> None:
    """Issue 37: shorter engine steps beside a batch tenant did not help on GPUs (isolation
    runs 3 and 5: 1,024-token chunks, 2,048-token steps), so the planner adds no step flags
    for tenants: vLLM's own step, or the user's extra_args verbatim."""
    for inv in ("h200x1-isolation", engine_args(tmp_path / "pd", [], [], **BATCH)):
        for cmd in engine_commands(plan_of(inv)).values():
            assert not any(f in cmd for f in STEP_FLAGS), cmd
    own = ["--max-num-batched-tokens", "2048", "--long-prefill-token-threshold", "1024"]
    prefill = engine_commands(plan_of(engine_args(tmp_path / "own", own, [], **BATCH)))["prefill"]
    i = prefill.index("--max-num-batched-tokens")
    assert prefill[i:i + 4] == own and prefill.count("--max-num-batched-tokens") == 1


@pytest.mark.parametrize("inventory", ["h200x1", "local-cpu", "h200x1-nixl"])
def test_the_planned_proxy_command_parses_with_the_proxys_own_flags(inventory: str) -> None:
    """Every flag the planner gives the proxy is one ``pdstack proxy`` knows, with the value
    the plan meant (a flag the proxy does not know stops the stack at start)."""
    import argparse

    from pdstack.proxy.admission_flags import admission_from_args
    from pdstack.proxy.cli import register

    parser = register(argparse.ArgumentParser().add_subparsers(), "proxy", "")
    cmd = service(plan_of(inventory), "proxy").command
    args = parser.parse_args(cmd[cmd.index("proxy") + 1:])
    admission = admission_from_args(args)
    assert admission.enabled
    want = 6.0 if inventory == "local-cpu" else 2.0
    assert admission.ttft_slo_s == want
