"""How a stack names what the planner plans, in one place: the ``.env`` prefix of a
service, an engine's generation, and the order a rolling upgrade takes a node's engines.

Stdlib only (like :mod:`pdstack.kvmodes`): the engine_upgrade role runs
the ``pdstack.upgrade`` package on a node with this file beside it, without the planner's
dependencies. The planner (``generation``), the renderer (``env_prefix``) and the upgrade
(all three) read it; nothing else derives these."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def env_prefix(service: str) -> str:
    """``decode-1`` -> ``DECODE_1``: the ``.env`` prefix of one engine's image, model,
    revision and GPU ids."""
    return service.upper().replace("-", "_")


def generation(revision: str, image: str) -> str:
    """``<model_revision>@<engine_image>``: engines pair only within one generation."""
    return f"{revision}@{image}"


def upgrade_order(engines: Sequence[T], role: Callable[[T], str]) -> list[T]:
    """One decoder, then every prefiller, then the other decoders (colocated: as is): the
    new generation gets a decoder before a prefiller, so its first complete pair exists
    while the old generation still serves."""
    decoders = [e for e in engines if role(e) == "decode"]
    prefillers = [e for e in engines if role(e) == "prefill"]
    others = [e for e in engines if role(e) not in ("decode", "prefill")]
    if not decoders or not prefillers:
        return [*prefillers, *decoders, *others]
    return [decoders[-1], *prefillers, *decoders[:-1], *others]
