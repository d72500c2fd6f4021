"""``pdstack bench --tenant NAME:SHARE``: several tenants at once, each with its own key,
its own share of the asked rate and its own prompt mix (its own workload seed: other
system prompts), reported per tenant (TTFT, served) in the JSON and the table.

A tenant's key comes from the environment, ``PDSTACK_BENCH_KEY_<NAME>`` (upper case,
``-`` and ``.`` as ``_``), never from argv."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

KEY_ENV_PREFIX = "PDSTACK_BENCH_KEY_"


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
