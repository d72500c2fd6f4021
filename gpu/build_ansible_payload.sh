#!/bin/bash
# Build gpu/payload-ansible/ (gitignored): ansible-core and its dependencies as wheels for
# the GPU machine (CPython 3.12, manylinux x86_64, binary only, no network there), plus the
# Ansible collections the host-path roles need, as a tarball.  gpu/host_path.sh installs
# from it.  Run here, from the repository root:
#     bash gpu/build_ansible_payload.sh [OUT_DIR]        (default gpu/payload-ansible)
#     SLIM=1 bash gpu/build_ansible_payload.sh              (3.5 MiB instead of 8.3 MiB)
# Takes ~10 s; the folder must stay under 20 MiB (the lead's device call carries 64 MiB in all).
# SLIM=1 leaves out cryptography, cffi and pycparser (4.8 MiB): ansible-core imports
# cryptography only for Vault, which the host path does not use (rehearsed without them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-gpu/payload-ansible}
ANSIBLE_CORE=2.21.5          # = pyproject.toml's controller pin
PY=${PYTHON:-}
[ -n "$PY" ] || PY=$(command -v python3.12 || true)
[ -n "$PY" ] || PY=/root/.pyenv/versions/3.12.1/bin/python3.12
[ -x "$PY" ] || { echo "build_ansible_payload: no python3.12 (set PYTHON=)" >&2; exit 1; }
ROLES=(gpu_host rdma_ucx container_runtime)
MAX_BYTES=$((20 * 1024 * 1024))

grep -q "ansible-core==$ANSIBLE_CORE" pyproject.toml \
  || { echo "build_ansible_payload: pyproject.toml no longer pins ansible-core==$ANSIBLE_CORE" >&2; exit 1; }

rm -rf "$OUT"
mkdir -p "$OUT/wheels"
"$PY" -m pip download --quiet --disable-pip-version-check --no-cache-dir \
  --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 --platform any \
  -d "$OUT/wheels" "ansible-core==$ANSIBLE_CORE" 2> >(grep -v "is ignored" >&2)

if [ "${SLIM:-0}" = 1 ]; then
  rm -f "$OUT"/wheels/cryptography-*.whl "$OUT"/wheels/cffi-*.whl "$OUT"/wheels/pycparser-*.whl
  echo "SLIM=1: without cryptography, cffi, pycparser (Vault only)" > "$OUT/slim.txt"
fi

# Collections: every FQCN the roles (and gpu/host_path.yml) use outside ansible.builtin /
# ansible.legacy, taken from the controller venv's `ansible` package.
mapfile -t COLLS < <(grep -rhoE '\b[a-z0-9_]+\.[a-z0-9_]+\.[a-z0-9_]+:' \
    "${ROLES[@]/#/ansible/roles/}" gpu/host_path.yml \
  | sed -E 's/:$//' | awk -F. '{print $1"."$2}' \
  | grep -vE '^(ansible\.(builtin|legacy))$' | sort -u || true)
# a.b.c: also matches dotted values such as "2.20.0" or "x.stat.exists": keep only those
# that are installed collections
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
VENV_SITE=$(ls -d .venv/lib/python3.12/site-packages 2>/dev/null || echo "$SITE")
NEEDED=()
for c in "${COLLS[@]}"; do
  [ -d "$VENV_SITE/ansible_collections/${c%%.*}/${c#*.}" ] && NEEDED+=("$c")
done
if [ ${#NEEDED[@]} -gt 0 ]; then
  tar -C "$VENV_SITE" -czf "$OUT/collections.tar.gz" \
    $(for c in "${NEEDED[@]}"; do echo "ansible_collections/${c%%.*}/${c#*.}"; done)
  printf '%s\n' "${NEEDED[@]}" > "$OUT/collections.txt"
else
  : > "$OUT/collections.txt"   # the roles use ansible.builtin only: no collection to carry
fi

(cd "$OUT" && sha256sum wheels/*.whl $( [ -f collections.tar.gz ] && echo collections.tar.gz ) > SHA256SUMS)
bytes=$(du -sb "$OUT" | cut -f1)
echo "payload: $OUT $(ls "$OUT/wheels" | wc -l) wheels, collections: ${NEEDED[*]:-none}," \
     "$((bytes / 1024)) KiB"
[ "$bytes" -le "$MAX_BYTES" ] || { echo "build_ansible_payload: $OUT is $bytes bytes > 20 MiB" >&2; exit 1; }
