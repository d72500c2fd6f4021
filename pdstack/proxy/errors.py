"""OpenAI error JSON for every error a client sees: the proxy's own and the engines'.

Shape: ``{"error": {"message", "type", "param", "code"}}`` (``code`` = the HTTP status).
One vocabulary, OpenAI's: ``type`` is one of :data:`OPENAI_TYPES` and follows from the
HTTP status (:data:`ERROR_TYPES`). vLLM names its types after its exception classes
(``BadRequestError``, ``NotFoundError``, ...); :func:`engine_error` rewrites an engine's
error body into this shape (same message, param and status), so a client handles one set
of ``type`` values whichever part answered.
Three places produce replies without a handler of ours: aiohttp's router (404, 405),
its body-size check (413) and its HTTP parser (400 for a bad request line or header, 500
for an unhandled exception). :func:`openai_errors` (a middleware) covers the first two;
:class:`JsonErrorHandler` (the connection protocol) the parser's, and it also times out
request heads that arrive too slowly.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

log = logging.getLogger("pdstack.proxy")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


# every ``type`` a client can see (OpenAI's API reference and its Python client)
OPENAI_TYPES = frozenset({*ERROR_TYPES.values(), "server_error", "not_found_error"})

# the status an error ``type`` comes with, for an engine's error event that names no
# ``code`` (its HTTP status was 200): vLLM's names (its exception classes) and OpenAI's
TYPE_STATUS = {
    "BadRequestError": 400,
    "UnauthorizedError": 401,
    "NotFoundError": 404,
    "UnprocessableEntityError": 422,
    "InternalServerError": 500,
    "NotImplementedError": 501,
    "ServiceUnavailableError": 503,
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "timeout_error": 408,
    "rate_limit_error": 429,
    "server_error": 500,
}


def describe_failure(exc: BaseException, timeout: float | None = None) -> str:
    """A transport failure or timeout of an upstream leg, for its error message."""
    if isinstance(exc, TimeoutError):
        return f"timed out after {timeout:g}s" if timeout is not None else "timed out"
    text = str(exc)
    return f"{exc.__class__.__name__}: {text}" if text else exc.__class__.__name__


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def openai_type(given: object, status: int) -> str:
    """``given`` when it is OpenAI's, else the type of ``status`` (vLLM's class names,
    e.g. ``NotFoundError`` / ``BadRequestError``, map to ``not_found_error`` /
    ``invalid_request_error`` through the status they come with)."""
    return given if isinstance(given, str) and given in OPENAI_TYPES else error_type(status)


def error_body(
    message: str, err_type: str, code: int | str | None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def engine_error(status: int, data: bytes) -> bytes:
    """An engine's error reply (status >= 400) as the proxy's own error JSON: vLLM's
    ``{"error": {...}}`` and its older flat ``{"object": "error", "message": ...}`` keep
    their message and param; a body that is no JSON object (a plain-text 500 from the
    engine's web server) becomes the message."""
    message: object = None
    param: object = None
    given: object = None
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        doc = None
    if isinstance(doc, dict):
        inner = doc.get("error")
        fields = inner if isinstance(inner, dict) else doc
        message, param, given = fields.get("message"), fields.get("param"), fields.get("type")
        if message is None and isinstance(inner, str):
            message = inner
    if not isinstance(message, str) or not message:
        text = data[:2000].decode(errors="replace").strip()
        message = text or f"engine answered {status}"
    body = error_body(
        message, openai_type(given, status), status, param if isinstance(param, str) else None
    )
    return json.dumps(body).encode()


def error_event_status(payload: bytes) -> int | None:
    """The HTTP status an engine's SSE error event stands for (the stream itself was
    answered 200: vLLM's error during generation, e.g. a failed NIXL KV pull, is
    ``{"error": {"message", "type", "param", "code"}}``): its ``code`` when that is an
    error status, else its ``type``'s (:data:`TYPE_STATUS`), else 500. None when
    ``payload`` (an event's JSON) is no error: neither that shape, nor vLLM's
    ``{"error": "..."}``, nor its older flat ``{"object": "error", ...}``."""
    try:
        doc = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict):
        return None
    inner = doc.get("error")
    if isinstance(inner, dict):
        fields = inner
    elif isinstance(inner, str) or doc.get("object") == "error":
        fields = doc
    else:
        return None
    code = fields.get("code")
    if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600:
        return code
    given = fields.get("type")
    return TYPE_STATUS.get(given, 500) if isinstance(given, str) else 500


def engine_error_event(status: int, payload: bytes) -> bytes:
    """An engine's SSE error event (``payload``: its JSON; ``status``: what it stands
    for, :func:`error_event_status`) as the proxy's own (:func:`engine_error`): its
    ``data:`` line, without the blank line that ends the event."""
    return b"data: " + engine_error(status, payload)


def error_response(
    status: int,
    message: str,
    err_type: str | None = None,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> web.Response:
    body = error_body(message, openai_type(err_type, status), status, param)
    return web.json_response(body, status=status, headers=headers)


def error_event(message: str, code: int = 502) -> bytes:
    payload = json.dumps(error_body(message, "server_error", code))
    return b"data: " + payload.encode() + b"\n\ndata: [DONE]\n\n"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own HTTP errors (no route, wrong method, body too large) as OpenAI JSON."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        message = exc.text or exc.reason
        if exc.status == 404:
            message = f"no route {request.method} {request.path}"
        elif exc.status == 405:
            message = f"method {request.method} not allowed on {request.path}"
        return error_response(exc.status, message, headers=headers)


class JsonErrorHandler(RequestHandler):
    """aiohttp's connection protocol with OpenAI JSON error replies and a head timeout:
    a request head (line + headers) must be complete within ``header_timeout`` of its
    first byte, else the connection is closed."""

    header_timeout: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def _waiting_for_head(self) -> bool:
        # no handler running (it reads its body and writes its answer meanwhile), no
        # parsed request queued: bytes arriving now belong to the next request head
        return not (self._request_in_progress or self._messages or self._upgraded)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self.header_timeout > 0 and self._waiting_for_head():
            self._head_timer = self._loop.call_later(self.header_timeout, self._head_expired)
        super().data_received(data)
        if self._head_timer is not None and not self._waiting_for_head():
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._waiting_for_head() and self.transport is not None:
            log.info("closing a connection whose request head took over %gs", self.header_timeout)
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error reply")
        if status >= 500:
            text = "internal proxy error"
        else:
            text = message or (str(exc) if exc is not None else "") or "bad request"
        resp = error_response(status, text)
        resp.force_close()
        return resp


class JsonErrorServer(web.Server):
    """``web.Server`` whose connections are :class:`JsonErrorHandler`."""

    def __init__(self, *args: Any, header_timeout: float = 10.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout

    def __call__(self) -> RequestHandler:
        try:
            handler = JsonErrorHandler(self, loop=self._loop, **self._kwargs)
        except TypeError:  # aiohttp signature drift: fall back to plain errors
            return super().__call__()
        handler.header_timeout = self.header_timeout
        return handler


class ProxyRunner(web.AppRunner):
    """An AppRunner serving through :class:`JsonErrorServer`."""

    def __init__(self, app: web.Application, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout = header_timeout

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # rebuild it as our subclass with the same handler, factory and settings
        ours = JsonErrorServer.__new__(JsonErrorServer)
        ours.__dict__.update(server.__dict__)
        ours.header_timeout = self._header_timeout
        return ours
