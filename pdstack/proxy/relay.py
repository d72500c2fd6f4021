"""A lean HTTP/1.1 client for the proxy's hot path: streaming legs (SSE) to engines.

aiohttp's client parses each upstream chunk into a StreamReader and wakes a task per
chunk; at hundreds of concurrent streams that is most of the proxy's CPU. Here an
``asyncio.Protocol`` parses the response head and the chunked framing itself and hands
each piece of body straight to a sink callback (which writes it to the client), with no
task switch per chunk. Connections are kept alive and reused per (host, port).

Only what engines speak is supported: a response with ``Transfer-Encoding: chunked``,
``Content-Length``, or a body until close; no upgrades, no trailers kept.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from urllib.parse import urlsplit

Sink = Callable[[bytes], None]

_HEAD_LIMIT = 64 * 1024


class RelayError(ConnectionError):
    """The upstream connection failed or sent something unparseable."""


class RelayProtocol(asyncio.Protocol):
    """One upstream HTTP/1.1 connection; one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done: asyncio.Future[None] = self.loop.create_future()
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.keep_alive = True
        self._head = b""
        self._mode = "head"  # head | chunked | length | close | done
        self._remaining = 0  # bytes left in the current chunk / content-length body
        self._chunk_state = "size"  # size | data | crlf | trailer
        self._line = b""
        self.buffered: list[bytes] = []  # body bytes while no sink is set
        self.sink: Sink | None = None
        self.on_data: Callable[[], None] | None = None

    # ------------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._mode == "close" and exc is None:
            self._finish()
            return
        error = RelayError(f"upstream closed the connection ({exc or 'EOF'})")
        if not self.head_done.done():
            self.head_done.set_exception(error)
        if not self.done.done():
            self.done.set_exception(error)
        # the futures' exceptions may be unobserved if nobody waits any more
        for fut in (self.head_done, self.done):
            if fut.done() and not fut.cancelled():
                fut.exception()
        if self.on_data is not None:
            self.on_data()

    def eof_received(self) -> bool | None:
        return False  # close the transport -> connection_lost

    def data_received(self, data: bytes) -> None:
        if self._mode == "head":
            data = self._parse_head(data)
            if not data:
                return
        if self._mode == "chunked":
            self._parse_chunked(data)
        elif self._mode == "length":
            take = data[: self._remaining]
            self._remaining -= len(take)
            self._deliver(take)
            if self._remaining == 0:
                self._finish()
                if len(data) > len(take):
                    self.keep_alive = False  # bytes beyond the body: do not reuse
        elif self._mode == "close":
            self._deliver(data)
        # mode "done": stray bytes after a complete response -> not reusable
        elif data:
            self.keep_alive = False

    # ------------------------------------------------------------- parsing
    def _parse_head(self, data: bytes) -> bytes:
        head = self._head + data
        end = head.find(b"\r\n\r\n")
        if end < 0:
            if len(head) > _HEAD_LIMIT:
                self._fail("response head too large")
            self._head = head
            return b""
        self._head = b""
        lines = head[:end].decode("latin-1").split("\r\n")
        try:
            version, code = lines[0].split(" ", 2)[:2]
            self.status = int(code)
        except ValueError:
            self._fail(f"bad status line {lines[0]!r}")
            return b""
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self.headers = headers
        if headers.get("connection", "").lower() == "close" or version == "HTTP/1.0":
            self.keep_alive = False
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self._mode = "chunked"
        elif "content-length" in headers:
            self._remaining = int(headers["content-length"])
            self._mode = "length"
        elif self.status in (204, 304) or 100 <= self.status < 200:
            self._mode = "length"
            self._remaining = 0
        else:
            self._mode = "close"
            self.keep_alive = False
        if not self.head_done.done():  # cancelled: its leg was given up while it waited
            self.head_done.set_result(None)
        if self._mode == "length" and self._remaining == 0:
            self._finish()
        return head[end + 4 :]

    def _parse_chunked(self, data: bytes) -> None:
        pos = 0
        n = len(data)
        while pos < n and self._mode == "chunked":
            state = self._chunk_state
            if state == "data":
                take = min(self._remaining, n - pos)
                self._deliver(data[pos : pos + take])
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._chunk_state = "crlf"
                    self._line = b""
                continue
            # size line, the CRLF after data, or trailer lines: read up to "\n"
            nl = data.find(b"\n", pos)
            if nl < 0:
                self._line += data[pos:]
                if len(self._line) > 4096:
                    self._fail("chunk header too long")
                return
            line = (self._line + data[pos:nl]).rstrip(b"\r")
            self._line = b""
            pos = nl + 1
            if state == "crlf":
                self._chunk_state = "size"
            elif state == "size":
                try:
                    size = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    self._fail(f"bad chunk size {line[:40]!r}")
                    return
                if size == 0:
                    self._chunk_state = "trailer"
                else:
                    self._remaining = size
                    self._chunk_state = "data"
            elif not line:  # state == "trailer": an empty line ends the message
                self._finish()
        if self._mode == "done" and pos < n:
            self.keep_alive = False

    def _deliver(self, body: bytes) -> None:
        if not body:
            return
        sink = self.sink
        if sink is not None:
            sink(body)
        else:
            self.buffered.append(body)
            if self.on_data is not None:
                self.on_data()

    def _finish(self) -> None:
        self._mode = "done"
        if not self.done.done():
            self.done.set_result(None)
        if self.on_data is not None:
            self.on_data()

    def _fail(self, message: str) -> None:
        self.keep_alive = False
        error = RelayError(message)
        for fut in (self.head_done, self.done):
            if not fut.done():
                fut.set_exception(error)
                fut.exception()
        if self.transport is not None:
            self.transport.abort()

    # ------------------------------------------------------------- requests
    def send(self, request: bytes) -> None:
        assert self.transport is not None
        self.transport.write(request)

    @property
    def reusable(self) -> bool:
        return self.keep_alive and not self.closed and self._mode == "done"

    def take_buffered(self) -> bytes:
        data = b"".join(self.buffered)
        self.buffered.clear()
        return data

    def abort(self) -> None:
        self.keep_alive = False
        if self.transport is not None and not self.closed:
            self.transport.abort()


class RelayPool:
    """Keep-alive connections per (host, port)."""

    def __init__(self, max_idle_per_host: int = 1024) -> None:
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[tuple[str, int], collections.deque[RelayProtocol]] = {}

    async def acquire(
        self, host: str, port: int, connect_timeout: float
    ) -> tuple[RelayProtocol, bool]:
        """A connection and whether it was reused from the pool."""
        idle = self._idle.get((host, port))
        while idle:
            proto = idle.pop()
            if not proto.closed:
                proto._reset()
                return proto, True
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(connect_timeout):
            _, proto = await loop.create_connection(lambda: RelayProtocol(loop), host, port)
        return proto, False

    def release(self, host: str, port: int, proto: RelayProtocol) -> None:
        if not proto.reusable:
            proto.abort()
            return
        idle = self._idle.setdefault((host, port), collections.deque())
        if len(idle) >= self.max_idle_per_host:
            proto.abort()
            return
        # drop what refers to the finished request (its client, response, closures)
        proto.sink = None
        proto.on_data = None
        proto.buffered = []
        idle.append(proto)

    def close(self) -> None:
        for idle in self._idle.values():
            for proto in idle:
                proto.abort()
        self._idle.clear()


def split_url(url: str) -> tuple[str, int, str]:
    """``http://host:port/prefix`` -> (host, port, path prefix)."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"only http:// backends are supported by the relay: {url}")
    return parts.hostname or "127.0.0.1", parts.port or 80, parts.path.rstrip("/")


def build_request(host: str, port: int, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
