"""A lean streaming OpenAI client for load generation (aiohttp, SSE parsed by hand).

One :class:`BenchClient` holds one connection pool for all streams. Timing uses
``time.perf_counter()``; TTFT is the time from sending the request (the prefill
leg, when the client plays the P/D proxy itself) to the first event that carries a
generated token (see :func:`content_tokens`; the role announcement does not count).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdstack.bench.workload import ChatRequest

ENDPOINTS = ("chat", "completions")
_HTTP_ERROR = "http_"  # error kind of an HTTP error status: http_429, http_503, ...


@dataclass(slots=True)
class RequestResult:
    """What one request did. Times are absolute ``perf_counter`` seconds."""

    index: int
    shared: bool
    send_time: float
    prompt_tokens: int
    first_token_time: float | None = None
    end_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None  # kind, e.g. "http_503", "timeout", "disconnected"
    error_detail: str = ""
    error_time: float | None = None  # when the error (an HTTP error status: its answer) came

    @property
    def refusal_status(self) -> str | None:
        """The HTTP status of an error answer ("429", "503", ...), else None."""
        if self.error is None or not self.error.startswith(_HTTP_ERROR):
            return None
        return self.error.removeprefix(_HTTP_ERROR)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_time is not None

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.send_time

    @property
    def e2e(self) -> float | None:
        if self.end_time is None:
            return None
        return self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]


def build_body(
    req: ChatRequest, model: str, endpoint: str, ignore_eos: bool = True,
    cache_salt: str | None = None, token_ids_back: bool = True,
) -> dict[str, Any]:
    """The OpenAI request body for ``req`` (streaming, usage reported at the end).
    ``cache_salt``: vLLM's per-request prefix-cache salt (cold caches for a repeat of the
    same requests: the GPU prefix cache and vLLM's native tier key blocks by it).
    ``token_ids_back``: a token-id prompt asks vLLM's ``return_token_ids`` (each event's
    tokens counted exactly); off, the body has only OpenAI's fields and ``ignore_eos``
    (vllm-router 0.1.17's ``kv_aware`` skips its KV lookup for a field it does not model)."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if cache_salt:
        body["cache_salt"] = cache_salt
    if req.session is not None:
        body["user"] = req.session
    if isinstance(req.system, list):  # token ids: only /v1/completions takes them
        assert isinstance(req.user, list)
        if req.history:
            ids = list(req.system)
            for part in req.history:
                assert isinstance(part, list)
                ids += part
            body["prompt"] = ids + req.user
        else:
            body["prompt"] = req.system + req.user
        if token_ids_back:
            body["return_token_ids"] = True
    elif endpoint == "chat":
        messages: list[dict[str, Any]] = [{"role": "system", "content": req.system}]
        for i, part in enumerate(req.history):  # user, assistant, user, assistant, ...
            messages.append({"role": "assistant" if i % 2 else "user", "content": part})
        messages.append({"role": "user", "content": req.user})
        body["messages"] = messages
    else:
        body["prompt"] = "\n\n".join(str(p) for p in (req.system, *req.history, req.user))
    return body


def endpoint_path(endpoint: str, token_ids: bool) -> str:
    if token_ids or endpoint == "completions":
        return "/v1/completions"
    if endpoint == "chat":
        return "/v1/chat/completions"
    raise ValueError(f"unknown endpoint {endpoint!r}")


_DELTA_KEYS = ("content", "reasoning_content", "reasoning")


def content_tokens(choice: dict[str, Any]) -> int:
    """How many generated tokens one streamed choice carries (0: none).

    vLLM streams one event per token, and a token's text may be empty (the detokenizer
    holds back a partial UTF-8 character; a special token is skipped), so an event
    counts by its shape, not by non-empty text: token ids, a chat delta with content
    that is not the role announcement, or a completion's ``text`` field.
    """
    ids = choice.get("token_ids")
    if ids:
        return len(ids)
    delta = choice.get("delta")
    if delta is not None:
        if "role" in delta and not any(delta.get(k) for k in _DELTA_KEYS):
            return 0  # the opening {"role": "assistant", "content": ""}
        return 1 if any(delta.get(k) is not None for k in _DELTA_KEYS) else 0
    return 1 if choice.get("text") is not None else 0


@dataclass(eq=False)
class BenchClient:
    """Sends :class:`ChatRequest` s and streams the answers.

    ``prefill_url``: play the NIXL P/D proxy in the client (prefill leg with
    ``max_tokens: 1`` there, then the decode leg to ``base_url`` with the
    returned ``kv_transfer_params``) — the zero-overhead baseline for a proxy.
    """

    base_url: str
    model: str
    endpoint: str = "chat"
    token_ids: bool = False
    ignore_eos: bool = True
    timeout_s: float = 600.0
    prefill_url: str | None = None
    api_key: str | None = field(default=None, repr=False)
    cache_salt: str | None = None
    token_ids_back: bool = True

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        self.prefill_url = self.prefill_url.rstrip("/") if self.prefill_url else None
        self.path = endpoint_path(self.endpoint, self.token_ids)
        self.timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=10)
        self.headers = {"Content-Type": "application/json"}
        if self.api_key:
            self.headers["Authorization"] = f"Bearer {self.api_key}"
        self._session: aiohttp.ClientSession | None = None
        self._prefix = uuid.uuid4().hex[:12]

    async def __aenter__(self) -> BenchClient:
        self.session()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=None)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self.timeout, skip_auto_headers=("User-Agent",)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(
        self, req: ChatRequest, sink: list[RequestResult] | None = None
    ) -> RequestResult:
        """Send ``req`` and stream the answer. The result goes into ``sink`` at once,
        so a request cancelled midway still leaves its partial result there."""
        body = build_body(req, self.model, self.endpoint, self.ignore_eos, self.cache_salt,
                          self.token_ids_back)
        result = RequestResult(req.index, req.shared, time.perf_counter(), req.prompt_len)
        if sink is not None:
            sink.append(result)
        headers = dict(self.headers)
        headers["X-Request-Id"] = f"bench-{self._prefix}-{req.index}"
        if req.session is not None:
            headers["X-Session-ID"] = req.session
        try:
            if self.prefill_url is not None:
                kv = await self._prefill(body, headers)
                if kv is None:
                    result.error = "prefill_no_kv_params"
                    return result
                body["kv_transfer_params"] = kv
            await self._stream(body, headers, result)
        except asyncio.CancelledError:
            result.error = result.error or "cancelled"
            raise
        except _HTTPError as exc:
            result.error, result.error_detail = f"{_HTTP_ERROR}{exc.status}", exc.text
        except TimeoutError:
            result.error = "timeout"
        except aiohttp.ClientConnectorError as exc:
            result.error, result.error_detail = "connect", str(exc)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
            result.error, result.error_detail = "disconnected", str(exc)
        except aiohttp.ClientError as exc:
            result.error, result.error_detail = "client_error", f"{type(exc).__name__}: {exc}"
        except (ValueError, KeyError, TypeError) as exc:  # bad JSON or shape
            result.error, result.error_detail = "bad_response", f"{type(exc).__name__}: {exc}"
        if result.error is not None and result.error_time is None:
            result.error_time = time.perf_counter()
        return result

    async def _prefill(self, body: dict[str, Any], headers: dict[str, str]) -> Any:
        assert self.prefill_url is not None
        leg = dict(body)
        leg.pop("stream_options", None)
        leg.update(
            stream=False,
            max_tokens=1,
            kv_transfer_params={
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        )
        async with self.session().post(
            self.prefill_url + self.path, json=leg, headers=headers
        ) as resp:
            if resp.status != 200:
                raise _HTTPError(resp.status, (await resp.text())[:200])
            return (await resp.json()).get("kv_transfer_params")

    async def _stream(
        self, body: dict[str, Any], headers: dict[str, str], result: RequestResult
    ) -> None:
        url = self.base_url + self.path
        usage_tokens: int | None = None
        counted = 0
        try:
            async with self.session().post(
                url, data=json.dumps(body), headers=headers
            ) as resp:
                if resp.status != 200:
                    result.error_time = time.perf_counter()
                    text = await resp.text()
                    result.error, result.error_detail = f"{_HTTP_ERROR}{resp.status}", text[:300]
                    return
                buf = b""
                done = False
                async for chunk in resp.content.iter_any():
                    now = time.perf_counter()
                    buf += chunk
                    if b"\r" in buf:
                        buf = buf.replace(b"\r\n", b"\n")
                    while True:
                        cut = buf.find(b"\n\n")
                        if cut < 0:
                            break
                        event, buf = buf[:cut], buf[cut + 2 :]
                        for line in event.split(b"\n"):
                            if not line.startswith(b"data:"):
                                continue
                            data = line[5:].strip()
                            if data == b"[DONE]":
                                done = True
                                continue
                            obj = json.loads(data)
                            if "error" in obj and not obj.get("choices"):
                                result.error = "stream_error"
                                result.error_detail = str(obj["error"])[:300]
                                return
                            usage = obj.get("usage")
                            if usage and usage.get("completion_tokens") is not None:
                                usage_tokens = int(usage["completion_tokens"])
                                if usage.get("prompt_tokens"):
                                    result.prompt_tokens = int(usage["prompt_tokens"])
                            n = 0
                            for choice in obj.get("choices") or ():
                                n += content_tokens(choice)
                            if n:
                                if result.first_token_time is None:
                                    result.first_token_time = now
                                result.chunk_times.append(now)
                                counted += n
                if not done:
                    result.error = "truncated"
                    result.error_detail = "stream ended without [DONE]"
        finally:
            result.output_tokens = usage_tokens if usage_tokens is not None else counted
        result.end_time = time.perf_counter()
        if result.first_token_time is None and result.error is None:
            result.error = "empty"


class _HTTPError(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status
        self.text = text


async def first_model(base_url: str, timeout_s: float = 10.0) -> str:
    """The id of the first model in ``GET /v1/models``."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(base_url.rstrip("/") + "/v1/models") as resp,
    ):
        resp.raise_for_status()
        data = await resp.json()
    models = data.get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])


def api_key_from_env() -> str | None:
    return os.environ.get("OPENAI_API_KEY") or None
