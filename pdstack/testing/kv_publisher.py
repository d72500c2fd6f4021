"""A stand-in for vLLM's ZMQ KV-event publisher (``vllm/distributed/kv_events.py``
``ZmqEventPublisher``): a PUB that connects to the proxy's SUB, ``(topic, seq, payload)``
batches numbered from 0, and a ROUTER answering replays from its buffer, ended by the
``-1`` marker; for the proxy's tests (the real one is tested with real engines)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import zmq
import zmq.asyncio

from pdstack.proxy.kv_events import BlockRemoved, BlockStored, EventBatch
from pdstack.proxy.kv_index import HashScheme, block_hashes

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class FakePublisher:
    def __init__(self, ctx: zmq.asyncio.Context, topic: str, endpoint: str, replay: str) -> None:
        self.ctx, self.topic, self.endpoint, self.replay_endpoint = ctx, topic, endpoint, replay
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.answer_replays = True
        self.replays = 0
        self._enc = msgspec.msgpack.Encoder()
        self.pub: zmq.asyncio.Socket | None = None
        self.router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> FakePublisher:
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.connect(self.endpoint)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.replay_endpoint)
        self._task = asyncio.create_task(self._serve())
        return self

    async def _start_again(self) -> None:
        # a closed socket lets go of its port in ZMQ's I/O thread, a moment later
        for _ in range(50):
            try:
                self.start()
                return
            except zmq.ZMQError:
                for sock in (self.pub, self.router):
                    if sock is not None:
                        sock.close(linger=0)
                await asyncio.sleep(0.1)
        self.start()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for sock in (self.pub, self.router):
            if sock is not None:
                sock.close(linger=0)

    async def restart(self) -> None:
        """A new engine process: sockets again, seqs from 0, an empty buffer."""
        await self.close()
        self.seq, self.buffer = 0, []
        await self._start_again()

    async def publish(self, *events: BlockStored | BlockRemoved) -> None:
        payload = self._enc.encode(EventBatch(ts=time.time(), events=list(events)))
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        assert self.pub is not None
        await self.pub.send_multipart([self.topic.encode(), seq.to_bytes(8, "big"), payload])

    async def store(self, tokens: list[int], block_size: int = 16, seed: str = "0",
                    medium: str = "GPU") -> list[int]:
        """Publish that the engine holds every full block of ``tokens``; their hashes."""
        hashes = block_hashes(tokens, block_size, HashScheme(seed))
        await self.publish(BlockStored(block_hashes=list(hashes), parent_block_hash=None,
                                       token_ids=tokens[: len(hashes) * block_size],
                                       block_size=block_size, medium=medium))
        return hashes

    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            client, _, start_b = await self.router.recv_multipart()
            self.replays += 1
            if not self.answer_replays:
                continue
            start = int.from_bytes(start_b, "big")
            for seq, payload in self.buffer:
                if seq >= start:
                    await self.router.send_multipart(
                        [client, b"", self.topic.encode(), seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])
