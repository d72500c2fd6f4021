"""Where a CPU benchmark script (``benchmarks/*.py``) leaves its results: one JSON (when,
its arguments, what it compared, its rows) and the printed table beside it."""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path
from typing import Any


def save(results: Path, args: argparse.Namespace, compared: dict[str, Any],
         rows: list[dict[str, Any]], text: str) -> None:
    """Print ``text`` and write ``results/LABEL.json`` (``compared``: e.g. ``{"variants":
    ...}``) and ``results/LABEL.txt`` (``args.label``)."""
    print("\n" + text)
    results.mkdir(exist_ok=True)
    meta = {"when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "args": vars(args),
            **compared}
    (results / f"{args.label}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    (results / f"{args.label}.txt").write_text(text + "\n")
