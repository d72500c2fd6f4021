#!/usr/bin/env bash
# Install everything pdstack's tests need on a fresh Debian 12 machine (root, 2 cores,
# no GPU, only PyPI/Debian reachable). Idempotent: each step is skipped when done.
#   1. the project venv (.venv, Python 3.12: ansible-core 2.21 needs >= 3.12)
#   2. Docker engine + Compose v2 + local base image + pdstack images   (.ci/install-docker.sh)
#   3. the Python 3.11 vLLM CPU venv for real-engine tests              (.ci/install-vllm-venv.sh)
#   4. the network-namespace lab's packages (sshd, iproute2, iptables)  (.ci/install-ansible-lab.sh)
#   5. Prometheus + promtool (Debian package) for the monitoring tests   (.ci/install-prometheus.sh)
#   (and pipx, for the fresh-clone test of the README's CLI install line)
# Steps 2 and 3 run in the background from the start, while 1, 4 and 5 run in the
# foreground: step 2 (apt, mmdebstrap, then the engine image build: ~6 min fresh) is the
# longest path, step 3 (pip downloads and unpacking, ~4 GB) and step 1 (pip) only compete
# with it for the network and the disk. apt runs under one lock (/var/tmp/ci-apt.lock).
# Each step is cached by its content (see the scripts). Logs: $CI_LOG_DIR (/var/tmp/ci-install).
#   .ci/install.sh          everything (steps 1-5), as above
#   .ci/install.sh light    steps 1, 4, 5 only: what the light tests need (.ci/run runs them
#                           while `.ci/install.sh heavy` builds the rest)
#   .ci/install.sh heavy    steps 2 and 3 only (side by side), for the heavy tests
set -euo pipefail
PHASE=${1:-all}
case "$PHASE" in all|light|heavy) ;; *) echo "install: phase is all, light or heavy, not '$PHASE'" >&2; exit 2;; esac
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
docker_log="$CI_LOG_DIR/docker.log"
if [ "$PHASE" != light ]; then
  step "vLLM CPU venv, in the background (log: $vllm_log)"
  bash .ci/install-vllm-venv.sh >"$vllm_log" 2>&1 &
  vllm_pid=$!
  step "docker engine, compose, images, in the background (log: $docker_log)"
  bash .ci/install-docker.sh >"$docker_log" 2>&1 &
  docker_pid=$!
  trap 'for p in "${vllm_pid:-}" "${docker_pid:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null; done; true' EXIT
fi

wait_heavy() {
  step "waiting for docker engine, compose, images"
  if ! wait "$docker_pid"; then
    docker_pid=""
    tail -40 "$docker_log"; echo "install: docker engine/images failed (log: $docker_log)" >&2; exit 1
  fi
  docker_pid=""
  grep '^\[install-docker' "$docker_log" || true
  step "waiting for the vLLM CPU venv"
  if ! wait "$vllm_pid"; then
    vllm_pid=""
    tail -40 "$vllm_log"; echo "install: the vLLM CPU venv failed (log: $vllm_log)" >&2; exit 1
  fi
  vllm_pid=""
  tail -6 "$vllm_log"
  step "done"
}
if [ "$PHASE" = heavy ]; then
  wait_heavy
  exit 0
fi

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

if ! command -v pipx >/dev/null; then
  step "pipx (the README's CLI install line; tests/spine/test_first_day.py runs it)"
  flock "${CI_APT_LOCK:-/var/tmp/ci-apt.lock}" apt-get -o DPkg::Lock::Timeout=600 -qq \
    install -y --no-install-recommends pipx >/dev/null
fi
step "lab packages"
bash .ci/install-ansible-lab.sh
step "prometheus (promtool + server for the monitoring tests)"
bash .ci/install-prometheus.sh
if [ "$PHASE" = light ]; then
  step "done (light)"
else
  wait_heavy
fi
