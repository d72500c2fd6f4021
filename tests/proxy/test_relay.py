"""The proxy's lean upstream HTTP/1.1 client (relay): parsing and connection reuse."""

from __future__ import annotations

import asyncio

import pytest

from pdstack.proxy.relay import RelayError, RelayPool, RelayProtocol, build_request, split_url
from pdstack.testing.fake_engine import FakeEngine

CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"7\r\ndata: 1\r\n"
    b"a;ext=1\r\n\ndata: 22\n\r\n"
    b"0\r\nX-Trailer: t\r\n\r\n"
)


class FakeTransport:
    def __init__(self) -> None:
        self.aborted = False
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abort(self) -> None:
        self.aborted = True


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
async def test_chunked_parse_any_split(step: int) -> None:
    proto = RelayProtocol(asyncio.get_running_loop())
    proto.connection_made(FakeTransport())  # type: ignore[arg-type]
    for i in range(0, len(CHUNKED), step):
        proto.data_received(CHUNKED[i : i + step])
    assert proto.status == 200
    assert proto.headers["content-type"] == "text/event-stream"
    assert proto.done.done() and proto.done.exception() is None
    assert proto.take_buffered() == b"data: 1\ndata: 22\n"
    assert proto.reusable


async def test_a_head_after_its_leg_was_given_up_is_no_fatal_error() -> None:
    """The leg awaiting the head was cancelled (its client left, a deadline passed): the
    head arriving afterwards is parsed without raising in data_received (asyncio logged
    that as a fatal protocol error and closed the transport)."""
    proto = RelayProtocol(asyncio.get_running_loop())
    proto.connection_made(FakeTransport())  # type: ignore[arg-type]
    proto.head_done.cancel()
    proto.data_received(CHUNKED)
    assert proto.status == 200 and proto.done.done()


async def test_content_length_and_sink() -> None:
    proto = RelayProtocol(asyncio.get_running_loop())
    proto.connection_made(FakeTransport())  # type: ignore[arg-type]
    got: list[bytes] = []
    proto.sink = got.append
    proto.data_received(b"HTTP/1.1 500 Oops\r\nContent-Length: 5\r\n\r\nab")
    assert proto.status == 500 and not proto.done.done()
    proto.data_received(b"cde")
    assert b"".join(got) == b"abcde" and proto.done.done()


async def test_connection_lost_mid_body_is_an_error() -> None:
    proto = RelayProtocol(asyncio.get_running_loop())
    proto.connection_made(FakeTransport())  # type: ignore[arg-type]
    proto.data_received(CHUNKED[:90])
    proto.connection_lost(None)
    with pytest.raises(RelayError):
        proto.done.result()
    assert not proto.reusable


async def test_bad_status_line_fails_and_aborts() -> None:
    proto = RelayProtocol(asyncio.get_running_loop())
    transport = FakeTransport()
    proto.connection_made(transport)  # type: ignore[arg-type]
    proto.data_received(b"garbage\r\n\r\n")
    with pytest.raises(RelayError):
        proto.head_done.result()
    assert transport.aborted


async def test_pool_reuses_keepalive_connections() -> None:
    async with FakeEngine(output_tokens=3) as engine:
        host, port, prefix = split_url(engine.url)
        pool = RelayPool()
        body = b'{"prompt": "hi", "stream": true}'
        seen = []
        for _ in range(3):
            proto, reused = await pool.acquire(host, port, 5.0)
            seen.append((id(proto), reused))
            proto.send(
                build_request(
                    host,
                    port,
                    prefix + "/v1/completions",
                    body,
                    {"Content-Type": "application/json"},
                )
            )
            await proto.done
            assert proto.status == 200
            assert proto.take_buffered().endswith(b"data: [DONE]\n\n")
            pool.release(host, port, proto)
        pool.close()
    assert [r for _, r in seen] == [False, True, True]
    assert len({i for i, _ in seen}) == 1
