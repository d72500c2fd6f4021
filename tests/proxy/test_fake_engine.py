"""Tests of the FakeEngine test double itself (so proxy tests can trust it)."""

from __future__ import annotations

import json

import aiohttp
import pytest

from pdstack.testing.fake_engine import FakeEngine, Faults


async def read_events(resp: aiohttp.ClientResponse) -> list[str]:
    events = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            events.append(line[6:].strip().decode())
    return events


async def test_stream_and_nonstream_and_prefill_params() -> None:
    async with (
        FakeEngine(name="p0", ttft_ms=1, output_tokens=4) as engine,
        aiohttp.ClientSession() as s,
    ):
        body = {"model": "fake", "prompt": "hello world", "max_tokens": 3, "stream": True}
        async with s.post(f"{engine.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            events = await read_events(resp)
        assert events[-1] == "[DONE]"
        assert len(events) == 4
        body = {
            "prompt": "hello world",
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        async with s.post(
            f"{engine.url}/v1/completions", json=body, headers={"X-Request-Id": "r1"}
        ) as resp:
            data = await resp.json()
        assert data["kv_transfer_params"]["do_remote_prefill"] is True
        assert data["kv_transfer_params"]["request_id"] == "r1"
        assert engine.seen()[-1].request_id == "r1"
        chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with s.post(f"{engine.url}/v1/chat/completions", json=chat) as resp:
            events = await read_events(resp)
        assert len(events) == 1 + 4 + 1


async def test_faults_status_close_and_times() -> None:
    async with FakeEngine(output_tokens=5) as engine, aiohttp.ClientSession() as s:
        engine.faults = Faults(status=500, times=1)
        body = {"prompt": "x", "stream": True}
        async with s.post(f"{engine.url}/v1/completions", json=body) as resp:
            assert resp.status == 500
            assert "error" in await resp.json()
        async with s.post(f"{engine.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()
        engine.faults = Faults(close_after_chunks=2)
        got: list[bytes] = []
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.post(f"{engine.url}/v1/completions", json=body) as resp:
                async for line in resp.content:
                    got.append(line)
        assert sum(1 for line in got if line.startswith(b"data: ")) == 2


async def test_fault_error_event_like_vllm() -> None:
    """vLLM's failed generation: 200, N tokens (a chat stream's role event first), its
    error event, [DONE]; non-streaming: the error's status and JSON."""
    async with FakeEngine(output_tokens=5) as engine, aiohttp.ClientSession() as s:
        engine.faults = Faults(error_event_after_chunks=2)
        body = {"prompt": "x", "stream": True}
        async with s.post(f"{engine.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            events = await read_events(resp)
        assert len(events) == 2 + 1 + 1 and events[-1] == "[DONE]"
        assert json.loads(events[2]) == {"error": {
            "message": "Internal server error", "type": "InternalServerError", "param": None,
            "code": 500}}
        engine.faults = Faults(error_event_after_chunks=0, error_event_status=400)
        chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with s.post(f"{engine.url}/v1/chat/completions", json=chat) as resp:
            events = await read_events(resp)
        assert '"role"' in events[0] and len(events) == 3
        assert json.loads(events[1])["error"]["type"] == "BadRequestError"
        async with s.post(f"{engine.url}/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == 400


async def test_kill_and_restart_same_port() -> None:
    engine = FakeEngine()
    url = await engine.start()
    await engine.kill()
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientConnectionError):
            async with s.get(f"{url}/health") as resp:
                await resp.read()
        assert await engine.start() == url
        async with s.get(f"{url}/health") as resp:
            assert resp.status == 200
    await engine.stop()
