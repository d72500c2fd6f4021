"""Engine routes the proxy forwards as they are: ``POST /tokenize`` and ``POST /detokenize``
(vLLM's; ``vllm bench serve`` asks ``/tokenize`` to align its prompts with the server's
tokenizer), and ``GET /v1/models/{model}`` (the official ``openai`` client's
``models.retrieve``), answered from the engines' ``/v1/models``.

The request goes to one usable engine that serves the body's ``model`` (every engine of a
stack serves the stack's model: prefillers and decoders alike), decoders and colocated
engines first; a connection error, timeout or 5xx tries the next one. Errors, the proxy's
and the engine's, are OpenAI error JSON in one vocabulary (:mod:`pdstack.proxy.errors`).
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from pdstack.proxy.backends import BackendRegistry, BackendState
from pdstack.proxy.config import ProxyConfig
from pdstack.proxy.errors import engine_error, error_response
from pdstack.proxy.limits import BodyBudget, read_body
from pdstack.proxy.limits import request_id as valid_request_id

log = logging.getLogger("pdstack.proxy")

# the paths forwarded as they are (POST, JSON body with an optional ``model``)
FORWARDED = ("/tokenize", "/detokenize")
# which engines answer them first: those that serve clients' final legs
ROLE_ORDER = {"decode": 0, "colocated": 0, "prefill": 1}
# one engine's answer to a forwarded request (tokenizing a long prompt takes milliseconds)
FORWARD_TIMEOUT_S = 30.0


class EngineRoutes:
    """Mixin of :class:`pdstack.proxy.app.Proxy`: the forwarded engine routes."""

    registry: BackendRegistry
    config: ProxyConfig
    session: aiohttp.ClientSession | None
    body_budget: BodyBudget

    if TYPE_CHECKING:  # provided by AdminAPI / Proxy (no runtime stubs: they would shadow)

        def _client_authorized(self, request: web.Request) -> bool: ...
        def _auth_headers(self) -> dict[str, str]: ...
        def _served_names(self) -> frozenset[str]: ...

    def add_engine_routes(self, app: web.Application) -> None:
        for path in FORWARDED:
            app.router.add_post(path, self.handle_forward)
        app.router.add_get("/v1/models/{model:.+}", self.handle_model)

    def _engines(self) -> list[BackendState]:
        usable = [b for b in self.registry.backends.values() if b.usable]
        return sorted(usable, key=lambda b: (ROLE_ORDER.get(b.role, 2), b.standby, -b.served))

    async def handle_forward(self, request: web.Request) -> web.StreamResponse:
        if not self._client_authorized(request):
            return error_response(401, "invalid or missing API key", "authentication_error")
        rid = valid_request_id(request.headers.get("X-Request-Id"))
        rid_header = {"X-Request-Id": rid}
        config = self.config
        raw, taken = await read_body(
            request, self.body_budget, config.max_body_bytes, config.body_timeout_s
        )
        try:
            if isinstance(raw, web.Response):
                raw.headers.update(rid_header)
                return raw
            return await self._forward(request, raw, rid_header)
        finally:
            self.body_budget.give(taken)

    async def _forward(
        self, request: web.Request, raw: bytes, rid_header: dict[str, str]
    ) -> web.StreamResponse:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(400, f"body is not valid JSON: {exc}", headers=rid_header)
        if not isinstance(body, dict):
            return error_response(400, "body must be a JSON object", headers=rid_header)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            return error_response(400, "'model' must be a string", param="model",
                                  headers=rid_header)
        served = self._served_names()
        if model is not None and served and model not in served:
            return error_response(404, f"The model `{model}` does not exist.", param="model",
                                  headers=rid_header)
        headers = {"Content-Type": "application/json", **rid_header, **self._auth_headers()}
        answer = await self._first_answer("POST", request.path, raw, headers, FORWARD_TIMEOUT_S)
        if isinstance(answer, str):
            return error_response(502 if answer else 503,
                                  answer or self.registry.describe_unroutable(),
                                  headers=rid_header)
        status, data = answer
        if status >= 400:
            return web.Response(body=engine_error(status, data), status=status,
                                content_type="application/json", headers=rid_header)
        return web.Response(body=data, status=status, content_type="application/json",
                            headers=rid_header)

    async def _first_answer(
        self, method: str, path: str, data: bytes | None, headers: dict[str, str],
        timeout_s: float,
    ) -> tuple[int, bytes] | str:
        """(status, body) of the first engine that answers below 500 within ``timeout_s``;
        else the last failure as a sentence ("" when no engine was usable)."""
        assert self.session is not None
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        last = ""
        for backend in self._engines():
            try:
                async with self.session.request(
                    method, backend.url + path, data=data, headers=headers, timeout=timeout
                ) as resp:
                    body = await resp.read()
                    if resp.status < 500:
                        return resp.status, body
                    last = f"{backend.role} {backend.name} answered {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = f"{backend.role} {backend.name}: {exc.__class__.__name__} {exc}".strip()
            log.info("%s %s: %s; trying the next engine", method, path, last)
        return last

    async def engine_models(self) -> dict[str, Any] | None:
        """The engines' ``GET /v1/models`` answer (the first usable engine's), or None."""
        answer = await self._first_answer(
            "GET", "/v1/models", None, self._auth_headers(), self.config.health_timeout_s + 3
        )
        if isinstance(answer, str) or answer[0] != 200:
            return None
        try:
            doc = json.loads(answer[1])
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        return doc if isinstance(doc, dict) and isinstance(doc.get("data"), list) else None

    def model_list(self, doc: dict[str, Any] | None) -> dict[str, Any] | None:
        """``doc`` (the engines' list) or, without one, the served names as a list."""
        if doc is not None:
            return doc
        names = sorted(self._served_names())
        if not names:
            return None
        return {
            "object": "list",
            "data": [{"id": n, "object": "model", "created": 0, "owned_by": "pdstack"}
                     for n in names],
        }

    async def handle_model(self, request: web.Request) -> web.StreamResponse:
        if not self._client_authorized(request):
            return error_response(401, "invalid or missing API key", "authentication_error")
        model = request.match_info["model"]
        doc = self.model_list(await self.engine_models())
        for entry in (doc or {}).get("data", []):
            if isinstance(entry, dict) and entry.get("id") == model:
                return web.json_response(entry)
        if doc is None:
            return error_response(503, self.registry.describe_unroutable())
        return error_response(404, f"The model `{model}` does not exist.", param="model")
