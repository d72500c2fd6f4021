"""``pdstack bench --tenant NAME:SHARE``: several tenants at once, each with its own key,
its own share of the asked rate and its own prompt mix (its own workload seed: other
system prompts), reported per tenant (TTFT, served, output tokens/s) in the JSON and the
table. Against a pdstack proxy with KV admission, also each tenant's engine time (the
proxy's ``pdstack_proxy_tenant_engine_seconds_total``, read before and after the point,
warm-up included) and its share of all tenants' engine time: what a flooding tenant paid.

A tenant's key comes from the environment, ``PDSTACK_BENCH_KEY_<NAME>`` (upper case,
``-`` and ``.`` as ``_``), never from argv."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdstack.proxy.tenants import digest, key_tenant_name

KEY_ENV_PREFIX = "PDSTACK_BENCH_KEY_"
ENGINE_SECONDS = "pdstack_proxy_tenant_engine_seconds_total"


@dataclass(frozen=True)
class BenchTenant:
    name: str
    share: float

    @property
    def key_env(self) -> str:
        return KEY_ENV_PREFIX + re.sub(r"[^A-Z0-9]", "_", self.name.upper())

    def key(self) -> str | None:
        return os.environ.get(self.key_env) or None


def parse_tenant(text: str) -> BenchTenant:
    """``NAME:SHARE`` (SHARE > 0, the tenant's part of each asked rate)."""
    name, _, share = text.partition(":")
    try:
        value = float(share)
    except ValueError:
        value = -1.0
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", name) or not value > 0:
        raise ValueError(f"--tenant {text!r}: want NAME:SHARE (e.g. acme:3), SHARE > 0")
    return BenchTenant(name, value)


def split_rate(tenants: list[BenchTenant], rate: float) -> list[float]:
    total = sum(t.share for t in tenants)
    return [rate * t.share / total for t in tenants]


async def engine_seconds(target: str) -> dict[str, float] | None:
    """Engine seconds per tenant label from the proxy at ``target`` (None: not a pdstack
    proxy with KV admission and tenants, or unreachable)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s, \
                s.get(f"{target.rstrip('/')}/metrics") as r:  # fmt: skip
            text = await r.text() if r.status == 200 else ""
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(ENGINE_SECONDS + r'\{tenant="([^"]+)"\} (\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out if out or ENGINE_SECONDS.removesuffix("_total") in text else None


def engine_time(
    tenants: list[BenchTenant], before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, dict[str, Any]]:
    """Each bench tenant's engine seconds over the point and its share of all tenants'
    (the proxy's label: the tenant's name, else its key's ``key-...`` tenant)."""
    if before is None or after is None:
        return {}
    spent = {k: v - before.get(k, 0.0) for k, v in after.items()}
    total = sum(spent.values())
    out: dict[str, dict[str, Any]] = {}
    for t in tenants:
        key = t.key()
        label = t.name if t.name in spent or key is None else key_tenant_name(digest(key))
        seconds = spent.get(label, 0.0)
        out[t.name] = {"engine_seconds": round(seconds, 3),
                       "engine_time_share": round(seconds / total, 4) if total else None}
    return out

