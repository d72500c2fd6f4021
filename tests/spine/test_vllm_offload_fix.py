"""pdstack.vllm_offload_fix: an aborted request no longer ends vLLM 0.26.0's EngineCore through
the native CPU tier (``assert len(offload_keys) == len(offload_block_ids)``, vLLM issues 52170
and 49118).

vLLM 0.26.0's own scheduler code before and after the patch, and its plugin loader, are checked
by gpu/check_offload_fix.py where 0.26.0 is (the GPU host, or its wheel here): CI's CPU venv has
vLLM 0.32, fixed upstream, and the ``vllm`` test below shows that one is left alone.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pdstack import vllm_offload_fix

REPO = Path(__file__).resolve().parents[2]
WHEEL_ENV = "PDSTACK_VLLM_0260_WHEEL"
ABORTED = "FINISHED_ABORTED"


def test_plugin_path_names_the_entry_point(tmp_path: Path) -> None:
    """What ``pdstack launch`` puts on an engine's PYTHONPATH: importlib.metadata (vLLM's
    plugin discovery) finds the entry point there, and a Python with nothing else on its path
    (no site-packages: no pdstack installed) loads this module's register from it."""
    path = vllm_offload_fix.plugin_path(tmp_path)
    assert vllm_offload_fix.plugin_path(tmp_path) == path  # again: same folder, no error
    found = [ep for dist in importlib.metadata.distributions(path=[str(path)])
             for ep in dist.entry_points if ep.group == "vllm.general_plugins"]
    found = [ep for ep in found if ep.name == "pdstack_offload_fix"]  # beside engine auth
    assert [(ep.name, ep.value) for ep in found] == [
        ("pdstack_offload_fix", "pdstack.vllm_offload_fix:register")]
    code = ("import importlib.metadata as m, sys\n"
            "(ep,) = [e for e in m.entry_points(group='vllm.general_plugins')"
            " if e.name == 'pdstack_offload_fix']\n"
            "f = ep.load()\nprint(f.__module__, sys.modules[f.__module__].__file__)\n")
    run = subprocess.run([sys.executable, "-S", "-c", code], env={"PYTHONPATH": str(path)},
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["pdstack.vllm_offload_fix",
                                  str(path / "pdstack" / "vllm_offload_fix.py")]
    assert (path / "pdstack" / "vllm_offload_fix.py").read_text() == Path(
        vllm_offload_fix.__file__).read_text()


def storable_chunks_0260(self: Any, group_config: Any, num_offloadable_tokens: int) -> int:
    """vLLM 0.26.0's RequestOffloadState.storable_chunks (scheduler.py l. 308) on a
    non-EAGLE group: chunks from tokens alone."""
    return num_offloadable_tokens // group_config.tokens_per_chunk


def fake_state(status: str, computed: int, keys: int, blocks: int) -> SimpleNamespace:
    """Fake RequestOffloadState: one KV group, 64-token chunks of one GPU block each."""
    group = SimpleNamespace(offload_keys=[f"k{i}" for i in range(keys)],
                            block_ids=list(range(1, blocks + 1)))
    return SimpleNamespace(req=SimpleNamespace(status=status, num_computed_tokens=computed),
                           group_states=(group,), config=SimpleNamespace(blocks_per_chunk=1))


@pytest.mark.parametrize(
    ("status", "tokens", "computed", "keys", "blocks", "before", "after"),
    [
        # aborted while queued: whole-prompt keys (330 tokens), no blocks -> the assert
        (ABORTED, 330, 0, 5, 0, 5, 0),
        # aborted part-way through its chunked prefill: 128 tokens computed, 2 blocks
        (ABORTED, 330, 128, 5, 2, 5, 2),
        # ... 100 tokens computed: the second block is partial, so not stored
        (ABORTED, 330, 100, 5, 2, 5, 1),
        # running: blocks allocated before the block hash arrived (PR 52923's case)
        ("RUNNING", 320, 256, 4, 5, 5, 4),
        # running: a key without its blocks (blocks lag keys)
        ("RUNNING", 320, 256, 5, 3, 5, 3),
        # running, everything in step: unchanged
        ("RUNNING", 320, 256, 5, 5, 5, 5),
    ],
)
def test_storable_chunks_bounded_by_keys_blocks_and_computed_tokens(
    status: str, tokens: int, computed: int, keys: int, blocks: int, before: int, after: int
) -> None:
    state = fake_state(status, computed, keys, blocks)
    group_config = SimpleNamespace(group_idx=0, tokens_per_chunk=64)
    patched = vllm_offload_fix.bounded_storable_chunks(storable_chunks_0260, ABORTED)
    assert storable_chunks_0260(state, group_config, tokens) == before
    assert patched(state, group_config, tokens) == after
    # _build_store_jobs (l. 966-975) slices both lists with it: they now always agree
    n = patched(state, group_config, tokens)
    assert len(state.group_states[0].offload_keys[:n]) == len(state.group_states[0].block_ids[:n])


def venv_python() -> Path:
    from pdstack.testing.vllm_engines import VENV, require_venv

    require_venv()
    return VENV / "bin" / "python"


@pytest.mark.vllm
def test_other_vllm_versions_are_left_alone() -> None:
    """The CPU venv's vLLM (0.32, fixed upstream) is not patched."""
    code = (
        "from pdstack import vllm_offload_fix as f\n"
        "import vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler as s\n"
        "before = s.RequestOffloadState.storable_chunks\n"
        "print(f.apply(), s.RequestOffloadState.storable_chunks is before)\n"
    )
    proc = subprocess.run([str(venv_python()), "-c", code], capture_output=True, text=True,
                          timeout=300, check=False, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "False True"
