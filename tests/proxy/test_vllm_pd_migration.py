"""Stream migration in P/D on real vLLM CPU engines (issue 55): one prefiller and two
decoders joined by NIXL behind the proxy; 20 greedy streams (completions and chat, a third
through the official ``openai`` client) are prefilled on P and decode on decoder A; A is
SIGKILLed (API server and EngineCore) mid-stream, and every client stream completes on
decoder B (its prompt and the tokens already sent, recomputed there), token-identical to an
unbroken run, with the same usage and one id, no client waiting more than GAP_S across the
kill."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest

from pdstack.testing import proxy_harness as ph
from pdstack.testing import vllm_engines as ve

from .test_vllm_migration import (
    GAP_S,
    GEN,
    STREAMS,
    _gap_across,
    assert_continued,
    fault_mid_streams,
)

pytestmark = pytest.mark.vllm

Engines = tuple[ve.Proc, ve.Proc, ve.Proc]


@pytest.fixture(scope="module")
def pd_engines() -> Iterator[Engines]:
    """Prefiller (core 0), decoder A (core 1), decoder B (core 0): NIXL on CPU buffers."""
    starts = (ve.start_nixl_engine(name, cpu, role)
              for name, cpu, role in (("pdm-prefill", "0", "kv_producer"),
                                      ("pdm-decode-a", "1", "kv_consumer"),
                                      ("pdm-decode-b", "0", "kv_consumer")))
    with ve.running(starts) as (prefill, decode_a, decode_b):
        yield prefill, decode_a, decode_b


def _table(engines: Engines) -> dict[str, Any]:
    names = ("n1/prefill-0", "n1/decode-0", "n1/decode-1")
    roles = ("prefill", "decode", "decode")
    return ph.table("nixl", [
        {"name": name, "role": role, "node": "n1", "url": engine.url, "generation": GEN}
        for name, role, engine in zip(names, roles, engines, strict=True)
    ], served_model_name="tiny")


async def test_kill_9_decoder_streams_complete_on_the_other_token_identical(
    pd_engines: Engines,
) -> None:
    prefill, decoder_a, decoder_b = pd_engines
    reference, results, metrics, fault = await fault_mid_streams(
        _table(pd_engines), "n1/decode-1", decoder_a, decoder_b.url, signal.SIGKILL, 500)
    moved = ph.metric_value(metrics, "pdstack_proxy_migrations_total", outcome="continued")
    failed = ph.metric_value(metrics, "pdstack_proxy_migrations_total", outcome="failed")
    gaps = sorted(_gap_across(arrived, fault) for *_, arrived in results)
    print(f"\nP/D decoder SIGKILL: migrated {moved:g} of {STREAMS}, failed {failed:g}; the "
          f"clients' gaps across the kill: P50 "
          f"{gaps[len(gaps) // 2]:.3f} s, max {gaps[-1]:.3f} s")
    assert_continued(reference, results, metrics)
    assert gaps[-1] <= GAP_S, f"a client waited {gaps[-1]:.2f} s across the kill"
    assert prefill.popen.poll() is None and decoder_b.popen.poll() is None
