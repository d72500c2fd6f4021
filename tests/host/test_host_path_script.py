"""gpu/host_path.sh end to end on this GPU-less machine, as the lead's device call runs it,
with the nvidia-smi test double (tests/host/fake_nvidia_smi.sh) on PATH replaying the
fixtures; then gpu/host_path_fixtures.py turns its output into a fixture folder.  This is
the rehearsal that keeps a typo from costing the GPU call (issue 19)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jsonschema  # type: ignore[import-untyped]
import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "h200"
PAYLOAD = REPO / "gpu" / "payload-ansible"
SCHEMA = REPO / "pdstack" / "preflight" / "schema.json"


@pytest.fixture(scope="module")
def payload(tmp_path_factory) -> Path:
    """gpu/payload-ansible as the lead carries it (built here when absent: ~10 s, PyPI)."""
    if (PAYLOAD / "SHA256SUMS").is_file():
        return PAYLOAD
    out = tmp_path_factory.mktemp("payload") / "payload-ansible"
    proc = subprocess.run(["bash", "gpu/build_ansible_payload.sh", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_payload_is_small_and_complete(payload):
    size = sum(f.stat().st_size for f in payload.rglob("*") if f.is_file())
    assert size < 20 * 1024 * 1024, f"{payload}: {size} bytes"
    names = {w.name.split("-")[0].lower() for w in (payload / "wheels").glob("*.whl")}
    assert {"ansible_core", "jinja2", "pyyaml", "markupsafe", "packaging", "resolvelib"} <= names
    assert (payload / "collections.txt").read_text() == ""  # the roles use ansible.builtin only


def test_host_path_script_with_the_nvidia_smi_double(tmp_path, payload):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").symlink_to(REPO / "tests" / "host" / "fake_nvidia_smi.sh")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "WORK": str(tmp_path / "work"),
           "PYTHON": sys.executable, "HOST_PATH_PAYLOAD": str(payload),
           "FAKE_NVIDIA_SMI_FIXTURES": str(FIXTURES),
           "PATH": f"{bindir}:{os.environ.get('PATH', '')}"}
    start = time.monotonic()
    proc = subprocess.run(["bash", "gpu/host_path.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=180)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert took < 120, f"gpu/host_path.sh took {took:.0f}s (budget 100s)"
    res = out / "host-path"
    summary = json.loads((res / "summary.json").read_text())
    assert summary["verdicts"] == {"right_passes": True, "wrong_fails_naming_fields": True,
                                   "probe_sees_gpu": True}, json.dumps(summary, indent=2)
    assert summary["ansible"]["right"]["recap"]["failed"] == 0
    assert summary["ansible"]["wrong"]["messages"] == [
        "h200-node1: nvidia-smi shows 1 GPU(s), the inventory says pdstack_gpu_count=2; "
        "GPU model NVIDIA H200, the inventory says pdstack_gpu_model=NVIDIA H100 80GB HBM3"]
    assert summary["probe_gpu"]["count"] == 1
    for name in ("nvidia-smi-query-gpu.csv", "nvidia-smi-topo-m.txt", "nvidia-smi-L.txt"):
        assert (res / "raw" / name).read_bytes() == (FIXTURES / name).read_bytes(), name
    steps = summary["steps"]
    assert steps["smi_query"]["rc"] == 0 and steps["install_ansible"]["rc"] == 0
    assert steps["smi_q"]["rc"] == 64  # not recorded by the double: rc kept, script went on
    probe_gpu = json.loads((res / "probe" / "gpu.json").read_text())
    assert probe_gpu["gpus"][0]["memory_mib"] == 143771
    assert probe_gpu["topology"]["gpus"] == ["GPU0"]
    info = json.loads((res / "probe" / "info.json").read_text())
    assert info["gpu"] == probe_gpu
    schema = json.loads(SCHEMA.read_text())
    jsonschema.validate(info, {**schema["$defs"]["probe_info"], "$defs": schema["$defs"]})

    # the returned folder -> a fixture folder and a results folder
    fx = tmp_path / "fixtures"
    shutil.copytree(FIXTURES, fx)
    dest = tmp_path / "results"
    conv = subprocess.run([sys.executable, "gpu/host_path_fixtures.py", str(out),
                           "--fixtures", str(fx), "--dest-results", str(dest)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert conv.returncode == 0, conv.stdout + conv.stderr
    assert (dest / "summary.json").is_file() and (dest / "ansible" / "wrong.log").is_file()
    readme = (dest / "README.md").read_text()
    assert ("| `ansible/right.log` | `inventory/h200x1-host` | `--tags gpu,rdma` | "
            "passes, failed=0 | ok=") in readme
    assert "pdstack_gpu_model=NVIDIA H100 80GB HBM3 |" in readme
    expected = json.loads((fx / "expected.json").read_text())
    for name in ("nvidia-smi-query-gpu.csv", "nvidia-smi-query-gpu.argv", "nvidia-smi-topo-m.txt",
                 "nvidia-smi-L.txt", "ulimit-l.txt"):
        assert expected["files"][name]["status"] == "real", name
    before = json.loads((FIXTURES / "expected.json").read_text())["files"]
    # its step failed (rc 64 from the double): not copied, its entry untouched
    assert expected["files"].get("nvidia-smi-q.txt") == before.get("nvidia-smi-q.txt")
    assert (fx / "nvidia-smi-q.txt").exists() == (FIXTURES / "nvidia-smi-q.txt").exists()
    assert expected["files"]["ibv_devinfo.txt"]["status"] == "placeholder"
    assert "| `nvidia-smi-query-gpu.csv` | real | 1xH200 machine" in (fx / "README.md").read_text()
    assert (FIXTURES / "README.md").read_text() != (fx / "README.md").read_text()
    # dropping the converted files in is enough: the fixture tests pass on that folder
    sub = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/host/test_h200_fixtures.py", "-k", "not role"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PDSTACK_H200_FIXTURES": str(fx)})
    assert sub.returncode == 0, sub.stdout[-4000:] + sub.stderr[-2000:]
    assert " passed" in sub.stdout and "failed" not in sub.stdout


def test_fixtures_script_refuses_a_gpu_less_run(tmp_path):
    run = tmp_path / "host-path"
    (run / "raw").mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    (run / "steps.tsv").write_text("smi\t127\t0\traw/nvidia-smi (not found)\n")
    fx = tmp_path / "fixtures"
    shutil.copytree(FIXTURES, fx)
    proc = subprocess.run([sys.executable, "gpu/host_path_fixtures.py", str(tmp_path),
                           "--fixtures", str(fx), "--dest-results", str(tmp_path / "res")],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "this run saw no GPU, nothing copied" in proc.stderr
    assert not (tmp_path / "res").exists()
    for f in FIXTURES.iterdir():  # nothing half-applied
        assert (fx / f.name).read_bytes() == f.read_bytes(), f.name


def test_fixtures_script_names_machine_facts_the_real_run_contradicts():
    fx = importlib.util.spec_from_file_location("host_path_fixtures_t",
                                                REPO / "gpu" / "host_path_fixtures.py")
    assert fx is not None and fx.loader is not None
    mod = importlib.util.module_from_spec(fx)
    fx.loader.exec_module(mod)
    machine = json.loads((FIXTURES / "expected.json").read_text())["machine"]
    real = (FIXTURES / "nvidia-smi-query-gpu.csv").read_text()
    assert mod.machine_mismatches(machine, real) == []
    other = "0, NVIDIA H200, GPU-1, 570.86.15, Enabled, Enabled, 143360\n"
    assert mod.machine_mismatches(machine, other)[:3] == [
        "GPU 0: 143360, expected.json machine.memory_mib=143771",
        "GPU 0: 570, expected.json machine.driver_major=580",
        "GPU 0: MIG 'Enabled', expected.json machine.mig_modes=['Disabled', None]"]
