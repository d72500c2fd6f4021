"""The GPU branch of the node checks, fed with what an H200 host prints (issue 19).

Every file in tests/fixtures/h200/ is parsed by the code the roles and the probe run:
scripts/pdstack_probe.py's parsers, directly and through the Ansible filter plugin
(ansible/plugins/filter/pdstack_host.py) that gpu_host and rdma_ucx call.  The files are
whatever is in the folder, and expected.json says which are still placeholders (the real
ones were recorded on a lent H200 by gpu/host_path.sh, removed after 7f9e464).  The last
two tests run the gpu_host and rdma_ucx roles themselves (ansible/preflight.yml, check
mode, connection local) with test doubles of ``nvidia-smi`` and the RDMA tools that replay
the recorded outputs only for the recorded argv.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
# another folder of the same layout (a new recording, before it replaces this one)
FIXTURES = Path(os.environ.get("PDSTACK_H200_FIXTURES", REPO / "tests" / "fixtures" / "h200"))
EXPECTED: dict[str, Any] = json.loads((FIXTURES / "expected.json").read_text())
MACHINE: dict[str, Any] = EXPECTED["machine"]
ANSIBLE_PLAYBOOK = REPO / ".venv" / "bin" / "ansible-playbook"


def _load(name: str, path: Path) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


probe = _load("pdstack_probe", REPO / "scripts" / "pdstack_probe.py")
plugin = _load("pdstack_host_filters", REPO / "ansible" / "plugins" / "filter" / "pdstack_host.py")
FILTERS = plugin.FilterModule().filters()

# file name -> kind; a file of no kind fails test_every_fixture_has_a_kind
KINDS = [
    (r".*nvidia-smi-query-gpu\.argv", "smi_argv"),
    (r".*nvidia-smi-query-gpu.*\.csv", "smi_csv"),
    (r".*nvidia-smi-topo-m\.txt", "smi_topo"),
    (r".*nvidia-smi-L\.txt", "smi_list"),
    (r".*proc_driver_nvidia_version\.txt", "proc_version"),
    (r".*sys_module_nvidia_version\.txt", "module_version"),
    (r".*ucx_info-v\.txt", "ucx_version"),
    (r".*ucx_info-d\.txt", "ucx_devices"),
    (r".*ibv_devinfo\.txt", "ibv_devinfo"),
    (r".*ulimit-l\.txt", "memlock"),
    (r".*dev-nodes\.txt", "dev_nodes"),
    # saved for people, parsed by no code
    (r".*(nvidia-smi\.txt|nvidia-smi-q\.txt|nvidia-smi-nvlink-s\.txt|ibv_devices\.txt|"
     r"nvidia-smi-query-mig\.csv)", "reference"),
]
FILES = sorted(p.name for p in FIXTURES.iterdir()
               if p.is_file() and p.name not in ("README.md", "expected.json"))


def kind_of(name: str) -> str | None:
    return next((k for pat, k in KINDS if re.fullmatch(pat, name)), None)


def this_machine(name: str) -> bool:
    """Files of the lent 1xH200 machine; ``h200x2-*`` files come from another machine."""
    return not name.startswith("h200x2-")


def expect(name: str) -> dict[str, Any]:
    return dict(EXPECTED["files"].get(name, {"status": "real"}))


def text(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8", errors="replace")


def infiniband_nodes(ls_text: str) -> list[str]:
    """Names in the ``/dev/infiniband:`` section of ``ls -la`` (raw/dev-nodes.txt)."""
    names: list[str] = []
    inside = False
    for line in ls_text.splitlines():
        if line.endswith(":"):
            inside = line == "/dev/infiniband:"
            continue
        parts = line.split()
        if inside and len(parts) >= 9 and parts[-1] not in (".", ".."):
            names.append(parts[-1])
    return names


def query_gpus() -> list[dict[str, Any]]:
    """The GPUs of this machine as the role's own query printed them."""
    return probe.parse_nvidia_smi_csv(text("nvidia-smi-query-gpu.csv"))


# ---------------------------------------------------------------------------- the folder

def test_every_fixture_has_a_kind_and_a_status():
    assert FILES, f"{FIXTURES} is empty"
    for name in FILES:
        assert kind_of(name), f"{name}: no parser kind in tests/host/test_h200_fixtures.py KINDS"
        assert expect(name)["status"] in ("real", "placeholder"), name
    for name in EXPECTED["files"]:
        assert name in FILES, f"expected.json lists {name}, which is not in {FIXTURES}"


def status_table(expected: dict[str, Any]) -> str:
    """The README's table of fixture files: status and source, from expected.json."""
    rows = ["| file | status | source |", "|---|---|---|"]
    for name in sorted(expected["files"]):
        f = expected["files"][name]
        status = "**placeholder**" if f["status"] == "placeholder" else "real"
        rows.append(f"| `{name}` | {status} | {f.get('source', '')} |")
    return "\n".join(rows)


def test_readme_table_is_the_status_of_expected_json():
    table = status_table(EXPECTED)
    assert table in text("README.md"), (
        f"tests/fixtures/h200/README.md is stale: its status table should read\n{table}")


# ---------------------------------------------------------------------------- every file

@pytest.mark.parametrize("name", FILES)
def test_fixture_parses_through_the_roles_and_the_probes_code(name):
    kind = kind_of(name)
    body = text(name)
    exp = expect(name)
    assert body.strip(), f"{name} is empty"
    if kind == "smi_argv":
        # the recorded run asked exactly what the role and the probe ask now
        assert body.split("\n")[:-1] == probe.nvidia_smi_query_argv(), (
            f"{name}: the nvidia-smi query changed since the recording: record it on a GPU "
            "machine again (tests/fixtures/h200/README.md)")
        role_argv = FILTERS["pdstack_nvidia_smi_query_argv"]("nvidia-smi")
        assert role_argv == probe.nvidia_smi_query_argv()
    elif kind == "smi_csv":
        gpus = probe.parse_nvidia_smi_csv(body)
        assert FILTERS["pdstack_nvidia_smi_gpus"](body) == gpus  # the role's path
        want = exp.get("gpus", MACHINE["gpu_count"])
        assert len(gpus) == want
        for g in gpus:
            assert g["name"] == MACHINE["gpu_model"]
            assert g["memory_mib"] == MACHINE["memory_mib"]
            assert probe.parse_driver_version(g["driver_version"])[0] == MACHINE["driver_major"]
            if "mig_mode" in g:
                assert g["mig_mode"] in MACHINE["mig_modes"]
            if "index" in g:
                assert isinstance(g["index"], int)
        if "index" in gpus[0]:
            assert [g["index"] for g in gpus] == list(range(len(gpus)))
        if this_machine(name):
            ok = FILTERS["pdstack_gpu_problems"](gpus, MACHINE["gpu_count"], MACHINE["gpu_model"],
                                                 MACHINE["min_driver"], True)
            assert ok == []
    elif kind == "smi_topo":
        topo = probe.parse_nvidia_smi_topo(body)
        want = exp.get("gpus", MACHINE["gpu_count"])
        assert topo["gpus"] == [f"GPU{i}" for i in range(want)]
        for gpu_name in topo["gpus"]:
            assert topo["cpu_affinity"][gpu_name], f"{gpu_name}: no CPU affinity"
            assert set(topo["links"][gpu_name]) == set(topo["gpus"]) - {gpu_name}
        if "links" in exp:
            assert topo["links"] == exp["links"]
    elif kind == "smi_list":
        uuids = re.findall(r"^GPU (\d+): .+ \(UUID: (GPU-[0-9a-f-]+)\)$", body, re.M)
        assert len(uuids) == MACHINE["gpu_count"]
        assert [u for _, u in uuids] == [g["uuid"] for g in query_gpus()]
    elif kind in ("proc_version", "module_version"):
        version = (probe.parse_nvidia_proc_version(body) if kind == "proc_version"
                   else body.strip())
        assert version == query_gpus()[0]["driver_version"]  # the kernel module = the library
        assert probe.driver_at_least(version, MACHINE["min_driver"])
    elif kind == "ucx_version":
        version = probe.parse_ucx_info_version(body)
        assert version and re.fullmatch(r"\d+\.\d+(\.\d+)?\S*", version), body[:200]
        if "version" in exp:
            assert version == exp["version"]
    elif kind == "ucx_devices":
        devices = probe.parse_ucx_info_devices(body)
        assert len(devices) == len(re.findall(r"^#\s+Transport:", body, re.M))
        rdma = probe.ucx_rdma_transports(body)
        assert FILTERS["pdstack_ucx_rdma_transports"](body) == rdma  # the rdma_ucx role's path
        if "transports" in exp:
            assert sorted({d["transport"] for d in devices}) == exp["transports"]
            assert rdma == exp["rdma_transports"]
        if "cuda_ipc" in exp:
            assert any(d["transport"] == "cuda_ipc" for d in devices) is exp["cuda_ipc"]
    elif kind == "ibv_devinfo":
        ports = probe.parse_ibv_devinfo(body)
        assert FILTERS["pdstack_ibv_ports"](body) == ports  # the rdma_ucx role's path
        assert len(ports) == len(re.findall(r"^\s+port:\s+\d+", body, re.M))
        assert all(p["hca"] and p["state"].startswith("PORT_") for p in ports)
        if "ports" in exp:
            assert len(ports) == exp["ports"]
            assert sum(p["state"] == "PORT_ACTIVE" for p in ports) == exp["active_ports"]
    elif kind == "dev_nodes":
        names = infiniband_nodes(body)  # what rdma_ucx's find lists in /dev/infiniband
        verbs = FILTERS["pdstack_rdma_verbs_devices"](names)
        assert verbs == probe.rdma_verbs_devices(names)
        assert all(n.startswith("uverbs") for n in verbs)
        if "/dev/nvidia-uvm" not in body:
            pytest.fail(f"{name}: no /dev/nvidia-uvm: CUDA (and CUDA IPC) cannot run there")
    elif kind == "memlock":
        value = body.strip()  # the rdma_ucx role compares it as 'unlimited' or an int
        assert value == "unlimited" or value.isdigit(), value
    else:
        assert kind == "reference"


# ---------------------------------------------------------------------------- the judgement

def test_wrong_inventory_is_named_field_by_field():
    gpus = query_gpus()
    n = len(gpus)
    problems = FILTERS["pdstack_gpu_problems"](gpus, n + 1, "NVIDIA H100 80GB HBM3",
                                               MACHINE["min_driver"], True)
    assert problems == [
        f"nvidia-smi shows {n} GPU(s), the inventory says pdstack_gpu_count={n + 1}",
        f"GPU model {MACHINE['gpu_model']}, the inventory says "
        "pdstack_gpu_model=NVIDIA H100 80GB HBM3",
    ]
    newer = FILTERS["pdstack_gpu_problems"](gpus, n, "", "999.1", True)
    assert newer == [f"driver {gpus[0]['driver_version']} is older than 999.1 (the engine "
                     "image's minimum, gpu_host_min_driver_version)"]


# ---------------------------------------------------------------------------- synthetic cases

FIELDS = list(probe.NVSMI_GPU_FIELDS)


@pytest.mark.parametrize(("line", "key", "value"), [
    ("0, NVIDIA H200, GPU-1, 580.159.04, Enabled, [N/A], 143771", "mig_mode", None),
    ("0, NVIDIA H200, GPU-1, 580.159.04, Enabled, N/A, 143771", "mig_mode", None),
    ("0, NVIDIA H200, GPU-1, 580.159.04, [Not Supported], Enabled, 143771", "persistence_mode",
     None),
    ("0, NVIDIA H200, GPU-1, 580.159.04, Enabled, Disabled, 143771 MiB", "memory_mib", 143771),
    ("0, NVIDIA H200, GPU-1, 580.159.04, Enabled, Disabled, 140.4 GiB", "memory_mib", 143769),
    ("0, NVIDIA H200, GPU-1, 580.159.04, Enabled, Disabled, [N/A]", "memory_mib", None),
    ("3, NVIDIA H200, GPU-1, 580.159.04, Enabled, Disabled, 143771", "index", 3),
    ("0, NVIDIA H200 NVL, rev 2, GPU-1, 580.159.04, Enabled, Disabled, 1", "name",
     "NVIDIA H200 NVL, rev 2"),
])
def test_nvidia_smi_values(line, key, value):
    (gpu,) = probe.parse_nvidia_smi_csv(line + "\n", FIELDS)
    assert gpu[key] == value


def test_header_sets_the_field_order():
    out = "memory.total [MiB], name, index\n143771 MiB, NVIDIA H200, 0\n"
    assert probe.parse_nvidia_smi_csv(out) == [
        {"memory_mib": 143771, "name": "NVIDIA H200", "index": 0}]


def test_no_devices_is_an_error_quoting_the_line():
    with pytest.raises(ValueError, match="No devices were found"):
        probe.parse_nvidia_smi_csv("No devices were found\n")
    # the role gets it as a problem (its fail message), not as a template crash
    gpus = FILTERS["pdstack_nvidia_smi_gpus"]("No devices were found\n")
    problems = FILTERS["pdstack_gpu_problems"](gpus, 1, "", "570.26", True)
    assert len(problems) == 1 and "No devices were found" in problems[0]


def test_mig_enabled_is_named_unless_allowed():
    out = ("0, NVIDIA H200, GPU-1, 580.159.04, Enabled, Enabled, 143771\n"
           "1, NVIDIA H200, GPU-2, 580.159.04, Enabled, Disabled, 143771\n")
    gpus = probe.parse_nvidia_smi_csv(out)
    assert probe.gpu_problems(gpus, 2, "NVIDIA H200", "570.26", True) == [
        "MIG is enabled on GPU(s) 0 (disable it: nvidia-smi -mig 0, or set "
        "gpu_host_fail_on_mig: false)"]
    assert probe.gpu_problems(gpus, 2, "NVIDIA H200", "570.26", False) == []
    assert FILTERS["pdstack_gpu_problems"](gpus, "2", "NVIDIA H200", "570.26", "false") == []


@pytest.mark.parametrize(("version", "minimum", "ok"), [
    ("580.159.04", "570.26", True), ("570.26", "570.26", True), ("570.9", "570.26", False),
    ("565.57.01", "570.26", False), ("1000.1", "570.26", True), ("", "570.26", False),
])
def test_driver_versions_compare_numerically(version, minimum, ok):
    assert probe.driver_at_least(version, minimum) is ok


# ---------------------------------------------------------------------------- the role itself

RECAP = r"h200-node1\s*:\s*ok=\d+\s+changed=0\s+unreachable=0\s+failed={failed}\s"


def fake_nvidia_smi(tmp_path: Path) -> Path:
    """A PATH directory whose ``nvidia-smi`` is the test double tests/host/fake_nvidia_smi.sh:
    it replays this folder's recordings for the recorded argv only."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").symlink_to(REPO / "tests" / "host" / "fake_nvidia_smi.sh")
    return bindir


def _node_checks(inventory: str, bindir: Path, tags: str = "gpu",
                 extra: list[str] | None = None,
                 env_extra: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """ansible/preflight.yml's node roles of ``tags`` on this machine as the inventory's node,
    read-only; ``--skip-tags always`` leaves out the controller-side validate play."""
    env = {**os.environ, "PATH": f"{bindir}:{REPO / '.venv' / 'bin'}:{os.environ.get('PATH', '')}",
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
           "FAKE_NVIDIA_SMI_FIXTURES": str(FIXTURES), **(env_extra or {})}
    return subprocess.Popen(
        [str(ANSIBLE_PLAYBOOK), "ansible/preflight.yml", "-i", f"inventory/{inventory}",
         "--check", "--tags", tags, "--skip-tags", "always", "-e", "ansible_connection=local",
         "-e", f"ansible_python_interpreter={sys.executable}", *(extra or [])],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_gpu_host_role_passes_and_fails_on_the_recorded_query(tmp_path):
    """The role's own tasks on the recorded nvidia-smi answer: inventory/h200x1-host passes,
    inventory/h200x1-host-wrong fails naming pdstack_gpu_count and pdstack_gpu_model."""
    bindir = fake_nvidia_smi(tmp_path)
    right = _node_checks("h200x1-host", bindir)
    wrong = _node_checks("h200x1-host-wrong", bindir)
    out_right, _ = right.communicate(timeout=240)
    out_wrong, _ = wrong.communicate(timeout=240)
    g = query_gpus()[0]
    assert right.returncode == 0, out_right
    assert re.search(RECAP.format(failed=0), out_right), out_right
    report = (f"h200-node1: 1 x {g['name']}, driver {g['driver_version']}, {g['memory_mib']} MiB, "
              f"persistence mode {g['persistence_mode']}")
    assert report in re.sub(r"\s+", " ", out_right), out_right
    assert wrong.returncode == 2, out_wrong
    assert ("h200-node1: nvidia-smi shows 1 GPU(s), the inventory says pdstack_gpu_count=2; "
            f"GPU model {g['name']}, the inventory says pdstack_gpu_model=NVIDIA H100 80GB HBM3"
            in re.sub(r"\s+", " ", out_wrong)), out_wrong
    assert re.search(RECAP.format(failed=1), out_wrong), out_wrong


def test_rdma_ucx_role_on_recorded_ibv_devinfo_and_ucx_info(tmp_path):
    """The RDMA branch of rdma_ucx (never run in the lab: no /dev/infiniband there) on the
    recorded ibv_devinfo and ucx_info -d, with test doubles of ibv_devinfo and docker and
    rdma_ucx_device_dir pointing at a scratch directory: RDMA found -> passes with
    pdstack_rdma: true; every port down, or UCX without rc/ud/dc -> fails naming why."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("ibv_devinfo", "docker"):
        (bindir / tool).symlink_to(REPO / "tests" / "host" / "fake_rdma_tools.sh")
    devdir = tmp_path / "infiniband"
    devdir.mkdir()
    (devdir / "uverbs0").write_text("")
    ibv, ucx_d = text("ibv_devinfo.txt"), text("ucx_info-d.txt")
    down = tmp_path / "ibv_devinfo-down.txt"
    down.write_text(ibv.replace("PORT_ACTIVE", "PORT_DOWN"))
    no_rdma = tmp_path / "ucx_info-d-no-rdma.txt"  # the same listing without rc/ud/dc
    no_rdma.write_text("".join(
        block for block in re.split(r"(?m)^(?=#\s+Transport:)", ucx_d)
        if not re.match(r"#\s+Transport:\s+(rc|ud|dc)", block)))
    active = sum(p["state"] == "PORT_ACTIVE" for p in probe.parse_ibv_devinfo(ibv))
    transports = probe.ucx_rdma_transports(ucx_d)
    assert active > 0 and transports, "the RDMA fixtures must show an active port and rc/ud/dc"
    assert probe.ucx_rdma_transports(no_rdma.read_text()) == []
    image = "pdstack/engine:fixture"
    extra = ["-e", "pdstack_rdma=true", "-e", f"rdma_ucx_device_dir={devdir}",
             "-e", f"pdstack_engine_image={image}"]
    real_devdir = tmp_path / "infiniband-as-recorded"  # the lent H200's /dev/infiniband
    real_devdir.mkdir()
    real_names = infiniband_nodes(text("dev-nodes.txt"))
    for n in real_names:
        (real_devdir / n).write_text("")
    real_verbs = probe.rdma_verbs_devices(real_names)
    cases = {
        "rdma": (FIXTURES / "ibv_devinfo.txt", FIXTURES / "ucx_info-d.txt"),
        "ports_down": (down, FIXTURES / "ucx_info-d.txt"),
        "ucx_without_rdma": (FIXTURES / "ibv_devinfo.txt", no_rdma),
    }
    runs = {k: _node_checks("h200x1-host", bindir, "rdma", extra,
                            {"FAKE_IBV_DEVINFO": str(i), "FAKE_UCX_INFO_D": str(u)})
            for k, (i, u) in cases.items()}
    as_recorded = [a.replace(str(devdir), str(real_devdir)) for a in extra]
    runs["as_recorded"] = _node_checks(
        "h200x1-host", bindir, "rdma", as_recorded,
        {"FAKE_IBV_DEVINFO": str(FIXTURES / "ibv_devinfo.txt"),
         "FAKE_UCX_INFO_D": str(FIXTURES / "ucx_info-d.txt")})
    outs = {k: re.sub(r"\s+", " ", r.communicate(timeout=240)[0]) for k, r in runs.items()}
    assert runs["rdma"].returncode == 0, outs["rdma"]
    assert (f"h200-node1: NIXL transport RDMA ({active} active port(s), UCX transports "
            f"{','.join(transports)})") in outs["rdma"], outs["rdma"]
    lead = "h200-node1: the inventory sets pdstack_rdma: true but NIXL would fall back to TCP: "
    assert runs["ports_down"].returncode == 2, outs["ports_down"]
    assert lead + "no port in state PORT_ACTIVE (ibv_devinfo)" in outs["ports_down"]
    if not real_verbs:  # the lent H200: rdma_cm only -> said so, not "ibv_devinfo failed"
        assert runs["as_recorded"].returncode == 2, outs["as_recorded"]
        assert (lead + f"{real_devdir} has no uverbs device (only {', '.join(sorted(real_names))})"
                ": no RDMA HCA is exposed to this host") in outs["as_recorded"], outs["as_recorded"]
    else:
        assert runs["as_recorded"].returncode == 0, outs["as_recorded"]
    assert runs["ucx_without_rdma"].returncode == 2, outs["ucx_without_rdma"]
    assert (lead + f"ucx_info -d in {image} lists no RDMA transport (rc/ud/dc)"
            in outs["ucx_without_rdma"]), outs["ucx_without_rdma"]
