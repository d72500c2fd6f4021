"""SSE relay: the first event of an upstream stream, then the rest forwarded straight
from the upstream protocol's callbacks to the client transport (event-aligned, with
back-pressure and an idle watchdog); the usage rewrite for ``cached_tokens``."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from pdstack.proxy.backends import BackendState
from pdstack.proxy.relay import RelayError, RelayProtocol

log = logging.getLogger("pdstack.proxy")

SSE_END = b"\n\n"
_HIGH_WATER = 1 << 20  # client write buffer above which the engine is not read
_LOW_WATER = 1 << 18


class IdleWatchdog:
    """Closes an upstream response that stays silent for ``idle_s`` (no per-chunk timers:
    the hot path only stores a timestamp)."""

    def __init__(self, close: Callable[[], None], idle_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.close = close
        self.idle_s = idle_s
        self.last = self.loop.time()
        self.fired = False
        self._handle = self.loop.call_at(self.last + idle_s, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        if now - self.last >= self.idle_s:
            self.fired = True
            self.close()
        else:
            self._handle = self.loop.call_at(self.last + self.idle_s, self._check)

    def cancel(self) -> None:
        self._handle.cancel()


async def first_event(proto: RelayProtocol, backend: BackendState) -> tuple[bytes, bytes]:
    """Wait for the first complete SSE event; returns (it, what follows it)."""
    loop = asyncio.get_running_loop()
    acc = b""
    while True:
        acc += proto.take_buffered()
        cut = acc.rfind(SSE_END)
        if cut >= 0:
            proto.on_data = None
            return acc[: cut + 2], acc[cut + 2 :]
        if proto.done.done():
            proto.done.result()  # raises the connection error, if any
            if acc:
                return acc, b""
            raise RelayError(f"{backend.role} {backend.name} closed before the first event")
        woke: asyncio.Future[None] = loop.create_future()
        proto.on_data = lambda fut=woke: None if fut.done() else fut.set_result(None)
        await woke


async def relay_body(
    proto: RelayProtocol,
    client: asyncio.BaseTransport,
    chunked: bool,
    pending: bytes,
    idle_s: float,
    rewrite: Callable[[bytes], bytes] | None = None,
    progress: Callable[[bytes], None] | None = None,
) -> str:
    """Forward the rest of the body, event-aligned, straight from the upstream
    protocol's callbacks to the client transport. Returns a failure text or "".
    ``progress(chunk)`` is called on each chunk from upstream."""
    loop = asyncio.get_running_loop()
    write = client.write  # type: ignore[attr-defined]
    buffer_size = client.get_write_buffer_size  # type: ignore[attr-defined]
    upstream = proto.transport
    assert upstream is not None
    watchdog = IdleWatchdog(proto.abort, idle_s)
    state: dict[str, Any] = {"pending": pending, "paused": False}

    def resume_when_drained() -> None:
        if client.is_closing() or proto.closed:
            return
        if buffer_size() > _LOW_WATER:
            loop.call_later(0.01, resume_when_drained)
            return
        state["paused"] = False
        upstream.resume_reading()

    def sink(data: bytes) -> None:
        watchdog.last = loop.time()
        if progress is not None:
            progress(data)
        held = state["pending"]
        if held:
            data = held + data
            state["pending"] = b""
        if not data.endswith(SSE_END):
            cut = data.rfind(SSE_END)
            if cut < 0:
                state["pending"] = data
                return
            state["pending"] = data[cut + 2 :]
            data = data[: cut + 2]
        if rewrite is not None:
            data = rewrite(data)
        if chunked:
            write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            write(data)
        if not state["paused"] and buffer_size() > _HIGH_WATER:
            state["paused"] = True  # a slow client: stop reading the engine for now
            upstream.pause_reading()
            loop.call_later(0.01, resume_when_drained)

    rest = proto.take_buffered()
    proto.sink = sink
    if rest:
        sink(rest)
    failure = ""
    try:
        await proto.done
    except RelayError as exc:
        failure = str(exc)
    finally:
        watchdog.cancel()
    if watchdog.fired:
        return f"no data for {idle_s:g}s"
    if not failure and state["pending"]:
        tail = state["pending"]
        if rewrite is not None:
            tail = rewrite(tail)
        write(b"%x\r\n%b\r\n" % (len(tail), tail) if chunked else tail)
    return failure


def cached_tokens(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an engine answer (None: absent)."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None  # the engine does not report it (no --enable-prompt-tokens-details)
    value = details.get("cached_tokens")
    return value if isinstance(value, int) else None


_USAGE_MARK = b'"usage":{'


def _set_cached(obj: Any, cached: int) -> bool:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return False
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = usage["prompt_tokens_details"] = {}
    details["cached_tokens"] = cached
    return True


def usage_rewriter(cached: int | None) -> Callable[[bytes], bytes] | None:
    """P/D: the decoder got the whole prompt's KV from the prefiller, so the client is
    told the prefill leg's ``cached_tokens`` (its prefix-cache hit). Rewrites the usage
    of a JSON answer or of the SSE events that carry one; everything else is untouched
    (one substring test per piece on the hot path)."""
    if cached is None:
        return None

    def rewrite(data: bytes) -> bytes:
        compact = data.replace(b'"usage": {', _USAGE_MARK) if b'"usage": {' in data else data
        if _USAGE_MARK not in compact:
            return data
        if not data.startswith(b"data:"):  # a whole JSON answer
            try:
                obj = json.loads(data)
            except (json.JSONDecodeError, UnicodeDecodeError):
                return data
            return json.dumps(obj).encode() if _set_cached(obj, cached) else data
        out = []
        for event in data.split(SSE_END):
            if event.startswith(b"data: {") and (b'"usage"' in event):
                try:
                    obj = json.loads(event[6:])
                except (json.JSONDecodeError, UnicodeDecodeError):
                    obj = None
                if obj is not None and _set_cached(obj, cached):
                    event = b"data: " + json.dumps(obj, separators=(",", ":")).encode()
            out.append(event)
        return SSE_END.join(out)

    return rewrite


async def start_stream(
    request: web.Request, request_id: str, proto: RelayProtocol
) -> tuple[web.StreamResponse, bool]:
    """The client's response head for a stream; chunked unless the client speaks HTTP/1.0."""
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": proto.headers.get("content-type", "text/event-stream"),
            "Cache-Control": "no-cache",
            "X-Request-Id": request_id,
        },
    )
    chunked = request.version >= aiohttp.HttpVersion11
    if chunked:
        response.enable_chunked_encoding()
    else:
        response.force_close()  # HTTP/1.0: the body ends when the connection does
    await response.prepare(request)
    return response, chunked
