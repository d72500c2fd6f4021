#!/usr/bin/env python3
"""Turn the files of a gpu/host_path.sh run into the repository's record and test fixtures.

    python3 gpu/host_path_fixtures.py RESULTS_DIR [--dest-results results/h200x1/host-path]
    python3 gpu/host_path_fixtures.py --readme        (only re-render the README table)

RESULTS_DIR is what came back from the GPU machine: the folder that holds ``host-path/``
(``$OUT`` there) or ``host-path/`` itself.  It

1. copies the whole run (transcripts, raw outputs, probe JSON, summary.json) to
   results/h200x1/host-path/;
2. copies the raw outputs that code parses (and a few for reference) into
   tests/fixtures/h200/, replacing the placeholders of the same name, and marks each in
   tests/fixtures/h200/expected.json as ``real`` with its source (a placeholder's own
   expectations are dropped: the machine facts in ``machine`` stay and are checked);
3. re-renders the status table of tests/fixtures/h200/README.md.

Then run ``.venv/bin/pytest tests/host`` and commit.  Standard library only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "h200"
RESULTS = REPO / "results" / "h200x1" / "host-path"
# raw/ files that become fixtures (what code parses, plus references for people)
FIXTURE_FILES = [
    "nvidia-smi-query-gpu.argv", "nvidia-smi-query-gpu.csv", "nvidia-smi-query-gpu-units.csv",
    "nvidia-smi-query-gpu-units-noheader.csv", "nvidia-smi-query-mig.csv", "nvidia-smi-L.txt",
    "nvidia-smi-topo-m.txt", "nvidia-smi.txt", "nvidia-smi-q.txt",
    "proc_driver_nvidia_version.txt", "sys_module_nvidia_version.txt",
    "ucx_info-v.txt", "ucx_info-d.txt", "ibv_devinfo.txt", "ibv_devices.txt", "ulimit-l.txt",
    "dev-nodes.txt",
]
BEGIN, END = "<!-- status:begin -->", "<!-- status:end -->"


def status_table(expected: dict[str, Any]) -> str:
    """The README's table of fixture files: status and source, from expected.json."""
    rows = ["| file | status | source |", "|---|---|---|"]
    for name in sorted(expected["files"]):
        f = expected["files"][name]
        status = "**placeholder**" if f["status"] == "placeholder" else "real"
        rows.append(f"| `{name}` | {status} | {f.get('source', '')} |")
    return "\n".join(rows)


def write_readme(expected: dict[str, Any], fixtures: Path = FIXTURES) -> None:
    readme = fixtures / "README.md"
    text = readme.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    if not rest:
        raise SystemExit(f"{readme}: no {BEGIN} ... {END} markers")
    readme.write_text(f"{head}{BEGIN}\n{status_table(expected)}\n{END}{tail}")


RUNS = [
    ("right", "inventory/h200x1-host", "--tags gpu,rdma", "passes, failed=0"),
    ("wrong", "inventory/h200x1-host-wrong", "--tags gpu,rdma",
     "fails in gpu_host naming pdstack_gpu_count and pdstack_gpu_model"),
    ("container_runtime", "inventory/h200x1-host",
     "--tags docker -e container_runtime_install=false", "what the machine has (no verdict)"),
]


def results_readme(summary: dict[str, Any]) -> str:
    """results/h200x1/host-path/README.md: what the run showed, from its summary.json."""
    lines = [
        "# Host path of the node checks on the lent 1xH200 (issue 19)", "",
        f"`bash gpu/host_path.sh` of {summary.get('when', '?')} (see gpu/HOST_PATH.md): "
        "`ansible-playbook gpu/host_path.yml --check -e ansible_connection=local` on the GPU "
        "machine itself, the node probe, and the raw outputs they parse (`raw/`). Fixtures "
        "made from it: tests/fixtures/h200/.", "",
        "| run | inventory | options | expected | PLAY RECAP | role message(s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, inv, opts, want in RUNS:
        r = summary.get("ansible", {}).get(name, {})
        recap = r.get("recap") or {}
        counts = " ".join(f"{k}={v}" for k, v in recap.items()) or "none"
        msgs = "<br>".join(m.replace("|", "\\|") for m in r.get("messages") or []) or "-"
        lines.append(f"| `ansible/{name}.log` | `{inv}` | `{opts}` | {want} | {counts} | {msgs} |")
    lines += ["", "What the roles reported (their `Report ...` tasks):", ""]
    for name, *_ in RUNS:
        for rep in summary.get("ansible", {}).get(name, {}).get("reports") or []:
            lines.append(f"- `{name}`: {rep}")
    g = summary.get("probe_gpu", {})
    u = summary.get("probe_ucx", {})
    lines += [
        "", f"Verdicts: `{json.dumps(summary.get('verdicts', {}))}`", "",
        f"Probe (`probe/*.json`): GPU present {g.get('present')}, count {g.get('count')}, "
        f"driver {g.get('driver_version')}, kernel module {g.get('kernel_module_version')}; "
        f"UCX present {u.get('present')}, version {u.get('version')}, cuda_ipc {u.get('cuda_ipc')}"
        f"{', ' + u['reason'] if u.get('reason') else ''}.", "",
        "Every step's rc and time: `steps.tsv` / `summary.json`; the script's log: "
        "`host_path.log`.",
        *(["`summary.json` was regenerated from these files by gpu/host_path_fixtures.py: "
           "the run ended before writing it (its `wait` never returned; fixed since)."]
          if summary.get("regenerated") else []),
        "",
    ]
    return "\n".join(lines)


def run_time(run: Path) -> str | None:
    """When the run was, from what it saved: os.txt's `date -u` line, else the timestamp
    nvidia-smi prints atop its table (``Wed Dec  2 00:45:10 2026``, the machine's zone)."""
    os_txt = run / "raw" / "os.txt"
    for line in os_txt.read_text().splitlines() if os_txt.is_file() else []:
        if line.startswith("date: "):
            return line.removeprefix("date: ").strip()
    table = run / "raw" / "nvidia-smi.txt"
    if table.is_file():
        first = table.read_text().splitlines()[:1]
        try:
            t = time.strptime(" ".join(first[0].split()), "%a %b %d %H:%M:%S %Y")
            return time.strftime("%Y-%m-%dT%H:%M:%S (nvidia-smi's clock)", t)
        except (IndexError, ValueError):
            return None
    return None


def _summary_module() -> Any:
    spec = importlib.util.spec_from_file_location("host_path_summary",
                                                  REPO / "gpu" / "host_path_summary.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def machine_mismatches(machine: dict[str, Any], query_csv: str) -> list[str]:
    """Where the real query disagrees with expected.json's machine facts (tests would fail)."""
    probe_file = REPO / "scripts" / "pdstack_probe.py"
    spec = importlib.util.spec_from_file_location("pdstack_probe", probe_file)
    assert spec is not None and spec.loader is not None
    pdstack_probe = importlib.util.module_from_spec(spec)  # the parsers the roles use
    spec.loader.exec_module(pdstack_probe)

    gpus = pdstack_probe.parse_nvidia_smi_csv(query_csv)
    out = []
    if len(gpus) != machine["gpu_count"]:
        out.append(f"{len(gpus)} GPU(s) in the query, expected.json machine.gpu_count="
                   f"{machine['gpu_count']}")
    for g in gpus:
        major = (pdstack_probe.parse_driver_version(g.get("driver_version")) or (None,))[0]
        for key, have, want in (("gpu_model", g.get("name"), machine["gpu_model"]),
                                ("memory_mib", g.get("memory_mib"), machine["memory_mib"]),
                                ("driver_major", major, machine["driver_major"])):
            if have != want:
                out.append(f"GPU {g.get('index')}: {have!r}, expected.json machine.{key}={want!r}")
        if g.get("mig_mode") not in machine["mig_modes"]:
            out.append(f"GPU {g.get('index')}: MIG {g.get('mig_mode')!r}, expected.json "
                       f"machine.mig_modes={machine['mig_modes']!r}")
    if out:
        out.append("if the machine is right, edit tests/fixtures/h200/expected.json's machine "
                   "facts (and say so in the commit); otherwise a parser is wrong")
    return out


def steps_ok(run: Path) -> dict[str, int]:
    """output file (relative to host-path/) -> rc of the step that wrote it."""
    rcs: dict[str, int] = {}
    tsv = run / "steps.tsv"
    for line in tsv.read_text().splitlines() if tsv.exists() else []:
        cols = line.split("\t")
        if len(cols) >= 4:
            rcs[cols[3]] = int(cols[1])
    return rcs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="?", type=Path, help="folder returned by the GPU call")
    ap.add_argument("--dest-results", type=Path, default=RESULTS)
    ap.add_argument("--fixtures", type=Path, default=FIXTURES)
    ap.add_argument("--readme", action="store_true", help="only re-render the README table")
    args = ap.parse_args(argv)
    expected_file = args.fixtures / "expected.json"
    expected = json.loads(expected_file.read_text())
    if args.readme:
        write_readme(expected, args.fixtures)
        return 0
    if args.results is None:
        ap.error("RESULTS_DIR is required (or --readme)")
    run = args.results / "host-path" if (args.results / "host-path").is_dir() else args.results
    summary_file = run / "summary.json"
    if not (run / "steps.tsv").is_file():
        print(f"host_path_fixtures: {run / 'steps.tsv'} not found: is {args.results} the folder "
              "gpu/host_path.sh wrote ($OUT/host-path)?", file=sys.stderr)
        return 2
    if summary_file.is_file():
        summary = json.loads(summary_file.read_text())
    else:  # a run cut short before its summary: the same summary, from its files
        summary = _summary_module().summarize(run)
        summary["regenerated"] = "by gpu/host_path_fixtures.py: the run ended before its summary"
        summary["when"] = run_time(run) or "unknown"
        print(f"{summary_file} missing: regenerated from the run's files", file=sys.stderr)
    rcs = steps_ok(run)
    query = run / "raw" / "nvidia-smi-query-gpu.csv"
    rc = rcs.get("raw/nvidia-smi-query-gpu.csv")
    if rc != 0 or not query.is_file() or not query.read_text().strip():
        print(f"host_path_fixtures: {query} is missing or its step failed (rc "
              f"{rc}): this run saw no GPU, nothing copied",
              file=sys.stderr)
        return 2

    # 1. the whole run, as it came back, with a README that says what it showed
    if args.dest_results.resolve() != run.resolve():
        if args.dest_results.exists():
            shutil.rmtree(args.dest_results)
        shutil.copytree(run, args.dest_results)
    if not (args.dest_results / "summary.json").is_file():
        (args.dest_results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.dest_results / "README.md").write_text(results_readme(summary))
    print(f"copied {run} -> {args.dest_results}")

    # 2. fixtures
    when = summary.get("when", "?")
    copied = []
    for name in FIXTURE_FILES:
        src = run / "raw" / name
        rc = rcs.get(f"raw/{name}", 0 if name.endswith(".argv") else None)
        if not src.is_file() or not src.read_text(errors="replace").strip() or rc != 0:
            continue
        shutil.copyfile(src, args.fixtures / name)
        entry = {"status": "real",
                 "source": f"1xH200 machine, gpu/host_path.sh run of {when} "
                           "(results/h200x1/host-path/raw/)"}
        expected["files"][name] = entry
        copied.append(name)
    expected_file.write_text(json.dumps(expected, indent=2) + "\n")
    write_readme(expected, args.fixtures)
    for line in machine_mismatches(expected["machine"], query.read_text()):
        print(f"WARNING: {line}", file=sys.stderr)
    left = sorted(n for n, f in expected["files"].items() if f["status"] == "placeholder")
    print(f"fixtures: {len(copied)} real file(s) into {args.fixtures}: {', '.join(copied)}")
    print(f"still placeholders: {', '.join(left) or 'none'}")
    print("verdicts:", json.dumps(summary.get("verdicts", {})))
    print("next: .venv/bin/pytest tests/host && git add results/h200x1 tests/fixtures/h200")
    return 0


if __name__ == "__main__":
    sys.exit(main())
