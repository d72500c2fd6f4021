"""SSE relay: the first event of an upstream stream, then the rest forwarded straight
from the upstream protocol's callbacks to the client transport (event-aligned, with
back-pressure and an idle watchdog); the rewrites on the way: ``cached_tokens`` in the
usage, and the engine's error events in the proxy's error vocabulary
(:mod:`pdstack.proxy.errors`).

What the first event is: a stream's first event past a chat stream's role preamble (vLLM
opens each chat stream with the role and no content, sent with the request's first output,
so before an error event too). An error event there (:func:`leading_error`) means no token
was generated: the leg failed before its first byte (:mod:`pdstack.proxy.legs`)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from pdstack.proxy.backends import BackendState
from pdstack.proxy.errors import engine_error_event, error_event_status
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


def _event_json(event: bytes) -> bytes | None:
    """The JSON of an SSE event (its ``data:`` field), None for an event without one."""
    event = event.lstrip(b"\r\n")
    return event[5:].strip() if event.startswith(b"data:") else None


def _preamble(event: bytes) -> bool:
    """A chat stream's opening event: the assistant's role, no content, not finished."""
    if b'"role"' not in event:
        return False
    payload = _event_json(event)
    try:
        doc = json.loads(payload) if payload else None
    except (ValueError, UnicodeDecodeError):
        return False
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if not isinstance(delta, dict) or choice.get("finish_reason") is not None:
            return False
        if any(value for key, value in delta.items() if key != "role"):
            return False
    return True


def _events(data: bytes) -> list[bytes]:
    """The events of event-aligned ``data``, blank ones left out."""
    return [event for event in data.split(SSE_END) if event.strip()]


async def first_event(proto: RelayProtocol, backend: BackendState) -> tuple[bytes, bytes]:
    """Wait for the first complete SSE event past a chat stream's role preamble; returns
    (the complete events so far, what follows them)."""
    loop = asyncio.get_running_loop()
    acc = b""
    while True:
        acc += proto.take_buffered()
        cut = acc.rfind(SSE_END)
        if cut >= 0 and not all(_preamble(event) for event in _events(acc[:cut])):
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


def leading_error(first: bytes) -> bytes | None:
    """The JSON of the error event that a stream opens with (``first``: its first events,
    :func:`first_event`), no token before it; None when it opens otherwise."""
    for event in _events(first):
        if _preamble(event):
            continue
        payload = _event_json(event)
        if payload is None or error_event_status(payload) is None:
            return None
        return payload
    return None


class ErrorEvents:
    """A stream's rewrite: the engine's error events (vLLM's after tokens were sent, its
    ``type`` one of its class names) as the proxy's own (:func:`errors.engine_error_event`);
    ``status`` and ``text``: the first one's (None / "" when none came)."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.text = ""

    def __call__(self, data: bytes) -> bytes:
        if b'"error"' not in data:  # the hot path: one substring test per piece
            return data
        out = []
        for event in data.split(SSE_END):
            payload = _event_json(event) if b'"error"' in event else None
            status = error_event_status(payload) if payload else None
            if payload and status is not None:
                if self.status is None:
                    self.status, self.text = status, payload[:200].decode(errors="replace")
                event = engine_error_event(status, payload)
            out.append(event)
        return SSE_END.join(out)


def stream_rewriter(cached: int | None, errors: ErrorEvents) -> Callable[[bytes], bytes]:
    """The rewrite of a relayed stream: ``errors``, then the usage's ``cached_tokens``
    (:func:`usage_rewriter`)."""
    usage = usage_rewriter(cached)
    if usage is None:
        return errors
    return lambda data: usage(errors(data))


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
            loop.call_later(0.01, _resume_when_drained, client, proto, state)

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


def _resume_when_drained(client: Any, proto: RelayProtocol, state: dict[str, Any]) -> None:
    """Read the engine again once the client's write buffer is drained (a function, not a
    closure that calls itself: that is a reference cycle, which keeps the client's transport
    and all it holds alive until a collection of the garbage collector)."""
    if client.is_closing() or proto.closed or proto.transport is None:
        return
    if client.get_write_buffer_size() > _LOW_WATER:
        asyncio.get_running_loop().call_later(0.01, _resume_when_drained, client, proto, state)
        return
    state["paused"] = False
    proto.transport.resume_reading()


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
