#!/usr/bin/env python3
"""Run a Python module as ``__main__`` with the garbage collector tuned for a server:
everything alive after imports is frozen (never scanned again) and young collections
run 1 in 100,000 allocations instead of 1 in 2,000 (the old generations follow).

    python benchmarks/gc_tuned.py pdstack.cli proxy --prefill URL --decode URL ...
    python benchmarks/gc_tuned.py pdstack.testing.fake_engine --port 8100 ...

proxy_overhead.py uses it for the fake engines (so their collector pauses do not
add noise to every target) and for the ``pdstack-gc`` target: the proxy as shipped
plus the GC tuning suggested for it. Each collection's pause can be logged to a JSON
file with ``PDSTACK_GC_LOG=FILE`` (rewritten every second).
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import threading
import time
import warnings

GEN0_THRESHOLD = 100_000


def _log_pauses(path: str) -> None:
    pauses: list[tuple[int, float]] = []
    started: list[float] = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], (time.perf_counter() - started[0]) * 1000))

    def dump() -> None:
        while True:
            time.sleep(1)
            with open(path, "w") as fh:
                json.dump(pauses, fh)

    gc.callbacks.append(callback)
    threading.Thread(target=dump, daemon=True).start()


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: gc_tuned.py MODULE [ARGS...]")
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    if os.environ.get("PDSTACK_GC_LOG"):
        _log_pauses(os.environ["PDSTACK_GC_LOG"])
    # import first, so the module's objects get frozen too (runpy then warns that the
    # module is already imported: expected here, it runs again as __main__)
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
    __import__(module)
    __import__("aiohttp.web")
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, 50, 100)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
