#!/usr/bin/env python3
"""summary.json of a gpu/host_path.sh run, from what the run left in its folder.

    python3 gpu/host_path_summary.py RES            # the JSON on stdout
    python3 gpu/host_path_summary.py RES --brief    # verdicts and each run's outcome

RES is ``$OUT/host-path`` (steps.tsv, ansible/*.log, probe/*.json).  gpu/host_path.sh
runs it at its end; gpu/host_path_fixtures.py runs it again when a run came back without
a summary.json (a run cut short).  Standard library only (it runs on the GPU machine).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

WRONG_COUNT = "pdstack_gpu_count=2"
WRONG_MODEL = "pdstack_gpu_model=NVIDIA H100 80GB HBM3"
RECAP = re.compile(r"ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)\s+skipped=(\d+)")
# ansible-core 2.19+: one line per failed task, the role's whole message on it
FAILED = re.compile(r"^\[ERROR\]: Task failed: (?:Action failed: )?(.*)$", re.M)


def steps_of(res: Path) -> dict[str, dict[str, Any]]:
    steps: dict[str, dict[str, Any]] = {}
    tsv = res / "steps.tsv"
    for line in tsv.read_text().splitlines() if tsv.exists() else []:
        name, rc, secs, out = [*line.split("\t"), "", "", "", ""][:4]
        try:
            steps[name] = {"rc": int(rc), "seconds": float(secs or 0), "output": out}
        except ValueError:
            continue
    return steps


def reports(text: str) -> list[str]:
    """The msg of every ``Report ...`` debug task (the roles' one-line findings), unwrapped."""
    out = []
    for block in re.split(r"(?m)^TASK \[", text)[1:]:
        if not re.match(r"[\w]+ : Report ", block):
            continue
        m = re.search(r"msg: (.*?)(?:\n\s*\n|\Z)", block, re.S)
        if m:
            msg = " ".join(m.group(1).split())
            if len(msg) > 1 and msg[0] == msg[-1] and msg[0] in "'\"":
                msg = msg[1:-1].replace("''", "'")
            out.append(msg)
    return out


def ansible_run(res: Path, name: str) -> dict[str, Any]:
    f = res / "ansible" / f"{name}.log"
    text = f.read_text(errors="replace") if f.exists() else ""
    m = RECAP.search(text)
    keys = ("ok", "changed", "unreachable", "failed", "skipped")
    recap = dict(zip(keys, map(int, m.groups()), strict=True)) if m else None
    return {"recap": recap, "messages": FAILED.findall(text), "reports": reports(text)}


def summarize(res: Path) -> dict[str, Any]:
    steps = steps_of(res)
    runs = {n: ansible_run(res, n) for n in ("right", "wrong", "container_runtime")}
    right, wrong = runs["right"], runs["wrong"]
    probe: dict[str, Any] = {}
    for n in ("info", "gpu", "rdma", "ucx"):
        try:
            probe[n] = json.loads((res / "probe" / f"{n}.json").read_text())
        except (OSError, ValueError) as exc:
            probe[n] = {"error": str(exc)}
    g, u = probe["gpu"], probe["ucx"]
    verdicts = {
        "right_passes": bool(right["recap"]) and right["recap"]["failed"] == 0
        and steps.get("ansible_right", {}).get("rc") == 0,
        "wrong_fails_naming_fields": bool(wrong["recap"]) and wrong["recap"]["failed"] >= 1
        and any(WRONG_COUNT in m and WRONG_MODEL in m for m in wrong["messages"]),
        "probe_sees_gpu": bool(g.get("present")),
    }
    return {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "verdicts": verdicts,
        "ansible": runs,
        "probe_gpu": {k: g.get(k) for k in ("present", "count", "driver_version",
                                             "kernel_module_version", "reason")},
        "probe_ucx": {k: u.get(k) for k in ("present", "version", "transports", "cuda_ipc",
                                             "reason")},
        "steps": steps,
    }


def brief(doc: dict[str, Any]) -> str:
    lines = ["verdicts: " + json.dumps(doc["verdicts"])]
    for run, r in doc["ansible"].items():
        lines.append(f"{run}: {r['recap']} {r['messages']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    res = Path(argv[0])
    if argv[1:] == ["--brief"]:
        print(brief(json.loads((res / "summary.json").read_text())))
        return 0
    print(json.dumps(summarize(res), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
