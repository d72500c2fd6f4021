"""A vLLM 0.26.0 plugin: aborting a request no longer kills the EngineCore through the
native CPU KV tier (OffloadingConnector) -- vllm-project/vllm issues 52170 and 49118.

The crash (0.26.0, ``vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``):
``request_finished`` (l. 1297) fills the request's offload keys for its whole prompt, and the
next ``schedule()`` passes it in ``finished_req_ids`` to ``_build_store_jobs`` (l. 926), which
takes ``num_tokens_after_batch = req.num_tokens`` for any finished request (l. 942) and counts
storable chunks from tokens alone (``RequestOffloadState.storable_chunks``, l. 308). A request
aborted before its prompt's KV blocks were all allocated -- still queued (no blocks), preempted
(its block ids cleared, l. 891) or part-way through a chunked prefill -- has more keys than
blocks, and ``assert len(offload_keys) == len(offload_block_ids)`` (l. 975) ends the EngineCore.
A load generator or client that cancels its outstanding requests under overload hits it.

The fix is upstream's (after 0.26.0; vLLM 0.32's scheduler.py l. 450-481 and 1585-1594):
``storable_chunks`` counts only chunks that have an offload key and allocated GPU blocks (the
key bound is PR 52923), and an aborted request is stored only up to its computed tokens (PR
49285). ``storable_chunks`` bounds every store decision of
``_build_store_jobs`` (both passes and ``advance_stored_idx``), so bounding it there makes the
two slices equal; the store cursor never moves past a chunk that was not stored, so a chunk
whose key or blocks arrive later is still stored then. Other vLLM versions are left alone.

vLLM loads ``vllm.general_plugins`` entry points in every process, in the EngineCore before
it builds its scheduler (0.26.0 ``vllm/v1/engine/core.py`` l. 112). This module is that plugin,
standalone (stdlib and vLLM only), loaded as ``pdstack.vllm_offload_fix`` through the entry
point in ``pdstack/vllm_plugins/``: ``pdstack launch`` writes it, its package's ``__init__`` and
that dist-info (:func:`plugin_files`) under its log folder and puts that first on each engine's
PYTHONPATH; the Compose engines mount the package read-only (pdstack/render.py).
``VLLM_PLUGINS=none`` in an engine's environment turns it off.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

# a child of vLLM's own logger, so the line is in the engine's log with vLLM's
log = logging.getLogger("vllm.pdstack_offload_fix")

FIXED_VLLM = "0.26.0"
SCHEDULER_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
_SIGNATURE = ["self", "group_config", "num_offloadable_tokens"]
_MARK = "__pdstack_offload_fix__"
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "pdstack_offload_fix"

StorableChunks = Callable[[Any, Any, int], int]


def bounded_storable_chunks(original: StorableChunks, aborted: object) -> StorableChunks:
    """``RequestOffloadState.storable_chunks`` of vLLM 0.26.0 (``original``) bounded by the
    chunks the request can store now: those of its computed tokens if it was aborted (its
    status is ``aborted``), and those with both an offload key and allocated GPU blocks."""

    def storable_chunks(self: Any, group_config: Any, num_offloadable_tokens: int) -> int:
        req = self.req
        if req.status == aborted:
            num_offloadable_tokens = min(num_offloadable_tokens, req.num_computed_tokens)
        num_chunks = original(self, group_config, num_offloadable_tokens)
        state = self.group_states[group_config.group_idx]
        return min(
            num_chunks,
            len(state.block_ids) // self.config.blocks_per_chunk,
            len(state.offload_keys),
        )

    setattr(storable_chunks, _MARK, True)
    return storable_chunks


def apply() -> bool:
    """Patch vLLM 0.26.0's OffloadingConnector scheduler (idempotent); True if it is patched.
    Any other vLLM, or a 0.26.0 whose method is not the one this was written against, is
    left as it is (logged)."""
    import importlib

    import vllm  # type: ignore[import-not-found]  # only in vLLM's own environment

    version = getattr(vllm, "__version__", "")
    if version != FIXED_VLLM:
        log.debug("pdstack offload fix: vLLM %s is not %s, nothing patched", version, FIXED_VLLM)
        return False
    scheduler = importlib.import_module(SCHEDULER_MODULE)
    from vllm.v1.request import RequestStatus  # type: ignore[import-not-found]

    cls = scheduler.RequestOffloadState
    current = cls.storable_chunks
    if getattr(current, _MARK, False):
        return True
    if list(inspect.signature(current).parameters) != _SIGNATURE:
        log.warning(
            "pdstack offload fix: %s.RequestOffloadState.storable_chunks%s is not vLLM %s's;"
            " not patched (an aborted request can still end the EngineCore: vLLM issue 52170)",
            SCHEDULER_MODULE, inspect.signature(current), FIXED_VLLM,
        )
        return False
    cls.storable_chunks = bounded_storable_chunks(current, RequestStatus.FINISHED_ABORTED)
    log.info(
        "pdstack offload fix: vLLM %s OffloadingConnector stores only keyed, allocated (and,"
        " for an aborted request, computed) chunks (vLLM issues 52170, 49118)", version,
    )
    return True


def register() -> None:
    """The ``vllm.general_plugins`` entry point; never raises into vLLM's plugin loader."""
    try:
        apply()
    except Exception:  # a failed patch must not stop the engine starting
        log.exception("pdstack offload fix: not applied")


PLUGINS_DIR = "vllm-plugins"  # under a launch's log folder


def plugin_files() -> dict[str, str]:
    """What vLLM needs on its PYTHONPATH to load pdstack's plugins (this module and
    :mod:`pdstack.vllm_engine_auth`: every engine route needs the engine key), by relative
    path: the package's files the engines run (``pdstack/...``: ``pdstack.sidecars.
    container_files``, the sidecars too) and the plugins' dist-infos at the top, naming their
    entry points (importlib.metadata finds distributions on sys.path). ``pdstack launch``
    writes them under its log folder; the Compose stacks mount the package itself."""
    from pdstack import sidecars

    out = {}
    for rel, text in sidecars.container_files().items():
        top = rel.removeprefix(sidecars.PLUGINS_DIR + "/")
        out[top if top != rel else f"pdstack/{rel}"] = text
    return out


def plugin_path(root: Path) -> Path:
    """``root``/``PLUGINS_DIR``, (re)written with :func:`plugin_files`."""
    path = root / PLUGINS_DIR
    for rel, text in plugin_files().items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    return path
