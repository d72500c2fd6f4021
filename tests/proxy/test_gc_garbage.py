"""What the proxy leaves its garbage collector to walk (issues 53/54): a request's token-id
prompt and its engine's echo of it are tuples (the collector stops walking a tuple of ints),
and a request leaves no reference cycle (its objects go when it ends, not at a collection).
benchmarks/loop_lag.py measures what either cost the event loop."""

from __future__ import annotations

import asyncio
import gc
import json

from pdstack.proxy.migration_stream import StreamTracker
from pdstack.proxy.routing import prompt_text, settle_prompt
from pdstack.testing import proxy_harness as ph


def test_a_token_id_prompt_settles_as_a_tuple_the_collector_leaves() -> None:
    ids = list(range(10, 5010))
    body = {"prompt": list(ids), "stream": True}
    settle_prompt(body)
    assert body["prompt"] == tuple(ids)
    gc.collect()
    assert not gc.is_tracked(body["prompt"])  # a list of ints would be walked every time
    assert json.loads(json.dumps(body))["prompt"] == ids  # sent on as the same JSON
    assert prompt_text(body) == " ".join(map(str, ids))
    nested = {"prompt": [list(ids)]}
    settle_prompt(nested)
    assert nested["prompt"] == [tuple(ids)]
    assert prompt_text(nested) == prompt_text(body)
    for other in (["a", "b"], [True, 1], [], "text", [[1], [2]]):
        kept = {"prompt": other}
        settle_prompt(kept)
        assert kept["prompt"] is other


def test_a_prompt_echo_is_kept_as_a_tuple() -> None:
    ids = list(range(100, 3100))
    tracker = StreamTracker(chat=False, keep_ids=False)
    event = (b'data: {"id":"c","choices":[{"index":0,"text":"","token_ids":null}],'
             b'"prompt_token_ids":[' + b", ".join(str(i).encode() for i in ids) + b"]}\n\n")
    out = tracker(event)
    assert tracker.prompt_ids == tuple(ids)
    assert b'"prompt_token_ids":null' in out


async def test_streamed_requests_leave_no_cyclic_garbage_of_the_proxy() -> None:
    """Each request's objects are freed when it ends (reference counting), not left in a
    cycle for a collection to find: a closure that named itself (the relay's back-pressure
    timer, a leg's deadline check) kept a request's transport and all it held alive until
    the next full collection, which then walked and freed them, stopping the loop."""
    async with ph.engines("e0", "e1", output_tokens=8, itl_ms=1) as e, ph.running_proxy(
        ph.table("colocated", [ph.backend(n, "colocated", eng) for n, eng in e.items()])
    ) as rp:
        body = {"model": "fake", "stream": True, "max_tokens": 8,
                "prompt": list(range(100, 1100))}

        async def one() -> None:
            async with rp.session.post(rp.url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()

        await one()  # lazy set-ups (connections, pools) out of the way
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            await asyncio.gather(*(one() for _ in range(6)))
            await asyncio.sleep(0.2)
            gc.collect()
            ours = sorted({f"{o.__module__}.{o.__qualname__}" for o in gc.garbage
                           if type(o).__name__ == "function"
                           and o.__module__.startswith("pdstack.proxy")})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert ours == []
