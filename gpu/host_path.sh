#!/bin/bash
# Host path of the node checks on the lent GPU machine (issue 19). Run from the repository
# root ON that machine (no network; root; other work such as vLLM engines may be using the
# GPU at the same time):
#     bash gpu/host_path.sh
# It
#   1. installs ansible-core from gpu/payload-ansible/ (bash gpu/build_ansible_payload.sh,
#      carried along) into a scratch folder: no pip, no system package, no network;
#   2. saves every raw output the roles and the probe parse (the role's exact nvidia-smi
#      query, nvidia-smi topo -m / -q / -L, driver version files, ucx_info -v/-d,
#      ibv_devices/ibv_devinfo, ulimit -l, docker / nvidia-container-runtime answers);
#   3. runs gpu/host_path.yml in check mode with ansible_connection=local: --tags gpu,rdma
#      against inventory/h200x1-host (expected: pass, failed=0) and
#      inventory/h200x1-host-wrong (expected: fail in gpu_host naming pdstack_gpu_count and
#      pdstack_gpu_model), and --tags docker (container_runtime, install off);
#   4. runs the node probe (scripts/pdstack_probe.py info / gpu / rdma / ucx) and keeps its JSON;
#   5. writes $OUT/host-path/summary.json (rc, seconds, verdict of every step).
# Read-only: check mode, nvidia-smi queries only (no CUDA context, no GPU memory), nothing
# written outside $WORK and $OUT. Every step runs under `timeout`; the whole script stays
# under ~100 s and exits 0 whatever a step did (see summary.json).
# Knobs: OUT (default /tmp/host-path-out), WORK (default /tmp/host-path-work),
# PYTHON (default python3), HOST_PATH_BUDGET_S (default 100), HOST_PATH_PAYLOAD (default
# gpu/payload-ansible).
set -uo pipefail

START=$(date +%s)
BUDGET=${HOST_PATH_BUDGET_S:-100}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_ROOT=${OUT:-/tmp/host-path-out}
RES=$OUT_ROOT/host-path
WORK=${WORK:-/tmp/host-path-work}
PY=${PYTHON:-python3}
PAYLOAD=${HOST_PATH_PAYLOAD:-$REPO/gpu/payload-ansible}
mkdir -p "$RES/raw" "$RES/ansible" "$RES/probe" "$WORK"
STEPS=$RES/steps.tsv
: > "$STEPS"
LOG=$RES/host_path.log
: > "$LOG"
cd "$REPO" || exit 0

# to stdout and the log (no tee process: nothing is left to wait for at the end)
log() { local m; m="[host-path +$(( $(date +%s) - START ))s] $*"; echo "$m"; echo "$m" >> "$LOG"; }
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# step NAME SECONDS OUTFILE CMD...: CMD's stdout to OUTFILE, stderr to OUTFILE.err (removed
# when empty); one line "name rc seconds outfile" in steps.tsv. SECONDS is capped by the
# time left in the budget; a step with under 3 s left is not started (rc 125).
step() {
  local name=$1 secs=$2 out=$3; shift 3
  local rem; rem=$(left)
  [ "$name" = summary ] && rem=$((rem > 12 ? rem : 12))   # the summary always gets its 10 s
  [ "$secs" -gt $((rem - 2)) ] && secs=$((rem - 2))
  if [ "$secs" -lt 3 ]; then
    printf '%s\t125\t0\t%s\n' "$name" "${out#"$RES"/}" >> "$STEPS"; log "$name: skipped (budget)"; return 125
  fi
  local t0 rc ms; t0=$(date +%s%N)
  timeout -k 3 "$secs" "$@" > "$out" 2> "$out.err" < /dev/null
  rc=$?
  [ -s "$out.err" ] || rm -f "$out.err"
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '%s\t%s\t%d.%03d\t%s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) "${out#"$RES"/}" >> "$STEPS"
  log "$name: rc=$rc"
  return $rc
}
have() { command -v "$1" > /dev/null 2>&1; }

log "repo $REPO, out $RES, python $(command -v "$PY") ($("$PY" -V 2>&1))"

# --------------------------------------------------------------------------- 1. ansible-core
SITE=$WORK/site
cat > "$WORK/install_ansible.sh" <<'SHEOF'
set -eu
PY=$1 SITE=$2 PAYLOAD=$3 WORK=$4
[ -f "$PAYLOAD/SHA256SUMS" ] || { echo "no $PAYLOAD/SHA256SUMS: build it with gpu/build_ansible_payload.sh and carry gpu/payload-ansible" >&2; exit 3; }
(cd "$PAYLOAD" && sha256sum -c --quiet SHA256SUMS)
rm -rf "$SITE"; mkdir -p "$SITE"
# a wheel is a zip laid out for site-packages: unpack it (no pip needed there)
"$PY" -c 'import sys, zipfile
for whl in sys.argv[2:]:
    zipfile.ZipFile(whl).extractall(sys.argv[1]); print("unpacked", whl.rsplit("/", 1)[-1])' "$SITE" "$PAYLOAD"/wheels/*.whl
if [ -f "$PAYLOAD/collections.tar.gz" ]; then
  mkdir -p "$WORK/collections"; tar -C "$WORK/collections" -xzf "$PAYLOAD/collections.tar.gz"
fi
PYTHONPATH=$SITE "$PY" -m ansible.cli.playbook --version
SHEOF
step install_ansible 40 "$RES/ansible/install.txt" bash "$WORK/install_ansible.sh" "$PY" "$SITE" "$PAYLOAD" "$WORK"

# --------------------------------------------------------------------------- 2. raw outputs
R=$RES/raw
# the gpu_host role's and the probe's query, exactly: argv from scripts/pdstack_probe.py
mapfile -t SMI_QUERY < <("$PY" -c 'import sys; sys.path.insert(0, "scripts"); import pdstack_probe as p
print("\n".join(p.nvidia_smi_query_argv()))' 2>/dev/null)
printf '%s\n' "${SMI_QUERY[@]}" > "$R/nvidia-smi-query-gpu.argv"
if have nvidia-smi; then
  step smi_query 15 "$R/nvidia-smi-query-gpu.csv" "${SMI_QUERY[@]}"
  # the same fields with units and header (--format=csv), and with units only (csv,noheader)
  step smi_query_units 15 "$R/nvidia-smi-query-gpu-units.csv" "${SMI_QUERY[0]}" "${SMI_QUERY[1]}" --format=csv
  step smi_query_units_noheader 15 "$R/nvidia-smi-query-gpu-units-noheader.csv" "${SMI_QUERY[0]}" "${SMI_QUERY[1]}" --format=csv,noheader
  step smi_query_mig 15 "$R/nvidia-smi-query-mig.csv" nvidia-smi --query-gpu=index,mig.mode.current,mig.mode.pending,persistence_mode,memory.used,memory.free,pci.bus_id,compute_cap --format=csv
  step smi_table 15 "$R/nvidia-smi.txt" nvidia-smi
  step smi_list 15 "$R/nvidia-smi-L.txt" nvidia-smi -L
  step smi_topo 15 "$R/nvidia-smi-topo-m.txt" nvidia-smi topo -m
  step smi_q 20 "$R/nvidia-smi-q.txt" nvidia-smi -q
  step smi_nvlink 15 "$R/nvidia-smi-nvlink-s.txt" nvidia-smi nvlink -s
else
  printf 'smi\t127\t0\traw/nvidia-smi (not found)\n' >> "$STEPS"; log "nvidia-smi: not found"
fi
for f in /proc/driver/nvidia/version /sys/module/nvidia/version /proc/driver/nvidia/params; do
  [ -r "$f" ] && step "file:$f" 5 "$R/$(echo "${f#/}" | tr / _).txt" cat "$f"
done
for f in /proc/driver/nvidia/gpus/*/information; do
  [ -r "$f" ] && step "file:$f" 5 "$R/$(echo "${f#/}" | tr / _ | tr : -).txt" cat "$f"
done
step dev_nodes 5 "$R/dev-nodes.txt" bash -c 'ls -la /dev/nvidia* /dev/infiniband 2>&1; ls -la /sys/class/infiniband 2>&1; true'
step ulimit_l 5 "$R/ulimit-l.txt" sh -c 'ulimit -l'
for t in ibv_devices ibv_devinfo; do
  if have "$t"; then step "$t" 10 "$R/$t.txt" "$t"; else echo "$t: not found" > "$R/$t.missing"; fi
done
# ucx_info: on PATH, else where a wheel (nixl, ucx-py) or the engine payload may ship one
UCX_INFO=$(command -v ucx_info || true)
UCX_DIRS=(/tmp/site /opt /usr/local /usr/lib/python3 /usr/lib/x86_64-linux-gnu)
if [ -z "$UCX_INFO" ]; then
  UCX_INFO=$(timeout 10 find "${UCX_DIRS[@]}" -maxdepth 8 -name ucx_info -type f -perm -u+x 2>/dev/null | head -1 || true)
fi
# UCX libraries and transport modules NIXL would load (libuct_cuda* = cuda_copy/cuda_ipc,
# libuct_ib* = rc/ud/dc): a wheel such as nixl may bundle them without a ucx_info binary
step ucx_libs 12 "$R/ucx-libs.txt" bash -c 'timeout 10 find "$@" -maxdepth 8 \( -name "libucp*.so*" -o -name "libuct*.so*" -o -name "libucs*.so*" \) 2>/dev/null | sort; true' _ "${UCX_DIRS[@]}"
if [ -n "$UCX_INFO" ]; then
  echo "$UCX_INFO" > "$R/ucx_info.path"
  step ucx_info_v 10 "$R/ucx_info-v.txt" "$UCX_INFO" -v
  step ucx_info_d 20 "$R/ucx_info-d.txt" "$UCX_INFO" -d
else
  echo "ucx_info: not on PATH nor under /tmp/site /opt /usr/local" > "$R/ucx_info.missing"
fi
have docker && {
  step docker_version 10 "$R/docker-version.txt" docker version --format '{{.Client.Version}} {{.Server.Version}}'
  step docker_compose_version 10 "$R/docker-compose-version.txt" docker compose version --short
  step docker_runtimes 10 "$R/docker-info-runtimes.json" docker info --format '{{json .Runtimes}}'
}
have nvidia-container-runtime && step nvidia_container_runtime 10 "$R/nvidia-container-runtime-version.txt" nvidia-container-runtime --version
[ -r /etc/docker/daemon.json ] && step daemon_json 5 "$R/etc-docker-daemon.json" cat /etc/docker/daemon.json
step os 5 "$R/os.txt" bash -c 'echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"; uname -a; cat /etc/os-release 2>/dev/null; echo "python3: $(command -v python3) $(python3 -V 2>&1)"; nproc'
step tools 5 "$R/tools.txt" bash -c 'for t in nvidia-smi ucx_info ibv_devices ibv_devinfo docker nvidia-container-runtime nvidia-ctk ip ping; do printf "%s %s\n" "$t" "$(command -v $t || echo -)"; done'

# --------------------------------------------------------------------------- 3. ansible runs
export LC_ALL=C.UTF-8 LANG=C.UTF-8 PYTHONUTF8=1
export ANSIBLE_CONFIG=$REPO/ansible.cfg            # also when the checkout is world-writable
export ANSIBLE_ROLES_PATH=$REPO/ansible/roles
export ANSIBLE_FILTER_PLUGINS=$REPO/ansible/plugins/filter
export ANSIBLE_HOME=$WORK/ansible-home ANSIBLE_LOCAL_TEMP=$WORK/ansible-tmp ANSIBLE_REMOTE_TEMP=$WORK/ansible-rtmp
export ANSIBLE_COLLECTIONS_PATH=$WORK/collections
export ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0 ANSIBLE_RETRY_FILES_ENABLED=0 ANSIBLE_DEPRECATION_WARNINGS=0
export ANSIBLE_PYTHON_INTERPRETER=$(command -v "$PY")
# NAME INVENTORY TAGS [EXTRA...]: a background run, transcript in ansible/NAME.log, and
# $WORK/done.NAME when it is over. The main line polls for those files with a deadline
# instead of `wait`: a run on the first GPU machine finished but `wait` never returned there.
playbook() {
  local name=$1 inv=$2 tags=$3; shift 3
  rm -f "$WORK/done.$name"
  ( PYTHONPATH=$SITE step "ansible_$name" 60 "$RES/ansible/$name.log" \
      "$PY" -m ansible.cli.playbook gpu/host_path.yml -i "inventory/$inv" --check --diff \
      --tags "$tags" -e ansible_connection=local -e "ansible_python_interpreter=$ANSIBLE_PYTHON_INTERPRETER" "$@"
    touch "$WORK/done.$name" ) > /dev/null 2>&1 < /dev/null &
  RUNS+=("$name")
}
RUNS=()
if [ -f "$SITE/ansible/__init__.py" ]; then
  playbook right h200x1-host gpu,rdma
  playbook wrong h200x1-host-wrong gpu,rdma
  playbook container_runtime h200x1-host docker -e container_runtime_install=false
else
  for n in right wrong container_runtime; do
    printf 'ansible_%s\t126\t0\tansible/%s.log (not run: ansible-core not installed)\n' "$n" "$n" >> "$STEPS"
  done
  log "ansible runs: not started (ansible-core not installed, see ansible/install.txt)"
fi

# --------------------------------------------------------------------------- 4. the probe
P=$RES/probe
step probe_info 25 "$P/info.json" "$PY" scripts/pdstack_probe.py --pretty info --path / --path /tmp
step probe_gpu 20 "$P/gpu.json" "$PY" scripts/pdstack_probe.py --pretty gpu
step probe_rdma 15 "$P/rdma.json" "$PY" scripts/pdstack_probe.py --pretty rdma
if [ -n "$UCX_INFO" ]; then
  step probe_ucx 25 "$P/ucx.json" "$PY" scripts/pdstack_probe.py --pretty ucx --ucx-info "$UCX_INFO"
else
  step probe_ucx 25 "$P/ucx.json" "$PY" scripts/pdstack_probe.py --pretty ucx
fi
for n in "${RUNS[@]}"; do
  while [ ! -f "$WORK/done.$n" ] && [ "$(left)" -gt 14 ]; do sleep 0.5; done
  [ -f "$WORK/done.$n" ] || log "ansible_$n: still running at the deadline; summary without it"
done

# --------------------------------------------------------------------------- 5. summary
step summary 10 "$RES/summary.json" "$PY" gpu/host_path_summary.py "$RES"
log "done in $(( $(date +%s) - START ))s; results in $RES (summary.json)"
"$PY" gpu/host_path_summary.py "$RES" --brief 2>/dev/null || cat "$RES/steps.tsv"
exit 0
