"""The mini model (gpu/models/deepseek-v2-mini) against the planner's numbers, and the GPU fit
check that lets 16 of its engines share one H200 (issue 35)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from pdstack.plan import make_plan
from pdstack.topology import TopologyError, load_topology

REPO = Path(__file__).resolve().parents[2]
MINI = REPO / "gpu" / "models" / "deepseek-v2-mini" / "config.json"
SEED_INVENTORIES = sorted(
    p.parent.name for p in (REPO / "inventory").glob("h200x1-seed-*/hosts.yml")
)


def deepseek_v2_params(c: dict) -> int:
    """Parameters of a DeepseekV2ForCausalLM config (q_lora_rank null, untied embeddings),
    counted from vLLM's / transformers' module shapes (norm weights included)."""
    h, heads, vocab = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    nope, rope, v, rank = (c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"],
                           c["kv_lora_rank"])
    assert c["q_lora_rank"] is None and not c["tie_word_embeddings"]
    attn = (h * heads * (nope + rope)  # q_proj
            + h * (rank + rope) + rank  # kv_a_proj_with_mqa + kv_a_layernorm
            + rank * heads * (nope + v)  # kv_b_proj
            + heads * v * h)  # o_proj
    dense = 3 * h * c["intermediate_size"]
    experts = c["n_routed_experts"]
    moe = experts * h + 3 * h * c["moe_intermediate_size"] * (experts + c["n_shared_experts"])
    layers, first_dense = c["num_hidden_layers"], c["first_k_dense_replace"]
    return (2 * vocab * h + h + layers * (2 * h + attn) + first_dense * dense
            + (layers - first_dense) * moe)


def kv_bytes_per_token(c: dict, dtype_bytes: int = 2) -> int:
    """MLA caches the compressed latent and the rope key: (kv_lora_rank + rope) per layer."""
    return c["num_hidden_layers"] * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * dtype_bytes


def test_the_parameter_count_is_deepseek_v2_lites_published_one():
    """The mini's config with V2-Lite's 27 layers and 64 experts back: 15.7 B parameters
    (the model card's), 31,104 KV bytes per token (inventory/h200x1's)."""
    lite = {**json.loads(MINI.read_text()), "num_hidden_layers": 27, "n_routed_experts": 64}
    assert round(deepseek_v2_params(lite) / 1e9, 2) == 15.71
    assert kv_bytes_per_token(lite) == load_topology(
        REPO / "inventory" / "h200x1").deployment.model.kv_bytes_per_token == 31104


def test_mini_is_v2_lite_with_fewer_layers_and_experts():
    mini = json.loads(MINI.read_text())
    assert mini["architectures"] == ["DeepseekV2ForCausalLM"]
    assert (mini["num_hidden_layers"], mini["n_routed_experts"]) == (4, 16)
    assert (mini["kv_lora_rank"], mini["qk_rope_head_dim"], mini["num_experts_per_tok"]) == (
        512, 64, 6)


def test_seed_inventories_carry_the_minis_kv_and_weight_bytes():
    mini = json.loads(MINI.read_text())
    weights = deepseek_v2_params(mini) * 2  # bf16
    assert weights == 2_017_959_936
    assert len(SEED_INVENTORIES) == 7
    for name in SEED_INVENTORIES:
        model = load_topology(REPO / "inventory" / name).deployment.model
        assert model.name == "/tmp/models/deepseek-v2-mini", name
        assert model.kv_bytes_per_token == kv_bytes_per_token(mini) == 4608, name
        assert model.weight_bytes == weights, name


def test_all_seed_inventories_fit_one_h200_together():
    """16 engines: weights + KV + the planner's per-engine overhead, on one GPU's memory."""
    from pdstack.topology import ENGINE_GPU_OVERHEAD_BYTES, GPU_MEMORY_MIB

    need = 0
    for name in SEED_INVENTORIES:
        topo = load_topology(REPO / "inventory" / name)
        for node in topo.nodes:
            for eng in node.engines:
                need += (topo.deployment.model.weight_bytes or 0) + (eng.kv_cache_bytes or 0)
                need += ENGINE_GPU_OVERHEAD_BYTES
    assert need < GPU_MEMORY_MIB["NVIDIA H200"] * 2**20


def _copy(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name
    shutil.copytree(REPO / "inventory" / name, dst)
    return dst


def test_engines_that_do_not_fit_their_gpu_are_named(tmp_path):
    inv = _copy(tmp_path, "h200x1-seed-nixl-2p2d")
    hosts = yaml.safe_load((inv / "hosts.yml").read_text())
    node = hosts["all"]["children"]["pdstack_nodes"]["hosts"]["h200"]
    for eng in node["pdstack_engines"]:
        eng["kv_cache_bytes"] = 40 * 2**30  # 4 x (1.9 + 40 + 4) GiB > 140 GiB
    (inv / "hosts.yml").write_text(yaml.safe_dump(hosts))
    with pytest.raises(TopologyError) as err:
        load_topology(inv)
    (problem,) = [p for p in err.value.problems if p.field == "h200.pdstack_engines"]
    assert "GPU 0 needs 183.5 GiB" in problem.message
    assert "NVIDIA H200 has 140.4 GiB" in problem.message


def test_pretend_nodes_on_one_host_do_not_collide():
    """shared-l1+nixl on one host: two LMCache servers on two loopback addresses, the same
    ZMQ port, and no TCP API port to share (it is a unix socket: pdstack.sidecars)."""
    plan = make_plan(load_topology(REPO / "inventory" / "h200x1-seed-shared-l1-nixl"))
    binds = []
    for node in plan.nodes.values():
        (lm,) = [s for s in node.services if s.kind == "lmcache"]
        assert "--http-port" not in lm.command and "--http-host" not in lm.command
        binds.append((lm.command[lm.command.index("--host") + 1], lm.ports["zmq"]))
    assert sorted(binds) == [("127.0.0.1", 6110), ("127.0.0.2", 6110)]


def test_the_12_layer_model_is_v2_lite_cut_and_its_inventory_carries_it():
    """gpu/models/deepseek-v2-12l (issue 56 on an H100): V2-Lite with 12 layers, every expert;
    inventory/h100x1-3e's weight and KV bytes are its own."""
    c = json.loads((REPO / "gpu" / "models" / "deepseek-v2-12l" / "config.json").read_text())
    lite = {**json.loads(MINI.read_text()), "num_hidden_layers": 27, "n_routed_experts": 64}
    assert {k: v for k, v in c.items() if k != "num_hidden_layers"} == {
        k: v for k, v in lite.items() if k != "num_hidden_layers"}
    assert c["num_hidden_layers"] == 12
    model = load_topology(REPO / "inventory" / "h100x1-3e").deployment.model
    assert model.name == "/tmp/models/deepseek-v2-12l"
    assert model.weight_bytes == deepseek_v2_params(c) * 2 == 13_867_532_288
    assert model.kv_bytes_per_token == kv_bytes_per_token(c) == 13824
