"""A vLLM plugin: with an engine key set (``VLLM_API_KEY``, or ``--api-key``), every route of
the engine's API server needs it (``Authorization: Bearer KEY``), not only ``/v1/*``.

vLLM's own check (``--api-key`` / ``VLLM_API_KEY``: ``AuthenticationMiddleware``, vLLM 0.32
``vllm/entrypoints/serve/middleware/authenticate.py``) guards the paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere`` only: ``POST /invocations`` (a full generation, SageMaker's),
``/tokenize``, ``/detokenize``, ``/pooling``, ``/classify``, ``/score``, ``/rerank``,
``/scale_elastic_ep``, ``/reset_prefix_cache`` and, in dev mode, ``/sleep`` and
``/collective_rpc`` answered any process that reaches the engine's port (with host networking:
every process of the node), around the proxy's client keys and tenant limits (issue 54).

This plugin puts one more pure-ASGI middleware outermost on the API server's app: a request
without the key gets 401 on every path and method except ``GET``/``HEAD`` of
:data:`OPEN_PATHS`: ``/health`` (the proxy's probe, the container healthcheck and
``pdstack launch``'s readiness wait send none) and ``/metrics`` (read-only counters that
Prometheus, which holds no secret by design, and ``pdstack upgrade``'s capacity check scrape
without a key). A websocket without the key is closed before it is accepted (code 1008).

It is installed on the class, not on one vLLM function: ``fastapi.FastAPI.build_middleware_stack``
(which Starlette calls once, at an app's first request or lifespan event) is wrapped, so it
holds wherever a vLLM version builds its app (0.26.0 ``vllm/entrypoints/openai/api_server.py``,
0.32 ``vllm/entrypoints/launchers/app.py``). vLLM loads ``vllm.general_plugins`` entry points in
its API server process while it parses its arguments (``AsyncEngineArgs.add_cli_args``),
before any app exists. After wrapping, a self-test builds a FastAPI app and checks that a
request without the key gets 401, one with it reaches the route and ``/health`` needs none. If
the key is set and any of that fails, ``register`` raises ``SystemExit``: the engine does not
start rather than run with its other routes open.

Standalone (stdlib, plus FastAPI/Starlette where vLLM runs), loaded as
``pdstack.vllm_engine_auth`` through its entry point in ``pdstack/vllm_plugins/``: ``pdstack
launch`` and the Compose stacks ship it beside :mod:`pdstack.vllm_offload_fix` (its
:func:`plugin_files`).
``VLLM_PLUGINS`` names the plugins vLLM loads: ``VLLM_PLUGINS=none`` turns this one off too
(``VLLM_PLUGINS=pdstack_engine_auth`` keeps only this one).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import secrets
import sys
import threading
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any

# a child of vLLM's own logger, so the line is in the engine's log with vLLM's
log = logging.getLogger("vllm.pdstack_engine_auth")

KEY_ENV = "VLLM_API_KEY"
KEY_OPTION = "--api-key"
OPEN_PATHS = ("/health", "/metrics", "/metrics/")
OPEN_METHODS = ("GET", "HEAD")
PLUGIN_NAME = "pdstack_engine_auth"
_MARK = "__pdstack_engine_auth__"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def engine_keys(environ: Mapping[str, str], argv: Sequence[str]) -> list[str]:
    """The keys the engine accepts, as vLLM picks them: ``--api-key`` values on the command
    line (``--api-key K [K ...]``, ``--api-key=K``, ``--api_key``, repeated) if any, else
    ``VLLM_API_KEY``; empty values are ignored. [] = no key: vLLM and this plugin check none."""
    keys: list[str] = []
    taking = False
    for arg in argv:
        option, eq, value = arg.partition("=")
        if option.startswith("--"):
            option = option.replace("_", "-")
            # argparse also takes an unambiguous abbreviation (--api-k)
            taking = len(option) > len("--api-") and KEY_OPTION.startswith(option)
            if taking and eq:
                keys.append(value)
                taking = False
            continue
        if taking:
            if arg.startswith("-") and arg != "-":
                taking = False
            else:
                keys.append(arg)
    keys = [k for k in keys if k]
    if keys:
        return keys
    env = environ.get(KEY_ENV, "")
    return [env] if env else []


def open_without_key(method: str, path: str, root_path: str = "") -> bool:
    """True for what answers without the key: GET/HEAD of ``/health`` and ``/metrics`` (with
    or without the app's root path in front); every other method and path needs it."""
    if method.upper() not in OPEN_METHODS:
        return False
    return any(path == p or (root_path and path == root_path + p) for p in OPEN_PATHS)


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class EngineAuth:
    """Pure ASGI middleware: 401 (websocket: closed, 1008) for a request without one of
    ``keys`` as its bearer token, unless :func:`open_without_key`; lifespan passes."""

    def __init__(self, app: ASGIApp, keys: Sequence[str]) -> None:
        if not keys:
            raise ValueError("EngineAuth needs at least one key")
        self.app = app
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def allows(self, scope: Scope) -> bool:
        if scope["type"] not in ("http", "websocket"):
            return True
        method = scope.get("method", "GET") if scope["type"] == "http" else "WEBSOCKET"
        if open_without_key(method, scope.get("path", ""), scope.get("root_path", "")):
            return True
        token = _bearer(scope)
        if token is None:
            return False
        digest = hashlib.sha256(token.encode()).digest()
        ok = False
        for want in self._digests:  # no early exit: same time for every key
            ok |= hmac.compare_digest(digest, want)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allows(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({
            "type": "http.response.start",
            "status": 401,
            "headers": [(b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode()),
                        (b"www-authenticate", b"Bearer")],
        })
        await send({"type": "http.response.body", "body": body})


def _call(app: ASGIApp, method: str, path: str, token: str | None) -> int:
    """The status ``app`` answers to one HTTP request (run on its own event loop)."""
    headers = [(b"host", b"localhost")]
    if token is not None:
        headers.append((b"authorization", b"Bearer " + token.encode()))
    scope: Scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": b"", "headers": headers, "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80), "state": {},
    }
    status: list[int] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            status.append(int(message["status"]))

    async def main() -> None:
        await app(scope, receive, send)

    asyncio.run(main())
    return status[0] if status else 0


def self_test(keys: Sequence[str]) -> None:
    """A fresh FastAPI app (so the wrapped class) answers 401 to ``/probe`` without a key,
    200 with one, and ``/health`` without one reaches its route; raises RuntimeError if not.
    Runs in a thread of its own (the caller's thread may have an event loop running)."""
    import fastapi  # type: ignore[import-not-found,unused-ignore]  # vLLM's environment

    app = fastapi.FastAPI()
    app.add_api_route("/probe", lambda: {"ok": True}, methods=["GET", "POST"])
    app.add_api_route("/health", lambda: {"ok": True}, methods=["GET"])
    wrong = secrets.token_hex(16)
    cases = [("POST", "/probe", None, 401), ("GET", "/probe", wrong, 401),
             ("GET", "/probe", keys[0], 200), ("GET", "/health", None, 200)]
    got: list[int] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            got.extend(_call(app, m, p, t) for m, p, t, _ in cases)
        except BaseException as exc:  # reported below, in the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="pdstack-engine-auth-self-test", daemon=True)
    thread.start()
    thread.join(30)
    if failed:
        raise RuntimeError(f"self-test raised {failed[0].__class__.__name__}: {failed[0]}")
    want = [c[3] for c in cases]
    if got != want:
        said = ", ".join(f"{m} {p} {'with' if t else 'without'} key: {s}"
                         for (m, p, t, _), s in zip(cases, got, strict=False))
        raise RuntimeError(f"self-test: a FastAPI app answered {said or 'nothing'}"
                           f" (want {want})")


def install(keys: Sequence[str]) -> None:
    """Wrap ``fastapi.FastAPI.build_middleware_stack`` so every app built from then on has
    :class:`EngineAuth` outermost (idempotent: a second call replaces the keys), then
    :func:`self_test`."""
    import fastapi  # type: ignore[import-not-found,unused-ignore]  # vLLM's environment

    cls: Any = fastapi.FastAPI
    current = cls.build_middleware_stack
    holder: list[Sequence[str]] | None = getattr(current, _MARK, None)
    if holder is not None:
        holder[0] = list(keys)
    else:
        original = current
        held: list[Sequence[str]] = [list(keys)]

        def build_middleware_stack(self: Any) -> Any:
            return EngineAuth(original(self), held[0])

        setattr(build_middleware_stack, _MARK, held)
        build_middleware_stack.__wrapped__ = original  # type: ignore[attr-defined]
        cls.build_middleware_stack = build_middleware_stack
    self_test(keys)


def register() -> None:
    """The ``vllm.general_plugins`` entry point. No key: nothing to do. A key and the check
    cannot be installed: SystemExit (not an Exception: no plugin loader swallows it), so the
    engine never serves its non-``/v1`` routes without the key."""
    keys = engine_keys(os.environ, sys.argv)
    if not keys:
        log.debug("pdstack engine auth: no %s, no key to check", KEY_ENV)
        return
    try:
        install(keys)
    except Exception as exc:
        why = (f"pdstack engine auth: cannot make every route need the engine key "
               f"({exc.__class__.__name__}: {exc}); not starting an engine whose routes"
               f" outside /v1 would answer without {KEY_ENV}")
        log.critical("%s", why)
        raise SystemExit(why) from exc
    log.info("pdstack engine auth: every route but GET %s needs the engine key",
             " and GET ".join(p for p in OPEN_PATHS if not p.endswith("/")))
