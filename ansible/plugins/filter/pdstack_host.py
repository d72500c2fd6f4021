"""Filters that parse what the GPU/RDMA nodes print, for the roles gpu_host and rdma_ucx.

The parsing code has one home, ``scripts/pdstack_probe.py`` (standard library only, also
copied to the nodes and run there): this plugin loads that file and exposes its parsers,
so that the roles, the probe and the unit tests (tests/host/) read nvidia-smi,
ibv_devinfo and ucx_info with the same functions.  Enabled by ``filter_plugins`` in the
repository's ansible.cfg.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

PROBE = Path(__file__).resolve().parents[3] / "scripts" / "pdstack_probe.py"


def _probe() -> ModuleType:
    name = "pdstack_probe"
    mod = sys.modules.get(name)
    if mod is not None and Path(getattr(mod, "__file__", "") or "").resolve() == PROBE:
        return mod
    spec = importlib.util.spec_from_file_location(name, PROBE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {PROBE}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def nvidia_smi_query_argv(binary: str = "nvidia-smi") -> list[str]:
    """``'nvidia-smi' | pdstack_nvidia_smi_query_argv`` -> the GPU query's argv."""
    return list(_probe().nvidia_smi_query_argv(binary))


def nvidia_smi_gpus(stdout: str) -> list[dict[str, Any]]:
    """The query's stdout -> one dict per GPU (index, name, uuid, driver_version,
    persistence_mode, mig_mode, memory_mib)."""
    try:
        return list(_probe().parse_nvidia_smi_csv(stdout or ""))
    except ValueError as exc:
        # an AnsibleFilterError would hide the line; the role reports this string instead
        return [{"error": str(exc)}]


def gpu_problems(gpus: list[dict[str, Any]], expected_count: Any, expected_model: str = "",
                 min_driver: str = "0.0", fail_on_mig: Any = True) -> list[str]:
    errors = [g["error"] for g in gpus if "error" in g]
    if errors:
        return errors
    return list(_probe().gpu_problems(gpus, int(expected_count), str(expected_model or ""),
                                      str(min_driver), _truthy(fail_on_mig)))


def ibv_ports(stdout: str) -> list[dict[str, Any]]:
    return list(_probe().parse_ibv_devinfo(stdout or ""))


def rdma_verbs_devices(names: list[str]) -> list[str]:
    return list(_probe().rdma_verbs_devices([str(n) for n in names]))


def ucx_rdma_transports(stdout: str) -> list[str]:
    return list(_probe().ucx_rdma_transports(stdout or ""))


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


class FilterModule:
    """pdstack host parsers (scripts/pdstack_probe.py)."""

    def filters(self) -> dict[str, Any]:
        return {
            "pdstack_nvidia_smi_query_argv": nvidia_smi_query_argv,
            "pdstack_nvidia_smi_gpus": nvidia_smi_gpus,
            "pdstack_gpu_problems": gpu_problems,
            "pdstack_ibv_ports": ibv_ports,
            "pdstack_rdma_verbs_devices": rdma_verbs_devices,
            "pdstack_ucx_rdma_transports": ucx_rdma_transports,
        }
