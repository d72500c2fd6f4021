"""LMCache's legacy P/D push (kv_mode ``lmcache-pd``): the proxy's side of the protocol.

What LMCache 0.5.x expects (read from its source; file:line of the 0.5.6 wheel):

1. The proxy picks the decoder first and sends the prefill leg with
   ``kv_transfer_params = {"disagg_spec": {"req_id", "receiver_host",
   "receiver_init_port": [..], "receiver_alloc_port": [..]}}``
   (``integration/vllm/vllm_v1_adapter.py`` ``update_state_after_alloc`` ~1560: the
   dict becomes a ``DisaggSpec``).  The port lists are indexed by the prefiller's TP
   rank (``v1/storage_backend/pd_backend_async.py`` ``batched_submit_put_task``:
   ``transfer_spec.receiver_init_port[self.tp_rank]``; same in ``pd_backend.py``).
   Without a ``disagg_spec`` the prefiller's PD backend pushes nothing
   (``transfer_spec is None`` -> return).
2. Once a request's KV is written into the decoder, each pushing prefiller rank sends
   one ``ProxyNotif(req_id)`` over a ZMQ PUSH socket connected to
   ``tcp://{pd_proxy_host}:{pd_proxy_port}`` (``_async_init_proxy_socket`` /
   ``_send_proxy_notif``; sync backend: ``_init_sender`` / ``_nixl_worker_loop``).
   It is never sent when the push failed (``_abort_request``).
3. The wire format is ``msgspec.msgpack.encode(ProxyNotif(req_id=...))`` where
   ``class PDMsgBase(msgspec.Struct, tag=True)`` and ``class ProxyNotif(PDMsgBase):
   req_id: str``: a tagged struct, i.e. the msgpack map
   ``{"type": "ProxyNotif", "req_id": <str>}`` (tag field ``type``, tag = class name).
4. Then the proxy sends the decode leg (the original request) to that decoder, whose
   LMCache finds the pushed chunks in its receive buffer.

The proxy binds one ZMQ PULL socket and keeps ``req_id -> Future``; a request waits
(bounded) for its notification.  The wait resolves on the *first* ProxyNotif of the
``req_id`` (as LMCache's own example proxies do); later duplicates (one per pushing TP
rank) and late ones are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from pdstack.proxy import tracing
from pdstack.proxy.backends import BackendState
from pdstack.proxy.legs import Legs
from pdstack.proxy.request_context import RequestContext
from pdstack.proxy.routing import pick_p2c

log = logging.getLogger("pdstack.proxy")


@functools.cache
def _codec() -> tuple[Any, Any]:
    """(ProxyNotif, its msgpack decoder); msgspec is imported on first use only, so the
    other kv modes never need it."""
    import msgspec

    class PDMsgBase(msgspec.Struct, tag=True):
        """LMCache's ``PDMsgBase`` (tag=True: the tag is the class name, field ``type``)."""

    class ProxyNotif(PDMsgBase):
        """LMCache's ``ProxyNotif``: the class name is the wire tag, keep it."""

        req_id: str

    return ProxyNotif, msgspec.msgpack.Decoder(ProxyNotif)


def encode_notif(req_id: str) -> bytes:
    """The bytes a prefiller's LMCache PUSHes to the proxy for ``req_id``."""
    import msgspec

    notif, _ = _codec()
    return msgspec.msgpack.encode(notif(req_id=req_id))


def decode_notif(data: bytes) -> str:
    """The ``req_id`` of a ProxyNotif; raises ``msgspec.DecodeError`` /
    ``ValidationError`` (``ValueError``s) for anything else, another tagged PD message
    included."""
    _, decoder = _codec()
    return decoder.decode(data).req_id


def disagg_spec(req_id: str, receiver: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's ``kv_transfer_params`` naming the decoder that receives the KV."""
    return {
        "disagg_spec": {
            "req_id": req_id,
            "receiver_host": receiver["host"],
            "receiver_init_port": list(receiver["init_ports"]),
            "receiver_alloc_port": list(receiver["alloc_ports"]),
        }
    }


def zmq_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class NotifyListener:
    """One ZMQ PULL socket per proxy; ``expect(req_id)`` before the prefill leg, then
    ``wait(...)`` for it (ProxyNotif may arrive before the prefill's HTTP answer)."""

    def __init__(
        self,
        host: str,
        port: int,
        on_unmatched: Callable[[str], None] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.on_unmatched = on_unmatched
        self.pending: dict[str, asyncio.Future[None]] = {}
        self._ctx: Any = None
        self._sock: Any = None
        self._task: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        return zmq_endpoint(self.host, self.port)

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        if ":" in self.host:
            sock.setsockopt(zmq.IPV6, 1)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            self._ctx.term()
            self._ctx = None
            raise OSError(f"lmcache-pd notify socket cannot bind {self.endpoint}: {exc}") from exc
        if self.port == 0:  # tests: pick a free port
            last = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            self.port = int(last.rsplit(":", 1)[1])
        self._sock = sock
        self._task = asyncio.create_task(self._loop())
        log.warning("lmcache-pd: waiting for ProxyNotif on %s", self.endpoint)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        for fut in self.pending.values():
            fut.cancel()
        self.pending.clear()

    async def _loop(self) -> None:
        while True:
            try:
                data = await self._sock.recv()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("lmcache-pd: notify socket receive failed")
                await asyncio.sleep(0.1)
                continue
            try:
                req_id = decode_notif(data)
            except ValueError as exc:
                log.warning("lmcache-pd: not a ProxyNotif (%d bytes): %s", len(data), exc)
                if self.on_unmatched is not None:
                    self.on_unmatched("invalid")
                continue
            self.notify(req_id)

    def notify(self, req_id: str) -> None:
        fut = self.pending.pop(req_id, None)
        if fut is None or fut.done():
            # a second pushing TP rank, or a notification after its request stopped waiting
            log.debug("lmcache-pd: ProxyNotif for %s that nobody waits for", req_id)
            if self.on_unmatched is not None:
                self.on_unmatched("unmatched")
            return
        fut.set_result(None)

    def unique_id(self, base: str) -> str:
        """``base`` if no request waits under it yet, else ``base`` + a counter suffix
        (LMCache keys its per-request push bookkeeping by this id)."""
        req_id, n = base, 0
        while req_id in self.pending:
            n += 1
            req_id = f"{base}-{n}"
        return req_id

    def expect(self, req_id: str) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.pending[req_id] = fut
        return fut

    def forget(self, req_id: str) -> None:
        fut = self.pending.pop(req_id, None)
        if fut is not None and not fut.done():
            fut.cancel()


class LmcachePdFlow(Legs):
    """Mixin of :class:`pdstack.proxy.app.Proxy` (through ``Flows``): the ``lmcache-pd``
    flow (step 5 of :mod:`pdstack.proxy.flows`)."""

    notifier: NotifyListener | None
    rng: random.Random

    # pdstack.proxy.flows.Flows
    _paired_decoders: Callable[..., list[tuple[BackendState, str]]]
    _run_prefill_leg: Callable[..., Awaitable[BackendState | web.StreamResponse]]

    async def _serve_lmcache_pd(
        self, request: web.Request, ctx: RequestContext
    ) -> web.StreamResponse:
        """Decoder first, prefill with its disagg_spec, wait for ProxyNotif, decode there."""
        notifier = self.notifier
        decoder: BackendState | None = None
        waiter: asyncio.Future[None] | None = None
        req_id = ""

        async def prefill_leg(prefill: BackendState, attempt: int) -> None:
            nonlocal decoder, waiter, req_id
            paired = [d for d, _ in self._paired_decoders(prefill)]
            if decoder is None or decoder not in paired:
                decoder = pick_p2c(paired, self.rng)  # kept across prefill retries
            kv_request: dict[str, Any] | None = None
            if decoder is not None and decoder.lmcache_pd is not None:
                base = ctx.request_id if attempt == 0 else f"{ctx.request_id}-r{attempt}"
                if notifier is not None:
                    req_id = notifier.unique_id(base)
                    waiter = notifier.expect(req_id)
                else:
                    req_id = base
                kv_request = disagg_spec(req_id, decoder.lmcache_pd)
            await self._prefill(prefill, ctx, nixl=False, kv_request=kv_request)

        def forget_waiter() -> None:
            nonlocal waiter
            if notifier is not None and waiter is not None:
                notifier.forget(req_id)
                waiter = None

        try:
            answered = await self._run_prefill_leg(ctx, prefill_leg, forget_waiter)
            if not isinstance(answered, BackendState):
                return answered
            prefill = answered

            # ---- the KV push: wait (bounded) for the prefiller's ProxyNotif
            if decoder is not None and decoder.lmcache_pd is None:
                self.metrics.lmcache_pd_notify.labels("no_receiver").inc()
            elif waiter is not None:
                with tracing.kv_wait(ctx):
                    await self._await_notify(waiter, req_id, prefill, decoder)
        finally:
            if notifier is not None and waiter is not None and not waiter.done():
                notifier.forget(req_id)

        # ---- leg 2: decode, on the decoder the KV went to (a retry elsewhere recomputes)
        chosen_prefill = prefill
        first_choice = decoder

        def pick_decoder(tried_decoders: set[str]) -> BackendState | None:
            nonlocal first_choice
            chosen = None
            if (
                first_choice is not None
                and first_choice.usable
                and first_choice.name not in tried_decoders
            ):
                chosen = first_choice
            else:
                others = [
                    d
                    for d, _ in self._paired_decoders(chosen_prefill, tried_decoders)
                    if d.name not in tried_decoders
                ]
                chosen = pick_p2c(others, self.rng)
            first_choice = None
            if chosen is not None:
                self.metrics.pair(chosen_prefill, chosen).inc()
            return chosen

        return await self._final_leg(
            request, ctx, pick_decoder, lambda backend: ctx.raw, no_backend_hint=chosen_prefill
        )

    async def _await_notify(
        self,
        waiter: asyncio.Future[None],
        req_id: str,
        prefill: BackendState,
        decoder: BackendState | None,
    ) -> None:
        started = time.perf_counter()
        timeout = self.config.lmcache_pd_notify_timeout_s
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(waiter)
        except TimeoutError:
            self.metrics.lmcache_pd_notify.labels("timeout").inc()
            log.warning(
                "lmcache-pd: no ProxyNotif for %s from %s within %gs; decoding on %s anyway "
                "(it recomputes the prompt)",
                req_id,
                prefill.name,
                timeout,
                decoder.name if decoder is not None else "?",
            )
        else:
            self.metrics.lmcache_pd_notify.labels("received").inc()
        finally:
            self.metrics.lmcache_pd_notify_wait.observe(time.perf_counter() - started)
