#!/usr/bin/env python3
"""Run the proxy (``pdstack.cli proxy ...``) with its event loop's stalls attributed, for
benchmarks/loop_lag.py (issue 54: refusals must be fast; issue 53):

- every garbage collection: when, its generation, its pause (``gc.callbacks``);
- every loop-lag sample at microsecond resolution (the proxy's own probe,
  ``LoopLag.run``, reads uvloop's millisecond clock): when and how late;
- per call, the time of the proxy's CPU-heavy steps (KV-event batches, the routing's block
  hashes, its pick, the admission's prompt hashes, the engines' /metrics parse): when and
  how long;
- a sampler thread that reads the loop thread's stack every ~2 ms and counts each stack
  twice: all samples and those while the loop is late (no beat for ``STALL_S``), within the
  window that the file ``LOOP_PROBE_WINDOW`` names (``T0 T1``, monotonic) once it exists
  (only with ``LOOP_PROBE_SAMPLER=1``: it takes the GIL from the loop ~200 times a second,
  and it reads the stack where the loop lets go of the GIL, a biased sample; py-spy is not).

Everything goes to the JSON file ``LOOP_PROBE_OUT`` once, 1 s after the window (monotonic
timestamps, the clock the benchmark's own window uses). The proxy runs unchanged otherwise:

    LOOP_PROBE_OUT=/tmp/p.json python benchmarks/loop_lag_probe.py pdstack.cli proxy ...
"""

from __future__ import annotations

import asyncio
import functools
import gc
import importlib
import json
import os
import runpy
import sys
import threading
import time
from collections import Counter
from typing import Any

STALL_S = 0.02  # the loop counts as stalled when its beat is this late
BEAT_S = 0.002
SAMPLE_S = 0.002
MAX_CALLS = 300_000  # per timed function
TIMED = (  # module, attribute path (a class's method or a module's function)
    ("pdstack.proxy.kv_events", "KvEventsSubscriber._apply"),
    ("pdstack.proxy.kv_events_route", "hashes_by_scheme"),
    ("pdstack.proxy.kv_events_route", "KvRouting.pick"),
    ("pdstack.proxy.kv_index", "KvIndex.route"),
    ("pdstack.proxy.flows", "Flows._hashes"),
    ("pdstack.proxy.engine_metrics", "parse_engine_metrics"),
    ("pdstack.proxy.metrics", "ProxyMetrics.render"),
)

state: dict[str, Any] = {"gc": [], "lag": [], "timers": {}, "gc_frozen": None,
                         "gc_threshold": None}
all_stacks: Counter[str] = Counter()
stall_stacks: Counter[str] = Counter()
beat = [time.monotonic()]
main_thread = threading.get_ident()


def _gc_log() -> None:
    started = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.monotonic()
        else:
            state["gc"].append((started[0], info["generation"],
                                time.monotonic() - started[0], info["collected"]))

    gc.callbacks.append(callback)


def _timed(name: str, fn: Any) -> Any:
    calls: list[tuple[float, float]] = state["timers"].setdefault(name, [])

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if len(calls) < MAX_CALLS:
                calls.append((time.monotonic(), time.perf_counter() - t0))

    return wrapper


def _instrument() -> None:
    for module, path in TIMED:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        *owner_path, attr = path.split(".")
        owner: Any = mod
        for part in owner_path:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, attr):
            continue  # not in this tree
        setattr(owner, attr, _timed(path, getattr(owner, attr)))
        if not owner_path:  # a function: the modules that imported it by name
            for other in list(sys.modules.values()):
                if getattr(other, attr, None) is getattr(mod, attr).__wrapped__:
                    setattr(other, attr, getattr(mod, attr))
    periodic = importlib.import_module("pdstack.proxy.periodic")

    async def run(self: Any) -> None:  # the proxy's probe, at perf_counter resolution
        loop = asyncio.get_running_loop()

        def tick() -> None:
            beat[0] = time.monotonic()
            loop.call_later(BEAT_S, tick)

        tick()
        while True:
            start = time.perf_counter()
            await asyncio.sleep(periodic.LAG_TICK_S)
            lag = max(0.0, time.perf_counter() - start - periodic.LAG_TICK_S)
            self.histogram.observe(lag)
            state["lag"].append((time.monotonic(), lag))

    periodic.LoopLag.run = run


def _stack(frame: Any, depth: int = 10) -> str:
    parts = []
    while frame is not None and len(parts) < depth:
        code = frame.f_code
        parts.append(f"{os.path.basename(code.co_filename)}:{code.co_name}")
        frame = frame.f_back
    return " < ".join(parts)


def _window() -> tuple[float, float] | None:
    path = os.environ.get("LOOP_PROBE_WINDOW")
    try:
        with open(path or "") as fh:
            t0, t1 = (float(x) for x in fh.read().split())
        return t0, t1
    except (OSError, ValueError):
        return None


def _sampler() -> None:
    window = None
    while True:
        time.sleep(SAMPLE_S)
        now = time.monotonic()
        if window is None:
            window = _window()
        if window is None or not window[0] <= now <= window[1]:
            continue
        frame = sys._current_frames().get(main_thread)
        if frame is None:
            continue
        key = _stack(frame)
        del frame
        all_stacks[key] += 1
        if now - beat[0] > STALL_S:
            stall_stacks[key] += 1


def _heap(now: float) -> dict[str, Any]:
    """The tracked objects per generation (frozen ones apart) and the RSS: at the window's
    start and end (holds the GIL for a few ms)."""
    with open("/proc/self/statm") as fh:
        rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    objs = gc.get_objects()
    types: Counter[str] = Counter()
    refs: Counter[str] = Counter()
    for o in objs:
        name = type(o).__name__
        types[name] += 1
        if isinstance(o, list | dict | set | tuple):
            size = len(o)
            refs[f"{name} of {'>=1000' if size >= 1000 else '<1000'}"] += size
    big: Counter[str] = Counter()
    if state["heap"]:  # at the end: who holds the lists of >= 1000 items
        for o in objs:
            if isinstance(o, list) and len(o) >= 1000:
                holders = [r for r in gc.get_referrers(o) if r is not objs]
                where = []
                for r in holders[:3]:
                    if isinstance(r, dict):
                        key = next((k for k, v in r.items() if v is o), "?")
                        owners = [type(x).__name__ for x in gc.get_referrers(r)
                                  if x is not objs and not isinstance(x, list)][:2]
                        where.append(f"dict[{key!r}] in {owners}")
                    else:
                        where.append(type(r).__name__)
                big[f"{type(o[0]).__name__} x{len(o) // 1000}k <- {'; '.join(where)}"] += len(o)
    del objs
    return {"t": now, "big_lists": dict(big.most_common(25)),
            "gen": [len(gc.get_objects(g)) for g in range(3)],
            "frozen": gc.get_freeze_count(), "rss_mb": round(rss / 2**20, 1),
            "types": dict(types.most_common(15)), "container_refs": dict(refs)}


def _dump(path: str) -> None:
    """The heap 2 s before the window, then (1 s after its end) the heap again and the
    whole record, once: a census and a JSON dump hold the GIL, stalls of the loop in
    themselves, kept out of the window."""
    state["heap"] = []
    window = None
    while window is None:
        time.sleep(0.2)
        window = _window()
    while time.monotonic() < window[0] - 2.0:  # the census stalls the loop: not in the window
        time.sleep(0.1)
    state["heap"].append(_heap(time.monotonic()))
    if os.environ.get("LOOP_PROBE_GARBAGE") == "1":  # what dies in cycles (memory grows)
        gc.set_debug(gc.DEBUG_SAVEALL)
    while time.monotonic() < window[1] + 1.0:
        time.sleep(0.2)
    state["heap"].append(_heap(time.monotonic()))
    if gc.get_debug() & gc.DEBUG_SAVEALL:
        gc.collect()
        state["garbage"] = dict(Counter(type(o).__qualname__ for o in gc.garbage).most_common(60))
        state["garbage_functions"] = dict(Counter(
            f"{o.__module__}.{o.__qualname__}" for o in gc.garbage
            if type(o).__name__ in ("function", "method")).most_common(40))
        state["garbage_coroutines"] = dict(Counter(
            o.__qualname__ for o in gc.garbage if type(o).__name__ == "coroutine"
        ).most_common(20))
        gc.garbage.clear()
        gc.set_debug(0)
    state["gc_frozen"] = gc.get_freeze_count()  # once serving: the proxy's own tuning
    state["gc_threshold"] = gc.get_threshold()
    doc = {**state, "all_stacks": dict(all_stacks.most_common(400)),
           "stall_stacks": dict(stall_stacks.most_common(400)),
           "samples": sum(all_stacks.values()), "stall_samples": sum(stall_stacks.values())}
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
    os.replace(tmp, path)


def main() -> None:
    if len(sys.argv) < 2 or not os.environ.get("LOOP_PROBE_OUT"):
        raise SystemExit("usage: LOOP_PROBE_OUT=FILE loop_lag_probe.py MODULE [ARGS...]")
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    _gc_log()
    importlib.import_module("pdstack.proxy.app")
    _instrument()
    if os.environ.get("LOOP_PROBE_SAMPLER", "0") == "1":
        threading.Thread(target=_sampler, daemon=True).start()
    threading.Thread(target=_dump, args=(os.environ["LOOP_PROBE_OUT"],), daemon=True).start()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
