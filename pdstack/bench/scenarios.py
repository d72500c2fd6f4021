"""Named presets of the workload knobs (``pdstack bench --scenario NAME``).

A preset fills the knobs the command line leaves unset; an explicit flag always wins.
Without ``--scenario`` the knobs keep their historic defaults (:data:`DEFAULTS`), so
older commands and committed results keep their meaning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pdstack.bench.workload import Distribution

# knob -> value; the names are the argparse dests of ``pdstack bench``
DEFAULTS: dict[str, Any] = {
    "system_prompts": 4,
    "shared_share": 0.8,
    "system_len": "1024",
    "user_len": "uniform:32:256",
    "output_len": "uniform:64:256",
    "turns": None,
    "think_time": None,
}

# the knobs of results/h200x2 (4 shared prompts of 2-6 k tokens)
_SEED = DEFAULTS | {"system_len": "uniform:2000:6000"}

PRESETS: dict[str, dict[str, Any]] = {
    "seed": _SEED,
    # system_prompts: sized from the engine's KV capacity (see many_tenants_prompts)
    "many-tenants": _SEED | {"system_prompts": None},
    "multi-turn": _SEED | {"turns": "uniform:3:8", "think_time": 4.0},
    # 6-12 k tokens: a shared prefix of 2-4 k (one of 16 conversations) + 4-8 k unique,
    # about a third of each prompt (mean 3 k of 9 k) shared with earlier requests
    "long-input": _SEED | {
        "system_prompts": 16,
        "shared_share": 1.0,
        "system_len": "uniform:2000:4000",
        "user_len": "uniform:4000:8000",
    },
}

KNOBS = tuple(DEFAULTS)
# how many times one engine's GPU KV the shared prompts of many-tenants hold
MANY_TENANTS_KV_FACTOR = 2.0


class ScenarioError(ValueError):
    """A scenario that cannot be resolved (unknown name, no KV capacity, ...)."""


@dataclass
class Resolved:
    """The knobs after the preset and the flags, and how the preset sized itself."""

    name: str | None
    knobs: dict[str, Any]
    needs_kv_capacity: bool = False
    sizing: dict[str, Any] = field(default_factory=dict)


def _as_dist(value: Any) -> Any:
    return Distribution.parse(value) if isinstance(value, str) else value


def resolve(name: str | None, explicit: dict[str, Any]) -> Resolved:
    """Fill every knob: an explicit (not None) value, else the preset's, else the
    default. ``needs_kv_capacity``: many-tenants must still size ``system_prompts``
    (call :func:`size_many_tenants`)."""
    if name is not None and name not in PRESETS:
        raise ScenarioError(f"unknown --scenario {name!r}: choose from {', '.join(PRESETS)}")
    preset = PRESETS[name] if name is not None else DEFAULTS
    knobs: dict[str, Any] = {}
    for knob in KNOBS:
        value = explicit.get(knob)
        knobs[knob] = _as_dist(value if value is not None else preset[knob])
    if name != "multi-turn":
        for knob, flag in (("turns", "--turns"), ("think_time", "--think-time")):
            if knobs[knob] is not None:
                raise ScenarioError(f"{flag} needs --scenario multi-turn")
    return Resolved(name, knobs, needs_kv_capacity=knobs["system_prompts"] is None)


def many_tenants_prompts(capacity_tokens: int, mean_system_len: float) -> int:
    """Distinct shared prompts whose KV is MANY_TENANTS_KV_FACTOR x one engine's:
    ``ceil(2 * capacity_tokens / mean(system_len))``."""
    if capacity_tokens <= 0:
        raise ScenarioError(f"KV capacity must be > 0 tokens, got {capacity_tokens}")
    return max(1, math.ceil(MANY_TENANTS_KV_FACTOR * capacity_tokens / mean_system_len))


def size_many_tenants(resolved: Resolved, capacity_tokens: int, source: str) -> None:
    """Set ``system_prompts`` of a many-tenants resolution and record the sizing."""
    mean_len = resolved.knobs["system_len"].mean
    n = many_tenants_prompts(capacity_tokens, mean_len)
    resolved.knobs["system_prompts"] = n
    resolved.needs_kv_capacity = False
    resolved.sizing = {
        "kv_capacity_tokens": capacity_tokens,
        "kv_capacity_source": source,
        "kv_factor": MANY_TENANTS_KV_FACTOR,
        "mean_system_len": mean_len,
        "num_system_prompts": n,
        "shared_prompt_tokens": round(n * mean_len),
    }
