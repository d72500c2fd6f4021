"""pdstack.vllm_offload_fix: an aborted request no longer ends vLLM 0.26.0's EngineCore through
the native CPU tier (``assert len(offload_keys) == len(offload_block_ids)``, vLLM issues 52170
and 49118).

The ``vllm`` test runs vLLM 0.26.0's own scheduler code (the Python files of its wheel, on the
CPU venv's torch) before and after the patch: tests/spine/offload_fix_vllm026.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import zipfile
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
    plugin discovery) finds the entry point there, and it loads this module's register."""
    path = vllm_offload_fix.plugin_path(tmp_path)
    assert vllm_offload_fix.plugin_path(tmp_path) == path  # again: same folder, no error
    found = [ep for dist in importlib.metadata.distributions(path=[str(path)])
             for ep in dist.entry_points if ep.group == "vllm.general_plugins"]
    assert [(ep.name, ep.value) for ep in found] == [
        ("pdstack_offload_fix", "pdstack.vllm_offload_fix:register")]
    assert (path / "pdstack").resolve() == Path(vllm_offload_fix.__file__).resolve().parent
    assert found[0].load() is vllm_offload_fix.register


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


def vllm_0260_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vLLM 0.26.0's Python files, from its wheel (gpu/payload/.wheels, or $WHEEL_ENV)."""
    named = os.environ.get(WHEEL_ENV)
    wheels = [Path(named)] if named else sorted(
        (REPO / "gpu" / "payload" / ".wheels").glob("vllm-0.26.0-*.whl"))
    if not wheels or not wheels[0].is_file():
        pytest.skip(f"no vLLM 0.26.0 wheel: set {WHEEL_ENV} (the GPU payload's wheel)")
    tree = tmp_path_factory.mktemp("vllm-0.26.0")
    with zipfile.ZipFile(wheels[0]) as whl:
        whl.extractall(tree, [n for n in whl.namelist()
                              if n.startswith("vllm/") and n.endswith(".py")])
    return tree


def venv_python() -> Path:
    from pdstack.testing.vllm_engines import VENV, require_venv

    require_venv()
    return VENV / "bin" / "python"


@pytest.mark.vllm
def test_vllm_0260_build_store_jobs_survives_aborts(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    tree = vllm_0260_tree(tmp_path_factory)
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{REPO}", VLLM_LOGGING_LEVEL="WARNING")
    proc = subprocess.run([str(venv_python()), str(REPO / "tests/spine/offload_fix_vllm026.py")],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["vllm"] == "0.26.0" and got["source"].startswith(str(tree))
    before, after = got["before"], got["after"]
    # 0.26.0 as shipped: each abort before the prompt's blocks were all allocated
    for name in ("queued", "preempted", "mid_prefill"):
        assert before[name]["error"] == "AssertionError", (name, before[name])
    assert got["applied"] is True and got["applied_again"] is True
    for name in ("queued", "preempted", "mid_prefill", "running"):
        assert after[name]["error"] is None, (name, after[name])
    # nothing to store of a request that never got (or lost) its blocks; its state is dropped
    for name in ("queued", "preempted"):
        assert after[name]["store_jobs"] == 0 and not after[name]["tracked"], after[name]
    # the full computed chunk of an aborted prefill is stored, from its own block; the second
    # block (100 of 128 tokens computed) is not
    assert after["mid_prefill"]["stored_chunks"] == [1]
    assert after["mid_prefill"]["src_blocks"] == [[21]]
    # a running request is stored as before
    assert after["running"] == before["running"]
    assert after["running"]["stored_chunks"] == [3]


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


@pytest.mark.vllm
def test_vllm_0260_plugin_loader_applies_it(tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM 0.26.0's own plugin loader, with only ``plugin_path`` and vLLM on the path (as
    ``pdstack launch`` runs an engine), patches the scheduler."""
    tree = vllm_0260_tree(tmp_path_factory)
    plugins = vllm_offload_fix.plugin_path(tmp_path_factory.mktemp("launch-logs"))
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "import vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler as s\n"
        "print(getattr(s.RequestOffloadState.storable_chunks, '__pdstack_offload_fix__', 0))\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{plugins}{os.pathsep}{tree}")
    proc = subprocess.run([str(venv_python()), "-c", code], env=env, cwd=plugins.parent,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"
    assert "pdstack offload fix: vLLM 0.26.0" in proc.stdout + proc.stderr
