"""Session affinity: the requests of one conversation go to the same engines.

A conversation's next turn carries its whole history as the prompt prefix; the engine that
served the last turn holds that prefix in its GPU prefix cache (and its node's LMCache
tier), so sending the turn back there turns a long prefill into a cache hit. The session
is named by the ``X-Session-ID`` header or, failing that, the OpenAI ``user`` field. The
proxy hashes it onto the consistent-hash ring (bounded load, so a hot session spills
instead of overloading one engine; an unhealthy or full engine is skipped). Requests
without a session keep prefix affinity.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SESSION_HEADER = "X-Session-ID"
MAX_SESSION_CHARS = 256


def session_key(headers: Mapping[str, str], body: dict[str, Any]) -> str | None:
    """The request's session id, or None. Only printable ASCII up to 256 characters
    counts (anything else is ignored: affinity is a hint, never an error)."""
    for value in (headers.get(SESSION_HEADER), body.get("user")):
        if isinstance(value, str) and _valid(value):
            return value
    return None


def _valid(value: str) -> bool:
    return 0 < len(value) <= MAX_SESSION_CHARS and value.isascii() and value.isprintable()
