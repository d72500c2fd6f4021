#!/usr/bin/env bash
# Install everything pdstack's tests need on a fresh Debian 12 machine (root, 2 cores,
# no GPU, only PyPI/Debian reachable). Idempotent: each step is skipped when done.
#   1. the project venv (.venv, Python 3.12: ansible-core 2.21 needs >= 3.12)
#   2. Docker engine + Compose v2 + local base image + pdstack images   (.ci/install-docker.sh)
#   3. the Python 3.11 vLLM CPU venv for real-engine tests              (.ci/install-vllm-venv.sh)
#   4. the network-namespace lab's packages (sshd, iproute2, iptables)  (.ci/install-ansible-lab.sh)
#   5. Prometheus + promtool (Debian package) for the monitoring tests   (.ci/install-prometheus.sh)
# Step 3 (pip downloads and unpacking, ~4 GB) runs in the background while 1, 2, 4 and 5
# run (apt, debootstrap, image builds); each step is cached by its content (see the scripts).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
t0=$(date +%s)
step() { echo "[install $(( $(date +%s) - t0 ))s] $*"; }

find_py312() {
  local c
  for c in "$(command -v python3.12 || true)" "$HOME"/.pyenv/versions/3.12*/bin/python3.12 \
           /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
    [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}

: "${CI_LOG_DIR:=/var/tmp/ci-install}"
mkdir -p "$CI_LOG_DIR"
vllm_log="$CI_LOG_DIR/vllm-venv.log"
step "vLLM CPU venv, in the background (log: $vllm_log)"
bash .ci/install-vllm-venv.sh >"$vllm_log" 2>&1 &
vllm_pid=$!
trap '[ -n "${vllm_pid:-}" ] && kill "$vllm_pid" 2>/dev/null; true' EXIT

stamp=.venv/.pdstack-installed
want=$(sha256sum pyproject.toml | cut -c1-16)
if [ ! -x .venv/bin/pdstack ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  py=$(find_py312) || { echo "install: no Python 3.12 found (pyenv 3.12 or python3.12)" >&2; exit 1; }
  step "project venv with $py"
  [ -x .venv/bin/python ] || "$py" -m venv .venv
  .venv/bin/python -m pip install -q -U pip
  .venv/bin/python -m pip install -q -e '.[bench,controller,dev]'
  echo "$want" > "$stamp"
fi

step "docker engine, compose, images"
bash .ci/install-docker.sh
step "lab packages"
bash .ci/install-ansible-lab.sh
step "prometheus (promtool + server for the monitoring tests)"
bash .ci/install-prometheus.sh
step "waiting for the vLLM CPU venv"
if ! wait "$vllm_pid"; then
  vllm_pid=""
  tail -40 "$vllm_log"; echo "install: the vLLM CPU venv failed (log: $vllm_log)" >&2; exit 1
fi
vllm_pid=""
tail -6 "$vllm_log"
step "done"
