"""pdstack.vllm_kv_xfer_fix: a KV transfer that finishes after its request was aborted no longer
ends the EngineCore (``assert req_id in self.requests`` in ``Scheduler.
_update_from_kv_xfer_finished``, vLLM issues 43226 and 46240).

The light tests run the wrapper over a copy of vLLM 0.32.0's method; the ``vllm`` test runs the
pinned CPU vLLM's own method, before (it asserts) and after the plugin's patch.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pdstack import vllm_kv_xfer_fix as fix

REPO = Path(__file__).resolve().parents[2]
WAITING = "WAITING_FOR_REMOTE_KVS"
FINISHED = ("FINISHED_ABORTED", "FINISHED_STOPPED")


def is_finished(status: object) -> bool:
    return status in FINISHED


@dataclass
class Output:  # vLLM's KVConnectorOutput, the fields the method reads
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    extra: list[str] = field(default_factory=list)


def update_0320(self: Any, kv_connector_output: Any) -> None:
    """vLLM 0.32.0's ``_update_from_kv_xfer_finished`` (l. 3209-3235), its asserts included."""
    if self.connector is not None:
        self.connector.update_connector_output(kv_connector_output)
    for req_id in kv_connector_output.finished_recving or ():
        assert req_id in self.requests
        req = self.requests[req_id]
        if req.status == WAITING:
            self.finished_recving_kv_req_ids.add(req_id)
        else:
            assert is_finished(req.status)
            self._free_blocks(self.requests[req_id])
    for req_id in kv_connector_output.finished_sending or ():
        assert req_id in self.requests
        self._free_blocks(self.requests[req_id])


def scheduler(**statuses: str) -> Any:
    seen: list[Output] = []
    freed: list[str] = []
    sched = SimpleNamespace(
        requests={rid: SimpleNamespace(request_id=rid, status=s) for rid, s in statuses.items()},
        finished_recving_kv_req_ids=set(), seen=seen, freed=freed,
        connector=SimpleNamespace(update_connector_output=seen.append))

    def free(req: Any) -> None:
        assert is_finished(req.status)
        freed.append(req.request_id)
        del sched.requests[req.request_id]

    sched._free_blocks = free
    return sched


PATCHED = fix.tolerant(update_0320, WAITING, is_finished)


def test_a_transfer_of_a_freed_request_is_dropped_and_the_rest_goes_on() -> None:
    sched = scheduler(waits=WAITING, done="FINISHED_STOPPED")
    out = Output(finished_recving={"gone", "waits", "done"}, finished_sending={"gone2"})
    with pytest.raises(AssertionError):  # vLLM's own: the EngineCore would end here
        update_0320(scheduler(waits=WAITING, done="FINISHED_STOPPED"), out)
    PATCHED(sched, out)
    assert sched.finished_recving_kv_req_ids == {"waits"}
    assert sched.freed == ["done"]
    assert sched.seen == [out]  # the connector saw the whole output, once
    assert sched.connector.update_connector_output == sched.seen.append


def test_a_finished_receive_and_send_in_one_step_free_the_request_once() -> None:
    out = Output(finished_recving={"r"}, finished_sending={"r", "running"})
    with pytest.raises(AssertionError):
        update_0320(scheduler(r="FINISHED_ABORTED", running="RUNNING"), out)
    sched = scheduler(r="FINISHED_ABORTED", running="RUNNING")
    PATCHED(sched, out)
    assert sched.freed == ["r"] and "running" in sched.requests


def test_a_receive_for_a_request_moved_on_to_compute_locally_is_dropped() -> None:
    sched = scheduler(local="RUNNING")
    PATCHED(sched, Output(finished_recving={"local"}))
    assert sched.finished_recving_kv_req_ids == set() and "local" in sched.requests


def test_an_output_vllm_accepts_goes_through_untouched() -> None:
    sched = scheduler(waits=WAITING, done="FINISHED_STOPPED")
    out = Output(finished_recving={"waits"}, finished_sending={"done"})
    assert fix.stale(sched, out, WAITING, is_finished) == (set(), set())
    PATCHED(sched, out)
    assert sched.seen == [out] and sched.freed == ["done"]
    assert sched.finished_recving_kv_req_ids == {"waits"}


@pytest.mark.vllm
def test_the_pinned_vllms_own_method_asserts_and_patched_does_not() -> None:
    """vLLM 0.32.0 CPU (CI's venv): its method ends on a finished receive of a request it no
    longer holds; after the plugin's ``apply`` the same call drops it and goes on."""
    from pdstack.testing.vllm_engines import VENV, require_venv

    require_venv()
    code = """
from types import SimpleNamespace
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus
from pdstack import vllm_kv_xfer_fix as f

def fake():
    req = SimpleNamespace(request_id="waits", status=RequestStatus.WAITING_FOR_REMOTE_KVS)
    return SimpleNamespace(requests={"waits": req}, connector=None,
                           finished_recving_kv_req_ids=set(),
                           _set_kv_fetch_stage=lambda *a: None)

out = KVConnectorOutput(finished_recving={"gone", "waits"}, finished_sending={"gone"})
try:
    Scheduler._update_from_kv_xfer_finished(fake(), out)
    before = "ok"
except AssertionError:
    before = "AssertionError"
patched = f.apply()
s = fake()
Scheduler._update_from_kv_xfer_finished(s, out)
print(before, patched, f.apply(), sorted(s.finished_recving_kv_req_ids))
"""
    proc = subprocess.run([str(VENV / "bin" / "python"), "-c", code], capture_output=True,
                          text=True, timeout=300, check=False,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "AssertionError True True ['waits']"
