"""The proxy's garbage collector, out of the event loop's way (issues 53, 54).

CPython's cyclic collector stops the one event loop while it runs, and a collection of the
oldest generation walks every container object alive: the modules, the app, and every
stream in flight. In front of three fake engines with a GPU-like KV-event load (2 cores,
benchmarks/loop_lag.py, 40-100 req/s) such a collection took 56-133 ms, one every 10-30 s
(gen-1 ones up to 20-50 ms): the loop's tail, added to each refusal, first byte and token
that falls in it.

:func:`tune`, once the proxy serves (``pdstack.proxy.cli.serve``): everything alive then is
frozen (``gc.freeze``: the modules, the app, ~57 k objects, never walked again), so a full
collection walks what requests hold only (there: 11-26 ms). The thresholds stay CPython's
(700, 10, 10): larger young thresholds made each young collection walk more objects alive
(5,000: pauses of 30-40 ms; 50,000: 50-110 ms), and rarer collections buy nothing here: the
proxy leaves no cyclic garbage (its relay and leg deadlines left some per request: closures
that named themselves).

``--gc default`` (or ``PDSTACK_PROXY_GC=default`` in its environment) freezes nothing;
``PDSTACK_PROXY_GC=T0,T1,T2`` freezes and sets those thresholds.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass

log = logging.getLogger("pdstack.proxy")

ENV = "PDSTACK_PROXY_GC"
THRESHOLDS = (700, 10, 10)  # CPython's: see the module's docstring


@dataclass(frozen=True)
class GcTuning:
    """What :func:`tune` changed (for :func:`restore`)."""

    before: tuple[int, int, int]
    thresholds: tuple[int, int, int]
    frozen: int


def mode_from_env(default: str = "tuned") -> str:
    """``--gc``'s default: ``PDSTACK_PROXY_GC`` (tuned, default, or T0,T1,T2)."""
    return os.environ.get(ENV, default).strip() or default


def parse_mode(mode: str) -> tuple[int, int, int] | None:
    """The thresholds ``mode`` asks for, frozen; None for CPython's own, nothing frozen
    (``default``, ``off``). ValueError for anything else."""
    if mode in ("default", "off"):
        return None
    if mode in ("tuned", "on"):
        return THRESHOLDS
    parts = mode.split(",")
    values = tuple(int(p) for p in parts) if len(parts) == 3 else ()
    if len(values) != 3 or values[0] <= 0 or any(v < 0 for v in values):
        raise ValueError(f"gc mode {mode!r}: want tuned, default or T0,T1,T2 (T0 > 0)")
    return values[0], values[1], values[2]


def tune(mode: str) -> GcTuning | None:
    """Freeze what is alive now and set the thresholds ``mode`` asks for (None: nothing
    changed)."""
    thresholds = parse_mode(mode)
    if thresholds is None:
        return None
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
    frozen = gc.get_freeze_count()
    log.info("gc: %d objects frozen, thresholds %s (were %s)", frozen, thresholds, before)
    return GcTuning(before, thresholds, frozen)


def restore(tuning: GcTuning | None) -> None:
    """Undo :func:`tune` (a proxy served in a process that goes on: tests): the thresholds
    as before, nothing frozen (``gc.unfreeze`` cannot tell what was frozen before)."""
    if tuning is not None:
        gc.unfreeze()
        gc.set_threshold(*tuning.before)
