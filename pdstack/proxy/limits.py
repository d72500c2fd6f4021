"""What a client may cost the proxy: body size and read time, bytes held at once, input
checks, request ids, the per-leg time budgets, admin auth-failure rate limiting.

Memory bound (documented): a request body is at most ``max_body_bytes``, and all bodies
being read or held by requests in flight together at most ``max_body_bytes_held``
(over it: 503 + ``Retry-After``, before more of the body is read). A held body costs
about 4x its size (the bytes, the parsed JSON, one leg payload, the engine socket's
write buffer), so the proxy's RSS stays below its idle RSS + 4 x ``max_body_bytes_held``.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdstack.proxy.errors import error_response

_READ_CHUNK = 1 << 16


class BodyTooLarge(Exception):
    pass


class BodyBudgetExceeded(Exception):
    pass


@dataclass
class BodyBudget:
    """Bytes of request bodies held at once (read so far by requests in flight)."""

    limit: int
    held: int = 0

    def take(self, n: int) -> None:
        if self.held + n > self.limit:
            raise BodyBudgetExceeded
        self.held += n

    def give(self, n: int) -> None:
        self.held -= n


async def read_body(
    request: web.Request, budget: BodyBudget, max_bytes: int, timeout_s: float
) -> tuple[bytes | web.Response, int]:
    """The whole body, or the error reply (413 / 503 / 408). Returns (it, bytes taken from
    ``budget``): the caller gives them back when the request ends."""
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        return _too_large(max_bytes), 0
    taken = 0
    chunks: list[bytes] = []
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                chunk = await request.content.read(_READ_CHUNK)
                if not chunk:
                    break
                if taken + len(chunk) > max_bytes:
                    raise BodyTooLarge
                budget.take(len(chunk))
                taken += len(chunk)
                chunks.append(chunk)
    except BodyTooLarge:
        return _too_large(max_bytes), taken
    except BodyBudgetExceeded:
        response = error_response(
            503,
            "proxy is holding too many request bytes at once; retry later",
            headers={"Retry-After": "1"},
        )
        response.force_close()  # do not read the rest of this body
        return response, taken
    except TimeoutError:
        response = error_response(408, f"request body not received within {timeout_s:g}s")
        response.force_close()
        return response, taken
    except BaseException:  # the client went away (or we were cancelled) mid-body
        budget.give(taken)
        raise
    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return data, taken


def _too_large(max_bytes: int) -> web.Response:
    response = error_response(
        413, f"request body over {max_bytes} bytes (--max-body-mb)", param="body"
    )
    response.force_close()
    return response


# ------------------------------------------------------------------ request ids
MAX_REQUEST_ID = 128


def request_id(given: str | None) -> str:
    """The client's X-Request-Id when it is printable ASCII of at most 128 characters;
    otherwise a fresh one."""
    if given and len(given) <= MAX_REQUEST_ID and given.isascii() and given.isprintable():
        return given
    return uuid.uuid4().hex


# ------------------------------------------------------------------ input checks
def check_body(body: dict[str, Any], chat: bool, served: frozenset[str]) -> web.Response | None:
    """400 naming the field for a wrong type, 404 (as vLLM) for a model not served."""

    def bad(field: str, want: str) -> web.Response:
        return error_response(
            400, f"'{field}' must be {want}", "invalid_request_error", param=field
        )

    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return bad("stream", "a boolean")
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            return bad(field, "a positive integer")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return bad("messages", "a non-empty list of message objects")
        if not all(isinstance(m, dict) for m in messages):
            return bad("messages", "a non-empty list of message objects")
    else:
        prompt = body.get("prompt")
        ok = isinstance(prompt, str) or (
            isinstance(prompt, list)
            and prompt
            and (
                all(isinstance(p, str) for p in prompt)
                or set(map(type, prompt)) == {int}  # token ids (bools are not)
                or all(isinstance(p, list) for p in prompt)
            )
        )
        if not ok:
            return bad("prompt", "a string, a list of strings or a list of token ids")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return bad("stream_options", "an object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return bad("model", "a string")
    if model is not None and served and model not in served:
        return error_response(
            404, f"The model `{model}` does not exist.", "NotFoundError", param="model"
        )
    return None


# ------------------------------------------------------------------ leg budgets
@dataclass(frozen=True)
class LegBudget:
    """Seconds a leg may take before its answer (prefill) or first byte (decode):
    ``base_s + per_1k_tokens_s * prompt_tokens / 1000``, prompt tokens estimated from
    characters. Defaults: 6 k tokens -> 30 s, far above a loaded H200's prefill of it
    (about a second) and far below the old 300 s a hung engine held a request for."""

    base_s: float = 15.0
    per_1k_tokens_s: float = 2.5
    chars_per_token: float = 4.0

    def for_chars(self, chars: int) -> float:
        tokens = chars / self.chars_per_token
        return self.base_s + self.per_1k_tokens_s * math.ceil(tokens) / 1000


# ------------------------------------------------------------------ admin failures
class FailureLimiter:
    """At most ``limit`` failed admin authentications per client address per
    ``window_s``; beyond that the address gets 429 until the window has passed."""

    def __init__(self, limit: int = 10, window_s: float = 60.0) -> None:
        self.limit = limit
        self.window_s = window_s
        self._failures: dict[str, list[float]] = {}

    def _recent(self, key: str, now: float) -> list[float]:
        times = [t for t in self._failures.get(key, []) if now - t < self.window_s]
        if times:
            self._failures[key] = times
        else:
            self._failures.pop(key, None)
        return times

    def blocked_for(self, key: str) -> float:
        """Seconds until ``key`` may try again (0 = now)."""
        now = time.monotonic()
        times = self._recent(key, now)
        if len(times) < self.limit:
            return 0.0
        return max(0.0, times[-self.limit] + self.window_s - now)

    def failed(self, key: str) -> None:
        now = time.monotonic()
        times = self._recent(key, now)
        times.append(now)
        self._failures[key] = times[-self.limit :]
        if len(self._failures) > 10_000:  # forget the oldest addresses
            for old in list(self._failures)[:5_000]:
                del self._failures[old]
