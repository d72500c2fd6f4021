"""One request's state as it goes through the proxy (:class:`RequestContext`): what the
client sent, what the proxy decided about it, and what its legs learned. Its own module so
that the legs (:mod:`pdstack.proxy.legs`) and stream migration (:mod:`pdstack.proxy.migration`)
both read it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdstack.proxy.backends import BackendState
from pdstack.proxy.tenants import Ticket


@dataclass
class RequestContext:
    request_id: str
    path: str
    body: dict[str, Any]
    raw: bytes
    stream: bool
    started: float
    route: str = "pd"
    text: str | None = None
    blocks: list[int] | None = None  # its prompt's block hashes (flows._hashes: once)
    outcome: str = "ok"
    # the client's stream has its end (data: [DONE]): a disconnect after it is not a
    # client_disconnect (a client may close as soon as it reads [DONE])
    answered: bool = False
    session: str | None = None  # session affinity key (X-Session-ID header or `user`)
    tokens: int = 0  # prompt tokens (exact for token-id prompts, else estimated)
    upstream_headers: dict[str, str] = field(default_factory=dict)
    budget_s: float = 30.0  # prefill answer / first decode byte
    # the prefill leg's usage.prompt_tokens_details.cached_tokens (P/D: what the client
    # is told, the decoder having got the whole prompt's KV from the prefiller)
    cached_tokens: int | None = None
    trace: Any = None  # tracing.RequestTrace while traced
    ticket: Ticket | None = None  # its tenant's share (pdstack.proxy.tenants); None: no tenants
    # P/D: the prefiller whose KV the decode leg reads, counted in its in_flight until that
    # leg's first byte (a drain waits for the pull, not only for the prefill answer)
    kv_source: BackendState | None = None
    migratable: bool | None = None  # its stream may migrate (pdstack.proxy.migration); once

    def release_kv_source(self) -> None:
        """The decode leg has its first byte (or ended): the prefiller is free of it."""
        if self.kv_source is not None:
            self.kv_source.in_flight -= 1
            self.kv_source = None
