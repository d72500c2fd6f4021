"""P/D: a decode leg that fails before its first byte is no 502 while a decoder can serve
the request, and a drained prefiller counts as busy until the decode leg that reads its KV
has its first byte (FakeEngine test doubles)."""

from __future__ import annotations

import asyncio

from pdstack.testing import proxy_harness as ph
from pdstack.testing.fake_engine import Faults


async def test_decode_cut_before_first_byte_is_served_whole_not_502() -> None:
    """The only decoder paired with the prefiller cuts the decode leg before its first
    byte (its KV pull from a prefiller that stopped): the request is served whole by a
    decoder (decode fallback), not answered 502."""
    faults = {"d0": Faults(close_after_chunks=0, times=1)}
    res, text, e = await ph.pd_stream(faults, "hello there", output_tokens=4, eject_after=100)
    assert res.status == 200, res.text
    assert res.events[-1] == "[DONE]" and not res.error_events
    assert len(ph.completion_text(res.events).split()) == 4
    first, second = e["d0"].seen()
    assert first.body is not None and "kv_transfer_params" in first.body  # the P/D leg
    assert second.body is not None and "kv_transfer_params" not in second.body  # whole
    assert ph.metric_value(text, "pdstack_proxy_decode_fallback_total") == 1
    assert ph.metric_value(text, "pdstack_proxy_requests_total", outcome="ok") == 1


async def test_decode_failure_without_fallback_still_502() -> None:
    """With decode fallback off the old answer stands: a 502 in OpenAI error JSON."""
    async with ph.engines("p0", "d0", output_tokens=4) as e:
        t = ph.pd_table(e, ["p0"], ["d0"])
        async with ph.running_proxy(t, eject_after=100, decode_fallback=False) as rp:
            e["d0"].faults = Faults(close_after_chunks=0, times=1)
            res = await ph.stream_completion(rp.session, rp.url, "hello there", max_tokens=4)
    assert res.status == 502
    assert "upstream closed the connection" in res.text
    assert '"type": "server_error"' in res.text or '"type":"server_error"' in res.text


async def test_prefiller_busy_until_decode_first_byte() -> None:
    """The prefiller's in_flight (what a rolling upgrade's drain waits on) counts the
    decode leg that reads its KV until that leg's first byte, then drops to 0."""
    async with ph.engines("p0", "d0", output_tokens=3) as e:
        e["d0"].ttft_ms = 2000  # the decode leg's first byte comes late (a slow KV pull)
        async with ph.running_proxy(ph.pd_table(e, ["p0"], ["d0"])) as rp:
            p0 = rp.registry.backends["p0"]
            task = asyncio.create_task(ph.stream_completion(rp.session, rp.url, "hi there"))
            await ph.until(lambda: len(e["d0"].seen()) == 1, "the decode leg sent")
            assert p0.in_flight == 1  # its prefill answered; the decoder has no token yet
            assert await rp.backend_action("p0", "drain") == 200
            async with rp.session.get(f"{rp.url}/admin/backends",
                                      headers=rp.admin_headers()) as resp:
                listed = {b["name"]: b for b in (await resp.json())["backends"]}
            assert listed["p0"]["in_flight"] == 1 and listed["p0"]["drained"]
            res = await task
            assert p0.in_flight == 0
    assert res.status == 200 and res.events[-1] == "[DONE]"
