#!/bin/bash
# Drive the h200x1 measurements (issue 12) on the lent 1xH200 machine, from the repo root there.
#
#   RUN=1|2 bash gpu/run_h200x1.sh [BUDGET_S]
#
# RUN=1: the first session's sweep; RUN=2 (default): the second one (tuned admission, NIXL
# with CUDA IPC GET, the full-hit TTFT breakdown). Same engines, same workloads.
# Idempotent and resumable (state in /tmp/pdrun$RUN): call it again in the next device call.
#   1. install the payload from /tmp/chunks (once) -> /tmp/site; models into /tmp/models
#   2. machine facts; the host-path check (gpu/host_path.sh, in the background) if present
#   3. phase A: start V2-Lite engines at once on GPU 0 (pdstack launch, the plan's commands):
#        A1 = inventory/h200x1-nixl prefill-0    (NixlConnector only: "vLLM alone")
#        A3 = inventory/h200x1-nixl decode-0     (NixlConnector only: the decoder of both pairs)
#        A2 = inventory/h200x1-nixl-l1 prefill-0 (MultiConnector[Nixl, LMCacheMP] + LMCache server:
#             "vLLM + LMCache tier")
#      phase B (after phase A's variants): shared-l1 P+D + LMCache, V3-shaped A1/A2 analogues
#   4. one pdstack bench sweep per variant (VARIANTS order = priority), each on cold caches
#      (engines' prefix caches reset, LMCache L1 cleared), proxies ad hoc per variant
#   5. pack results + logs into $OUT/results.tar.gz (always)
set -uo pipefail
T0=$(date +%s)
BUDGET=${1:-560}
REPO=$(pwd)
RUN=${RUN:-2}
W=${W:-/tmp/pdrun$RUN}
SITE=${SITE:-/tmp/site}
OUTDIR=${OUT:-$W/out}
mkdir -p "$W/results" "$W/logs" "$W/state" "$OUTDIR"
DURATION=${DURATION:-15}
WARMUP=${WARMUP:-5}
RATES_MT=${RATES_MT:-8,16,24}
RATES_PD=${RATES_PD:-8,16,24}
RATES_TURN=${RATES_TURN:-8,16}

elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(elapsed) )); }
log() { echo "[h200x1 +$(elapsed)s] $*" | tee -a "$W/run.log"; }
pack() {
  for d in "$W"/logs/*/; do
    [ -d "$d" ] || continue
    for f in "$d"*.log; do [ -f "$f" ] && tail -c 300000 "$f" > "$f.tail"; done
  done
  for f in "$W"/logs/*.log; do [ -f "$f" ] && tail -c 300000 "$f" > "$f.tail"; done
  tar -C "$W" -czf "$OUTDIR/results.tar.gz" --exclude='*.log' results logs run.log state 2>/dev/null
  cp "$W/run.log" "$OUTDIR/run.log" 2>/dev/null
  [ -d /tmp/host-path-out ] && tar -C /tmp -czf "$OUTDIR/host-path.tar.gz" host-path-out 2>/dev/null
  log "packed $(du -h "$OUTDIR/results.tar.gz" | cut -f1)"
}
trap pack EXIT

# ------------------------------------------------------------------ 1. install
if [ ! -f "$SITE/env.sh" ]; then
  log "installing payload from /tmp/chunks ($(ls /tmp/chunks 2>/dev/null | wc -l) files)"
  SKIP_CHECK=1 bash /tmp/chunks/install.sh /tmp/chunks > "$W/install.log" 2>&1
  rc=$?; tail -5 "$W/install.log" | tee -a "$W/run.log"
  [ $rc -eq 0 ] || { log "install failed rc=$rc"; exit 1; }
fi
# shellcheck disable=SC1091
source "$SITE/env.sh"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=python3
PD=("$PY" -m pdstack.cli)
mkdir -p /tmp/models && cp -r gpu/models/deepseek-v3-shaped /tmp/models/

# ------------------------------------------------------------------ 2. facts, host path
if [ ! -f "$W/results/machine.txt" ]; then
  {
    echo "# h200x1 machine facts, $(date -u +%FT%TZ)"
    uname -a; nproc; free -g; df -h /tmp | tail -1
    nvidia-smi
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
    "$PY" - <<'EOF'
import sys
from importlib.metadata import version
print("python", sys.version.split()[0])
for p in ("torch", "vllm", "lmcache", "nixl", "nixl-cu13", "aiohttp", "prometheus-client"):
    try:
        print(p, version(p))
    except Exception as e:
        print(p, "missing", e)
import pdstack.bench.cli, pdstack.proxy.app, pdstack.launch  # noqa: F401
print("pdstack imports ok")
EOF
  } > "$W/results/machine.txt" 2>&1
  grep -E "H200|^vllm|^lmcache|^nixl|^torch|pdstack imports|missing" "$W/results/machine.txt" | head -10 | tee -a "$W/run.log"
fi
# the host-path check (issue 19): gpu/hp is a copy of that work's tree, its ansible wheels
# travel in gpu/payload/ansible (ignored, carried)
HP=gpu/host_path.sh; [ -f gpu/hp/gpu/host_path.sh ] && HP=gpu/hp/gpu/host_path.sh
if [ -f "$HP" ] && [ ! -f "$W/state/host-path" ]; then
  touch "$W/state/host-path"
  hp_root=$(cd "$(dirname "$HP")/.." && pwd)
  [ -d gpu/payload/ansible ] && [ ! -e "$hp_root/gpu/payload-ansible" ] && cp -r gpu/payload/ansible "$hp_root/gpu/payload-ansible"
  [ -d /tmp/payload-ansible ] && [ ! -e "$hp_root/gpu/payload-ansible" ] && cp -r /tmp/payload-ansible "$hp_root/gpu/payload-ansible"
  log "host path check in the background ($HP)"
  (OUT=/tmp/host-path-out timeout 300 bash "$HP" > "$W/logs/host-path.log" 2>&1; echo "rc=$?" >> "$W/logs/host-path.log") &
fi

# ------------------------------------------------------------------ 3. engines
# UCX_CUDA_IPC_ENABLE_GET_ZCOPY: UCX turns cuda_ipc GET off on a GPU without active NVLinks
# (the one lent H200), so NIXL's READ fell back to TCP in run 1 (63-83 MB/s); run 2 forces
# it on (auto = run 1's behaviour)
COMMON_ENV=(--env VLLM_SERVER_DEV_MODE=1 --env VLLM_DISABLE_COMPILE_CACHE=1 --env UCX_TLS=
            --env "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=$([ "$RUN" = 1 ] && echo auto || echo y)")
start() {  # key inventory services
  local key=$1 inv=$2 svcs=$3
  [ -f "$W/state/launched-$key" ] && return
  touch "$W/state/launched-$key"
  log "launch $key: $inv $svcs"
  setsid bash -c "'${PD[0]}' ${PD[*]:1} launch -i $inv start --services $svcs --log-dir $W/logs/$key \
    --timeout 900 ${COMMON_ENV[*]} ; echo \$? > $W/state/launch-$key.rc" > "$W/logs/launch-$key.out" 2>&1 < /dev/null &
}
stop() {  # key inventory
  [ -f "$W/state/stopped-$1" ] && return
  "${PD[@]}" launch -i "$2" stop --log-dir "$W/logs/$1" --grace 15 2>&1 | tail -2 >> "$W/run.log"
  touch "$W/state/stopped-$1"
}
wait_up() {  # key...: 0 when all healthy, 1 when one failed, 2 when the budget ran out
  local k
  for k in "$@"; do
    while [ ! -f "$W/state/launch-$k.rc" ]; do
      [ "$(left)" -lt 20 ] && return 2
      sleep 5
    done
    if [ "$(cat "$W/state/launch-$k.rc")" != 0 ]; then
      log "$k failed to start:"; tail -40 "$W/logs/launch-$k.out" | tee -a "$W/run.log"
      return 1
    fi
  done
  return 0
}
phase_a() {
  start a-nixl inventory/h200x1-nixl prefill-0,decode-0
  start a-l1 inventory/h200x1-nixl-l1 lmcache,prefill-0
}
phase_b() {
  stop a-nixl inventory/h200x1-nixl; stop a-l1 inventory/h200x1-nixl-l1
  start b-shared inventory/h200x1-shared-l1 lmcache,prefill-0,decode-0
  start b-v3 inventory/h200x1-v3-nixl prefill-0
  start b-v3l1 inventory/h200x1-v3-nixl-l1 lmcache,prefill-0
}
# engine URLs (the plan's ports: engine_http_base + index)
A1=http://127.0.0.1:8111 A3=http://127.0.0.1:8112 A2=http://127.0.0.1:8121 LMA=http://127.0.0.1:6021
B1=http://127.0.0.1:8131 B2=http://127.0.0.1:8132 LMB=http://127.0.0.1:6031
V1=http://127.0.0.1:8141 V2=http://127.0.0.1:8151 LMV=http://127.0.0.1:6051

post() {
  "$PY" - "$1" <<'EOF' 2>&1 | tee -a "$W/run.log"
import sys, urllib.request
try:
    with urllib.request.urlopen(urllib.request.Request(sys.argv[1], b"", method="POST"), timeout=30) as r:
        print("POST", sys.argv[1], r.status, r.read()[:120])
except Exception as e:
    print("POST", sys.argv[1], "FAILED", e)
EOF
}
proxy_up() {  # port args...: start an ad hoc proxy, wait for /health
  local port=$1; shift
  setsid "${PD[@]}" proxy --host 127.0.0.1 --port "$port" --served-model-name "$CUR_MODEL" "$@" \
    > "$W/logs/proxy-$port.log" 2>&1 < /dev/null &
  echo $! > "$W/state/proxy-$port.pid"
  for _ in $(seq 1 40); do
    "$PY" -c "import sys,urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
      "http://127.0.0.1:$port/health" 2>/dev/null && return 0
    sleep 0.5
  done
  log "proxy :$port did not come up"; tail -20 "$W/logs/proxy-$port.log" | tee -a "$W/run.log"; return 1
}
proxy_down() { [ -f "$W/state/proxy-$1.pid" ] && kill "$(cat "$W/state/proxy-$1.pid")" 2>/dev/null; sleep 0.5; }

# variant: name phase scenario model rates target-kind args
#   target-kind: direct URL | proxy PORT <proxy flags>
# the metrics URLs: engines involved (+ LMCache server), + the proxy
run_variant() {
  local name=$1 scenario=$2 model=$3 rates=$4 engines=$5 lm=$6 target=$7; shift 7
  CUR_MODEL=$model
  local out="$W/results/$name.json"
  [ -f "$W/state/swept-$name" ] && return 0
  local est=$(( $(echo "$rates" | tr ',' '\n' | wc -l) * (DURATION + WARMUP + 6) + 30 ))
  if [ "$(left)" -lt "$est" ]; then log "left $(left)s < ${est}s for $name: call again"; exit 0; fi
  # cold start for every variant: same seed, same requests, same (empty) caches
  local e
  for e in ${engines//,/ }; do post "$e/reset_prefix_cache"; done
  [ "$lm" != - ] && post "$lm/cache/clear"
  local url=$target port=""
  if [ "$target" = proxy ]; then
    port=$1; shift
    proxy_up "$port" "$@" || { touch "$W/state/failed-$name"; return 1; }
    url=http://127.0.0.1:$port
  fi
  local metrics=()
  for e in ${engines//,/ }; do metrics+=(--metrics-url "$e/metrics"); done
  [ "$lm" != - ] && metrics+=(--metrics-url "$lm/metrics")
  [ -n "$port" ] && metrics+=(--metrics-url "$url/metrics")
  log "sweep $name: $scenario, rates $rates x ${DURATION}s via $url $*"
  "${PD[@]}" bench --target "$url" --token-ids --model "$model" --scenario "$scenario" \
    --rates "$rates" --duration "$DURATION" --warmup "$WARMUP" --drain-timeout 20 \
    --seed 1 --gpus 1 --request-timeout 120 "${metrics[@]}" --label "$name" --output "$out" \
    --no-progress > "$W/logs/bench-$name.out" 2>&1
  local rc=$?
  tail -8 "$W/logs/bench-$name.out" | tee -a "$W/run.log"
  log "sweep $name rc=$rc"
  [ -n "$port" ] && proxy_down "$port"
  [ -f "$out" ] && touch "$W/state/swept-$name" || touch "$W/state/failed-$name"
}

V2M=deepseek-v2-lite V3M=deepseek-v3-shaped
ADM=(--admission kv --admission-queue-timeout 30)

probe_full_hit() {  # issue 12 step 3: where a full-hit request's TTFT goes (no load)
  [ -f "$W/state/probed-full-hit" ] && return 0
  [ "$(left)" -lt 90 ] && { log "left $(left)s: full-hit probe next call"; exit 0; }
  log "full-hit TTFT probe"
  "$PY" benchmarks/full_hit_ttft.py --model $V2M --engine "alone=$A1" --engine "tier=$A2,$LMA" \
    --prompts 6 --prefix 6000 --suffix 200 --output "$W/results/full-hit-ttft.json" \
    > "$W/logs/full-hit-ttft.out" 2>&1
  local rc=$?
  tail -8 "$W/logs/full-hit-ttft.out" | tee -a "$W/run.log"
  log "full-hit probe rc=$rc"
  touch "$W/state/probed-full-hit"
}

run1() {
  phase_a
  if wait_up a-nixl a-l1; then
    # step 1: one engine, many tenants (their KV is 2x the engine's GPU KV)
    run_variant mt-v2-alone many-tenants $V2M "$RATES_MT" $A1 - $A1
    run_variant mt-v2-tier many-tenants $V2M "$RATES_MT" $A2 $LMA $A2
    run_variant mt-v2-tier-adm many-tenants $V2M "$RATES_MT" $A2 $LMA proxy 8031 --kv-mode colocated+l1 --decode $A2 "${ADM[@]}"
    run_variant mt-v2-alone-adm many-tenants $V2M "$RATES_MT" $A1 - proxy 8032 --kv-mode colocated --decode $A1 "${ADM[@]}"
    # step 2: 1P1D on the one GPU (prefiller and decoder share it), the seed workload
    run_variant pd-nixl seed $V2M "$RATES_PD" $A1,$A3 - proxy 8033 --kv-mode nixl --prefill $A1 --decode $A3
    run_variant pd-nixl-adm seed $V2M "$RATES_PD" $A1,$A3 - proxy 8034 --kv-mode nixl --prefill $A1 --decode $A3 "${ADM[@]}"
    run_variant pd-nixl-l1 seed $V2M "$RATES_PD" $A2,$A3 $LMA proxy 8035 --kv-mode nixl+l1 --prefill $A2 --decode $A3
    run_variant pd-nixl-l1-adm seed $V2M "$RATES_PD" $A2,$A3 $LMA proxy 8036 --kv-mode nixl+l1 --prefill $A2 --decode $A3 "${ADM[@]}"
    # multi-turn: one engine
    run_variant mtt-v2-alone multi-turn $V2M "$RATES_TURN" $A1 - $A1
    run_variant mtt-v2-tier-adm multi-turn $V2M "$RATES_TURN" $A2 $LMA proxy 8037 --kv-mode colocated+l1 --decode $A2 "${ADM[@]}"
  fi
  phase_b
  if wait_up b-shared; then
    run_variant pd-shared-l1 seed $V2M "$RATES_PD" $B1,$B2 $LMB proxy 8041 --kv-mode shared-l1 --prefill $B1 --decode $B2
    run_variant pd-shared-l1-adm seed $V2M "$RATES_PD" $B1,$B2 $LMB proxy 8042 --kv-mode shared-l1 --prefill $B1 --decode $B2 "${ADM[@]}"
  fi
  if wait_up b-v3 b-v3l1; then
    run_variant mt-v3-alone many-tenants $V3M "$RATES_MT" $V1 - $V1
    run_variant mt-v3-tier-adm many-tenants $V3M "$RATES_MT" $V2 $LMV proxy 8043 --kv-mode colocated+l1 --decode $V2 "${ADM[@]}"
    run_variant mt-v3-tier many-tenants $V3M "$RATES_MT" $V2 $LMV $V2
  fi
}

run2() {  # variants in priority order; r2- names keep run 1's JSONs beside them
  # run 2 (2026-12) held a request while an engine had > 2 waiting (--admission-max-waiting 2);
  # that flag is gone (the KV gate reads no waiting gauge: a clear error now), so ADM2 is the
  # plan's admission, and r2-mt-v2-tier-adm2 (ADM2 vs r2-mt-v2-tier-adm's ADM) is dropped:
  # a rerun of the r2-*-adm2 names measures today's gate, not run 2's
  local ADM2=("${ADM[@]}")
  phase_a
  wait_up a-nixl a-l1 || return
  probe_full_hit
  run_variant r2-pd-nixl seed $V2M "$RATES_PD" $A1,$A3 - proxy 8033 --kv-mode nixl --prefill $A1 --decode $A3
  run_variant r2-mt-v2-alone many-tenants $V2M "$RATES_MT" $A1 - $A1
  run_variant r2-pd-nixl-l1-adm seed $V2M "$RATES_PD" $A2,$A3 $LMA proxy 8036 --kv-mode nixl+l1 --prefill $A2 --decode $A3 "${ADM2[@]}"
  run_variant r2-mtt-v2-alone multi-turn $V2M "$RATES_TURN" $A1 - $A1
  run_variant r2-mtt-v2-tier-adm-cap multi-turn $V2M "$RATES_TURN" $A2 $LMA proxy 8037 --kv-mode colocated+l1 --decode $A2 "${ADM2[@]}" --admission-max-running 64
  run_variant r2-pd-nixl-adm seed $V2M "$RATES_PD" $A1,$A3 - proxy 8034 --kv-mode nixl --prefill $A1 --decode $A3 "${ADM2[@]}"
  run_variant r2-mt-v2-tier-adm many-tenants $V2M "$RATES_MT" $A2 $LMA proxy 8032 --kv-mode colocated+l1 --decode $A2 "${ADM[@]}"
  run_variant r2-pd-nixl-l1 seed $V2M "$RATES_PD" $A2,$A3 $LMA proxy 8035 --kv-mode nixl+l1 --prefill $A2 --decode $A3
  run_variant r2-mt-v2-tier many-tenants $V2M "$RATES_MT" $A2 $LMA $A2
  # the running cap at the engines' CUDA-graph limit (--max-cudagraph-capture-size 128):
  # past it every decode step runs eager (~10x slower), the collapse of the rows above
  local CAP=(--admission-max-running 128)
  run_variant r2-pd-nixl-l1-adm-cap seed $V2M "$RATES_PD" $A2,$A3 $LMA proxy 8038 --kv-mode nixl+l1 --prefill $A2 --decode $A3 "${ADM2[@]}" "${CAP[@]}"
  run_variant r2-mt-v2-tier-adm2-cap many-tenants $V2M "$RATES_MT" $A2 $LMA proxy 8039 --kv-mode colocated+l1 --decode $A2 "${ADM2[@]}" "${CAP[@]}"
  run_variant r2-mtt-v2-tier-adm-cap128 multi-turn $V2M "$RATES_TURN" $A2 $LMA proxy 8040 --kv-mode colocated+l1 --decode $A2 "${ADM2[@]}" "${CAP[@]}"
  run_variant r2-pd-nixl-adm-cap seed $V2M "$RATES_PD" $A1,$A3 - proxy 8044 --kv-mode nixl --prefill $A1 --decode $A3 "${ADM2[@]}" "${CAP[@]}"
  # shared L1 (the seed's design) with the same admission
  stop a-nixl inventory/h200x1-nixl; stop a-l1 inventory/h200x1-nixl-l1
  start b-shared inventory/h200x1-shared-l1 lmcache,prefill-0,decode-0
  wait_up b-shared || return
  run_variant r2-pd-shared-l1-adm-cap seed $V2M "$RATES_PD" $B1,$B2 $LMB proxy 8045 --kv-mode shared-l1 --prefill $B1 --decode $B2 "${ADM2[@]}" "${CAP[@]}"
  run_variant r2-pd-shared-l1 seed $V2M "$RATES_PD" $B1,$B2 $LMB proxy 8046 --kv-mode shared-l1 --prefill $B1 --decode $B2
}

"run$RUN"
log "status: $(ls "$W/state" | tr '\n' ' ')"
