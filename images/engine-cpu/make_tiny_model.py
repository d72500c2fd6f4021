#!/usr/bin/env python3
"""Make a tiny, servable model directory with no download.

    make_tiny_model.py --out DIR [--seed N] [--arch llama|deepseek-v2]

Writes into DIR:
- tokenizer.json / tokenizer_config.json / special_tokens_map.json: a byte-level BPE
  trained here with `tokenizers` on a synthetic corpus that is generated from a fixed
  seed, so every run (any machine, any Python) gives the same tokenizer;
- config.json + generation_config.json (LlamaForCausalLM, or a DeepSeek-V2-Lite-shaped
  DeepseekV2ForCausalLM with MLA: kv_lora_rank 512 + qk_rope_head_dim 64, the only head
  size vLLM's CPU MLA kernel supports);
- model.safetensors: random bf16 weights drawn from `--seed` (N(0, 0.08), embeddings
  N(0, 1), norms 1). Real random weights make the output depend on the prompt, unlike
  vLLM's `--load-format dummy`; two seeds give two "revisions" of one model.

Needs only numpy and tokenizers (both come with vLLM); the safetensors file is written
directly. Serve it with `--load-format auto` (the default).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

TOKENIZER_VOCAB = 4096
# Embedding rows = the tokenizer's vocabulary: with random weights every id the model can
# sample then decodes to text (ids past the tokenizer would stream as empty strings).
VOCAB_SIZE = TOKENIZER_VOCAB
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_WORDS_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their can has more when will "
    "would if so what up out about who them some into time only other could new these two "
    "may then do first any like now my such make over our even most me state after also made "
    "many did must before back see through way where get much go well your know should down "
    "work year because come people just say each those take day good how long little use "
    "prefill decode cache token model server request stream node engine memory block layer "
    "vector tensor prefix shared store transfer kernel batch queue proxy metric latency "
    "hello world answer question please thank chat assistant user system message reply"
)
_SYLLABLES_TEXT = (
    "ka ri to na mi ro se lu pe da vo ne si ta ko mu re ga zo be fi ha ju lo ma ni po qu "
    "sa te vi wa xe yo zu ar en il on ur st th ch sh tr pl gr"
)
_WORDS = _WORDS_TEXT.split(" ")
_SYLLABLES = _SYLLABLES_TEXT.split(" ")
_PUNCT = [".", ",", "!", "?", ":", ";", "-", "(", ")", "\"", "'", "=", "+", "*", "/", "#"]


def corpus(n_lines: int = 6000) -> Iterator[str]:
    """Deterministic synthetic text: English-ish words, made-up words, numbers, code-ish."""
    rng = random.Random(20261130)
    for i in range(n_lines):
        parts: list[str] = []
        for _ in range(rng.randint(6, 24)):
            r = rng.random()
            if r < 0.62:
                w = rng.choice(_WORDS)
            elif r < 0.86:
                w = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
            elif r < 0.94:
                w = str(rng.randint(0, 10 ** rng.randint(1, 5)))
            else:
                w = rng.choice(_PUNCT)
            if rng.random() < 0.1:
                w = w.capitalize()
            parts.append(w)
        line = " ".join(parts)
        if i % 7 == 0:
            line = f"def {rng.choice(_WORDS)}_{rng.choice(_WORDS)}(x, y={i}):\n    return {line!r}"
        yield line + "\n"


def build_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n")


def tiny_config(bos: int, eos: int, pad: int) -> dict[str, Any]:
    """What every tiny model shares: its size, vocabulary, context and special tokens."""
    return {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "bfloat16",
    }


def llama_config(bos: int, eos: int, pad: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **tiny_config(bos, eos, pad),
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
    }


def deepseek_v2_config(bos: int, eos: int, pad: int) -> dict[str, Any]:
    # DeepSeek-V2-Lite-shaped, tiny. CPU MLA kernel needs kv_lora_rank + qk_rope_head_dim == 576.
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        **tiny_config(bos, eos, pad),
        "moe_intermediate_size": 128,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
    }


def llama_shapes(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (nh * hd, h)),
            (p + "self_attn.k_proj.weight", (nkv * hd, h)),
            (p + "self_attn.v_proj.weight", (nkv * hd, h)),
            (p + "self_attn.o_proj.weight", (h, nh * hd)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]
    return out


def deepseek_v2_shapes(c: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    h, nh = c["hidden_size"], c["num_attention_heads"]
    nope, rope, vdim, lora = (
        c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    )
    moe_i = c["moe_intermediate_size"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (nh * (nope + rope), h)),
            (p + "self_attn.kv_a_proj_with_mqa.weight", (lora + rope, h)),
            (p + "self_attn.kv_a_layernorm.weight", (lora,)),
            (p + "self_attn.kv_b_proj.weight", (nh * (nope + vdim), lora)),
            (p + "self_attn.o_proj.weight", (h, nh * vdim)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        if i < c["first_k_dense_replace"]:
            inter = c["intermediate_size"]
            out += [
                (p + "mlp.gate_proj.weight", (inter, h)),
                (p + "mlp.up_proj.weight", (inter, h)),
                (p + "mlp.down_proj.weight", (h, inter)),
            ]
            continue
        out.append((p + "mlp.gate.weight", (c["n_routed_experts"], h)))
        for e in range(c["n_routed_experts"]):
            q = f"{p}mlp.experts.{e}."
            out += [
                (q + "gate_proj.weight", (moe_i, h)),
                (q + "up_proj.weight", (moe_i, h)),
                (q + "down_proj.weight", (h, moe_i)),
            ]
        si = moe_i * c["n_shared_experts"]
        q = p + "mlp.shared_experts."
        out += [
            (q + "gate_proj.weight", (si, h)),
            (q + "up_proj.weight", (si, h)),
            (q + "down_proj.weight", (h, si)),
        ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]
    return out


def to_bf16_bytes(a: np.ndarray) -> bytes:
    """float32 -> bfloat16 (round to nearest even), as raw little-endian bytes."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], bytes]]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, data in tensors:
        header[name] = {"dtype": "BF16", "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for _, _, data in tensors:
            f.write(data)


def random_weights(shapes: list[tuple[str, tuple[int, ...]]], seed: int
                   ) -> list[tuple[str, tuple[int, ...], bytes]]:
    rng = np.random.default_rng(seed)
    out = []
    for name, shape in shapes:
        if "norm" in name:
            a = np.ones(shape, dtype=np.float32)
        else:
            std = 1.0 if "embed" in name else 0.08
            a = rng.standard_normal(shape, dtype=np.float32) * std
        out.append((name, shape, to_bf16_bytes(a)))
    return out


def make_model(out: Path, seed: int, arch: str) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    bos, eos, pad = (tok.token_to_id(t) for t in SPECIAL_TOKENS)
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "model_max_length": 4096, "add_bos_token": False,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
    })
    write_json(out / "special_tokens_map.json",
               {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
    if arch == "llama":
        cfg = llama_config(bos, eos, pad)
        shapes = llama_shapes(cfg)
    else:
        cfg = deepseek_v2_config(bos, eos, pad)
        shapes = deepseek_v2_shapes(cfg)
    write_json(out / "config.json", cfg)
    write_json(out / "generation_config.json",
               {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False})
    tensors = random_weights(shapes, seed)
    write_safetensors(out / "model.safetensors", tensors)
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    info = {
        "arch": arch, "seed": seed, "tokenizer_vocab": tok.get_vocab_size(),
        "params": sum(int(np.prod(s)) for _, s, _ in tensors),
        "weights_sha256": digest,
    }
    write_json(out / "pdstack_tiny_model.json", info)
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="model directory to write")
    ap.add_argument("--seed", type=int, default=1, help="weights seed (the 'revision')")
    ap.add_argument("--arch", choices=["llama", "deepseek-v2"], default="llama")
    a = ap.parse_args(argv)
    info = make_model(a.out, a.seed, a.arch)
    print(f"wrote {a.out}: {json.dumps(info)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
