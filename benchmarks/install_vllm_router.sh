#!/usr/bin/env bash
# Install vllm-router (Rust load balancer with P/D support, from PyPI) into its
# own venv so its dependencies never touch the project venv.
#   bash benchmarks/install_vllm_router.sh            # -> .venv-router/bin/vllm-router
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"  # .python-version there picks the interpreter under pyenv
venv="${VLLM_ROUTER_VENV:-$here/.venv-router}"
version="${VLLM_ROUTER_VERSION:-0.1.17}"
python="${PYTHON:-python3}"
if [[ -x "$venv/bin/vllm-router" ]] && "$venv/bin/python" -m pip show vllm-router 2>/dev/null \
    | grep -x "Version: $version" >/dev/null; then
  echo "vllm-router $version already in $venv"
  exit 0
fi
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "vllm-router==$version"
ls -l "$venv/bin/" | grep -i router || true
echo "installed vllm-router $version into $venv"
