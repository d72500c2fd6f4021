"""The fake engine's server (a TEST DOUBLE, see :mod:`pdstack.testing.fake_engine`): its
state, its lifecycle (start, kill, restart on the same port), vLLM's routes and the double's
own, and the generate pipeline up to the answer (record, refuse or fault, capacity, what it
says); :mod:`pdstack.testing.fake_replies` writes the answer out."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import time
import uuid
from collections import deque
from typing import Any

from aiohttp import web

from pdstack.testing.fake_replies import stream, too_long, unary
from pdstack.testing.fake_wire import (
    Answer,
    Faults,
    SeenRequest,
    continued_prompt,
    error_json,
    prompt_ids,
    prompt_text,
    tokens_for,
)


class FakeEngine:
    """A fake vLLM OpenAI server. TEST DOUBLE: see :mod:`pdstack.testing.fake_engine`."""

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
            return web.json_response(error_json(400, "body is not JSON"), status=400)
        if self.record:
            headers = {k.lower(): v for k, v in request.headers.items()}
            self.requests.append(SeenRequest(request.path, headers, body))
        model = body.get("model")
        if model is not None and model != self.model:
            return web.json_response(
                error_json(404, f"The model `{model}` does not exist.", param="model"),
                status=404,
            )
        return body

    async def _handle_tokenize(self, request: web.Request) -> web.Response:
        body = await self._tokenizer_body(request)
        if isinstance(body, web.Response):
            return body
        ids = [self._vocab.setdefault(w, len(self._vocab)) for w in prompt_text(body).split()]
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
            return web.json_response(error_json(400, "tokens must be a list of ints",
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
                error_json(
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
                error_json(400, "body is not JSON", "invalid_request_error"), status=400
            )
        early = await self._refuse_or_fault(request, body)
        if isinstance(early, web.StreamResponse):
            return early
        fault = early
        over = too_long(body, self.max_model_len)
        if over is not None:
            return over
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
                return await unary(self, ans, fault, transport)
            return await stream(self, request, body, ans, fault, transport)
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
        if poison and poison in prompt_text(body):
            status = self.faults.poison_status
            return web.json_response(
                error_json(status, f"poisoned request at {self.name}"), status=status
            )
        fault = self._take_fault()
        if fault is not None:
            if fault.delay_ms > 0:
                await asyncio.sleep(fault.delay_ms / 1000)
            if fault.hang:
                await asyncio.Event().wait()
            if fault.status is not None:
                return web.json_response(
                    error_json(fault.status, f"injected failure from {self.name}"),
                    status=fault.status,
                )
        return fault

    def _answer(self, request: web.Request, body: dict[str, Any]) -> Answer:
        """What the answer says: tokens, usage, kv_transfer_params; counts the prompt."""
        chat = request.path.endswith("/chat/completions")
        prompt = prompt_text(body)
        done = (continued_prompt(body) or ("", 0))[1]  # a continuation: output tokens made before
        prompt_tokens = len(prompt.split()) + done
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        left = self.output_tokens - done
        count = left if max_tokens is None else min(int(max_tokens), left)
        count = max(count, 1)
        tokens = tokens_for(prompt, count, done)
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
        return Answer(
            chat=chat, prompt_tokens=prompt_tokens, count=count, tokens=tokens,
            request_id=request_id, kv_out=kv_out, usage=usage,
            model=body.get("model") or self.model,
            response_id=f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
            created=int(time.time()),
            prompt_ids=prompt_ids(body, prompt) if body.get("return_token_ids") else None,
        )
