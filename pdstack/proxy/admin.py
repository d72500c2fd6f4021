"""Authentication (client keys, the admin token with its failure limit) and the admin
API (``/admin/backends``: list, add/replace, drain/undrain, remove)."""

from __future__ import annotations

import hmac
import json
import logging

from aiohttp import web

from pdstack.proxy.backends import BackendRegistry, BackendState
from pdstack.proxy.config import ProxyConfig
from pdstack.proxy.errors import error_response
from pdstack.proxy.limits import (
    FailureLimiter,
)
from pdstack.proxy.tenants import digest

log = logging.getLogger("pdstack.proxy")


class AdminAPI:
    """Mixin of :class:`pdstack.proxy.app.Proxy`: auth and ``/admin/*``."""

    registry: BackendRegistry
    config: ProxyConfig
    admin_failures: FailureLimiter
    in_flight: int
    skip_threshold_tokens: int

    async def probe(self, backend: BackendState) -> bool:
        raise NotImplementedError

    # ------------------------------------------------------------------ auth helpers
    def _client_authorized(self, request: web.Request) -> bool:
        keys = self.config.api_keys
        named = self.config.tenant_keys
        if not keys and not named:
            return True
        token = _bearer(request)
        if named and digest(token) in named:
            return True
        return any(hmac.compare_digest(token, k) for k in keys)

    def _admin_error(self, request: web.Request) -> web.Response | None:
        token = self.config.admin_token
        if not token:
            return error_response(
                403, "admin API disabled: set PDSTACK_ADMIN_TOKEN", "permission_error"
            )
        remote = request.remote or "?"
        wait = self.admin_failures.blocked_for(remote)
        if wait > 0:
            return error_response(
                429,
                "too many failed admin authentications; retry later",
                headers={"Retry-After": str(max(1, int(wait + 0.999)))},
            )
        if not self._admin_authorized(request):
            self.admin_failures.failed(remote)
            return error_response(401, "admin token missing or wrong", "authentication_error")
        return None

    def _admin_authorized(self, request: web.Request) -> bool:
        token = self.config.admin_token
        if not token:
            return False
        given = _bearer(request) or request.headers.get("X-Admin-Token", "")
        return hmac.compare_digest(given.encode(errors="replace"), token.encode())

    # ------------------------------------------------------------------ admin API
    async def admin_list(self, request: web.Request) -> web.Response:
        if (err := self._admin_error(request)) is not None:
            return err
        data = self.registry.to_json()
        data["in_flight"] = self.in_flight
        data["skip_prefill_threshold_tokens"] = self.skip_threshold_tokens
        return web.json_response(data)

    def _named(self, request: web.Request) -> BackendState | web.Response:
        name = request.match_info["name"]
        backend = self.registry.backends.get(name)
        if backend is None:
            return error_response(404, f"no backend named {name!r}", "not_found_error")
        return backend

    async def admin_drain(self, request: web.Request) -> web.Response:
        return await self._set_drained(request, True)

    async def admin_undrain(self, request: web.Request) -> web.Response:
        return await self._set_drained(request, False)

    async def _set_drained(self, request: web.Request, drained: bool) -> web.Response:
        if (err := self._admin_error(request)) is not None:
            return err
        backend = self._named(request)
        if isinstance(backend, web.Response):
            return backend
        backend.drained = drained
        log.warning("%s backend %s", "drained" if drained else "undrained", backend.name)
        return web.json_response(backend.to_json())

    async def admin_upsert(self, request: web.Request) -> web.Response:
        if (err := self._admin_error(request)) is not None:
            return err
        try:
            spec = await request.json()
            if not isinstance(spec, dict):
                raise ValueError("body must be a JSON object")
            for key in ("name", "role", "url"):
                if not spec.get(key):
                    raise ValueError(f"missing field {key!r}")
            old = self.registry.backends.get(str(spec["name"]))
            backend = self.registry.upsert(spec)
        except (ValueError, KeyError, json.JSONDecodeError) as exc:
            return error_response(400, f"bad backend: {exc}", "invalid_request_error")
        await self.probe(backend)  # answer with its first health state
        log.warning("%s backend %s (%s)", "replaced" if old else "added", backend.name, backend.url)
        return web.json_response(backend.to_json(), status=200 if old else 201)

    async def admin_remove(self, request: web.Request) -> web.Response:
        if (err := self._admin_error(request)) is not None:
            return err
        backend = self._named(request)
        if isinstance(backend, web.Response):
            return backend
        self.registry.remove(backend.name)
        return web.json_response(backend.to_json())


def _bearer(request: web.Request) -> str:
    """The token of an ``Authorization: Bearer <token>`` header, or ``""``."""
    auth = request.headers.get("Authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else ""
