"""A vLLM plugin: a KV transfer that finishes after its request was aborted no longer kills the
EngineCore (vllm-project/vllm issues 43226, 46240, 49089; fixes proposed upstream, none in the
pinned versions).

``Scheduler._update_from_kv_xfer_finished`` asserts that every request a KV connector reports
in ``finished_recving`` / ``finished_sending`` is still the scheduler's, and that a finished
receive belongs to a request still waiting for it or finished. With an asynchronous connector
(NIXL pulls, LMCache's loads and stores) neither holds when the request was aborted while its
transfer was in flight: the proxy ends a leg (a client gone, a stream moved to another engine,
a link lost, a prefill retried), the scheduler frees the request, the transfer's completion
arrives a step later, and the ``AssertionError`` ends the EngineCore with every request on it.
Seen here: the two-node lab's decoder after its link came back (``assert req_id in
self.requests``, vLLM 0.32.0 CPU, NIXL), the same test's node1 decoder once in CI.

The patch drops only those notifications (their blocks were freed with the request) and logs
each; everything else runs vLLM's own method unchanged, the connector's
``update_connector_output`` with the whole output. It applies to any vLLM whose method still
has the assertion (0.26.0 on the GPUs, 0.32.0 on CPU), and leaves a fixed one alone.

Loaded like :mod:`pdstack.vllm_offload_fix` (its entry point in ``pdstack/vllm_plugins/``);
``VLLM_PLUGINS=none`` turns it off. Standalone: stdlib and vLLM only.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("vllm.pdstack_kv_xfer_fix")

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
METHOD = "_update_from_kv_xfer_finished"
ASSERTION = "assert req_id in self.requests"
_MARK = "__pdstack_kv_xfer_fix__"
PLUGIN_NAME = "pdstack_kv_xfer_fix"

Update = Callable[[Any, Any], None]


def stale(scheduler: Any, output: Any, waiting: object,
          is_finished: Callable[[object], bool]) -> tuple[set[str], set[str]]:
    """The finished receives and sends of ``output`` that vLLM's method would assert on: for
    requests the scheduler no longer holds; a receive for a request neither ``waiting`` for it
    nor finished (it was moved on to compute locally); a send for a request not finished (its
    blocks are not the send's to free), or whose receive, in the same output, frees it first."""
    requests = scheduler.requests
    recv = set(output.finished_recving or ())
    send = set(output.finished_sending or ())
    bad_recv = {r for r in recv if r not in requests
                or (requests[r].status != waiting and not is_finished(requests[r].status))}
    freed = {r for r in recv - bad_recv if requests[r].status != waiting}
    bad_send = {r for r in send if r not in requests or r in freed
                or not is_finished(requests[r].status)}
    return bad_recv, bad_send


def tolerant(original: Update, waiting: object, is_finished: Callable[[object], bool]) -> Update:
    """vLLM's ``_update_from_kv_xfer_finished`` (``original``) without the notifications that
    :func:`stale` finds: the connector still sees the whole output."""

    def update(self: Any, kv_connector_output: Any) -> None:
        bad_recv, bad_send = stale(self, kv_connector_output, waiting, is_finished)
        if not bad_recv and not bad_send:
            return original(self, kv_connector_output)
        log.warning("pdstack kv transfer fix: dropped finished KV transfers of requests already"
                    " freed or moved on (receives %s, sends %s)", sorted(bad_recv),
                    sorted(bad_send))
        connector = self.connector
        if connector is not None:
            connector.update_connector_output(kv_connector_output)
        kept = dataclasses.replace(
            kv_connector_output,
            finished_recving=set(kv_connector_output.finished_recving or ()) - bad_recv,
            finished_sending=set(kv_connector_output.finished_sending or ()) - bad_send)
        self.connector = None  # updated above, once
        try:
            return original(self, kept)
        finally:
            self.connector = connector

    setattr(update, _MARK, True)
    return update


def apply() -> bool:
    """Patch vLLM's scheduler (idempotent); True if it is patched. A vLLM whose method has no
    such assertion (fixed), or another signature, is left as it is (logged)."""
    import importlib

    scheduler = importlib.import_module(SCHEDULER_MODULE)
    from vllm.v1.request import RequestStatus  # type: ignore[import-not-found]

    cls = scheduler.Scheduler
    current = getattr(cls, METHOD)
    if getattr(current, _MARK, False):
        return True
    params = list(inspect.signature(current).parameters)
    if params != ["self", "kv_connector_output"] or ASSERTION not in inspect.getsource(current):
        log.debug("pdstack kv transfer fix: %s.%s has no %r; nothing patched",
                  SCHEDULER_MODULE, METHOD, ASSERTION)
        return False
    setattr(cls, METHOD, tolerant(current, RequestStatus.WAITING_FOR_REMOTE_KVS,
                                  RequestStatus.is_finished))
    log.info("pdstack kv transfer fix: a KV transfer finishing after its request was aborted"
             " no longer ends the EngineCore (vLLM issues 43226, 46240)")
    return True


def register() -> None:
    """The ``vllm.general_plugins`` entry point; never raises into vLLM's plugin loader."""
    try:
        apply()
    except Exception:  # a failed patch must not stop the engine starting
        log.exception("pdstack kv transfer fix: not applied")
