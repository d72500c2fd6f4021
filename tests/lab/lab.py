"""The namespaced test lab as a Python object and pytest fixtures.

``Lab`` drives ``tests/lab/netns_lab.sh`` (three nodes 10.77.0.1-3, each a network
namespace with its own sshd; a controller namespace holding the bridge) and injects
faults inside node namespaces: iptables DROP / REJECT on a port, link down, MTU change.
Every fault is undone by :meth:`Lab.clear_faults`, which the ``clean_lab`` fixture calls
after each test, pass or fail; the session fixture ``lab`` tears the namespaces down at
the end even when tests fail.  A missing prerequisite (not root, no sshd, no iptables)
*fails* with a message naming what to install; it never skips.

Load it from a conftest without making ``tests`` a package, with a namespace prefix of
your own (so two test folders' session labs never collide)::

    import importlib.util, pathlib, sys
    _p = pathlib.Path(__file__).parents[1] / "lab" / "lab.py"
    _spec = importlib.util.spec_from_file_location("pdstack_netns_lab", _p)
    netns_lab = importlib.util.module_from_spec(_spec)
    sys.modules["pdstack_netns_lab"] = netns_lab
    _spec.loader.exec_module(netns_lab)
    lab, clean_lab = netns_lab.lab_fixtures("pdans")   # pytest fixtures

See tests/lab/README.md for the full interface.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPT = HERE / "netns_lab.sh"
LAB_INVENTORY = REPO / "inventory" / "lab"
DEFAULT_BASE_ROOT = "/var/lib/pdstack-lab"
# what the committed inventory/lab refers to (LAB_PREFIX=pdlab)
INVENTORY_BASE = f"{DEFAULT_BASE_ROOT}/pdlab"

REQUIRED_TOOLS = {
    "ip": "iproute2",
    "unshare": "util-linux",
    "ssh-keygen": "openssh-client",
    "ssh": "openssh-client",
    "/usr/sbin/sshd": "openssh-server",
    "iptables": "iptables",
    "ping": "iputils-ping",
}


class LabError(RuntimeError):
    pass


def missing_prerequisites() -> list[str]:
    """Human-readable list of what this machine lacks for the lab (empty when ready)."""
    problems = []
    if os.geteuid() != 0:
        problems.append("must run as root (network namespaces, sshd, iptables)")
    for tool, package in REQUIRED_TOOLS.items():
        if shutil.which(tool) is None and not Path(tool).is_file():
            problems.append(f"{tool} not found (apt-get install {package})")
    if not Path("/usr/bin/python3").is_file():
        problems.append("/usr/bin/python3 not found (the nodes run the probe with it)")
    return problems


class Lab:
    """One running lab; node names are ``node1`` .. ``nodeN``."""

    def __init__(self, prefix: str = "pdlab", n: int = 3, net: str = "10.77.0",
                 mtu: int = 1500, base: str | None = None):
        self.prefix = prefix
        self.n = n
        self.net = net
        self.mtu = mtu
        self.base = Path(base or f"{DEFAULT_BASE_ROOT}/{prefix}")
        self.ctl = f"{prefix}-ctl"
        self.key_file = self.base / "keys" / "id_ed25519"
        self.known_hosts = self.base / "known_hosts"
        self._faults: list[tuple[str, str]] = []

    # ------------------------------------------------------------------ lifecycle
    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "LAB_PREFIX": self.prefix, "LAB_N": str(self.n),
                "LAB_NET": self.net, "LAB_MTU": str(self.mtu), "LAB_BASE": str(self.base)}

    def up(self) -> str:
        proc = subprocess.run([str(SCRIPT), "up"], env=self.env, capture_output=True,
                              text=True, timeout=60)
        if proc.returncode != 0:
            raise LabError(f"netns_lab.sh up failed ({proc.returncode}):\n{proc.stdout}\n"
                           f"{proc.stderr}")
        return proc.stdout

    def down(self) -> str:
        proc = subprocess.run([str(SCRIPT), "down"], env=self.env, capture_output=True,
                              text=True, timeout=60)
        if proc.returncode != 0:
            raise LabError(f"netns_lab.sh down failed:\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def namespaces(self) -> list[str]:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        names = [line.split()[0] for line in out.splitlines() if line.strip()]
        return [n for n in names if n == self.ctl or n.startswith(f"{self.prefix}-node")]

    # ------------------------------------------------------------------ naming
    @property
    def nodes(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.n + 1)]

    def ns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def address(self, node: str) -> str:
        return f"{self.net}.{int(node.removeprefix('node'))}"

    def _bridge_port(self, node: str) -> str:
        return f"p{int(node.removeprefix('node'))}"

    # ------------------------------------------------------------------ running things
    def ctl_run(self, argv: Sequence[str], timeout: float = 60, check: bool = False,
                env: Mapping[str, str] | None = None,
                input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in the controller namespace (where the nodes' sshd are reachable)."""
        return subprocess.run(["ip", "netns", "exec", self.ctl, *argv], capture_output=True,
                              text=True, timeout=timeout, check=check,
                              env=dict(env) if env is not None else None, input=input)

    def node_run(self, node: str, argv: Sequence[str], timeout: float = 30,
                 check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in a node's *network* namespace (root mount namespace)."""
        return subprocess.run(["ip", "netns", "exec", self.ns(node), *argv],
                              capture_output=True, text=True, timeout=timeout, check=check)

    def ssh(self, node: str, command: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a shell command on a node over real SSH (its own mount/UTS namespace)."""
        return self.ctl_run(["ssh", "-i", str(self.key_file), "-o", "BatchMode=yes",
                             "-o", f"UserKnownHostsFile={self.known_hosts}",
                             "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=5",
                             f"root@{self.address(node)}", command], timeout=timeout)

    # ------------------------------------------------------------------ faults
    def _iptables(self, node: str, rule: list[str]) -> None:
        self.node_run(node, ["iptables", "-I", "INPUT", *rule])
        self._faults.append(("iptables", node))

    def drop(self, node: str, port: int, src: str | None = None, proto: str = "tcp") -> None:
        """Silently drop packets to ``node``'s ``port`` (optionally only from ``src``,
        a node name or address): connects time out."""
        self._iptables(node, [*self._match(port, src, proto), "-j", "DROP"])

    def reject(self, node: str, port: int, src: str | None = None, proto: str = "tcp",
               reject_with: str = "icmp-port-unreachable") -> None:
        """Reject packets to ``node``'s ``port``: connects are refused at once."""
        self._iptables(node, [*self._match(port, src, proto), "-j", "REJECT",
                              "--reject-with", reject_with])

    def allow_only(self, node: str, ports: Sequence[int]) -> None:
        """A stateful firewall on ``node`` that admits TCP only to ``ports`` (plus SSH,
        replies to the node's own connections, and loopback); every other TCP port drops."""
        dports = ",".join(str(p) for p in sorted({22, *ports}))
        # inserted in reverse, so the final order is: established, lo, drop-the-rest
        self._iptables(node, ["-p", "tcp", "-m", "multiport", "!", "--dports", dports,
                              "-j", "DROP"])
        self._iptables(node, ["-i", "lo", "-j", "ACCEPT"])
        self._iptables(node, ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
                              "-j", "ACCEPT"])

    def hold_from(self, node: str, src: str, but_port: int) -> None:
        """Drop every TCP packet from node ``src`` to ``node`` except those to ``but_port``:
        ``src``'s transfers to ``node`` stall, unreset, while ``node`` still serves
        ``but_port`` (a KV pull held open until the link goes down); ``unhold`` ends it."""
        self._iptables(node, ["-s", self.address(src), "-p", "tcp", "!", "--dport",
                              str(but_port), "-j", "DROP"])

    def unhold(self, node: str) -> None:
        """Flush ``node``'s firewall (``hold_from`` and the other rules), its link as it is."""
        self.node_run(node, ["iptables", "-F", "INPUT"])

    def cpu_shares(self, node: str, shares: int) -> None:
        """The CPU weight of everything in ``node``'s containers (its Docker engine's cgroup
        parent) against the rest of this machine: 1024 is the default; a low value lets
        ``node`` use only what the other nodes leave, as on a machine of its own (the lab's
        nodes share this machine's cores)."""
        v1 = Path(f"/sys/fs/cgroup/cpu/{self.prefix}-{node}/cpu.shares")
        if v1.exists():
            v1.write_text(str(shares))
        else:  # cgroup v2: the same scale as Docker's --cpu-shares
            v2 = Path(f"/sys/fs/cgroup/{self.prefix}-{node}/cpu.weight")
            v2.write_text(str(max(1, 1 + (shares - 2) * 9999 // 262142)))
        self._faults.append(("cpu", node))

    def drop_icmp(self, node: str) -> None:
        """Drop every ICMP echo request to ``node`` (a firewall that blocks ping)."""
        self._iptables(node, ["-p", "icmp", "--icmp-type", "echo-request", "-j", "DROP"])

    def _match(self, port: int, src: str | None, proto: str) -> list[str]:
        rule = ["-p", proto, "--dport", str(port)]
        if src is not None:
            rule = ["-s", self.address(src) if src.startswith("node") else src, *rule]
        return rule

    def link_down(self, node: str) -> None:
        """Take the node's eth0 down (its address and route go with it)."""
        self.link_down_armed(node)()

    def link_down_armed(self, node: str) -> Callable[[], float]:
        """:meth:`link_down`, ready to fire: a socket is opened in the node's network
        namespace now; the returned trigger clears eth0's ``IFF_UP`` through it
        (``SIOCSIFFLAGS``, what ``ip link set eth0 down`` does) in the calling thread, at
        real-time priority (``SCHED_FIFO`` 1) for that moment, and gives the seconds it took.
        No process has to run at the fault. An ``ip`` armed beforehand (a shell waiting for
        the word, then ``exec ip -n NS link set eth0 down``) took 4 ms median, but while the
        two-node test cut a KV pull (the lab's engines spinning on both cores) the link went
        down up to 5.1 s after the word (9 of 685 samples over 1 s; 5.7 s once in CI): the
        shell and ``ip``, 3-4 ms of CPU, waited in the run queue (their run delay up to
        7.9 s); the same through ``nsenter --net`` (no mount namespace) up to 8.8 s. This
        trigger, in the same three runs: 0.2 ms median, 7.5 ms at most."""
        sock = _netns_socket(f"/run/netns/{self.ns(node)}")
        self._faults.append(("link", node))

        def fire() -> float:
            t0 = time.monotonic()
            try:
                with _realtime():
                    _set_up(sock, "eth0", False)
            finally:
                sock.close()
            return time.monotonic() - t0

        return fire

    def link_up(self, node: str) -> None:
        sock = _netns_socket(f"/run/netns/{self.ns(node)}")
        with contextlib.closing(sock):
            _set_up(sock, "eth0", True)

    def set_mtu(self, node: str, mtu: int, path: bool = False) -> None:
        """Set ``node``'s eth0 MTU.  With ``path=True`` also its bridge port and the bridge
        (so jumbo frames really pass); with ``path=False`` the path stays at the lab MTU
        and oversized frames from the node are dropped on the way."""
        self.node_run(node, ["ip", "link", "set", "eth0", "mtu", str(mtu)])
        if path:
            subprocess.run(["ip", "-n", self.ctl, "link", "set", self._bridge_port(node),
                            "mtu", str(mtu)], check=True, capture_output=True)
        self._faults.append(("mtu", node))

    def set_path_mtu(self, mtu: int) -> None:
        """Every node's eth0, every bridge port and the bridge to ``mtu``."""
        for node in self.nodes:
            self.set_mtu(node, mtu, path=True)

    def clear_faults(self) -> None:
        """Undo every fault: flush node firewalls, links up, MTUs back to the lab MTU, CPU
        shares back to the default."""
        for kind, node in list(self._faults):
            if kind == "cpu":
                self.cpu_shares(node, 1024)
        for node in self.nodes:
            self.node_run(node, ["iptables", "-F", "INPUT"], check=False)
            self.node_run(node, ["ip", "link", "set", "eth0", "mtu", str(self.mtu), "up"],
                          check=False)
            subprocess.run(["ip", "-n", self.ctl, "link", "set", self._bridge_port(node),
                            "mtu", str(self.mtu), "up"], capture_output=True, check=False)
            # a link brought down loses its connected route only while down; the address
            # stays, so bringing it up restores the node completely
        self._faults.clear()

    # ------------------------------------------------------------------ network namespaces
    @contextlib.contextmanager
    def in_ctl(self) -> Iterator[None]:
        """Run the calling thread (and the threads it starts meanwhile) in the controller
        namespace, where every node's addresses are reachable; back to its own after."""
        with _in_netns(f"/run/netns/{self.ctl}"):
            yield

    # ------------------------------------------------------------------ a Docker engine per node
    def node_pid(self, node: str) -> int:
        """The node's sshd: its network, mount and UTS namespaces are the node's."""
        return int((self.base / "nodes" / node / "sshd.pid").read_text())

    def docker_root(self, node: str) -> Path:
        return Path(_root_docker_dir()) / "pdstack-lab" / self.prefix / node

    def docker_host(self, node: str) -> str:
        """DOCKER_HOST for the node's own engine, from this machine's namespaces."""
        return f"unix:///proc/{self.node_pid(node)}/root/run/docker.sock"

    def start_docker(self, node: str, timeout: float = 60) -> float:
        """Start a Docker engine inside ``node`` (its network, mount and UTS namespaces),
        as a real host has one: containers with ``network_mode: host`` live on the node's
        eth0, ``/run/docker.sock`` is the node's own (Ansible over SSH finds it there), and
        bind mounts resolve in the node's file system (its overlaid /opt and /etc).

        Its data root holds every image of this machine's engine, cloned with hard links
        (the image layers are read-only; ~3 s for the 4.8 GB engine image, where
        ``docker save | docker load`` takes minutes); it lies on the same file system as
        the machine's data root, under ``<root>/pdstack-lab/<prefix>/<node>`` (the
        machine's daemon ignores unknown directories there).  Returns seconds taken."""
        t0 = time.monotonic()
        root = self.docker_root(node)
        self.stop_docker(node)
        _clone_images(Path(_root_docker_dir()), root)
        pid = self.node_pid(node)
        enter = ["nsenter", "-t", str(pid), "-n", "-m", "-u", "--"]
        # the node's /sys is its network namespace's sysfs (ip netns exec): no cgroup
        # hierarchies there; mount this machine's (cgroup v1: the same hierarchies) again
        mounts = Path("/proc/1/mounts").read_text()
        script = ["set -e", "mountpoint -q /sys/fs/cgroup || mount -t tmpfs -o mode=755 "
                  "tmpfs /sys/fs/cgroup"]
        for line in mounts.splitlines():
            _dev, where, kind, opts, *_ = line.split()
            if not where.startswith("/sys/fs/cgroup/"):
                continue
            if kind == "cgroup":
                keep = ",".join(o for o in opts.split(",") if o not in ("rw", "relatime"))
                script.append(f"mkdir -p {where}; mountpoint -q {where} || "
                              f"mount -t cgroup -o {keep} cgroup {where}")
            elif kind == "cgroup2":
                script.append(f"mkdir -p {where}; mountpoint -q {where} || "
                              f"mount -t cgroup2 cgroup2 {where}")
        subprocess.run([*enter, "sh", "-c", "\n".join(script)], check=True,
                       capture_output=True, text=True, timeout=30)
        log = self.base / "nodes" / node / "dockerd.log"
        # host networking only: no bridge, no iptables rules of Docker's in the node
        argv = [*enter, "setsid", "dockerd", "--data-root", str(root), "--bridge", "none",
                "--iptables=false", "--ip6tables=false", "--ip-masq=false",
                "--cgroup-parent", f"/{self.prefix}-{node}"]
        with open(log, "ab") as out:
            subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            probe = subprocess.run(["docker", "-H", self.docker_host(node), "version",
                                    "--format", "{{.Server.Version}}"],
                                   capture_output=True, text=True, timeout=30)
            if probe.returncode == 0:
                return time.monotonic() - t0
            if time.monotonic() > deadline:
                raise LabError(f"{node}: dockerd not up in {timeout:.0f}s: "
                               f"{log.read_text()[-2000:]}")
            time.sleep(0.3)

    def stop_docker(self, node: str, timeout: float = 60) -> None:
        """Remove the node's containers, stop its engine, delete its data root."""
        root = self.docker_root(node)
        pids = [p for p in _pids_of("dockerd") if _cmdline_has(p, str(root))]
        if pids:
            dh = ["docker", "-H", self.docker_host(node)]
            ids = subprocess.run([*dh, "ps", "-aq"], capture_output=True, text=True,
                                 timeout=30).stdout.split()
            if ids:
                subprocess.run([*dh, "rm", "-f", "-v", *ids], capture_output=True, timeout=120)
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while any(Path(f"/proc/{p}").exists() for p in pids):
                if time.monotonic() > deadline:
                    for p in pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(p, signal.SIGKILL)
                    break
                time.sleep(0.2)
        if root.exists():
            subprocess.run(["rm", "-rf", "--one-file-system", str(root)], check=False,
                           capture_output=True, timeout=300)
        for parent in (root.parent, root.parent.parent):  # <prefix>/, pdstack-lab/ when empty
            with contextlib.suppress(OSError):
                parent.rmdir()

    # ------------------------------------------------------------------ inventories
    def write_inventory(self, dest: str | Path,
                        node_vars: Mapping[str, Mapping[str, Any]] | None = None,
                        group_vars: Mapping[str, Any] | None = None,
                        source: Path = LAB_INVENTORY) -> Path:
        """Copy ``source`` (inventory/lab) to ``dest`` pointing at this lab's keys, with
        overrides: ``node_vars={"node1": {"pdstack_mtu": 9000}}``, ``group_vars={...}``."""
        dest = Path(dest)
        (dest / "group_vars").mkdir(parents=True, exist_ok=True)
        text = (source / "hosts.yml").read_text()
        text = text.replace(_inventory_base(text), str(self.base))
        hosts = yaml.safe_load(text)
        nodes = hosts["all"]["children"]["pdstack_nodes"]["hosts"]
        for name, extra in (node_vars or {}).items():
            nodes[name].update(extra)
        (dest / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
        gv = yaml.safe_load((source / "group_vars" / "all.yml").read_text())
        gv.update(group_vars or {})
        (dest / "group_vars" / "all.yml").write_text(yaml.safe_dump(gv, sort_keys=False))
        return dest


def _inventory_base(hosts_text: str) -> str:
    """The lab base a committed lab inventory refers to (/var/lib/pdstack-lab/<prefix>)."""
    for word in hosts_text.split():
        if word.startswith(f"{DEFAULT_BASE_ROOT}/"):
            return "/".join(word.split("/")[:5])
    return INVENTORY_BASE


@contextlib.contextmanager
def _in_netns(path: str) -> Iterator[None]:
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(path, os.O_RDONLY)
    try:
        os.setns(target, os.CLONE_NEWNET)
        try:
            yield
        finally:
            os.setns(own, os.CLONE_NEWNET)
    finally:
        os.close(target)
        os.close(own)


def _netns_socket(path: str) -> socket.socket:
    """A socket of the network namespace at ``path``: it acts there (interface ioctls)
    whichever namespace the thread that uses it is in."""
    with _in_netns(path):
        return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1  # linux/sockios.h, linux/if.h


def _set_up(sock: socket.socket, ifname: str, up: bool) -> None:
    """Set or clear an interface's ``IFF_UP`` (``ip link set IF up/down``) through a socket
    of its network namespace."""
    name = ifname.encode()
    got = fcntl.ioctl(sock, SIOCGIFFLAGS, struct.pack("16sH22x", name, 0))
    flags = struct.unpack_from("16sH", got)[1]
    flags = flags | IFF_UP if up else flags & ~IFF_UP
    fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH22x", name, flags))


@contextlib.contextmanager
def _realtime() -> Iterator[None]:
    """The calling thread at ``SCHED_FIFO`` 1 meanwhile (as is, where not permitted)."""
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        raised = True
    except PermissionError:
        raised = False
    try:
        yield
    finally:
        if raised:
            os.sched_setscheduler(0, policy, param)


@functools.cache
def _root_docker_dir() -> str:
    """This machine's Docker data root (asked once per process: start and stop of every
    node's engine need it)."""
    out = subprocess.run(["docker", "info", "--format", "{{.DockerRootDir}}"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0 or not out.stdout.strip():
        raise LabError(f"this machine's Docker engine does not answer: {out.stderr[-500:]}")
    return out.stdout.strip()


def _clone_images(src: Path, dest: Path) -> None:
    """Every image of the Docker data root ``src`` (overlay2) into a fresh data root
    ``dest``, by hard links: image layers, their short-name links, image metadata; no
    containers, no volumes."""
    layerdb = src / "image" / "overlay2" / "layerdb" / "sha256"
    (dest / "overlay2" / "l").mkdir(parents=True)
    for cache_id_file in layerdb.glob("*/cache-id"):
        cache_id = cache_id_file.read_text().strip()
        layer = src / "overlay2" / cache_id
        if not layer.is_dir():
            continue
        done = subprocess.run(["cp", "-al", str(layer), str(dest / "overlay2" / cache_id)],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise LabError(f"cloning {layer} into {dest} failed (hard links need one file "
                           f"system): {done.stderr[:300]}")
        short = (layer / "link").read_text().strip()
        (dest / "overlay2" / "l" / short).symlink_to(f"../{cache_id}/diff")
    subprocess.run(["cp", "-a", str(src / "image"), str(dest / "image")], check=True,
                   capture_output=True, timeout=120)
    mounts = dest / "image" / "overlay2" / "layerdb" / "mounts"
    shutil.rmtree(mounts, ignore_errors=True)
    mounts.mkdir()
    repos = dest / "image" / "overlay2" / "repositories.json"
    json.loads(repos.read_text())  # present and whole: the tags come with the images


def _pids_of(name: str) -> list[int]:
    out = subprocess.run(["pgrep", "-x", name], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _cmdline_has(pid: int, word: str) -> bool:
    try:
        return word in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


# ---------------------------------------------------------------------- fixtures


def lab_fixtures(prefix: str) -> tuple[Any, Any]:
    """``(lab, clean_lab)`` pytest fixtures for a lab with its own namespace prefix.

    Each test folder that needs a lab uses its own prefix (at most 8 characters), so two
    folders' session labs never tear each other down::

        lab, clean_lab = netns_lab.lab_fixtures("pdans")
    """

    @pytest.fixture(scope="session")
    def lab() -> Iterator[Lab]:
        """A running 3-node lab for the whole session; always torn down."""
        missing = missing_prerequisites()
        if missing:
            pytest.fail("netns lab prerequisites missing:\n  " + "\n  ".join(missing)
                        + "\n(CI: .ci/install.sh must install them)", pytrace=False)
        the_lab = Lab(prefix=prefix)
        try:
            the_lab.up()
        except LabError as exc:
            the_lab.down()
            pytest.fail(str(exc), pytrace=False)
        try:
            yield the_lab
        finally:
            the_lab.down()

    @pytest.fixture
    def clean_lab(lab: Lab) -> Iterator[Lab]:
        """The session lab, with every injected fault undone after the test."""
        lab.clear_faults()
        try:
            yield lab
        finally:
            lab.clear_faults()

    return lab, clean_lab
