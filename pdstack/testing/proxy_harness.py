"""Harness for proxy tests: in-process FakeEngine test doubles + an in-process proxy."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from pdstack import kvmodes
from pdstack.proxy.app import Proxy
from pdstack.proxy.backends import BackendRegistry
from pdstack.proxy.config import ProxyConfig
from pdstack.testing.fake_engine import FakeEngine, Faults

ADMIN_TOKEN = "test-admin-token"


@dataclass
class RunningProxy:
    proxy: Proxy
    url: str
    session: aiohttp.ClientSession

    @property
    def registry(self) -> BackendRegistry:
        return self.proxy.registry

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    async def backend_action(self, name: str, action: str) -> int:
        """POST ``/admin/backends/NAME/ACTION`` (drain, undrain, ...); the status."""
        url = f"{self.url}/admin/backends/{name}/{action}"
        async with self.session.post(url, headers=self.admin_headers()) as resp:
            return resp.status

    async def metrics(self) -> str:
        async with self.session.get(f"{self.url}/metrics") as resp:
            return await resp.text()


def backend(name: str, role: str, engine: FakeEngine, node: str = "n1", gen: str = "g1") -> dict:
    return {"name": name, "role": role, "node": node, "url": engine.url, "generation": gen}


def table(
    kv_mode: str,
    backends: list[dict],
    pairings: list[tuple[str, str, str]] | None = None,
    threshold: int = 0,
    served_model_name: str = "fake",
) -> dict[str, Any]:
    """A backend table dict; pairings default to every P x D allowed by ``kv_mode``."""
    if pairings is None:
        pairings = []
        for p in (b for b in backends if b["role"] == "prefill"):
            for d in (b for b in backends if b["role"] == "decode"):
                path = kvmodes.kv_path(kv_mode, same_node=p["node"] == d["node"])
                if path is not None:
                    pairings.append((p["name"], d["name"], path))
    return {
        "kv_mode": kv_mode,
        "served_model_name": served_model_name,
        "backends": backends,
        "pairings": [{"prefill": p, "decode": d, "kv_path": k} for p, d, k in pairings],
        "skip_prefill_threshold_tokens": threshold,
    }


def pd_table(
    e: dict[str, FakeEngine], prefill: list[str], decode: list[str], kv_mode: str = "nixl"
) -> dict[str, Any]:
    """A P/D table of the engines ``e`` named in ``prefill`` and ``decode`` (node n1)."""
    return table(
        kv_mode,
        [
            *(backend(n, "prefill", e[n]) for n in prefill),
            *(backend(n, "decode", e[n]) for n in decode),
        ],
    )


async def until(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll ``cond`` until it holds; AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def cancel(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel each client task and wait for it to end (cancelled, or its connection cut)."""
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
            await task


@contextlib.asynccontextmanager
async def serve(app: web.Application | web.AppRunner, backlog: int = 128) -> AsyncIterator[str]:
    """Serve ``app`` (or an app's runner) on a free port of 127.0.0.1: its base URL; cleaned
    up on exit."""
    runner = app if isinstance(app, web.AppRunner) else web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=backlog)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def running_proxy(
    backend_table: dict[str, Any], **config: Any
) -> AsyncIterator[RunningProxy]:
    defaults: dict[str, Any] = {
        "health_interval_s": 0.2,
        "health_timeout_s": 0.5,
        "admin_token": ADMIN_TOKEN,
    }
    defaults.update(config)
    proxy = Proxy(BackendRegistry.from_table(backend_table), ProxyConfig(**defaults))
    connector = aiohttp.TCPConnector(limit=0)
    async with serve(proxy.runner(), backlog=4096) as url, aiohttp.ClientSession(
        connector=connector
    ) as session:
        yield RunningProxy(proxy, url, session)


@contextlib.asynccontextmanager
async def engines(*names: str, **kwargs: Any) -> AsyncIterator[dict[str, FakeEngine]]:
    started: dict[str, FakeEngine] = {}
    try:
        for name in names:
            engine = FakeEngine(name=name, **kwargs)
            await engine.start()
            started[name] = engine
        yield started
    finally:
        for engine in started.values():
            await engine.stop()


@dataclass
class StreamResult:
    status: int
    headers: CIMultiDict[str]
    events: list[str]
    text: str

    @property
    def error_events(self) -> list[dict]:
        out = []
        for e in self.events:
            if e.startswith("{") and '"error"' in e:
                out.append(json.loads(e)["error"])
        return out


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    prompt: str,
    headers: dict | None = None,
    chat: bool = False,
    **extra: Any,
) -> StreamResult:
    body: dict[str, Any] = {"model": "fake", "stream": True, **extra}
    if chat:
        body["messages"] = [
            {"role": "system", "content": prompt},
            {"role": "user", "content": "hi"},
        ]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    async with session.post(url + path, json=body, headers=headers or {}) as resp:
        raw = await resp.read()
        hdrs = CIMultiDict(resp.headers)
        status = resp.status
    text = raw.decode()
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    return StreamResult(status, hdrs, events, text)


async def pd_stream(
    faults: dict[str, Faults], prompt: str, output_tokens: int = 16, **proxy: Any
) -> tuple[StreamResult, str, dict[str, FakeEngine]]:
    """One streamed completion of ``prompt`` (``max_tokens`` = ``output_tokens``) through a
    1P1D proxy (``proxy``: its config) whose engines p0 and d0 play ``faults`` (engine name
    -> Faults): the result, the proxy's metrics after it, and the engines (stopped)."""
    async with (
        engines("p0", "d0", output_tokens=output_tokens) as e,
        running_proxy(pd_table(e, ["p0"], ["d0"]), **proxy) as rp,
    ):
        for name, fault in faults.items():
            e[name].faults = fault
        res = await stream_completion(rp.session, rp.url, prompt, max_tokens=output_tokens)
        return res, await rp.metrics(), e


async def open_loop(
    rate: float, seconds: float, one: Callable[[int], Coroutine[Any, Any, None]]
) -> None:
    """``one(n)`` started ``rate`` times a second for ``seconds`` (open loop: on time,
    whatever the earlier ones are doing); returns once every one has finished."""
    tasks: list[asyncio.Task[None]] = []
    t0 = time.perf_counter()
    i = 0
    while (now := time.perf_counter() - t0) < seconds:
        if i / rate > now:
            await asyncio.sleep(i / rate - now)
        tasks.append(asyncio.create_task(one(i)))
        i += 1
    await asyncio.gather(*tasks)


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile: the ceil(0.99 n)-th smallest (of fewer than 100
    values the largest; of 100-199 the second largest)."""
    ordered = sorted(values)
    return ordered[max(0, (99 * len(ordered) + 99) // 100 - 1)]


def completion_text(events: list[str]) -> str:
    out = []
    for e in events:
        if e == "[DONE]":
            continue
        data = json.loads(e)
        for choice in data.get("choices", []):
            out.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(out)


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
            found = True
    if not found:
        return 0.0
    return total
