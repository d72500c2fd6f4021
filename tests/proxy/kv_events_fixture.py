"""Run with the vLLM venv's python (``.venv-vllm/bin/python``): prints, as JSON, block
hashes and encoded KV-event batches made by vLLM's own code, for the proxy's parity tests
(``tests/proxy/test_kv_index.py``; recorded in ``data/kv_events_vllm.json``)."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("PYTHONHASHSEED", "0")

import msgspec
from vllm.distributed import kv_events as ke
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils as kcu


def chain(tokens: list[int], block_size: int, first_extra: object) -> list[int]:
    out, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = first_extra if start == 0 else None
        parent = kcu.hash_block_tokens(sha256, parent, tokens[start : start + block_size], extra)
        out.append(kcu.maybe_convert_block_hash(parent))
    return out


def main() -> None:
    kcu.init_none_hash(sha256)
    tokens = [(i * 7919) % 32000 for i in range(100)]
    cases = []
    for block_size in (16, 32):
        for salt in (None, "tenant-a"):
            # vLLM 0.32 tags the salt; 0.26 hashed the bare salt (same NONE_HASH rules)
            for tagged in (True, False):
                extra = None if salt is None else (
                    (("cache_salt", salt),) if tagged else (salt,))
                cases.append({"block_size": block_size, "salt": salt, "tagged": tagged,
                              "tokens": tokens, "hashes": chain(tokens, block_size, extra)})
    h = chain(tokens, 16, None)
    enc = msgspec.msgpack.Encoder()
    stored = ke.BlockStored(
        block_hashes=h[:3], parent_block_hash=None, token_ids=tokens[:48], block_size=16,
        lora_id=None, medium="GPU", lora_name=None, extra_keys=None,
    )
    salted_first = chain(tokens, 16, (("cache_salt", "tenant-a"),))[0]
    salted = ke.BlockStored(
        block_hashes=[salted_first], parent_block_hash=None, token_ids=tokens[:16],
        block_size=16, lora_id=None, medium="GPU", lora_name=None,
        extra_keys=kcu.to_event_extra_keys([(("cache_salt", "tenant-a"),)]),
    )
    offloaded = ke.BlockStored(
        block_hashes=h[3:5], parent_block_hash=h[2], token_ids=tokens[48:80], block_size=16,
        lora_id=None, medium="CPU", lora_name=None,
    )
    removed = ke.BlockRemoved(block_hashes=[h[2]], medium="GPU")
    batches = [
        ke.KVEventBatch(ts=1.0, events=[stored, salted]),
        ke.KVEventBatch(ts=2.0, events=[offloaded, removed]),
        ke.KVEventBatch(ts=3.0, events=[ke.AllBlocksCleared()]),
    ]
    json.dump({
        "vllm_seed": os.environ["PYTHONHASHSEED"],
        "cases": cases,
        "gpu_hashes": h,
        "salted_first": salted_first,
        "batches": [enc.encode(b).hex() for b in batches],
    }, sys.stdout)


if __name__ == "__main__":
    main()
