#!/usr/bin/env python3
"""Does ``pdstack.vllm_offload_fix`` keep vLLM 0.26.0's EngineCore alive when requests are
aborted? Runs 0.26.0's own OffloadingConnector scheduler (``_build_store_jobs``) on constructed
states before and after the patch (``gpu/offload_fix_vllm026.py``), and 0.26.0's own plugin
loader with only the plugin folder (what ``pdstack launch`` puts on an engine's PYTHONPATH)
and vLLM on the path. Exit 0 when every check holds.

Not a CI test: it needs vLLM 0.26.0, which CI does not have (its CPU venv has 0.32, fixed
upstream; tests/spine/test_vllm_offload_fix.py covers the bound itself and that 0.32 is left
alone). Where it runs:

    # the GPU host, after the payload (vLLM 0.26.0 installed there)
    python3 gpu/check_offload_fix.py
    # here: the Python files of the payload's 0.26.0 wheel on the CPU venv's torch
    .venv/bin/python gpu/check_offload_fix.py --wheel gpu/payload/.wheels/vllm-0.26.0-*.whl \
        --python .venv-vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pdstack import vllm_offload_fix  # noqa: E402


def wheel_tree(wheel: Path, into: Path) -> Path:
    """vLLM's Python files from ``wheel`` under ``into`` (nothing compiled is needed)."""
    with zipfile.ZipFile(wheel) as whl:
        whl.extractall(into, [n for n in whl.namelist()
                              if n.startswith("vllm/") and n.endswith(".py")])
    return into


def run(python: str, code_or_file: list[str], path: list[str], cwd: Path | None = None,
        level: str = "INFO") -> str:
    # the GPU host's payload puts vLLM on PYTHONPATH ($SITE, gpu/lib.sh): keep what the caller
    # had there (a replaced PYTHONPATH lost vLLM in the fifth session's run), but not the repo
    # (the plugin loader check must find pdstack's plugin in its own folder only)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                 if p and Path(p).resolve() != REPO]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, *inherited]),
               VLLM_LOGGING_LEVEL=level)
    proc = subprocess.run([python, *code_or_file], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{code_or_file[0]} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def check_build_store_jobs(python: str, path: list[str]) -> list[str]:
    """0.26.0's ``_build_store_jobs`` raises on the three aborts without the patch, stores
    what was computed with it, and a running request is unchanged. Returns the failures."""
    out = run(python, [str(REPO / "gpu" / "offload_fix_vllm026.py")], [*path, str(REPO)],
              level="WARNING")
    got: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    before, after, bad = got["before"], got["after"], []

    def need(ok: bool, what: str) -> None:
        if not ok:
            bad.append(what)
    need(got["vllm"] == "0.26.0", f"vLLM {got['vllm']} (0.26.0 wanted) from {got['source']}")
    for name in ("queued", "preempted", "mid_prefill"):  # 0.26.0 as shipped
        need(before[name]["error"] == "AssertionError", f"before, {name}: {before[name]}")
    need(got["applied"] is True and got["applied_again"] is True, "the patch did not apply")
    for name in ("queued", "preempted", "mid_prefill", "running"):
        need(after[name]["error"] is None, f"after, {name}: {after[name]}")
    for name in ("queued", "preempted"):  # nothing to store; its state dropped
        a = after[name]
        need(a.get("store_jobs") == 0 and not a.get("tracked"), f"{name}: {a}")
    # an aborted prefill stores its full computed chunk from its own block, not the second
    need(after["mid_prefill"].get("stored_chunks") == [1], f"mid_prefill: {after['mid_prefill']}")
    need(after["mid_prefill"].get("src_blocks") == [[21]], f"mid_prefill: {after['mid_prefill']}")
    need(after["running"] == before["running"], "a running request is stored differently")
    need(after["running"].get("stored_chunks") == [3], f"running: {after['running']}")
    return bad


def check_plugin_loader(python: str, path: list[str], logs: Path) -> list[str]:
    """0.26.0's own ``load_general_plugins``, with only ``plugin_path`` and vLLM on the path
    (as ``pdstack launch`` runs an engine), patches the scheduler."""
    plugins = vllm_offload_fix.plugin_path(logs)
    code = ("from vllm.plugins import load_general_plugins\n"
            "load_general_plugins()\n"
            "import vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler as s\n"
            "print(getattr(s.RequestOffloadState.storable_chunks, '__pdstack_offload_fix__', 0))\n")
    out = run(python, ["-c", code], [str(plugins), *path], cwd=plugins.parent)
    bad = [] if out.strip().splitlines()[-1] == "True" else ["the plugin loader did not patch"]
    if "pdstack offload fix: vLLM 0.26.0" not in out:
        bad.append("no 'pdstack offload fix' line in the engine's log")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel", type=Path, help="vLLM 0.26.0 wheel (default: the installed vLLM)")
    ap.add_argument("--python", default=sys.executable, help="a Python with torch (and vLLM)")
    a = ap.parse_args()
    python = str(Path(a.python).absolute()) if os.sep in a.python else a.python
    with tempfile.TemporaryDirectory() as tmp:
        path = [str(wheel_tree(a.wheel, Path(tmp) / "vllm-0.26.0"))] if a.wheel else []
        bad = check_build_store_jobs(python, path)
        bad += check_plugin_loader(python, path, Path(tmp) / "logs")
    for line in bad:
        print("FAIL", line)
    ok = "ok (3 aborts fixed, running unchanged, loaded by vLLM's plugin loader)"
    print("offload fix on vLLM 0.26.0:", "FAILED" if bad else ok)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
