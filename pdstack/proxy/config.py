"""Proxy settings and secrets.

Secrets never come from argv: the admin token and client API keys are read from the
environment, which an env file (``KEY=VALUE`` lines, ``#`` comments) may fill in:
- ``PDSTACK_ADMIN_TOKEN``: required for ``/admin/*`` (without it the admin API answers 403).
- ``PDSTACK_API_KEYS``: comma-separated client keys; when set, ``/v1/*`` needs
  ``Authorization: Bearer <key>``.
- ``PDSTACK_TENANT_KEYS``: named client keys, ``TENANT:KEY`` comma-separated (see
  :mod:`pdstack.proxy.tenants`); when set, ``/v1/*`` needs one of them (or of
  ``PDSTACK_API_KEYS``, each of whose keys is its own tenant, ``key-<sha256 prefix>``).
- ``VLLM_API_KEY``: the engines' key. vLLM reads it from the environment (the engines' and
  the proxy's own secrets files both hold it: :mod:`pdstack.secrets`), so with it set every
  engine refuses requests without it, and the proxy sends it to the engines (both legs,
  ``/v1/models``) as ``Authorization: Bearer``. ``PDSTACK_ENGINE_API_KEY`` is the older
  name (used when ``VLLM_API_KEY`` is not set).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pdstack.proxy.admission_config import AdmissionConfig
from pdstack.proxy.kv_events_route import KvEventsConfig
from pdstack.proxy.tenants import TENANT_KEYS_ENV, TenantPolicy, parse_tenant_keys
from pdstack.secrets import (
    ADMIN_TOKEN_ENV,
    API_KEYS_ENV,
    ENGINE_API_KEY_ENV,
    LEGACY_ENGINE_API_KEY_ENV,
)

MIB = 1 << 20


@dataclass
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # admission
    max_concurrency: int = 2048  # counted once the body is read
    retry_after_s: int = 1
    # clients (pdstack.proxy.limits): body size, bytes held at once, read timeouts
    max_body_bytes: int = 8 * MIB
    max_body_bytes_held: int = 64 * MIB
    header_timeout_s: float = 10.0  # request line + headers, from their first byte
    body_timeout_s: float = 30.0  # the whole body, from the end of the head
    idle_timeout_s: float = 60.0  # a kept-alive connection with no request
    admin_auth_failures_per_min: int = 10  # per client address, then 429
    # KV-aware admission (off unless enabled: ``--admission kv``)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    # routing
    prefix_chars: int = 1024  # leading characters hashed for prefill affinity
    load_factor: float = 1.25  # bounded-load factor c (>= 1)
    skip_prefill_threshold_tokens: int | None = None  # None = the backend table's value
    chars_per_token: float = 4.0  # the proxy does not tokenize; it estimates
    index_block_chars: int = 256
    index_capacity: int = 200_000
    # the engines' KV events (pdstack.proxy.kv_events_route): colocated requests routed by
    # what each engine holds; off without sources (the backend table's ``kv_events``)
    kv_events: KvEventsConfig = field(default_factory=lambda: KvEventsConfig(enabled=False))
    # health
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    eject_after: int = 3
    readmit_after: int = 2  # passing probes: ejected -> half-open
    # a backend out of rotation (never admitted yet, or ejected; not a wedged one, whose
    # re-admission needs a generation) is probed this often between health rounds, so a
    # restarted engine is routable again about readmit_after x this after its /health passes
    # (with health_interval_s alone: 2.6 s on the CPU stack); 0 = health rounds only
    readmit_interval_s: float = 0.5
    close_after: int = 2  # successful legs: half-open -> closed
    # wedged engines (pdstack.proxy.progress): a leg waiting this long with no answer from
    # its backend since makes it a suspect (0 = off), confirmed by a 1-token generation
    # that must answer within wedge_probe_timeout_s
    wedge_after_s: float = 5.0
    wedge_probe_timeout_s: float = 5.0
    # no usable prefiller (of any generation with usable decoders): decoders serve whole
    # requests themselves (they compute the prompt)
    decode_fallback: bool = True
    # retries and timeouts (per leg)
    max_retries: int = 2
    # a stream whose leg fails mid-stream goes on on another engine of the same role and
    # generation at most this often (pdstack.proxy.migration); 0 = off (an error event)
    max_migrations: int = 2
    # an engine with such streams that sends nothing this long has its /health probed: no
    # answer within stall_probe_timeout_s = frozen, its streams migrate now (it is not
    # ejected for it: pdstack.proxy.migration_stall); 0 = off
    stall_probe_after_s: float = 0.25
    stall_probe_timeout_s: float = 1.0
    connect_timeout_s: float = 10.0
    # the prefill answer and the decoder's first byte: a budget from the prompt length
    # (pdstack.proxy.limits.LegBudget), unless fixed here
    leg_budget_base_s: float = 15.0
    leg_budget_per_1k_tokens_s: float = 2.5
    prefill_timeout_s: float | None = None
    decode_first_byte_timeout_s: float | None = None
    stream_idle_timeout_s: float = 60.0
    # non-streaming decode leg (the whole response): the budget + this per max_tokens,
    # at most request_timeout_s
    unary_per_token_s: float = 0.25
    request_timeout_s: float = 900.0
    # lmcache-pd: the ZMQ PULL socket for LMCache's ProxyNotif (None = the backend
    # table's ``lmcache_pd_notify``; host None there = ``host``) and the bounded wait
    lmcache_pd_notify_host: str | None = None
    lmcache_pd_notify_port: int | None = None
    lmcache_pd_notify_timeout_s: float = 5.0
    # the engines run vLLM's priority scheduling (the backend table's ``engine_priority``):
    # each request's ``priority`` is its tenant's class rank (interactive 0 before batch 1)
    engine_priority: bool = False
    # tenants (pdstack.proxy.tenants): policies by name (the backend table's ``tenants``)
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)
    tenant_window_s: float = 60.0  # the rpm / tpm window (tests shorten it)
    # secrets
    tenant_keys: dict[str, str] = field(default_factory=dict, repr=False)  # sha256 -> tenant
    admin_token: str | None = field(default=None, repr=False)
    api_keys: frozenset[str] = field(default_factory=frozenset, repr=False)
    engine_api_key: str | None = field(default=None, repr=False)


def read_env_file(path: str | Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for raw in Path(path).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, value = line.split("=", 1)
        key = key.strip().removeprefix("export ").strip()
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        values[key] = value
    return values


def load_secrets(
    config: ProxyConfig, env_file: str | Path | None, environ: dict[str, str] | None = None
) -> ProxyConfig:
    """Fill the secrets of ``config`` from the environment (which wins) and ``env_file``;
    ValueError for named keys that name no tenant of ``config.tenants`` or share a key."""
    env: dict[str, str] = {}
    if env_file is not None and Path(env_file).exists():
        env.update(read_env_file(env_file))
    env.update(os.environ if environ is None else environ)
    config.admin_token = env.get(ADMIN_TOKEN_ENV) or None
    config.api_keys = frozenset(
        k.strip() for k in env.get(API_KEYS_ENV, "").split(",") if k.strip()
    )
    named = env.get(TENANT_KEYS_ENV, "")
    if named.strip():
        names = {*config.tenants, "default"}
        config.tenant_keys, problems = parse_tenant_keys(named, names)
        if problems:
            raise ValueError("; ".join(problems))
    config.engine_api_key = (
        env.get(ENGINE_API_KEY_ENV) or env.get(LEGACY_ENGINE_API_KEY_ENV) or None
    )
    return config
