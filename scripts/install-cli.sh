#!/usr/bin/env bash
# The `pdstack` command, installed the way Python CLIs are: pipx puts this checkout
# (editable: a `git pull` needs no reinstall) with its dependencies and the `bench` extra
# into its own virtual environment, and links `pdstack` onto PATH. The one-line install
# docs/getting-started.md documents is the pipx line below; this script adds pipx itself (Debian's
# package) and, as root, installs for every user (PIPX_HOME=/opt/pipx,
# PIPX_BIN_DIR=/usr/local/bin). Idempotent: reinstalls only when pyproject.toml changed.
#   bash scripts/install-cli.sh         (./quickstart runs it)
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
ROOT=$(cd "$(dirname "$0")/.." && pwd)
say() { echo "[install-cli] $*"; }

if ! command -v pipx >/dev/null; then
  say "apt-get install pipx"
  APT=(flock "${CI_APT_LOCK:-/var/tmp/ci-apt.lock}" apt-get -o DPkg::Lock::Timeout=600 -o Acquire::Retries=3 -qq)
  "${APT[@]}" update
  "${APT[@]}" install -y --no-install-recommends pipx >/dev/null
fi
if [ "$(id -u)" = 0 ]; then
  export PIPX_HOME=${PIPX_HOME:-/opt/pipx} PIPX_BIN_DIR=${PIPX_BIN_DIR:-/usr/local/bin}
fi
bin_dir=${PIPX_BIN_DIR:-$HOME/.local/bin}
venv=${PIPX_HOME:-$HOME/.local/pipx}/venvs/pdstack
stamp="$venv/.pdstack-cli"
want="$ROOT $(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
if [ -x "$bin_dir/pdstack" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  say "pdstack is up to date: $bin_dir/pdstack -> $ROOT"
else
  say "pipx install --editable '$ROOT[bench]' (its own venv; first time ~1 min)"
  if ! out=$(cd "$ROOT" && pipx install --force --editable '.[bench]' 2>&1); then
    echo "$out" >&2; exit 1
  fi
  echo "$want" > "$stamp"
  say "installed $bin_dir/pdstack"
fi
case ":$PATH:" in
  *":$bin_dir:"*) ;;
  *) say "note: $bin_dir is not on PATH: run 'pipx ensurepath' (or add it) and open a new shell" ;;
esac
