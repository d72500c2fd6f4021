# mypy: disable-error-code="import-not-found"
# (run by the CPU vLLM venv's Python: torch and vLLM 0.26.0 are not in pdstack's venv)
"""Driver for gpu/check_offload_fix.py: vLLM 0.26.0's own OffloadingConnector scheduler
(``_build_store_jobs``) on a constructed state, before and after ``pdstack.vllm_offload_fix``.

Run by the CPU vLLM venv's Python with a vLLM 0.26.0 source tree first on PYTHONPATH (the
Python files of the 0.26.0 wheel; nothing of it is compiled in this path). Real: the
scheduler, its config and per-request state, ``Request`` with its block hasher. Fakes (named
so): the CPU offloading manager (records what it is asked to store) and the engine config
holder. Prints one JSON object: per scenario, what happened without and with the fix.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as sched_mod
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MLAAttentionSpec
from vllm.v1.kv_offload.base import LookupResult, PrepareStoreOutput
from vllm.v1.request import Request, RequestStatus

from pdstack import vllm_offload_fix

BLOCK = 64  # FlashMLA's GPU block size (DeepSeek-V2-Lite); one GPU block per offloaded chunk
PROMPT = 5 * BLOCK + 10  # five full chunks and a partial one


class FakeManager:
    """Fake CPU offloading manager: misses every lookup, accepts every store and records
    the keys offered."""

    def __init__(self) -> None:
        self.offered: list[list[Any]] = []

    def prepare_store(self, keys: list[Any], req_context: Any) -> PrepareStoreOutput:
        self.offered.append(list(keys))
        return PrepareStoreOutput(keys_to_store=list(keys), store_spec=None, evicted_keys=[])

    def lookup(self, key: Any, req_context: Any) -> LookupResult:
        return LookupResult.MISS  # a unique prompt: nothing of it offloaded yet

    def touch(self, keys: Any, req_context: Any) -> None:
        pass

    def on_new_request(self, req_context: Any) -> None:
        return None

    def on_request_finished(self, req_context: Any) -> None:
        pass


def new_scheduler() -> tuple[Any, FakeManager]:
    manager = FakeManager()
    spec = SimpleNamespace(  # fake OffloadingSpec: what the scheduler reads of it
        tokens_per_block=(BLOCK,), blocks_per_chunk=1, tokens_per_hash=BLOCK,
        get_manager=lambda: manager, offload_prompt_only=True,
        kv_events_config=SimpleNamespace(enable_kv_cache_events=False,
                                         self_describing_kv_events=False),
    )
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(world_size=1), speculative_config=None,
        cache_config=SimpleNamespace(enable_prefix_caching=True),
    )
    mla = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    kv_cache_config = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["layer.0"], mla)])
    return sched_mod.OffloadingConnectorScheduler(spec, vllm_config, kv_cache_config), manager


def new_request(rid: str) -> Request:
    return Request(
        rid, list(range(1000, 1000 + PROMPT)), SamplingParams(max_tokens=8), None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )


def output(scheduled: dict[str, int], finished: set[str]) -> SchedulerOutput:
    out = SchedulerOutput.make_empty()
    out.num_scheduled_tokens = scheduled
    out.finished_req_ids = finished
    return out


def scenario(name: str) -> dict[str, Any]:
    """Build the state of one scenario and run _build_store_jobs on it."""
    sched, manager = new_scheduler()
    req = new_request(name)
    sched.on_new_request(req)
    status = sched._req_status[name]
    if name in ("queued", "preempted"):
        # considered for scheduling, no KV blocks free: the lookup fills the keys
        sched.get_num_new_matched_tokens(req, 0)
    if name == "preempted":
        status.update_block_id_groups(([11, 12, 13],))
        req.num_computed_tokens = 3 * BLOCK
        # preemption (0.26.0 Scheduler._preempt_request) and the next step's state update
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        for state in status.group_states:
            state.block_ids.clear()
    if name in ("mid_prefill", "running"):
        # first chunk of a chunked prefill: 100 tokens scheduled, their 2 blocks allocated
        status.update_offload_keys()
        status.update_block_id_groups(([21, 22],))
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = 100
    if name == "running":
        sched_out = output({name: 92}, set())  # the next chunk: to 192 tokens, block 23
        status.update_block_id_groups(([23],))
    else:  # aborted by its client (0.26.0 Scheduler.finish_requests -> _free_request)
        req.status = RequestStatus.FINISHED_ABORTED
        sched.request_finished(req)
        sched_out = output({}, {name})
    try:
        jobs = sched._build_store_jobs(sched_out)
    except AssertionError as exc:
        return {"error": f"AssertionError {exc}".strip()}
    return {
        "error": None,
        "stored_chunks": [len(keys) for keys in manager.offered],
        "store_jobs": len(jobs),
        "src_blocks": [[int(b) for b in job.src_spec.block_ids] for job in jobs.values()],
        "tracked": name in sched._req_status,
    }


def main() -> None:
    init_none_hash(sha256)
    names = ("queued", "preempted", "mid_prefill", "running")
    result: dict[str, Any] = {"vllm": vllm.__version__, "source": sched_mod.__file__}
    result["before"] = {n: scenario(n) for n in names}
    result["applied"] = vllm_offload_fix.apply()
    result["applied_again"] = vllm_offload_fix.apply()
    result["after"] = {n: scenario(n) for n in names}
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
