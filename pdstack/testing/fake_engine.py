"""FakeEngine: a TEST DOUBLE of an OpenAI-compatible vLLM server (aiohttp).

It is for unit tests, fault-injection tests and proxy overhead benchmarks only;
it never runs a model. Real-engine tests use real vLLM.

Endpoints
---------
- ``POST /v1/completions`` and ``POST /v1/chat/completions``, streaming (SSE,
  ``stream: true``) and not. Output is ``n`` tokens, ``n = min(max_tokens,
  output_tokens)``; token ``i`` is the text `` t<k>`` where ``k`` depends only on
  the prompt and ``i`` (so every engine answers a prompt identically, like greedy
  decoding of one model). Prompt tokens are counted as whitespace-separated words.
  Headers are sent at once (like vLLM), the first token after ``ttft_ms``, then
  one SSE event per token every ``itl_ms``. ``stream_options.include_usage``
  adds a usage event; the stream ends with ``data: [DONE]``. Usage carries
  ``prompt_tokens_details.cached_tokens`` (vLLM's ``--enable-prompt-tokens-details``):
  all prompt tokens for a prompt this engine has seen before, and for a decode leg
  carrying ``do_remote_prefill`` (its KV came from the prefiller), else 0.
- ``return_token_ids`` (vLLM's): each token event's choice carries ``token_ids`` (output
  token `` t<k>`` is ``OUTPUT_ID_BASE + k``) and the first event the prompt's
  ``prompt_token_ids`` (its characters' code points; a chat stream's role event, at its
  top level). A token-id prompt that holds output ids (a stream continued elsewhere:
  prompt ids + the output's so far) is answered as that prompt's continuation: the tokens
  that follow, up to ``output_tokens`` in all, as greedy decoding of one model would.
- ``api_key``: when set, generation requests without ``Authorization: Bearer <it>``
  get 401 (vLLM's ``--api-key`` / ``VLLM_API_KEY``).
- ``kv_transfer_params`` (the vLLM NIXL P/D protocol): a request with
  ``{"do_remote_decode": true}`` is a prefill leg: the response carries
  ``kv_transfer_params = {"do_remote_prefill": true, "remote_engine_id": <name>,
  "remote_block_ids": [...], "remote_host": <host>, "remote_port": <port>,
  "request_id": <X-Request-Id>}``. A request carrying ``do_remote_prefill`` is a
  decode leg: its prompt tokens count as ``external_kv_transfer`` in /metrics.
- LMCache's legacy P/D push (kv_mode ``lmcache-pd``): built with
  ``lmcache_pd_notify="HOST:PORT"`` (a prefiller's ``LMCACHE_PD_PROXY_HOST``/``PORT``),
  a request carrying ``kv_transfer_params.disagg_spec`` makes the engine "push the KV"
  and then send LMCache's ``ProxyNotif(req_id)`` (msgspec msgpack, over a ZMQ PUSH
  socket) ``lmcache_pd_notify_delay_ms`` after the request arrived; sent notifications
  are listed in ``lmcache_pd_notified`` as ``(req_id, time.time())``. Without the
  option a ``disagg_spec`` is only recorded (no notification: LMCache's push failed).
- ``max_running``: a fixed capacity (vLLM's ``--max-num-seqs``): at most that many
  requests are served at once; the others wait in the engine, in arrival order (their
  TTFT includes the wait).
- ``GET /v1/models``: one model, ``model`` (default ``"fake"``).
- ``POST /tokenize`` (``prompt`` or chat ``messages``) and ``POST /detokenize``
  (``tokens``), vLLM's shapes (``count``, ``max_model_len``, ``tokens`` / ``prompt``): one
  token per whitespace-separated word, ids assigned in order of first sight (so
  detokenize inverts tokenize); a ``model`` other than ``model`` is vLLM's 404.
- Errors carry vLLM's ``type`` names (its exception classes: ``BadRequestError``,
  ``NotFoundError``, ``InternalServerError``, ...), as the real engine does. With
  ``max_model_len`` set, a generate request whose prompt tokens + ``max_tokens`` exceed it
  is vLLM's 400 (``max_tokens`` too large).
- ``GET /health``: 200, or ``faults.health_status``.
- ``GET /metrics``: Prometheus text with vLLM's names:
  ``vllm:num_requests_running``, ``vllm:prompt_tokens_total``,
  ``vllm:generation_tokens_total``, ``vllm:request_success_total``,
  ``vllm:prompt_tokens_by_source_total{source="local_compute"|"external_kv_transfer"}``,
  and ``fake_engine_requests_total`` (``metrics_reads`` counts the reads). With
  ``kv_capacity_tokens`` set, also the gauges KV-aware admission reads:
  ``vllm:cache_config_info{num_gpu_blocks, block_size} 1`` (``kv_block_size``: 1 unless a
  test sets it -- the fake counts KV in tokens, not in vLLM's whole blocks),
  ``vllm:kv_cache_usage_perc`` = (running requests' prompt tokens + ``kv_held_tokens``)
  / capacity, capped at 1, ``vllm:num_requests_waiting`` = ``num_waiting`` and
  ``vllm:num_preemptions_total`` = ``num_preemptions``; tests set ``kv_held_tokens`` (KV
  "held by other requests"), ``num_waiting`` and ``num_preemptions`` at any time.
- ``GET /fake/requests`` (JSON list of what it saw; header names lower-cased),
  ``DELETE /fake/requests``,
  ``GET /fake/faults``, ``PUT /fake/faults`` (JSON body = ``Faults`` fields;
  replaces the faults): control from another process, e.g. a benchmark.

Faults (``FakeEngine.faults``, a :class:`Faults`; applies to generation requests)
--------------------------------------------------------------------------------
- ``status`` (e.g. 500): answer that HTTP status with an OpenAI error JSON
  before any byte of the body (a retryable failure).
- ``delay_ms``: extra delay before the response headers.
- ``hang``: never answer (headers never sent) until the client goes away.
- ``hang_after_chunks`` N: stream N token events, then stall forever.
- ``close_after_chunks`` N: stream N token events (0 = right after the headers),
  then abort the TCP connection (the engine "died" mid-stream). For a
  non-streaming request: abort before answering.
- ``error_event_after_chunks`` N: stream N token events, then vLLM's error event
  ``data: {"error": {"message", "type", "param", "code"}}`` and ``data: [DONE]``; the
  HTTP status stays 200 (vLLM's failure during generation, e.g. of a NIXL KV pull: after
  a chat stream's role event, as vLLM sends it, with 0 tokens for N = 0).
  ``error_event_status`` (default 500: its ``InternalServerError`` "Internal server
  error"; 400: ``BadRequestError``) is the event's ``code``. For a non-streaming request:
  that status with the error JSON (vLLM answers a failed generation so).
- ``times``: apply the fault to that many more requests, then clear it
  (``None`` = every request).
- ``poison`` (a string) with ``poison_status``: a request whose prompt contains it is
  answered ``poison_status`` (default 500) with an OpenAI error JSON, while ``/health``
  stays 200: a "bad request" that makes an engine fail without the engine being sick.
  Independent of the other faults and of ``times``.
- ``health_status``: what ``/health`` answers (e.g. 503).
- ``health_hang``: ``/health`` and ``/metrics`` never answer (the engine's host cannot be
  reached: its link is down), until the client goes away.
- ``health_delay_ms``: ``/health`` answers that much later (a busy API server); ``/metrics``
  answers at once.

In-process use (tests)
----------------------
::

    engine = FakeEngine(name="d0", ttft_ms=5, itl_ms=1, output_tokens=8)
    url = await engine.start()            # port 0 = pick a free port
    engine.faults = Faults(status=500, times=1)
    ...
    engine.requests                        # list[SeenRequest]: path, headers, body
    await engine.kill()                    # abort every open connection, stop listening
    await engine.start()                   # same port again (a "restart")
    await engine.stop()

Or ``async with FakeEngine(...) as engine:``.

Command line
------------
``python -m pdstack.testing.fake_engine --port 8100 --ttft-ms 20 --itl-ms 5``
(also ``--host``, ``--output-tokens``, ``--model``, ``--name``, ``--no-record``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = ["FakeEngine", "Faults", "SeenRequest", "main"]


@dataclass
class Faults:
    """Fault injection for generation requests (see module docstring)."""

    status: int | None = None
    delay_ms: float = 0.0
    hang: bool = False
    hang_after_chunks: int | None = None
    close_after_chunks: int | None = None
    error_event_after_chunks: int | None = None
    error_event_status: int = 500
    times: int | None = None
    health_status: int = 200
    health_hang: bool = False
    health_delay_ms: float = 0.0
    poison: str | None = None
    poison_status: int = 500

    def active(self) -> bool:
        return (
            self.status is not None
            or self.delay_ms > 0
            or self.hang
            or self.hang_after_chunks is not None
            or self.close_after_chunks is not None
            or self.error_event_after_chunks is not None
        )


@dataclass
class SeenRequest:
    """One request the engine received."""

    path: str
    headers: dict[str, str]  # names lower-cased
    body: dict[str, Any] | None
    received_at: float = field(default_factory=time.time)

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# the fake's token ids (``return_token_ids``): a prompt's are its characters' code points,
# output token `` t<k>``'s is OUTPUT_ID_BASE + k
OUTPUT_ID_BASE = 2_000_000


def _continued(body: dict[str, Any]) -> tuple[str, int] | None:
    """A token-id prompt that carries output ids (a stream continued elsewhere, as the
    proxy's migration sends it): (the original prompt's text, output tokens already made)."""
    prompt = body.get("prompt")
    if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        return None
    done = sum(1 for t in prompt if t >= OUTPUT_ID_BASE)
    if not done:
        return None
    return "".join(chr(t) for t in prompt if t < OUTPUT_ID_BASE), done


def _prompt_text(body: dict[str, Any]) -> str:
    continued = _continued(body)
    if continued is not None:
        return continued[0]
    if "messages" in body:
        parts: list[str] = []
        for message in body.get("messages") or []:
            content = message.get("content", "")
            if isinstance(content, list):
                content = " ".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
            parts.append(f"{message.get('role', '')}: {content}")
        return "\n".join(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return " ".join(str(p) for p in prompt)
    return str(prompt)


# vLLM's error ``type`` per status: the names of its exception classes (vllm 0.32)
VLLM_ERROR_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    404: "NotFoundError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def _error_json(
    status: int, message: str, err_type: str | None = None, param: str | None = None
) -> dict[str, Any]:
    default = "BadRequestError" if status < 500 else "InternalServerError"
    kind = err_type or VLLM_ERROR_TYPES.get(status, default)
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass
class _Answer:
    """What one generate request answers (the same for the unary and the streamed form)."""

    chat: bool
    prompt_tokens: int
    count: int
    tokens: list[str]
    request_id: str
    kv_out: dict[str, Any] | None
    usage: dict[str, Any]
    model: Any
    response_id: str
    created: int
    prompt_ids: list[int] | None = None  # with return_token_ids: the prompt's token ids


class FakeEngine:
    """A fake vLLM OpenAI server. TEST DOUBLE: see the module docstring."""

    def __init__(
        self,
        name: str = "fake",
        host: str = "127.0.0.1",
        port: int = 0,
        ttft_ms: float = 0.0,
        itl_ms: float = 0.0,
        output_tokens: int = 16,
        model: str = "fake",
        record: bool = True,
        max_records: int = 100_000,
        lmcache_pd_notify: str | None = None,
        lmcache_pd_notify_delay_ms: float = 0.0,
        api_key: str | None = None,
        kv_capacity_tokens: int | None = None,
        max_running: int | None = None,
        max_model_len: int | None = None,
        kv_block_size: int = 1,
    ) -> None:
        self.name = name
        self.max_model_len = max_model_len
        self._vocab: dict[str, int] = {}  # /tokenize: word -> id, in order of first sight
        self.host = host
        self.port = port
        self.ttft_ms = ttft_ms
        self.itl_ms = itl_ms
        self.output_tokens = output_tokens
        self.model = model
        self.record = record
        self.faults = Faults()
        self.api_key = api_key
        self._seen_prompts: set[bytes] = set()
        self.requests: deque[SeenRequest] = deque(maxlen=max_records)
        self.running = 0
        self.counters: dict[str, int] = {
            "requests": 0,
            "success": 0,
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "local_compute": 0,
            "external_kv_transfer": 0,
            "aborted": 0,
        }
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._transports: set[asyncio.BaseTransport] = set()
        self._block_seq = 0
        self.lmcache_pd_notify = lmcache_pd_notify
        self.lmcache_pd_notify_delay_ms = lmcache_pd_notify_delay_ms
        self.lmcache_pd_notified: list[tuple[str, float]] = []
        self._zmq: tuple[Any, Any] | None = None  # (context, PUSH socket)
        self._notify_tasks: set[asyncio.Task[None]] = set()
        # KV gauges for admission tests (exported only with kv_capacity_tokens)
        self.kv_capacity_tokens = kv_capacity_tokens
        self.kv_block_size = kv_block_size
        self.kv_held_tokens = 0
        self.num_waiting = 0
        self.num_preemptions = 0
        self.running_prompt_tokens = 0
        self.metrics_reads = 0  # GET /metrics answered (tests count a scraper's rate)
        # a fixed capacity (vLLM's --max-num-seqs): more requests wait, FIFO, in the engine
        self.max_running = max_running
        self._slots = asyncio.Semaphore(max_running) if max_running else None

    # ----------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes([
            # vLLM's own routes
            web.post("/v1/completions", self._handle_generate),
            web.post("/v1/chat/completions", self._handle_generate),
            web.get("/v1/models", self._handle_models),
            web.post("/tokenize", self._handle_tokenize),
            web.post("/detokenize", self._handle_detokenize),
            web.get("/health", self._handle_health),
            web.get("/metrics", self._handle_metrics),
            # the test double's: what it was sent, and the faults it plays
            web.get("/fake/requests", self._handle_get_requests),
            web.delete("/fake/requests", self._handle_clear_requests),
            web.get("/fake/faults", self._handle_get_faults),
            web.put("/fake/faults", self._handle_put_faults),
        ])
        return app

    async def start(self) -> str:
        """Start listening (again, on the same port after a kill/stop); returns the URL."""
        if self._runner is None:
            # handler_cancellation: a client that goes away cancels the handler (vLLM
            # aborts the request the same way)
            self._runner = web.AppRunner(
                self.make_app(), access_log=None, shutdown_timeout=0.5, handler_cancellation=True
            )
            await self._runner.setup()
        self._site = web.TCPSite(
            self._runner, self.host, self.port, reuse_address=True, backlog=4096
        )
        await self._site.start()
        server = self._site._server  # need the bound port
        if self.port == 0 and server is not None:
            sockets = getattr(server, "sockets", None) or []
            self.port = sockets[0].getsockname()[1]
        return self.url

    async def kill(self) -> None:
        """Simulate a crash: stop listening and abort every open connection (idle
        keep-alive ones too). ``start()`` brings it back on the same port."""
        runner, self._runner = self._runner, None
        self._site = None
        if runner is None:
            return
        server = runner.server
        if server is not None:
            for handler in server.connections:
                conn = handler.transport
                if conn is not None:
                    conn.abort()
        for transport in list(self._transports):
            with contextlib.suppress(Exception):
                transport.abort()  # type: ignore[attr-defined]
        self._transports.clear()
        await runner.cleanup()

    async def stop(self) -> None:
        await self.kill()
        for task in list(self._notify_tasks):
            task.cancel()
        if self._zmq is not None:
            ctx, sock = self._zmq
            self._zmq = None
            sock.close(linger=0)
            ctx.term()

    async def __aenter__(self) -> FakeEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ----------------------------------------------------------------- helpers
    def seen(self, path: str | None = None) -> list[SeenRequest]:
        return [r for r in self.requests if path is None or r.path == path]

    def _take_fault(self) -> Faults | None:
        faults = self.faults
        if not faults.active():
            return None
        if faults.times is not None:
            if faults.times <= 0:
                return None
            faults.times -= 1
            taken = dataclasses.replace(faults)
            if faults.times == 0:
                self.faults = Faults(
                    health_status=faults.health_status,
                    health_hang=faults.health_hang,
                    health_delay_ms=faults.health_delay_ms,
                    poison=faults.poison,
                    poison_status=faults.poison_status,
                )
            return taken
        return faults

    def _tokens(self, prompt: str, count: int, start: int = 0) -> list[str]:
        seed = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "big")
        return [f" t{(seed + 7919 * i) % 1000}" for i in range(start, start + count)]

    def _push_lmcache_pd_notify(self, req_id: str) -> None:
        """LMCache's sender: after the push, PUSH ProxyNotif(req_id) to the proxy."""
        from pdstack.proxy.lmcache_pd import encode_notif, zmq_endpoint

        async def send() -> None:
            if self.lmcache_pd_notify_delay_ms > 0:
                await asyncio.sleep(self.lmcache_pd_notify_delay_ms / 1000)
            if self._zmq is None:
                import zmq
                import zmq.asyncio

                ctx = zmq.asyncio.Context()
                sock = ctx.socket(zmq.PUSH)
                host, _, port = str(self.lmcache_pd_notify).rpartition(":")
                sock.connect(zmq_endpoint(host.strip("[]"), int(port)))
                self._zmq = (ctx, sock)
            await self._zmq[1].send(encode_notif(req_id))
            self.lmcache_pd_notified.append((req_id, time.time()))

        task = asyncio.get_running_loop().create_task(send())
        self._notify_tasks.add(task)
        task.add_done_callback(self._notify_tasks.discard)

    # ----------------------------------------------------------------- handlers
    async def _handle_models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "fake"}],
            }
        )

    async def _tokenizer_body(self, request: web.Request) -> dict[str, Any] | web.Response:
        """The request body of /tokenize or /detokenize, recorded; or vLLM's error."""
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response(_error_json(400, "body is not JSON"), status=400)
        if self.record:
            headers = {k.lower(): v for k, v in request.headers.items()}
            self.requests.append(SeenRequest(request.path, headers, body))
        model = body.get("model")
        if model is not None and model != self.model:
            return web.json_response(
                _error_json(404, f"The model `{model}` does not exist.", param="model"),
                status=404,
            )
        return body

    async def _handle_tokenize(self, request: web.Request) -> web.Response:
        body = await self._tokenizer_body(request)
        if isinstance(body, web.Response):
            return body
        ids = [self._vocab.setdefault(w, len(self._vocab)) for w in _prompt_text(body).split()]
        return web.json_response(
            {"count": len(ids), "max_model_len": self.max_model_len or 4096, "tokens": ids,
             "token_strs": None}
        )

    async def _handle_detokenize(self, request: web.Request) -> web.Response:
        body = await self._tokenizer_body(request)
        if isinstance(body, web.Response):
            return body
        words = {i: w for w, i in self._vocab.items()}
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return web.json_response(_error_json(400, "tokens must be a list of ints",
                                                 param="tokens"), status=400)
        return web.json_response({"prompt": " ".join(words.get(t, "<unk>") for t in tokens)})

    async def _handle_health(self, request: web.Request) -> web.Response:
        if self.faults.health_hang:
            await asyncio.Event().wait()  # until the client goes away (cancelled)
        if self.faults.health_delay_ms > 0:
            await asyncio.sleep(self.faults.health_delay_ms / 1000)
        return web.Response(status=self.faults.health_status)

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        if self.faults.health_hang:  # the host cannot be reached: nothing answers
            await asyncio.Event().wait()
        self.metrics_reads += 1
        c = self.counters
        lbl = f'model_name="{self.model}"'
        lines = [
            f"vllm:num_requests_running{{{lbl}}} {self.running}",
            f"vllm:prompt_tokens_total{{{lbl}}} {c['prompt_tokens']}",
            f"vllm:generation_tokens_total{{{lbl}}} {c['generation_tokens']}",
            f"vllm:request_success_total{{{lbl}}} {c['success']}",
            f'vllm:prompt_tokens_by_source_total{{{lbl},source="local_compute"}} '
            f"{c['local_compute']}",
            f'vllm:prompt_tokens_by_source_total{{{lbl},source="external_kv_transfer"}} '
            f"{c['external_kv_transfer']}",
            f'fake_engine_requests_total{{engine="{self.name}"}} {c["requests"]}',
            f'fake_engine_aborted_total{{engine="{self.name}"}} {c["aborted"]}',
        ]
        if self.kv_capacity_tokens:
            size = self.kv_block_size
            blocks = self.kv_capacity_tokens // size
            used = (self.running_prompt_tokens + self.kv_held_tokens) / self.kv_capacity_tokens
            lines += [
                f'vllm:cache_config_info{{block_size="{size}",engine="0",'
                f'num_gpu_blocks="{blocks}"}} 1',
                f"vllm:kv_cache_usage_perc{{{lbl}}} {min(1.0, used)}",
                f"vllm:num_requests_waiting{{{lbl}}} {self.num_waiting}",
                f"vllm:num_preemptions_total{{{lbl}}} {self.num_preemptions}",
            ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _handle_get_requests(self, request: web.Request) -> web.Response:
        return web.json_response([r.to_json() for r in self.requests])

    async def _handle_clear_requests(self, request: web.Request) -> web.Response:
        self.requests.clear()
        return web.Response(status=204)

    async def _handle_get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(dataclasses.asdict(self.faults))

    async def _handle_put_faults(self, request: web.Request) -> web.Response:
        body = await request.json()
        names = {f.name for f in dataclasses.fields(Faults)}
        unknown = set(body) - names
        if unknown:
            return web.json_response(
                _error_json(
                    400, f"unknown fault fields {sorted(unknown)}", "invalid_request_error"
                ),
                status=400,
            )
        self.faults = Faults(**body)
        return web.json_response(dataclasses.asdict(self.faults))

    async def _handle_generate(self, request: web.Request) -> web.StreamResponse:
        transport = request.transport
        if transport is not None:
            self._transports.add(transport)
        try:
            return await self._generate(request, transport)
        finally:
            if transport is not None:
                self._transports.discard(transport)

    async def _generate(
        self, request: web.Request, transport: asyncio.BaseTransport | None
    ) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response(
                _error_json(400, "body is not JSON", "invalid_request_error"), status=400
            )
        early = await self._refuse_or_fault(request, body)
        if isinstance(early, web.StreamResponse):
            return early
        fault = early
        too_long = self._too_long(body)
        if too_long is not None:
            return too_long
        if self._slots is not None:
            async with self._slots:
                return await self._serve(request, body, fault, transport)
        return await self._serve(request, body, fault, transport)

    async def _serve(
        self,
        request: web.Request,
        body: dict[str, Any],
        fault: Faults | None,
        transport: asyncio.BaseTransport | None,
    ) -> web.StreamResponse:
        ans = self._answer(request, body)
        self.running += 1
        self.running_prompt_tokens += ans.prompt_tokens
        try:
            if not body.get("stream"):
                return await self._unary(ans, fault, transport)
            return await self._stream(request, body, ans, fault, transport)
        except asyncio.CancelledError:
            self.counters["aborted"] += 1
            raise
        except ConnectionResetError:  # the peer went away while we wrote
            self.counters["aborted"] += 1
            return web.Response(status=499)
        finally:
            self.running -= 1
            self.running_prompt_tokens -= ans.prompt_tokens

    async def _refuse_or_fault(
        self, request: web.Request, body: dict[str, Any]
    ) -> web.StreamResponse | Faults | None:
        """Count and record the request; an error response (auth, poison, injected status)
        or the fault to apply while answering (None: none)."""
        self.counters["requests"] += 1
        if self.record:
            self.requests.append(
                SeenRequest(request.path, {k.lower(): v for k, v in request.headers.items()}, body)
            )
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        poison = self.faults.poison
        if poison and poison in _prompt_text(body):
            status = self.faults.poison_status
            return web.json_response(
                _error_json(status, f"poisoned request at {self.name}"), status=status
            )
        fault = self._take_fault()
        if fault is not None:
            if fault.delay_ms > 0:
                await asyncio.sleep(fault.delay_ms / 1000)
            if fault.hang:
                await asyncio.Event().wait()
            if fault.status is not None:
                return web.json_response(
                    _error_json(fault.status, f"injected failure from {self.name}"),
                    status=fault.status,
                )
        return fault

    def _too_long(self, body: dict[str, Any]) -> web.Response | None:
        """vLLM's 400 for prompt + max_tokens past ``max_model_len`` (None: it fits)."""
        limit = self.max_model_len
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        if limit is None or not isinstance(max_tokens, int):
            return None
        prompt = len(_prompt_text(body).split())
        if prompt + max_tokens <= limit:
            return None
        message = (
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
            f"model's maximum context length is {limit} tokens and your request has "
            f"{prompt} input tokens ({max_tokens} > {limit} - {prompt})."
        )
        return web.json_response(_error_json(400, message), status=400)

    def _answer(self, request: web.Request, body: dict[str, Any]) -> _Answer:
        """What the answer says: tokens, usage, kv_transfer_params; counts the prompt."""
        chat = request.path.endswith("/chat/completions")
        prompt = _prompt_text(body)
        done = (_continued(body) or ("", 0))[1]  # a continuation: output tokens made before
        prompt_tokens = len(prompt.split()) + done
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        left = self.output_tokens - done
        count = left if max_tokens is None else min(int(max_tokens), left)
        count = max(count, 1)
        tokens = self._tokens(prompt, count, done)
        request_id = request.headers.get("X-Request-Id") or f"fake-{uuid.uuid4().hex}"
        kv_in = body.get("kv_transfer_params") or {}
        kv_out: dict[str, Any] | None = None
        if kv_in.get("do_remote_decode"):
            self._block_seq += 1
            kv_out = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.name,
                "remote_block_ids": [self._block_seq],
                "remote_host": self.host,
                "remote_port": self.port,
                "request_id": request_id,
                "tp_size": 1,
            }
        spec = kv_in.get("disagg_spec")
        if isinstance(spec, dict) and self.lmcache_pd_notify:
            self._push_lmcache_pd_notify(str(spec.get("req_id", "")))
        prompt_key = hashlib.blake2b(prompt.encode(), digest_size=16).digest()
        cached = prompt_tokens if prompt_key in self._seen_prompts else 0
        if len(self._seen_prompts) < 100_000:
            self._seen_prompts.add(prompt_key)
        if kv_in.get("do_remote_prefill"):
            self.counters["external_kv_transfer"] += prompt_tokens
            cached = prompt_tokens
        else:
            self.counters["local_compute"] += prompt_tokens
        self.counters["prompt_tokens"] += prompt_tokens
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": count,
            "total_tokens": prompt_tokens + count,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        return _Answer(
            chat=chat, prompt_tokens=prompt_tokens, count=count, tokens=tokens,
            request_id=request_id, kv_out=kv_out, usage=usage,
            model=body.get("model") or self.model,
            response_id=f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            created=int(time.time()),
            prompt_ids=self._prompt_ids(body, prompt) if body.get("return_token_ids") else None,
        )

    @staticmethod
    def _prompt_ids(body: dict[str, Any], prompt: str) -> list[int]:
        given = body.get("prompt")
        if isinstance(given, list) and given and all(isinstance(t, int) for t in given):
            return given
        return [ord(c) for c in prompt]

    async def _unary(
        self, ans: _Answer, fault: Faults | None, transport: asyncio.BaseTransport | None
    ) -> web.StreamResponse:
        if fault is not None and fault.close_after_chunks is not None:
            self._abort(transport)
            raise asyncio.CancelledError
        if fault is not None and fault.hang_after_chunks is not None:
            await asyncio.Event().wait()
        failed = self._generation_error(fault)
        if failed is not None:
            return web.json_response(failed, status=failed["error"]["code"])
        await asyncio.sleep((self.ttft_ms + self.itl_ms * (ans.count - 1)) / 1000)
        text = "".join(ans.tokens)
        if ans.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        payload: dict[str, Any] = {
            "id": ans.response_id,
            "object": "chat.completion" if ans.chat else "text_completion",
            "created": ans.created,
            "model": ans.model,
            "choices": [choice],
            "usage": ans.usage,
        }
        if ans.kv_out is not None:
            payload["kv_transfer_params"] = ans.kv_out
        self.counters["generation_tokens"] += ans.count
        self.counters["success"] += 1
        return web.json_response(payload, headers={"X-Request-Id": ans.request_id})

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        ans: _Answer,
        fault: Faults | None,
        transport: asyncio.BaseTransport | None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Request-Id": ans.request_id,
            }
        )
        await response.prepare(request)
        close_after = fault.close_after_chunks if fault is not None else None
        hang_after = fault.hang_after_chunks if fault is not None else None
        error_after = fault.error_event_after_chunks if fault is not None else None
        obj = "chat.completion.chunk" if ans.chat else "text_completion"
        head = f'{{"id":"{ans.response_id}","object":"{obj}","created":{ans.created},"model":'
        head += json.dumps(ans.model) + ',"choices":[{"index":0,'
        if self.ttft_ms > 0:
            await asyncio.sleep(self.ttft_ms / 1000)
        ids = ans.prompt_ids
        if ans.chat:
            extra = "" if ids is None else ',"prompt_token_ids":' + json.dumps(ids)
            await response.write(
                (
                    "data: " + head + '"delta":{"role":"assistant","content":""},'
                    '"logprobs":null,"finish_reason":null}]' + extra + "}\n\n"
                ).encode()
            )
        for i, token in enumerate(ans.tokens):
            if close_after is not None and i >= close_after:
                self._abort(transport)
                raise asyncio.CancelledError
            if hang_after is not None and i >= hang_after:
                await asyncio.Event().wait()
            if error_after is not None and i >= error_after:
                failed = self._generation_error(fault)
                await response.write(b"data: " + json.dumps(failed).encode() + b"\n\n")
                break
            if i > 0 and self.itl_ms > 0:
                await asyncio.sleep(self.itl_ms / 1000)
            last = i == ans.count - 1
            finish = '"length"' if last else "null"
            if ans.chat:
                event = head + '"delta":{"content":' + json.dumps(token) + "},"
            else:
                event = head + '"text":' + json.dumps(token) + ","
            event += '"logprobs":null,"finish_reason":' + finish
            if ids is not None:  # return_token_ids: the token's id (the prompt's, first)
                if not ans.chat and i == 0:
                    event += ',"prompt_token_ids":' + json.dumps(ids)
                event += f',"token_ids":[{OUTPUT_ID_BASE + int(token[2:])}]'
            event += "}]"
            if last and ans.kv_out is not None:
                event += ',"kv_transfer_params":' + json.dumps(ans.kv_out)
            event += "}"
            await response.write(b"data: " + event.encode() + b"\n\n")
            self.counters["generation_tokens"] += 1
        opts = body.get("stream_options") or {}
        if opts.get("include_usage") and error_after is None:
            usage_event: dict[str, Any] = {
                "id": ans.response_id,
                "object": obj,
                "created": ans.created,
                "model": ans.model,
                "choices": [],
                "usage": ans.usage,
            }
            await response.write(b"data: " + json.dumps(usage_event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        if error_after is None:
            self.counters["success"] += 1
        return response

    def _generation_error(self, fault: Faults | None) -> dict[str, Any] | None:
        """vLLM's error for a generation that failed (``error_event_after_chunks``)."""
        if fault is None or fault.error_event_after_chunks is None:
            return None
        status = fault.error_event_status
        message = "Internal server error" if status >= 500 else f"bad request at {self.name}"
        return _error_json(status, message)

    @staticmethod
    def _abort(transport: asyncio.BaseTransport | None) -> None:
        if transport is not None:
            transport.abort()  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdstack.testing.fake_engine",
        description="Fake OpenAI-compatible engine (TEST DOUBLE; no model).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--model", default="fake")
    parser.add_argument("--name", default=None, help="engine name (default fake-<port>)")
    parser.add_argument("--no-record", action="store_true", help="do not keep seen requests")
    parser.add_argument(
        "--kv-capacity-tokens", type=int, default=None,
        help="export the KV gauges KV-aware admission reads, for this capacity",
    )  # fmt: skip
    parser.add_argument(
        "--lmcache-pd-notify",
        metavar="HOST:PORT",
        default=None,
        help="send LMCache's ProxyNotif there for prefill legs carrying a disagg_spec",
    )
    parser.add_argument("--lmcache-pd-notify-delay-ms", type=float, default=0.0)
    parser.add_argument(
        "--api-key-env",
        default=None,
        metavar="NAME",
        help="require the API key in this environment variable (e.g. VLLM_API_KEY)",
    )
    args = parser.parse_args(argv)
    engine = FakeEngine(
        name=args.name or f"fake-{args.port}",
        host=args.host,
        port=args.port,
        ttft_ms=args.ttft_ms,
        itl_ms=args.itl_ms,
        output_tokens=args.output_tokens,
        model=args.model,
        record=not args.no_record,
        lmcache_pd_notify=args.lmcache_pd_notify,
        lmcache_pd_notify_delay_ms=args.lmcache_pd_notify_delay_ms,
        api_key=os.environ.get(args.api_key_env) if args.api_key_env else None,
        kv_capacity_tokens=args.kv_capacity_tokens,
    )
    try:
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    except ImportError:
        pass

    async def run() -> None:
        await engine.start()
        print(f"fake engine {engine.name} listening on {engine.url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await engine.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
