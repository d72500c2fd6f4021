#!/usr/bin/env bash
# netns_lab.sh - a reusable lab of N fake pdstack nodes on one Linux machine (root).
#
# Each node = a network namespace ($LAB_PREFIX-nodeI) + its own UTS (hostname nodeI)
# + its own mount namespace (overlay /etc and /opt, private tmpfs /run and /tmp)
# + its own sshd listening only on the node's address 10.77.0.I:22.
# A controller namespace ($LAB_PREFIX-ctl, address 10.77.0.254) holds the bridge br0;
# run the controller side (pdstack preflight, ansible-playbook, ssh) inside it:
#     tests/lab/netns_lab.sh ctl pdstack preflight -i inventory/lab
# Nothing gets an address in the root namespace and no namespace has a default route,
# so nothing can leave the machine.  Adapted from shared/recipes/netns-lab.sh.
#
# usage: netns_lab.sh up|down|status|ctl CMD...|exec NODE CMD...
# env:   LAB_PREFIX (pdlab)  LAB_N (3)  LAB_NET (10.77.0)  LAB_MTU (1500)
#        LAB_BASE (/var/lib/pdstack-lab/$LAB_PREFIX)  keys, known_hosts, logs live there
# needs: iproute2, openssh-server (sshd), openssh-client (ssh-keygen), util-linux (unshare)
set -euo pipefail

LAB_PREFIX=${LAB_PREFIX:-pdlab}
LAB_N=${LAB_N:-3}
LAB_NET=${LAB_NET:-10.77.0}
LAB_MTU=${LAB_MTU:-1500}
LAB_BASE=${LAB_BASE:-/var/lib/pdstack-lab/$LAB_PREFIX}
CTL=$LAB_PREFIX-ctl
SELF=$(readlink -f "$0")

die() { echo "netns_lab: $*" >&2; exit 1; }
ts() { date +%s.%N; }
el() { awk -v a="$1" -v b="$(ts)" 'BEGIN{printf "%.2fs", b-a}'; }
our_namespaces() { ip netns list | awk -v p="$LAB_PREFIX" '$1 ~ ("^" p "-(ctl|node[0-9]+)$") {print $1}'; }

prereqs() {
  [ "$(id -u)" = 0 ] || die "must run as root (network namespaces, sshd)"
  local missing=()
  for t in ip unshare ssh-keygen /usr/sbin/sshd mount; do command -v "$t" >/dev/null || missing+=("$t"); done
  [ ${#missing[@]} = 0 ] || die "missing: ${missing[*]} (apt-get install iproute2 openssh-server openssh-client util-linux)"
  [ ${#LAB_PREFIX} -le 8 ] || die "LAB_PREFIX must be at most 8 characters"
}

node_init() {   # runs INSIDE: ip netns exec PREFIX-nodeI unshare --uts --mount ...
  local name=$1 nroot=$LAB_BASE/nodes/$1
  hostname "$name"
  mount -t overlay overlay -o "lowerdir=/etc,upperdir=$nroot/etc-upper,workdir=$nroot/etc-work" /etc
  mount -t overlay overlay -o "lowerdir=/opt,upperdir=$nroot/opt-upper,workdir=$nroot/opt-work" /opt
  mount -t tmpfs -o mode=0755 tmpfs /run
  mount -t tmpfs -o mode=1777 tmpfs /tmp
  mkdir -p /run/sshd
  /usr/sbin/sshd -t -f "$nroot/sshd_config"
  echo "$name" > /etc/hostname
  exec /usr/sbin/sshd -D -e -f "$nroot/sshd_config"
}

up() {
  prereqs
  local t0; t0=$(ts)
  if [ -n "$(our_namespaces)" ]; then echo "netns_lab: removing a stale $LAB_PREFIX lab first" >&2; down >/dev/null; fi
  mkdir -p "$LAB_BASE/keys"
  [ -f "$LAB_BASE/keys/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C "$LAB_PREFIX-client" -f "$LAB_BASE/keys/id_ed25519"
  cp "$LAB_BASE/keys/id_ed25519.pub" "$LAB_BASE/keys/authorized_keys"
  : > "$LAB_BASE/known_hosts"

  ip netns add "$CTL"
  ip -n "$CTL" link set lo up
  ip -n "$CTL" link add br0 mtu "$LAB_MTU" type bridge
  ip -n "$CTL" addr add "$LAB_NET.254/24" dev br0
  ip -n "$CTL" link set br0 up

  local i ns nroot
  for i in $(seq 1 "$LAB_N"); do
    ns=$LAB_PREFIX-node$i nroot=$LAB_BASE/nodes/node$i
    mkdir -p "$nroot"/{etc-upper,etc-work,opt-upper,opt-work,ssh}
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # the veth pair is created directly inside the two namespaces (never in the root ns)
    ip link add "p$i" mtu "$LAB_MTU" netns "$CTL" type veth peer name eth0 mtu "$LAB_MTU" netns "$ns"
    ip -n "$CTL" link set "p$i" master br0 up
    ip -n "$ns" addr add "$LAB_NET.$i/24" dev eth0
    ip -n "$ns" link set eth0 up

    [ -f "$nroot/ssh/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C "node$i" -f "$nroot/ssh/host_ed25519"
    echo "$LAB_NET.$i $(cut -d' ' -f1-2 "$nroot/ssh/host_ed25519.pub")" >> "$LAB_BASE/known_hosts"
    cat > "$nroot/sshd_config" <<CFG
ListenAddress $LAB_NET.$i:22
HostKey $nroot/ssh/host_ed25519
PidFile none
AuthorizedKeysFile $LAB_BASE/keys/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
MaxStartups 50:30:100
MaxSessions 50
Subsystem sftp /usr/lib/openssh/sftp-server
LogLevel INFO
CFG
    # ip netns exec and unshare both exec(), so $! is sshd's PID
    ip netns exec "$ns" unshare --uts --mount --propagation private \
        env LAB_BASE="$LAB_BASE" "$SELF" _node_init "node$i" > "$nroot/sshd.log" 2>&1 &
    echo $! > "$nroot/sshd.pid"
  done

  for i in $(seq 1 "$LAB_N"); do
    local ok=0
    for _ in $(seq 1 50); do
      if ip netns exec "$CTL" timeout 1 bash -c "exec 3<>/dev/tcp/$LAB_NET.$i/22" 2>/dev/null; then ok=1; break; fi
      sleep 0.1
    done
    [ $ok = 1 ] || { cat "$LAB_BASE/nodes/node$i/sshd.log" >&2; die "node$i sshd not reachable"; }
  done
  write_files
  echo "lab $LAB_PREFIX up: $LAB_N nodes in $(el "$t0"); controller namespace $CTL"
}

write_files() {
  {
    echo "LAB_PREFIX=$LAB_PREFIX"; echo "LAB_N=$LAB_N"; echo "LAB_NET=$LAB_NET"; echo "LAB_BASE=$LAB_BASE"
    echo "LAB_CTL=$CTL"; echo "LAB_KEY=$LAB_BASE/keys/id_ed25519"; echo "LAB_KNOWN_HOSTS=$LAB_BASE/known_hosts"
  } > "$LAB_BASE/lab.env"
  {
    echo "[lab]"
    for i in $(seq 1 "$LAB_N"); do echo "node$i ansible_host=$LAB_NET.$i"; done
    echo
    echo "[lab:vars]"
    echo "ansible_user=root"
    echo "ansible_ssh_private_key_file=$LAB_BASE/keys/id_ed25519"
    echo "ansible_ssh_common_args=-o UserKnownHostsFile=$LAB_BASE/known_hosts -o StrictHostKeyChecking=yes"
    echo "ansible_python_interpreter=/usr/bin/python3"
  } > "$LAB_BASE/inventory.ini"
}

down() {
  [ "$(id -u)" = 0 ] || die "must run as root"
  local t0 ns pid f i; t0=$(ts)
  # 1) every process living in one of OUR namespaces, by PID - nothing else
  for ns in $(our_namespaces); do
    for pid in $(ip netns pids "$ns"); do kill "$pid" 2>/dev/null || true; done
  done
  for f in "$LAB_BASE"/nodes/node*/sshd.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f"); i=$(basename "$(dirname "$f")")
    for _ in $(seq 1 30); do
      # gone, or a zombie nobody reaps (sshd was started by a shell that has exited)
      st=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || echo gone)
      [ "$st" = gone ] || [ "$st" = Z ] && break
      sleep 0.1
    done
    if [ "$(ip netns identify "$pid" 2>/dev/null)" = "$LAB_PREFIX-$i" ]; then kill -9 "$pid" || true; fi
    rm -f "$f"
  done
  for ns in $(our_namespaces); do
    for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
  done
  # 2) namespaces (deleting a netns deletes its veth ends and the bridge)
  for ns in $(our_namespaces); do ip netns del "$ns"; done
  # keep keys (stable across runs), drop per-node state
  rm -rf "$LAB_BASE/nodes" "$LAB_BASE/known_hosts" "$LAB_BASE/lab.env" "$LAB_BASE/inventory.ini"
  echo "lab $LAB_PREFIX down in $(el "$t0"); remaining $LAB_PREFIX-* netns: $(our_namespaces | wc -l)"
}

status() {
  local ns
  for ns in $(our_namespaces); do
    echo "== $ns"; ip -n "$ns" -br addr; ip netns exec "$ns" iptables -S 2>/dev/null | grep -v '^-P' || true
  done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  ctl) shift; exec ip netns exec "$CTL" "$@" ;;
  exec) shift; n=$1; shift; exec ip netns exec "$LAB_PREFIX-$n" "$@" ;;
  _node_init) shift; node_init "$@" ;;
  *) echo "usage: $0 up|down|status|ctl CMD...|exec NODE CMD..." >&2; exit 2 ;;
esac
