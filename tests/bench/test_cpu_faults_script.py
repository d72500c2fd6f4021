"""benchmarks/cpu_faults.py's client and judgement (the numbers come from the real CPU stack;
this checks the plumbing): a streamed chat that ends with a finish_reason and [DONE] is
completed, one cut before [DONE] is not, a fast 503 with Retry-After is admission's refusal
(not a failure), a slow one is a failure, and a stall across a fault is measured from the
token times; the table renders every committed result set."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

REPO = Path(__file__).resolve().parents[2]


def _script() -> Any:
    path = REPO / "benchmarks" / "cpu_faults.py"
    spec = importlib.util.spec_from_file_location("cpu_faults", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cpu_faults"] = mod
    spec.loader.exec_module(mod)
    return mod


def _chunk(content: str, finish: str | None = None) -> bytes:
    event = {"choices": [{"delta": {"content": content}, "finish_reason": finish}]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def _serve(mode: str) -> tuple[web.AppRunner, str]:
    async def chat(request: web.Request) -> web.StreamResponse:
        if mode.startswith("refuse"):
            if mode == "refuse-slow":
                await asyncio.sleep(0.3)
            return web.json_response({"error": {"message": "saturated"}}, status=503,
                                     headers={"Retry-After": "1"})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chunk("a"))
        await asyncio.sleep(0.2)
        await resp.write(_chunk("b", "length" if mode == "ok" else None))
        if mode == "ok":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_client_judges_streams_and_refusals() -> None:
    cf = _script()

    async def one(mode: str) -> dict[str, Any]:
        runner, url = await _serve(mode)
        try:
            async with cf.Client(url, "tiny", 2) as c:
                return await c.one("t", 0)  # type: ignore[no-any-return]
        finally:
            await runner.cleanup()

    ok = asyncio.run(one("ok"))
    assert ok["completed"] and ok["status"] == 200 and ok["tokens"] == 2
    assert ok["ttft"] is not None and ok["ttft"] < 0.2 and not cf.failed(ok)
    assert 0.15 < cf.stall_after(ok, ok["start"] + ok["ttft"] + 0.01) < 1.0
    cut = asyncio.run(one("cut"))
    assert not cut["completed"] and cut["error"] == "unfinished" and cf.failed(cut)
    fast = asyncio.run(one("refuse"))
    assert fast["status"] == 503 and cf.refused_fast(fast) and not cf.failed(fast)
    slow = asyncio.run(one("refuse-slow"))
    assert not cf.refused_fast(slow) and cf.failed(slow)
    s = cf.summary([ok, cut, fast, slow])
    assert (s["completed"], s["refused_fast"], s["refused_slow"], s["failed"]) == (1, 1, 1, 2)


def test_table_renders_the_committed_results() -> None:
    cf = _script()
    for path in sorted((REPO / "benchmarks" / "results").glob("cpu_faults*.json")):
        text = cf.table(json.loads(path.read_text()))
        assert text.startswith("| scenario |") and ("pass" in text or "FAIL" in text), path
