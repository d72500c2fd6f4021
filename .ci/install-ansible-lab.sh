#!/usr/bin/env bash
# Packages the Ansible/preflight network-namespace lab needs (tests/lab/netns_lab.sh,
# tests/ansible): sshd per node, iproute2 (ip netns, veth, bridges), iptables (faults),
# ping (DF path-MTU probes), unshare (mount/UTS namespaces), python3 on the "nodes".
# Idempotent: apt runs only when something is missing.  sshd is installed but never
# started as a service (the lab starts one sshd per namespace on its private address).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
PKGS=(openssh-server openssh-client iproute2 iptables iputils-ping util-linux python3 procps)
# shellcheck source=.ci/apt.sh
source "$(dirname "$0")/apt.sh"
apt_install_missing install-ansible-lab "${PKGS[@]}"
# the lab runs sshd -t/-D by hand; it needs its privilege-separation directory
mkdir -p /run/sshd
for t in ip unshare ssh-keygen /usr/sbin/sshd iptables ping python3; do
  command -v "$t" >/dev/null || [ -x "$t" ] || { echo "[install-ansible-lab] $t still missing" >&2; exit 1; }
done
echo "[install-ansible-lab] ok: ${PKGS[*]}"
