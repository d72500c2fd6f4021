#!/usr/bin/env bash
# Install vllm-router (Rust load balancer with P/D support, from PyPI) into its
# own venv so its dependencies never touch the project venv.
#   bash benchmarks/install_vllm_router.sh            # -> .venv-router/bin/vllm-router
# Also puts uvloop into .venv-uvloop (pip --target, for the project venv's Python):
# proxy_overhead.py runs its load generator and fake engines on it, and measures the
# pdstack proxy with and without it.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"  # .python-version there picks the interpreter under pyenv
venv="${VLLM_ROUTER_VENV:-$here/.venv-router}"
version="${VLLM_ROUTER_VERSION:-0.1.17}"
python="${PYTHON:-python3}"
uvloop_dir="$here/.venv-uvloop"
uvloop_version="${UVLOOP_VERSION:-0.23.0}"
project_python="$here/.venv/bin/python"
[[ -x "$project_python" ]] || project_python="$python"

if [[ -x "$venv/bin/vllm-router" ]] && "$venv/bin/python" -m pip show vllm-router 2>/dev/null \
    | grep -x "Version: $version" >/dev/null; then
  echo "vllm-router $version already in $venv"
else
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet "vllm-router==$version"
  echo "installed vllm-router $version into $venv"
fi

if [[ -d "$uvloop_dir/uvloop" ]]; then
  echo "uvloop already in $uvloop_dir"
else
  "$project_python" -m pip install --quiet --target "$uvloop_dir" "uvloop==$uvloop_version"
  echo "installed uvloop $uvloop_version into $uvloop_dir"
fi
