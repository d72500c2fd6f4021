#!/bin/bash
# gpu/lib.sh: gpu/run_ceiling.sh's steps (sourced from the repo root, then
# `gpu_start TAG DEFAULT_STATE_DIR "${1:-}" || exit 1`).

# the driver's frame: T0, BUDGET (its first argument, default 560 s), REPO (the repo root, the
# caller's folder), W (its state folder: $W or DEFAULT_STATE_DIR), SITE (the payload's install
# folder), OUTDIR ($OUT: what comes back); its folders; `log` lines tagged TAG; the results
# packed at every exit; the payload installed and its environment sourced
gpu_start() {
  GPU_TAG=$1 T0=$(date +%s) BUDGET=${3:-560} REPO=$(pwd)
  W=${W:-$2} SITE=${SITE:-/tmp/site}
  OUTDIR=${OUT:-$W/out}
  mkdir -p "$W/results" "$W/logs" "$W/state" "$OUTDIR"
  trap gpu_pack EXIT
  gpu_install || return 1
  gpu_check_offload_fix
}
# once per machine: does pdstack's vLLM plugin fix 0.26.0's abort crash there (seconds;
# gpu/check_offload_fix.py)? Its verdict goes into every driver's results
gpu_check_offload_fix() {
  local out=$SITE/offload-fix-check.txt
  [ -f "$out" ] || python3 "$REPO/gpu/check_offload_fix.py" > "$out" 2>&1
  cp "$out" "$W/results/"
  log "$(tail -1 "$out")"
}
log() { echo "[$GPU_TAG +$(elapsed)s $(date -u +%T)] $*" | tee -a "$W/run.log"; }

# launch flags of the measured stacks: supervised, so an engine that dies under a sweep (vLLM
# issue 52170 killed two in one session, with nobody to restart them) or wedges (a dead
# EngineCore leaves /health hanging) is started again instead of failing every later sweep
GPU_SUPERVISE=(--foreground --wedge-s "${WEDGE_S:-60}")
# launch flags of a baseline (vLLM as users would run it instead): without pdstack's vLLM
# plugin (pdstack.vllm_offload_fix, which `pdstack launch` gives every engine)
GPU_STOCK=(--env VLLM_PLUGINS=none)

# the issue-23 many-tenants workload (results/h200x1-tiers): 200 shared prompts of 1.5-5 k
# tokens (~1.9x one engine's GPU KV), 85 % reuse, user 64-512, answers 48-160
GPU_MT=(--scenario many-tenants --system-prompts 200 --system-len uniform:1500:5000
        --shared-share 0.85 --user-len uniform:64:512 --output-len uniform:48:160)

# the driver's seconds so far, and those left of its BUDGET (from its T0)
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( BUDGET - $(elapsed) )); }

# pack results + log tails into $OUTDIR/results.tar.gz (what comes back from the machine)
gpu_pack() {
  local d f
  for d in "$W"/logs/*/; do
    [ -d "$d" ] || continue
    for f in "$d"*.log; do [ -f "$f" ] && tail -c 200000 "$f" > "$f.tail"; done
  done
  for f in "$W"/logs/*.out; do [ -f "$f" ] && tail -c 200000 "$f" > "$f.tail"; done
  tar -C "$W" -czf "$OUTDIR/results.tar.gz" --exclude='*.log' --exclude='*.out' \
    results logs run.log state 2>/dev/null
  cp "$W/run.log" "$OUTDIR/run.log" 2>/dev/null
  log "packed $(du -h "$OUTDIR/results.tar.gz" | cut -f1)"
}

# install the payload from /tmp/chunks once, then its environment and this repo on the path
gpu_install() {
  if [ ! -f "$SITE/env.sh" ]; then
    log "installing payload from /tmp/chunks ($(ls /tmp/chunks 2>/dev/null | wc -l) files)"
    SKIP_CHECK=1 bash /tmp/chunks/install.sh /tmp/chunks > "$W/install.log" 2>&1
    local rc=$?
    tail -5 "$W/install.log" | tee -a "$W/run.log"
    [ $rc -eq 0 ] || { log "install failed rc=$rc"; return 1; }
  fi
  # shellcheck disable=SC1091
  source "$SITE/env.sh"
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
}

# GET a URL, print the body; exit status 0 only for a 2xx answer within 3 s (no curl there)
http_get() {
  python3 -c "import sys, urllib.request as u; sys.stdout.write(u.urlopen(sys.argv[1], timeout=3).read().decode())" \
    "$1" 2>/dev/null
}

# --- engines, proxies and sweeps ---
GPU_ENV=(--env VLLM_SERVER_DEV_MODE=1 --env VLLM_DISABLE_COMPILE_CACHE=1)

# gpu_launch KEY INVENTORY SERVICES [FLAGS...]: `pdstack launch ... start` detached, once
# (state/launched-KEY); SERVICES "" = the node's all; its output in logs/launch-KEY.out, its
# exit code in state/launch-KEY.rc
gpu_launch() {
  local key=$1 inv=$2 svcs=$3; shift 3
  [ -f "$W/state/launched-$key" ] && return 0
  touch "$W/state/launched-$key"
  log "launch $key: $inv $svcs $*"
  setsid bash -c "python3 -m pdstack.cli launch -i $inv start ${svcs:+--services $svcs} \
    --log-dir $W/logs/$key --timeout 900 ${GPU_ENV[*]} $* ; echo \$? > $W/state/launch-$key.rc" \
    > "$W/logs/launch-$key.out" 2>&1 < /dev/null &
  echo $! > "$W/state/launcher-$key.pgid"  # setsid: its own process group (gpu_stop)
}
# gpu_stop KEY INVENTORY: stop what gpu_launch started (once; no-op if it never was)
gpu_stop() {
  [ -f "$W/state/launched-$1" ] && [ ! -f "$W/state/stopped-$1" ] || return 0
  touch "$W/state/stopped-$1"
  # a supervising launcher (GPU_SUPERVISE) would start again what `launch stop` ends: end it
  # first (SIGTERM: it stops its services itself), then stop whatever is left
  local pg i
  pg=$(cat "$W/state/launcher-$1.pgid" 2>/dev/null)
  if [ -n "$pg" ] && kill -TERM -- "-$pg" 2>/dev/null; then
    for i in $(seq 60); do kill -0 -- "-$pg" 2>/dev/null || break; sleep 1; done
  fi
  python3 -m pdstack.cli launch -i "$2" stop --log-dir "$W/logs/$1" --grace 15 2>&1 | tail -2 \
    | tee -a "$W/run.log"
}
# gpu_wait_up KEY...: 0 when all are healthy, 1 when one failed (its log in run.log); exits the
# driver (call it again) when the budget runs out first
gpu_wait_up() {
  local k
  for k in "$@"; do
    until grep -q "all services healthy" "$W/logs/launch-$k.out" 2>/dev/null; do
      if [ -f "$W/state/launch-$k.rc" ]; then
        log "$k failed to start:"; tail -40 "$W/logs/launch-$k.out" | tee -a "$W/run.log"
        return 1
      fi
      [ "$(left)" -lt 30 ] && { log "$k not up yet: call again"; exit 0; }
      sleep 5
    done
  done
}
# gpu_proxy_args KEY: the arguments of the proxy that `pdstack launch` started for KEY (after
# `proxy`, from its /proc cmdline; the plan's flags, its backends file; no secrets in argv)
gpu_proxy_args() {
  python3 - "$W/logs/$1/proxy.pid" <<'PYEOF'
import json, sys
pid = json.load(open(sys.argv[1]))["pid"]
argv = open(f"/proc/{pid}/cmdline").read().split("\0")[:-1]
print(" ".join(argv[argv.index("proxy") + 1:]))
PYEOF
}
# gpu_proxy NAME PORT CODE_DIR ARGS...: `pdstack proxy ARGS --host 127.0.0.1 --port PORT` of the
# pdstack package in CODE_DIR (the later flag wins), detached, once; tenants' keys from
# $GPU_SECRETS when set; 0 once it answers /health (<= 30 s)
gpu_proxy() {
  local name=$1 port=$2 code=$3; shift 3
  if [ ! -f "$W/state/proxy-$name" ]; then
    touch "$W/state/proxy-$name"
    log "proxy $name :$port from $code: $*"
    (if [ -n "${GPU_SECRETS:-}" ]; then set -a; source "$GPU_SECRETS"; set +a; fi
     cd "$code" || exit 1
     PYTHONPATH="$code:$PYTHONPATH" setsid python3 -m pdstack.cli proxy "$@" \
       --host 127.0.0.1 --port "$port" > "$W/logs/proxy-$name.out" 2>&1 < /dev/null &
     echo $! > "$W/state/proxy-$name.pid")
  fi
  for _ in $(seq 30); do http_get "http://127.0.0.1:$port/health" > /dev/null && return 0; sleep 1; done
  log "proxy $name :$port not healthy:"; tail -20 "$W/logs/proxy-$name.out" | tee -a "$W/run.log"
  return 1
}
# gpu_proxy_stop NAME: stop the proxy gpu_proxy started (by its pid)
gpu_proxy_stop() {
  [ -f "$W/state/proxy-$1.pid" ] && kill "$(cat "$W/state/proxy-$1.pid")" 2>/dev/null
  rm -f "$W/state/proxy-$1.pid"
}
# gpu_tenant_keys NAME...: a 0600 secrets file ($GPU_SECRETS = $W/secrets.env, once) with a
# random key per tenant (PDSTACK_TENANT_KEYS, for `pdstack launch --secrets-env`), and each
# key exported as PDSTACK_BENCH_KEY_<NAME> for the bench (never argv)
gpu_tenant_keys() {
  GPU_SECRETS=$W/secrets.env
  [ -f "$GPU_SECRETS" ] || (umask 077; python3 - "$@" > "$GPU_SECRETS" <<'PYEOF'
import secrets, sys
print("PDSTACK_TENANT_KEYS=" + ",".join(f"{n}:sk-{secrets.token_hex(16)}" for n in sys.argv[1:]))
PYEOF
)
  local pair
  for pair in $(sed -n 's/^PDSTACK_TENANT_KEYS=//p' "$GPU_SECRETS" | tr ',' ' '); do
    export "PDSTACK_BENCH_KEY_$(echo "${pair%%:*}" | tr 'a-z.-' 'A-Z__')=${pair#*:}"
  done
}
# gpu_quiesce ENGINE_URL: wait (<= 90 s) until the engine runs and queues nothing (a flood's
# aborts)
gpu_quiesce() {
  # an engine that is down (restarting under GPU_SUPERVISE: ~2-3 min) is waited for, up to
  # 240 s while the budget allows, so the next sweep does not measure its absence
  local down_s=$(( $(left) > 420 ? 240 : 0 ))
  python3 - "$1/metrics" "$down_s" <<'PYEOF' 2>&1 | tee -a "$W/run.log"
import sys, time, urllib.request
url, t0 = sys.argv[1], time.monotonic()
up_by = t0 + float(sys.argv[2])
busy, i, down = -1.0, 0, ""
while i < 90:
    try:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    except OSError as e:
        down = down or str(e)
        if time.monotonic() < up_by:
            time.sleep(2)
            continue
        print(f"{url}: {e}, still after {time.monotonic() - t0:.0f} s")
        break
    if down:
        print(f"{url}: was down ({down}), up after {time.monotonic() - t0:.0f} s")
        down = ""
    busy = sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if l.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))
    if busy == 0:
        print(f"{url}: idle after {i} s")
        break
    time.sleep(1)
    i += 1
else:
    print(f"{url}: still {busy:.0f} requests after 90 s")
PYEOF
}
# gpu_fits NAME RATES DURATION: 0 if a sweep of RATES x DURATION s fits in what is left (each
# rate: WARMUP + DURATION + DRAIN + 5 s; 30 s for quiescing and start); else says so
gpu_fits() {
  local n; n=$(echo "$2" | tr ',' '\n' | wc -l)
  local est=$(( n * ($3 + WARMUP + ${DRAIN:-30} + 5) + 30 ))
  [ "$(left)" -ge "$est" ] && return 0
  log "left $(left)s < ${est}s for $1: not now"
  return 1
}
# gpu_facts: the card, its clocks and power now, the CPU (two H100 calls of one day served the
# same sweep at 24 vs 19 req/s, ITL 8 vs 18 ms: ceiling run 6; these say which host was slow)
GPU_CLOCKS=clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,pstate,clocks_throttle_reasons.active
gpu_facts() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,$GPU_CLOCKS --format=csv
  lscpu 2>/dev/null | grep -m1 'Model name'
}
# gpu_bench NAME TARGET RATES DURATION ARGS...: one `pdstack bench` (seed 1, cold caches: the
# sweep's own vLLM cache_salt, or with GPU_SALT_FLAG=--prompt-salt its own salt leading every
# prompt; GPU_BENCH_EXTRA: more bench flags) into results/NAME.json; 0 when the JSON is there
gpu_bench() {
  local name=$1 target=$2 rates=$3 dur=$4; shift 4
  python3 -m pdstack.cli bench --target "$target" --token-ids --model "${GPU_MODEL:-deepseek-v2-lite}" \
    "$@" --rates "$rates" --duration "$dur" --warmup "$WARMUP" --drain-timeout "${DRAIN:-30}" \
    --seed 1 --gpus 1 --request-timeout 120 "${GPU_SALT_FLAG:---cache-salt}" "$GPU_TAG-$name" \
    ${GPU_BENCH_EXTRA:-} --label "$name" \
    --output "$W/results/$name.json" --no-progress > "$W/logs/bench-$name.out" 2>&1 &
  local bench=$!  # the card's clocks under load, every 5 s (results/clocks-NAME.csv)
  nvidia-smi --query-gpu=timestamp,$GPU_CLOCKS --format=csv -l 5 > "$W/results/clocks-$name.csv" 2>&1 &
  local clocks=$!
  wait "$bench"
  local rc=$?
  kill "$clocks" 2>/dev/null; wait "$clocks" 2>/dev/null
  tail -12 "$W/logs/bench-$name.out" | tee -a "$W/run.log"
  log "bench $name rc=$rc"
  [ -f "$W/results/$name.json" ]
}
# a sweep's state: swept-NAME or failed-NAME once it ran (a sweep runs once)
gpu_pending() { [ ! -f "$W/state/swept-$1" ] && [ ! -f "$W/state/failed-$1" ]; }
gpu_mark() {  # NAME RC: swept (RC 0) or failed
  if [ "$2" = 0 ]; then touch "$W/state/swept-$1"; else touch "$W/state/failed-$1"; fi
}
# gpu_todo NAME ENGINE: 0 when sweep NAME is still to run and has an ENGINE (none: its stack
# failed to start, and the sweep is marked failed)
gpu_todo() {
  gpu_pending "$1" || return 1
  [ -n "$2" ] && return 0
  log "no engine for $1"; gpu_mark "$1" 1; return 1
}
# gpu_metrics ENGINE TARGET [FRONT_METRICS]: the bench's --metrics-url flags: each engine's
# (ENGINE: one URL, or several comma-separated) and, unless TARGET is the engine, the front's
# (default TARGET/metrics)
gpu_metrics() {
  local e
  for e in ${1//,/ }; do echo "--metrics-url $e/metrics"; done
  [ "$2" = "$1" ] || echo "--metrics-url ${3:-$2/metrics}"
}
# gpu_sweep NAME ENGINE TARGET RATES DURATION ARGS...: once, on quiet engines, with their
# counters and the front's (TARGET_METRICS, default TARGET/metrics); 3 when it does not fit
# the budget
gpu_sweep() {
  local name=$1 engine=$2 target=$3 rates=$4 dur=$5 e rc=0; shift 5
  gpu_todo "$name" "$engine" || return 0
  gpu_fits "$name" "$rates" "$dur" || return 3
  for e in ${engine//,/ }; do gpu_quiesce "$e"; done
  log "sweep $name: rates $rates x ${dur}s via $target $*"
  # shellcheck disable=SC2046  # URLs: no spaces
  gpu_bench "$name" "$target" "$rates" "$dur" $(gpu_metrics "$engine" "$target" "${TARGET_METRICS:-}") \
    "$@" || rc=$?
  gpu_mark "$name" $rc
}
