"""Tenants: who a request belongs to, and what that tenant may cost the proxy.

Identity: client keys. ``PDSTACK_TENANT_KEYS`` (in the node's 0600 secrets file,
never argv or logs) lists ``TENANT:KEY`` entries, comma-separated; each tenant named
there must be one of the backend table's ``tenants`` (``pdstack_tenants`` in the
inventory). Fair out of the box: every key of the flat ``PDSTACK_API_KEYS`` that is not
a named key is its own tenant, ``key-`` + the first 10 hex digits of the key's SHA-256
(:func:`key_tenant_name`), with the ``default`` tenant's policy (weight 1, interactive,
no limits unless ``pdstack_tenants.default`` sets them); a request without a key, when
none is required, belongs to the tenant ``default``. The proxy keeps only the
SHA-256 of each key (a dict lookup of the presented key's digest: constant work per
request, whatever the number of keys). The OpenAI ``user`` field stays session affinity
only: nothing a client sends in the body changes its tenant or its limits.

Limits per tenant (each optional; over one: 429, ``Retry-After``, OpenAI error JSON with
``code: rate_limit_exceeded`` and ``param`` = the limit's name):
- ``max_concurrency``: the tenant's requests in the proxy at once (queued or running);
- ``max_queued``: of those, the ones held in KV admission's queue
  (:mod:`pdstack.proxy.admission`; only with ``--admission kv``);
- ``rpm``: requests per minute, ``tpm``: tokens per minute (prompt + ``max_tokens``
  charged on arrival, settled with the answer's real usage when it ends: its
  ``usage`` when the engine sends one, else the stream's token events). Both are token
  buckets of one minute's worth, refilled continuously: a burst of ``rpm`` requests
  passes, the next one is refused, and a full minute restores the whole allowance.

Memory: state is per configured tenant (a few counters each), never per key, client
address or request id; the key table is the secrets file's size.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web

from pdstack.proxy.errors import error_body
from pdstack.secrets import TENANT_KEYS_ENV

DEFAULT_TENANT = "default"
OTHER_LABEL = "other"  # metrics label of the tenants past MAX_LABELLED
MAX_LABELLED = 64  # per-tenant metric series: at most this many tenants + "other"
PRIORITIES = ("interactive", "batch")  # served in this order when engines are saturated
LIMITS = ("max_concurrency", "max_queued", "rpm", "tpm")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_NAME = re.compile(NAME_PATTERN)
_USAGE = re.compile(rb'"(prompt|completion)_tokens"\s*:\s*(\d+)')


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_tenant_name(key_digest: str) -> str:
    """The tenant of a plain ``PDSTACK_API_KEYS`` key, from its SHA-256 (never the key)."""
    return "key-" + key_digest[:10]


def parse_tenant_keys(text: str, tenants: Iterable[str]) -> tuple[dict[str, str], list[str]]:
    """``TENANT:KEY,...`` -> ({sha256(key): tenant}, problems). A problem names the
    entry by position and tenant, never the key."""
    known = set(tenants)
    keys: dict[str, str] = {}
    problems: list[str] = []
    for i, entry in enumerate(e.strip() for e in text.split(",")):
        if not entry:
            continue
        name, sep, key = entry.partition(":")
        name, key = name.strip(), key.strip()
        where = f"{TENANT_KEYS_ENV} entry {i + 1}"
        if not sep or not name or not key:
            problems.append(f"{where}: want TENANT:KEY")
            continue
        if name not in known:
            problems.append(
                f"{where}: tenant {name!r} is not in pdstack_tenants "
                f"({', '.join(sorted(known)) or 'none configured'})"
            )
            continue
        h = digest(key)
        if h in keys and keys[h] != name:
            problems.append(f"{where}: the same key is also tenant {keys[h]!r}'s")
            continue
        keys[h] = name
    return keys, problems


@dataclass(frozen=True)
class TenantPolicy:
    """One tenant's settings (``pdstack_tenants.<name>``); 0 = no such limit."""

    name: str
    weight: float = 1.0
    priority: str = "interactive"
    max_concurrency: int = 0
    max_queued: int = 0
    rpm: int = 0
    tpm: int = 0

    @classmethod
    def from_spec(cls, name: str, spec: Any) -> TenantPolicy:
        """From a ``pdstack.topology.TenantSpec`` (or any object with its fields)."""
        values = {f: getattr(spec, f, None) for f in ("weight", "priority", *LIMITS)}
        return cls(name=name, **{k: v for k, v in values.items() if v is not None})

    @property
    def rank(self) -> int:
        return PRIORITIES.index(self.priority)


class Bucket:
    """A token bucket of ``limit`` per ``window_s``; O(1) state. ``level`` may go
    negative when a settlement charges more than was reserved (the debt is paid first)."""

    __slots__ = ("level", "limit", "rate", "stamp")

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit = float(limit)
        self.rate = limit / window_s
        self.level = float(limit)
        self.stamp = time.monotonic()

    def _refill(self, now: float) -> None:
        self.level = min(self.limit, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` fits (0 = now). A cost above the whole allowance fits
        once the bucket is full."""
        self._refill(now)
        need = min(cost, self.limit)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, cost: float) -> None:
        self.level -= cost

    def give(self, amount: float) -> None:
        self.level = min(self.limit, self.level + amount)


@dataclass
class TenantState:
    policy: TenantPolicy
    label: str  # the metrics label (the name, or "other")
    window_s: float
    active: int = 0  # requests in the proxy (queued or running)
    queued: int = 0  # of those, held in admission's queue
    rpm: Bucket | None = None
    tpm: Bucket | None = None
    served: int = 0  # requests answered ok (bench / tests read it)

    def __post_init__(self) -> None:
        p = self.policy
        self.rpm = Bucket(p.rpm, self.window_s) if p.rpm else None
        self.tpm = Bucket(p.tpm, self.window_s) if p.tpm else None

    @property
    def name(self) -> str:
        return self.policy.name


class RateLimited(Exception):
    """A tenant limit refused the request."""

    def __init__(self, tenant: str, limit: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.tenant = tenant
        self.limit = limit
        self.retry_after_s = retry_after_s

    def response(self, request_id: str) -> web.Response:
        retry = str(max(1, math.ceil(self.retry_after_s)))
        body = error_body(str(self), "rate_limit_error", "rate_limit_exceeded", self.limit)
        return web.json_response(
            body, status=429, headers={"Retry-After": retry, "X-Request-Id": request_id}
        )


@dataclass
class Ticket:
    """One admitted request's share of its tenant: what it charged, what it used."""

    tenant: TenantState
    charged_tokens: int
    prompt_tokens: int
    meter: UsageMeter = field(default_factory=lambda: UsageMeter())
    released: bool = False


@dataclass
class UsageMeter:
    """The answer's real token counts, read from the bytes relayed (no JSON parse on the
    hot path: one substring count per chunk; a regex only on the chunk with ``usage``)."""

    events: int = 0
    prompt: int | None = None
    completion: int | None = None

    def feed(self, data: bytes) -> bytes:
        self.events += data.count(b"data: {")
        if b'_tokens"' in data:
            for kind, value in _USAGE.findall(data):
                if kind == b"prompt":
                    self.prompt = int(value)
                else:
                    self.completion = int(value)
        return data

    def wrap(
        self, rewrite: Callable[[bytes], bytes] | None, first: bytes
    ) -> Callable[[bytes], bytes]:
        """A stream's relay hook that also meters (``first``: the event already sent)."""
        self.feed(first)
        if rewrite is None:
            return self.feed
        feed = self.feed
        return lambda data: feed(rewrite(data))

    def used(self, prompt_estimate: int) -> int:
        prompt = self.prompt if self.prompt is not None else prompt_estimate
        completion = self.completion if self.completion is not None else self.events
        return prompt + completion


@dataclass
class TenantTable:
    """Every configured tenant's state and the key -> tenant map."""

    policies: Mapping[str, TenantPolicy] = field(default_factory=dict)
    keys: Mapping[str, str] = field(default_factory=dict)  # sha256(key) -> tenant
    window_s: float = 60.0
    # PDSTACK_API_KEYS: each its own tenant unless named (never printed)
    plain_keys: Iterable[str] = field(default=(), repr=False)
    states: dict[str, TenantState] = field(init=False)
    _configured: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        policies = dict(self.policies)
        keys = dict(self.keys)
        self._configured = bool(policies or keys or self.plain_keys)
        policies.setdefault(DEFAULT_TENANT, TenantPolicy(DEFAULT_TENANT))
        for key in self.plain_keys:
            h = digest(key)
            if h not in keys:
                name = keys[h] = key_tenant_name(h)
                policies.setdefault(name, replace(policies[DEFAULT_TENANT], name=name))
        self.keys = keys
        self.policies = policies
        names = sorted(policies, key=lambda n: (n != DEFAULT_TENANT, n))
        self.states = {
            name: TenantState(
                policies[name], name if i < MAX_LABELLED else OTHER_LABEL, self.window_s
            )
            for i, name in enumerate(names)
        }

    @property
    def configured(self) -> bool:
        """Tenants or keys given: the proxy tracks tenants at all."""
        return self._configured

    def labels(self) -> list[str]:
        return sorted({s.label for s in self.states.values()})

    def lookup(self, key: str | None) -> TenantState | None:
        """The tenant of a named key (None: not a named key)."""
        if not key or not self.keys:
            return None
        name = self.keys.get(digest(key))
        return None if name is None else self.states[name]

    @property
    def default(self) -> TenantState:
        return self.states[DEFAULT_TENANT]

    def admit(self, tenant: TenantState, prompt_tokens: int, max_tokens: int) -> Ticket:
        """Charge the request to its tenant, or raise :class:`RateLimited`."""
        p = tenant.policy
        if p.max_concurrency and tenant.active >= p.max_concurrency:
            raise RateLimited(
                p.name, "max_concurrency",
                f"tenant {p.name!r} is at its max_concurrency limit ({p.max_concurrency} "
                "requests at once); retry when one has finished", 1.0,
            )  # fmt: skip
        now = time.monotonic()
        cost = prompt_tokens + max_tokens
        wait_r = tenant.rpm.wait_for(1, now) if tenant.rpm is not None else 0.0
        if wait_r > 0:
            raise RateLimited(
                p.name, "rpm",
                f"tenant {p.name!r} is over its rpm limit ({p.rpm} requests per minute); "
                f"retry in {math.ceil(wait_r)} s", wait_r,
            )  # fmt: skip
        wait_t = tenant.tpm.wait_for(cost, now) if tenant.tpm is not None else 0.0
        if wait_t > 0:
            raise RateLimited(
                p.name, "tpm",
                f"tenant {p.name!r} is over its tpm limit ({p.tpm} tokens per minute; this "
                f"request counts {cost}: prompt + max_tokens); retry in {math.ceil(wait_t)} s",
                wait_t,
            )  # fmt: skip
        if tenant.rpm is not None:
            tenant.rpm.take(1)
        if tenant.tpm is not None:
            tenant.tpm.take(cost)
        tenant.active += 1
        return Ticket(tenant, cost, prompt_tokens)

    def release(self, ticket: Ticket, served: bool) -> int:
        """The request is over: free its slot, settle its tokens with the real usage
        (what the answer says or streamed; a request that got no answer uses none).
        Returns the tokens it used."""
        if ticket.released:
            return 0
        ticket.released = True
        tenant = ticket.tenant
        tenant.active -= 1
        meter = ticket.meter
        if meter.events or meter.completion is not None:
            used = meter.used(ticket.prompt_tokens)
        else:
            used = ticket.charged_tokens if served else 0
        if served:
            tenant.served += 1
        if tenant.tpm is not None:
            delta = ticket.charged_tokens - used
            if delta > 0:
                tenant.tpm.give(delta)
            else:
                tenant.tpm.take(-delta)
        return used


def max_tokens_of(body: Mapping[str, Any]) -> int:
    value = body.get("max_tokens") or body.get("max_completion_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def tenant_note(ticket: Ticket | None) -> str:
    """``", tenant NAME"`` for a log line about the request (empty without tenants)."""
    return "" if ticket is None else f", tenant {ticket.tenant.name}"
