"""The proxy's subscriber to every engine's vLLM KV events (``--kv-events-config``).

Each engine's ZMQ PUB connects to the proxy's one SUB socket (the planner's
``kv_events`` listen address); a batch is ``(topic, seq, payload)``: the topic is the
backend's name, ``seq`` counts the engine's batches from 0, ``payload`` an msgpack
``KVEventBatch`` (``vllm/distributed/kv_events.py``, the same in 0.26 and 0.32). Each engine
also answers replays on a ROUTER (its ``replay`` endpoint): send a start seq, get every
buffered batch from it on, then an end marker. This module uses the replay to

- **resync**: at start (from seq 0: a restarted proxy rebuilds the index from the engines'
  replay buffers, 10,000 batches each by default), and after a gap in the live seqs;
- **detect an engine restart**: its seqs start again at 0 (live), or the batch the proxy
  applied last is no longer the engine's at that seq (heartbeat): the engine's index is
  cleared and rebuilt from a replay;
- **tell staleness**: an engine quiet for ``heartbeat_s`` is asked for a replay from its
  last seq (answered by its publisher thread, so an answer proves the publisher alive); one
  with no contact for ``stale_after_s`` is *stale*, and routing falls back to the hash ring
  for it (:mod:`pdstack.proxy.kv_events_route`), with a log line and a metric.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdstack.proxy.kv_index import KvIndex

log = logging.getLogger("pdstack.proxy.kv_events")

END_SEQ = -1
STATES = ("fresh", "missing", "stale", "unverified")


# vLLM's event structs (tagged by class name, unknown fields ignored): only what the
# index reads
class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[int | bytes] = []
    parent_block_hash: int | bytes | None = None
    token_ids: list[int] = []
    block_size: int = 0
    medium: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[int | bytes] = []
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EventBatch)


def decode_batch(payload: bytes) -> EventBatch:
    return _decoder.decode(payload)


@dataclass
class Feed:
    """One engine's event stream as the proxy follows it."""

    name: str
    replay: str
    last_seq: int = -1
    digest: bytes = b""  # of the payload at last_seq (restart check)
    contact_at: float | None = None  # time.monotonic() of the last batch or replay answer
    syncing: bool = False
    pending: list[tuple[int, bytes]] = field(default_factory=list)
    dealer: zmq.asyncio.Socket | None = None
    batches: dict[str, int] = field(default_factory=lambda: {"live": 0, "replay": 0})
    resets: dict[str, int] = field(default_factory=dict)
    decode_errors: int = 0
    reported: str = "missing"  # the state last logged


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=8).digest()


class KvEventsSubscriber:
    """Follows every engine's events into ``index``; :meth:`state` says whom to trust."""

    def __init__(
        self,
        index: KvIndex,
        host: str,
        port: int,
        sources: dict[str, str],
        heartbeat_s: float = 5.0,
        stale_after_s: float = 15.0,
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.index = index
        self.endpoint = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        self.feeds = {name: Feed(name, replay) for name, replay in sources.items()}
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.replay_timeout_s = replay_timeout_s
        self.started_at = time.monotonic()
        self.unknown_topics = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sub.bind(self.endpoint)
        except zmq.ZMQError as exc:  # the proxy serves on: every engine routed by hash
            sub.close(linger=0)
            log.error("kv events: cannot listen on %s (%s): every engine is routed by hash",
                      self.endpoint, exc)
            return
        self._sub = sub
        self.started_at = time.monotonic()
        self._spawn(self._receive())
        self._spawn(self._heartbeat())
        for feed in self.feeds.values():
            self._spawn(self._sync(feed, 0))
        log.info("kv events: listening on %s for %d engines", self.endpoint, len(self.feeds))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for feed in self.feeds.values():
            self._drop_dealer(feed)
        if self._sub is not None:
            self._sub.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ state
    def state(self, name: str, now: float | None = None) -> str:
        """``fresh`` (trust its index), ``missing`` (never heard from, or not a source),
        ``stale`` (no contact for ``stale_after_s``) or ``unverified`` (its block hashes
        match no scheme the proxy computes, or none checked yet)."""
        feed = self.feeds.get(name)
        if feed is None or feed.contact_at is None:
            return "missing"
        now = time.monotonic() if now is None else now
        if now - feed.contact_at > self.stale_after_s:
            return "stale"
        eng = self.index.engines.get(name)
        if eng is None or eng.scheme is None:
            return "unverified"
        return "fresh"

    def _report(self, now: float) -> None:
        """One log line per change of an engine's state (missing only once past the grace
        of ``stale_after_s`` after start)."""
        for feed in self.feeds.values():
            state = self.state(feed.name, now)
            if state == feed.reported:
                continue
            if state == "missing" and now - self.started_at < self.stale_after_s:
                continue
            if state == "fresh":
                log.info("kv events: %s fresh: routed by its cached blocks", feed.name)
            elif state != "unverified" or self.index.engine(feed.name).unverified:
                log.warning(
                    "kv events: %s %s: routing it by hash (the prefix ring) until its events "
                    "are back", feed.name, state,
                )
            else:
                continue  # not yet checked: no news
            feed.reported = state

    # ------------------------------------------------------------------ live
    async def _receive(self) -> None:
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            if len(frames) != 3:
                continue
            topic, seq_b, payload = frames
            feed = self.feeds.get(topic.decode(errors="replace"))
            if feed is None:
                self.unknown_topics += 1
                continue
            try:
                self.on_live(feed, int.from_bytes(seq_b, "big"), payload)
            except Exception:  # one bad batch must not end the subscription
                log.exception("kv events: %s: batch not applied", feed.name)

    def on_live(self, feed: Feed, seq: int, payload: bytes) -> None:
        feed.contact_at = time.monotonic()
        if feed.syncing:
            feed.pending.append((seq, payload))
            return
        if feed.last_seq >= 0 and seq <= feed.last_seq:
            # its seqs began again: a new engine process, whose cache started empty
            self._reset(feed, "restart")
            if seq > 0:
                feed.pending.append((seq, payload))
                self._spawn(self._sync(feed, 0))
                return
        elif seq > feed.last_seq + 1:
            feed.pending.append((seq, payload))
            self._spawn(self._sync(feed, feed.last_seq + 1))
            return
        self._apply(feed, seq, payload, "live")

    def _reset(self, feed: Feed, reason: str) -> None:
        self.index.clear(feed.name)
        feed.last_seq, feed.digest = -1, b""
        feed.resets[reason] = feed.resets.get(reason, 0) + 1
        log.info("kv events: %s index cleared (%s)", feed.name, reason)

    def _apply(self, feed: Feed, seq: int, payload: bytes, via: str) -> None:
        try:
            batch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            feed.decode_errors += 1
            if feed.decode_errors == 1:
                log.warning("kv events: %s: undecodable batch %d: %s", feed.name, seq, exc)
        else:
            try:
                for event in batch.events:
                    self.index.apply(feed.name, event)
            except Exception:  # an event of a shape the index does not know
                feed.decode_errors += 1
                log.exception("kv events: %s: batch %d not applied", feed.name, seq)
        feed.last_seq, feed.digest = seq, _digest(payload)
        feed.batches[via] += 1

    # ------------------------------------------------------------------ replay
    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.heartbeat_s))
            now = time.monotonic()
            for feed in self.feeds.values():
                quiet = feed.contact_at is None or now - feed.contact_at >= self.heartbeat_s
                if quiet and not feed.syncing:
                    self._spawn(self._sync(feed, max(feed.last_seq, 0), verify=True))
            try:
                self._report(now)
            except Exception:
                log.exception("kv events: state report failed")

    async def _sync(self, feed: Feed, start: int, verify: bool = False) -> None:
        """Replay from ``start``; with ``verify`` (start = the last applied seq) check the
        engine still has that batch: if not it restarted, and it is replayed from 0."""
        if feed.syncing:
            return
        feed.syncing = True
        try:
            answer = await self._replay(feed, start)
            if answer is None:
                return
            feed.contact_at = time.monotonic()
            if verify and feed.last_seq >= 0:
                first = answer[0] if answer else None
                if first is None or first[0] != feed.last_seq or _digest(first[1]) != feed.digest:
                    self._reset(feed, "restart")
                    answer = await self._replay(feed, 0)
                    if answer is None:
                        return
            if answer and feed.last_seq >= 0 and answer[0][0] > feed.last_seq + 1:
                self._reset(feed, "gap")  # batches lost from its buffer: start over
            for seq, payload in answer:
                if seq > feed.last_seq:
                    self._apply(feed, seq, payload, "replay")
        finally:
            feed.syncing = False
            # the live batches that came meanwhile, in order; a gap the replay could not
            # fill (no answer, or gone from its buffer) is lost, and counted
            pending, feed.pending = sorted(feed.pending), []
            for seq, payload in pending:
                if seq <= feed.last_seq:
                    continue
                if feed.last_seq >= 0 and seq > feed.last_seq + 1:
                    feed.batches["lost"] = feed.batches.get("lost", 0) + seq - feed.last_seq - 1
                self._apply(feed, seq, payload, "live")

    async def _replay(self, feed: Feed, start: int) -> list[tuple[int, bytes]] | None:
        """Every buffered batch from ``start`` on, or None (no answer in time)."""
        if self._ctx is None:
            return None
        if feed.dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(feed.replay)
            feed.dealer = dealer
        dealer = feed.dealer
        out: list[tuple[int, bytes]] = []
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await dealer.poll(int(self.replay_timeout_s * 1000)):
                    self._drop_dealer(feed)  # drop what it queued for a dead peer
                    return None
                frames = await dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:  # (topic, seq, payload): vLLM 0.26, 0.32
                    frames = frames[1:]
                if len(frames) != 2:  # (seq, payload): older vLLM
                    continue
                seq = int.from_bytes(frames[0], "big", signed=True)
                if seq == END_SEQ:
                    return out
                out.append((seq, frames[1]))
        except zmq.ZMQError as exc:
            log.debug("kv events: %s replay failed: %s", feed.name, exc)
            self._drop_dealer(feed)
            return None

    @staticmethod
    def _drop_dealer(feed: Feed) -> None:
        if feed.dealer is not None:
            feed.dealer.close(linger=0)
            feed.dealer = None


class KvEventsCollector:
    """``pdstack_proxy_kv_events_*`` and ``pdstack_proxy_kv_index_blocks``, read at
    scrape time."""

    def __init__(self, sub: KvEventsSubscriber) -> None:
        self.sub = sub

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        sub = self.sub
        now = time.monotonic()
        state = GaugeMetricFamily(
            "pdstack_proxy_kv_events_state",
            "1 for each engine's KV-event state (fresh: routed by its blocks; missing, stale, "
            "unverified: routed by hash)", labels=["backend", "state"],
        )
        batches = CounterMetricFamily(
            "pdstack_proxy_kv_events_batches",
            "KV event batches applied (live, replay) or lost (a gap no replay filled)",
            labels=["backend", "via"],
        )
        resets = CounterMetricFamily(
            "pdstack_proxy_kv_events_resets", "an engine's index cleared (restart, gap)",
            labels=["backend", "reason"],
        )
        age = GaugeMetricFamily(
            "pdstack_proxy_kv_events_contact_age_seconds",
            "seconds since an engine's last event batch or replay answer", labels=["backend"],
        )
        blocks = GaugeMetricFamily(
            "pdstack_proxy_kv_index_blocks", "block hashes the index holds per engine and tier",
            labels=["backend", "medium"],
        )
        for feed in sub.feeds.values():
            current = sub.state(feed.name, now)
            for s in STATES:
                state.add_metric([feed.name, s], 1.0 if s == current else 0.0)
            for via, n in feed.batches.items():
                batches.add_metric([feed.name, via], n)
            for reason, n in feed.resets.items():
                resets.add_metric([feed.name, reason], n)
            if feed.contact_at is not None:
                age.add_metric([feed.name], now - feed.contact_at)
        pending = GaugeMetricFamily(
            "pdstack_proxy_kv_pending_blocks", "blocks of prompts this proxy routed to an "
            "engine that its events have not told of yet (counted as held until they do, or "
            "lapse)", labels=["backend"],
        )
        for name, tiers in sub.index.stats().items():
            for medium, n in tiers.items():
                blocks.add_metric([name, medium], n)
        for name, eng in sub.index.engines.items():
            pending.add_metric([name], len(eng.pending))
        yield from (state, batches, resets, age, blocks, pending)
