#!/usr/bin/env bash
# Packages the Ansible/preflight network-namespace lab needs (tests/lab/netns_lab.sh,
# tests/ansible): sshd per node, iproute2 (ip netns, veth, bridges), iptables (faults),
# ping (DF path-MTU probes), unshare (mount/UTS namespaces), python3 on the "nodes".
# Idempotent: apt runs only when something is missing.  sshd is installed but never
# started as a service (the lab starts one sshd per namespace on its private address).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
PKGS=(openssh-server openssh-client iproute2 iptables iputils-ping util-linux python3 procps)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[install-ansible-lab] apt-get install ${missing[*]}"
  # keep apt from starting sshd on 0.0.0.0:22 in the root namespace
  policy=/usr/sbin/policy-rc.d; had_policy=0
  [ -e "$policy" ] && had_policy=1
  [ $had_policy = 1 ] || { printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; }
  trap '[ $had_policy = 1 ] || rm -f "$policy"' EXIT
  flock "${CI_APT_LOCK:-/var/tmp/ci-apt.lock}" apt-get -o DPkg::Lock::Timeout=600 -o Acquire::Retries=3 -q update
  flock "${CI_APT_LOCK:-/var/tmp/ci-apt.lock}" apt-get -o DPkg::Lock::Timeout=600 -o Acquire::Retries=3 -q install -y --no-install-recommends "${missing[@]}"
fi
# the lab runs sshd -t/-D by hand; it needs its privilege-separation directory
mkdir -p /run/sshd
for t in ip unshare ssh-keygen /usr/sbin/sshd iptables ping python3; do
  command -v "$t" >/dev/null || [ -x "$t" ] || { echo "[install-ansible-lab] $t still missing" >&2; exit 1; }
done
echo "[install-ansible-lab] ok: ${PKGS[*]}"
