#!/usr/bin/env python3
"""pdstack_probe: node-side network and host probe for pdstack preflight.

Standard library only, Python >= 3.9: this file is copied as-is to freshly
rented hosts (by ``pdstack preflight`` and by Ansible's ``private_network``
role) and run there with the system ``python3``.  Every subcommand prints one
JSON document on stdout (``listen`` prints one JSON object per line: a
``ready`` event once its sockets are bound and a ``done`` event at exit).

Subcommands::

  listen      --bind ADDR:PORT ... --seconds N [--exit-on-stdin-eof]   (PORT 0: ephemeral)
  connect     HOST:PORT ... [--timeout S]            parallel, with RTT
  ping        HOST --size BYTES [--timeout S]          don't-fragment ICMP echo
  throughput  HOST:PORT [--seconds N]                  against a ``listen`` probe
  info        everything below in one document
  interfaces  interfaces, MTU, addresses (``ip -j addr`` or /sys/class/net)
  gpu         ``nvidia-smi`` GPUs and driver, when present
  rdma        /dev/infiniband and ``ibv_devinfo``, when present
  ucx         ``ucx_info -v`` / ``-d`` (version, transports, cuda_ipc), when present
  free-ports  [--address A] [--start P --end P --count N]
  resources   memory (/proc/meminfo), disk (--path ...), CPUs
  batch       reads {"timeout": s, "connect": [...], "ping": [...], "throughput": [...]}
              on stdin; connects and pings run in parallel, bounded by the timeout,
              then each throughput item ({"host", "port", "seconds"}) in turn

Connect results: ``ok`` | ``timeout`` (filtered / no route) | ``refused``
(nothing listening, or REJECT) | ``host_unreachable`` | ``network_unreachable``
| ``error``.  Ping results: ``ok`` | ``too_big`` (local or path MTU smaller than
the packet; ``mtu`` names it when known) | ``timeout`` | ``error`` |
``unavailable``.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import selectors
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

PROBE_VERSION = 1
BANNER = b"PDSTACK-PROBE 1\n"
TPUT_MAGIC = b"PDSTACK-TPUT\n"
IP_MTU_DISCOVER = getattr(socket, "IP_MTU_DISCOVER", 10)
IP_PMTUDISC_DO = getattr(socket, "IP_PMTUDISC_DO", 2)

Json = dict[str, Any]


def emit(doc: Any, pretty: bool = False) -> None:
    sys.stdout.write(json.dumps(doc, indent=2 if pretty else None, sort_keys=False) + "\n")
    sys.stdout.flush()


def split_hostport(text: str) -> tuple[str, int]:
    """``10.0.0.1:80`` / ``[fd00::1]:80`` / ``host:80`` -> (host, port)."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if not rest.startswith(":"):
            raise ValueError(f"expected [ADDR]:PORT, got {text!r}")
        return host, int(rest[1:])
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def family_of(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def run_cmd(argv: list[str], timeout: float = 10.0) -> tuple[int, str, str]:
    try:
        proc = subprocess.run(
            argv, capture_output=True, timeout=timeout,
            text=True,
        )
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"{argv[0]}: timed out after {timeout:.1f}s"
    return proc.returncode, proc.stdout, proc.stderr


# --------------------------------------------------------------------------- connect

def classify_oserror(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return "timeout"
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    code = getattr(exc, "errno", None)
    if code == errno.EHOSTUNREACH:
        return "host_unreachable"
    if code == errno.ENETUNREACH:
        return "network_unreachable"
    if code == errno.ETIMEDOUT:
        return "timeout"
    if code == errno.ECONNREFUSED:
        return "refused"
    return "error"


def connect_one(host: str, port: int, timeout: float, banner_wait: float = 0.3) -> Json:
    """One TCP connect; ``listener`` says whether a pdstack probe answered."""
    result: Json = {"host": host, "port": port, "timeout_s": timeout}
    start = time.monotonic()
    sock = None
    try:
        sock = socket.socket(family_of(host), socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect((host, port))
        result["rtt_ms"] = round((time.monotonic() - start) * 1000.0, 3)
        result["status"] = "ok"
        sock.settimeout(max(0.05, min(banner_wait, timeout)))
        try:
            data = sock.recv(len(BANNER))
            result["listener"] = "probe" if data == BANNER else "other"
        except OSError:
            result["listener"] = "other"
    except OSError as exc:
        result["status"] = classify_oserror(exc)
        result["error"] = str(exc) or exc.__class__.__name__
        result["elapsed_ms"] = round((time.monotonic() - start) * 1000.0, 3)
    finally:
        if sock is not None:
            sock.close()
    return result


def parallel(funcs: list[Any]) -> list[Any]:
    """Run zero-argument callables in threads; results in input order."""
    results: list[Any] = [None] * len(funcs)

    def work(i: int) -> None:
        try:
            results[i] = funcs[i]()
        except Exception as exc:
            results[i] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(funcs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# --------------------------------------------------------------------------- ping

PING_RTT = re.compile(r"time[=<]([0-9.]+) ?ms")
PING_MTU = re.compile(r"mtu ?= ?(\d+)")


def ping_df(host: str, size: int, timeout: float) -> Json:
    """Don't-fragment ICMP echo with ``size`` payload bytes (``ping -M do -s SIZE``).

    IP packet size = size + 28 (IPv4) or size + 48 (IPv6).
    """
    v6 = ":" in host
    result: Json = {"host": host, "size": size, "packet_bytes": size + (48 if v6 else 28),
                    "timeout_s": timeout}
    ping = shutil.which("ping")
    if ping is None and not v6:
        result.update(ping_raw_v4(host, size, timeout))
        return result
    if ping is None:
        result.update({"status": "unavailable", "error": "no ping binary for IPv6"})
        return result
    wait = max(1, int(timeout + 0.999))
    argv = [ping, "-n", "-c", "1", "-W", str(wait), "-M", "do", "-s", str(size)]
    if v6:
        argv.insert(1, "-6")
    rc, out, err = run_cmd([*argv, host], timeout=wait + 2.0)
    text = out + err
    result["method"] = "ping"
    if rc == 0:
        m = PING_RTT.search(text)
        result["status"] = "ok"
        if m:
            result["rtt_ms"] = float(m.group(1))
    elif ("invalid argument" in text.lower() and "-M" in text) or "unrecognized option" in text:
        if not v6:
            result.update(ping_raw_v4(host, size, timeout))
        else:
            result.update({"status": "unavailable", "error": text.strip()[:300]})
    elif any(k in text.lower() for k in ("too long", "frag needed", "packet too big")):
        result["status"] = "too_big"
        m = PING_MTU.search(text)
        if m:
            result["mtu"] = int(m.group(1))
        result["error"] = text.strip().splitlines()[-1][:300] if text.strip() else ""
    elif rc == 1:
        result["status"] = "timeout"
        unreach = [line for line in text.splitlines() if "unreachable" in line.lower()]
        if unreach:
            result["status"] = "host_unreachable"
            result["error"] = unreach[0].strip()[:300]
    else:
        result["status"] = "error"
        result["error"] = text.strip()[:300]
    return result


def icmp_checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack("!" + "H" * (len(data) // 2), data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def ping_raw_v4(host: str, size: int, timeout: float) -> Json:
    """Fallback without a ``ping`` that knows ``-M do``: raw ICMP with DF (needs root)."""
    res: Json = {"method": "raw"}
    try:
        sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
    except OSError as exc:
        res.update({"status": "unavailable", "error": f"raw ICMP socket: {exc}"})
        return res
    ident = os.getpid() & 0xFFFF
    payload = (b"pdstack" * (size // 7 + 1))[:size]
    header = struct.pack("!BBHHH", 8, 0, 0, ident, 1)
    packet = struct.pack("!BBHHH", 8, 0, icmp_checksum(header + payload), ident, 1) + payload
    try:
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        start = time.monotonic()
        try:
            sock.sendto(packet, (host, 0))
        except OSError as exc:
            if exc.errno == errno.EMSGSIZE:
                res.update({"status": "too_big", "error": str(exc)})
                try:
                    sock.connect((host, 0))
                    res["mtu"] = sock.getsockopt(socket.IPPROTO_IP, getattr(socket, "IP_MTU", 14))
                except OSError:
                    pass
                return res
            res.update({"status": classify_oserror(exc), "error": str(exc)})
            return res
        deadline = start + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                res["status"] = "timeout"
                return res
            sock.settimeout(left)
            try:
                data, addr = sock.recvfrom(65535)
            except socket.timeout:  # noqa: UP041 - not TimeoutError before Python 3.10
                res["status"] = "timeout"
                return res
            ihl = (data[0] & 0x0F) * 4
            if len(data) < ihl + 8 or addr[0] != host:
                continue
            itype, _code, _ck, rid, _seq = struct.unpack("!BBHHH", data[ihl:ihl + 8])
            if itype == 0 and rid == ident:
                res.update({"status": "ok", "rtt_ms": round((time.monotonic() - start) * 1000, 3)})
                return res
    finally:
        sock.close()


# --------------------------------------------------------------------------- listen

def bind_listener(host: str, port: int) -> tuple[socket.socket | None, Json]:
    info: Json = {"address": host, "port": port}
    sock = socket.socket(family_of(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            info["status"] = "in_use"
        elif exc.errno == errno.EADDRNOTAVAIL:
            info["status"] = "address_not_available"
        else:
            info["status"] = "error"
        info["error"] = str(exc)
        return None, info
    info["status"] = "listening"
    if port == 0:  # an ephemeral port, as UCX's TCP transport uses: say which one
        info["requested_port"] = 0
        info["port"] = sock.getsockname()[1]
    return sock, info


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock``, or fewer when the peer closes first."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def serve_conn(conn: socket.socket) -> None:
    """Send the banner; if the peer asks for a throughput run, sink and report."""
    try:
        conn.setblocking(True)
        conn.settimeout(5.0)
        conn.sendall(BANNER)
        if recv_exact(conn, len(TPUT_MAGIC)) != TPUT_MAGIC:
            return
        conn.settimeout(30.0)
        total = 0
        start = time.monotonic()
        while True:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            total += len(chunk)
        secs = time.monotonic() - start
        conn.sendall((json.dumps({"bytes": total, "seconds": secs}) + "\n").encode())
    except OSError:
        pass
    finally:
        conn.close()


def cmd_listen(args: argparse.Namespace) -> int:
    binds = [split_hostport(b) for b in args.bind]
    socks: list[socket.socket] = []
    infos: list[Json] = []
    for host, port in binds:
        sock, info = bind_listener(host, port)
        infos.append(info)
        if sock is not None:
            socks.append(sock)
    emit({"event": "ready", "pid": os.getpid(), "seconds": args.seconds, "binds": infos})
    stop = threading.Event()
    if args.exit_on_stdin_eof:
        def watch_stdin() -> None:
            try:
                while sys.stdin.buffer.read(4096):
                    pass
            except (OSError, ValueError):
                pass
            stop.set()
        threading.Thread(target=watch_stdin, daemon=True).start()
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    accepted: dict[str, int] = {}
    peers: dict[str, list[str]] = {}
    deadline = time.monotonic() + args.seconds
    while socks and not stop.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for key, _ in sel.select(timeout=min(left, 0.2)):
            lsock = key.fileobj
            assert isinstance(lsock, socket.socket)
            try:
                conn, peer = lsock.accept()
            except OSError:
                continue
            name = "{}:{}".format(*lsock.getsockname()[:2])
            accepted[name] = accepted.get(name, 0) + 1
            peers.setdefault(name, [])
            if peer[0] not in peers[name]:
                peers[name].append(peer[0])
            threading.Thread(target=serve_conn, args=(conn,), daemon=True).start()
    for s in socks:
        s.close()
    reason = "stdin closed" if stop.is_set() else "deadline" if socks else "nothing bound"
    emit({"event": "done", "reason": reason, "accepted": accepted, "peers": peers})
    return 0


# --------------------------------------------------------------------------- throughput

def throughput(host: str, port: int, seconds: float, timeout: float) -> Json:
    res: Json = {"host": host, "port": port}
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        res.update({"status": classify_oserror(exc), "error": str(exc)})
        return res
    try:
        sock.settimeout(timeout)
        if recv_exact(sock, len(BANNER)) != BANNER:
            res.update({"status": "error", "error": "peer is not a pdstack probe listener"})
            return res
        sock.sendall(TPUT_MAGIC)
        block = b"\0" * (1 << 16)
        sent = 0
        start = time.monotonic()
        sock.settimeout(max(timeout, seconds + 5))
        while time.monotonic() - start < seconds:
            sock.sendall(block)
            sent += len(block)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        elapsed = time.monotonic() - start
        server = json.loads(reply.decode() or "{}")
        received = int(server.get("bytes", 0))
        res.update({
            "status": "ok" if received == sent else "error",
            "bytes_sent": sent, "bytes_received": received, "seconds": round(elapsed, 3),
            "mbit_per_s": round(received * 8 / elapsed / 1e6, 1) if elapsed > 0 else None,
        })
        if received != sent:
            res["error"] = f"server received {received} of {sent} bytes"
    except (OSError, ValueError) as exc:
        res.update({"status": classify_oserror(exc) if isinstance(exc, OSError) else "error",
                    "error": str(exc)})
    finally:
        sock.close()
    return res


# --------------------------------------------------------------------------- host facts

def interfaces() -> Json:
    rc, out, _ = run_cmd(["ip", "-j", "addr", "show"], timeout=5.0)
    result: list[Json] = []
    if rc == 0 and out.strip():
        for link in json.loads(out):
            result.append({
                "name": link.get("ifname"),
                "mtu": link.get("mtu"),
                "state": link.get("operstate"),
                "up": "UP" in link.get("flags", []),
                "lower_up": "LOWER_UP" in link.get("flags", []),
                "mac": link.get("address"),
                "addresses": [
                    {"family": "inet6" if a.get("family") == "inet6" else "inet",
                     "address": a.get("local"), "prefixlen": a.get("prefixlen")}
                    for a in link.get("addr_info", []) if a.get("local")
                ],
            })
        return {"source": "ip -j addr", "interfaces": result}
    return {"source": "/sys/class/net", "interfaces": interfaces_sysfs()}


def interfaces_sysfs() -> list[Json]:
    v6: dict[str, list[Json]] = {}
    try:
        with open("/proc/net/if_inet6") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 6:
                    raw = parts[0]
                    addr = ":".join(raw[i:i + 4] for i in range(0, 32, 4))
                    packed = socket.inet_pton(socket.AF_INET6, addr)
                    v6.setdefault(parts[5], []).append({
                        "family": "inet6", "address": socket.inet_ntop(socket.AF_INET6, packed),
                        "prefixlen": int(parts[2], 16)})
    except OSError:
        pass
    result = []
    base = "/sys/class/net"
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        def read(attr: str, name: str = name) -> str:
            try:
                with open(os.path.join(base, name, attr)) as fh:
                    return fh.read().strip()
            except OSError:
                return ""
        flags = int(read("flags") or "0", 16)
        addrs = list_v4_addresses(name) + v6.get(name, [])
        result.append({
            "name": name, "mtu": int(read("mtu") or 0), "state": read("operstate").upper(),
            "up": bool(flags & 0x1), "lower_up": read("carrier") == "1", "mac": read("address"),
            "addresses": addrs,
        })
    return result


def list_v4_addresses(ifname: str) -> list[Json]:
    """Primary IPv4 address of an interface via SIOCGIFADDR (no ``ip`` needed)."""
    try:
        import fcntl
    except ImportError:
        return []
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        req = struct.pack("256s", ifname.encode()[:15])
        addr = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), 0x8915, req)[20:24])
        mask = socket.inet_ntoa(fcntl.ioctl(sock.fileno(), 0x891B, req)[20:24])
        prefix = sum(bin(int(x)).count("1") for x in mask.split("."))
        return [{"family": "inet", "address": addr, "prefixlen": prefix}]
    except OSError:
        return []
    finally:
        sock.close()


# --------------------------------------------------------------------------- parsers
# One home for reading what nvidia-smi, ibv_devinfo and ucx_info print: the probe uses
# these functions on the node, and Ansible's filter plugin (ansible/plugins/filter/
# pdstack_host.py) loads this file so that the roles gpu_host and rdma_ucx parse with the
# same code.  tests/host/ feeds real outputs (tests/fixtures/h200/) through them.

# Fields of the GPU query, in this order; ``nvidia_smi_query_argv`` builds the command.
NVSMI_GPU_FIELDS = ("index", "name", "uuid", "driver_version", "persistence_mode",
                    "mig.mode.current", "memory.total")
# nvidia-smi's CSV field name -> the key of a parsed GPU
NVSMI_KEYS = {"index": "index", "name": "name", "uuid": "uuid",
              "driver_version": "driver_version", "persistence_mode": "persistence_mode",
              "mig.mode.current": "mig_mode", "memory.total": "memory_mib"}
# What nvidia-smi prints for a value it does not have
NVSMI_MISSING = {"n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]",
                 "[insufficient permissions]", "[gpu requires reset]", "[gpu is lost]", ""}
_UNIT_MIB = {"mib": 1.0, "gib": 1024.0, "kib": 1.0 / 1024, "mb": 1.0, "gb": 1024.0}
ANSI_ESCAPE = re.compile(r"(?:\x1b)?\[[0-9;]*m")


def nvidia_smi_query_argv(binary: str = "nvidia-smi",
                          fields: tuple[str, ...] | list[str] = NVSMI_GPU_FIELDS) -> list[str]:
    """The GPU query, exactly as the probe and the gpu_host role run it."""
    return [binary, "--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"]


def _nvsmi_value(text: str) -> str | None:
    text = text.strip()
    return None if text.lower() in NVSMI_MISSING else text


def parse_memory_mib(text: str | None) -> int | None:
    """``143771``, ``143771 MiB``, ``140.4 GiB`` -> MiB (int); N/A -> None."""
    value = _nvsmi_value(text or "")
    if value is None:
        return None
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)", value)
    if not m:
        return None
    unit = m.group(2).lower() or "mib"
    if unit not in _UNIT_MIB:
        return None
    return int(float(m.group(1)) * _UNIT_MIB[unit])


def parse_driver_version(text: str | None) -> tuple[int, ...] | None:
    """``580.159.04`` -> (580, 159, 4); ``570.86.15`` / ``550.54`` alike; else None."""
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def driver_at_least(version: str | None, minimum: str) -> bool:
    have, want = parse_driver_version(version), parse_driver_version(minimum)
    if want is None:
        raise ValueError(f"minimum driver version {minimum!r} is not N.N[.N]")
    return have is not None and have >= want


NVSMI_HEADER_COL = re.compile(r"([a-z][a-z0-9_.]*)(?: \[([^\]]+)\])?")


def _nvsmi_header(cols: list[str]) -> list[tuple[str, str | None]] | None:
    """``index, name, memory.total [MiB]`` -> [(field, unit)]; None when not a header."""
    out = []
    for c in cols:
        m = NVSMI_HEADER_COL.fullmatch(c)
        if not m:
            return None
        out.append((m.group(1), m.group(2)))
    return out


def _nvsmi_key(field: str) -> str:
    if field in NVSMI_KEYS:
        return NVSMI_KEYS[field]
    key = field.replace(".", "_")
    return key + "_mib" if field.startswith("memory.") else key


def parse_nvidia_smi_csv(text: str, fields: tuple[str, ...] | list[str] = NVSMI_GPU_FIELDS,
                         ) -> list[Json]:
    """``nvidia-smi --query-gpu=FIELDS --format=csv[,noheader][,nounits]`` -> one dict per GPU.

    Keys: NVSMI_KEYS for the fields it names (``mig.mode.current`` -> ``mig_mode``,
    ``memory.total`` -> ``memory_mib``), else the field with ``_`` for ``.``.  ``index`` is
    an int; ``memory.*`` are ints in MiB, with or without the unit (``143771 MiB``); other
    values lose the unit the header names (``1980 MHz`` -> ``1980``); what nvidia-smi does
    not have (``N/A``, ``[N/A]``, ``[Not Supported]``) is None.  A header line
    (``--format=csv``) sets the fields and their order, whatever ``fields`` says.  A name
    with commas in it is put back together.  Raises ValueError, quoting the line, on a line
    with fewer columns than fields (e.g. ``No devices were found``).
    """
    cols_of = [[c.strip() for c in raw.split(",")] for raw in text.splitlines() if raw.strip()]
    spec: list[tuple[str, str | None]] = [(f, None) for f in fields]
    gpus: list[Json] = []
    for n, cols in enumerate(cols_of):
        header = _nvsmi_header(cols) if n == 0 else None
        if header:
            spec = header
            continue
        names = [f for f, _ in spec]
        line = ", ".join(cols)
        if len(cols) < len(spec):
            raise ValueError(f"nvidia-smi line has {len(cols)} of {len(spec)} fields "
                             f"({','.join(names)}): {line[:200]!r}")
        if len(cols) > len(spec) and "name" in names:  # a comma inside the name
            at = names.index("name")
            extra = len(cols) - len(spec)
            cols = [*cols[:at], ", ".join(cols[at:at + extra + 1]), *cols[at + extra + 1:]]
        gpu: Json = {}
        for i, (field, unit) in enumerate(spec):  # no zip(strict=): the probe runs on 3.9
            col = cols[i]
            key = _nvsmi_key(field)
            if field == "index":
                gpu[key] = int(col)
            elif field.startswith("memory."):
                gpu[key] = parse_memory_mib(col)
            else:
                value = _nvsmi_value(col)
                if value is not None and unit and value.endswith(" " + unit):
                    value = value[: -len(unit) - 1]
                gpu[key] = value
        gpus.append(gpu)
    return gpus


def gpu_problems(gpus: list[Json], expected_count: int, expected_model: str = "",
                 min_driver: str = "0.0", fail_on_mig: bool = True) -> list[str]:
    """What is wrong with the node's GPUs against the inventory; empty when all is well.

    Every message names the inventory field (pdstack_gpu_count, pdstack_gpu_model) or the
    setting it contradicts; the gpu_host role fails with them.
    """
    problems: list[str] = []
    if len(gpus) != int(expected_count):
        problems.append(f"nvidia-smi shows {len(gpus)} GPU(s), the inventory says "
                        f"pdstack_gpu_count={int(expected_count)}")
    old = sorted({str(g.get("driver_version")) for g in gpus
                  if not driver_at_least(g.get("driver_version"), min_driver)})
    if old:
        problems.append(f"driver {', '.join(old)} is older than {min_driver} "
                        "(the engine image's minimum, gpu_host_min_driver_version)")
    names = [str(g.get("name")) for g in gpus]
    if expected_model and any(n != expected_model for n in names):
        problems.append(f"GPU model {', '.join(sorted(set(names)))}, the inventory says "
                        f"pdstack_gpu_model={expected_model}")
    mig_on = [str(g["index"]) for g in gpus if str(g.get("mig_mode") or "").lower() == "enabled"]
    if fail_on_mig and mig_on:
        problems.append(f"MIG is enabled on GPU(s) {','.join(mig_on)} "
                        "(disable it: nvidia-smi -mig 0, or set gpu_host_fail_on_mig: false)")
    return problems


def parse_nvidia_smi_topo(text: str) -> Json:
    """``nvidia-smi topo -m`` -> {"gpus": [...], "links": {"GPU0": {"GPU1": "NV18"}},
    "cpu_affinity": {...}, "numa_affinity": {...}, "nics": [...]}.

    The header line of a real terminal-less run still carries ANSI underline escapes
    (``\x1b[4m`` ... ``\x1b[0m``); they are removed.  Columns are tab-separated.
    """
    lines = [ANSI_ESCAPE.sub("", ln).rstrip() for ln in text.splitlines()]
    header: list[str] = []
    res: Json = {"gpus": [], "nics": [], "links": {}, "cpu_affinity": {}, "numa_affinity": {}}
    for ln in lines:
        if not ln.strip():
            if header:
                break  # the legend follows the matrix after a blank line
            continue
        cols = [c.strip() for c in ln.split("\t")]
        if not header:
            if cols and cols[0] == "" and any(c.startswith("GPU") for c in cols):
                header = cols[1:]
            continue
        name = cols[0]
        if not re.fullmatch(r"(GPU|NIC|mlx)\w*", name):
            continue
        # nvidia-smi pads with an empty column before "GPU NUMA ID": values are never empty
        cols = [name, *(c for c in cols[1:] if c)]
        row = {h: cols[i + 1] for i, h in enumerate(header) if i + 1 < len(cols)}
        peers = {k: v for k, v in row.items() if re.fullmatch(r"(GPU|NIC)\d+", k)}
        if name.startswith("GPU"):
            res["gpus"].append(name)
            res["links"][name] = {k: v for k, v in peers.items() if k != name}
            res["cpu_affinity"][name] = row.get("CPU Affinity")
            numa = row.get("NUMA Affinity")
            res["numa_affinity"][name] = None if numa in (None, "N/A") else numa
        else:
            res["nics"].append(name)
    return res


def parse_ibv_devinfo(text: str) -> list[Json]:
    """``ibv_devinfo`` -> [{"hca", "port", "state", "link_layer"}] (state e.g. PORT_ACTIVE)."""
    ports: list[Json] = []
    hca = None
    port = None
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("hca_id:"):
            hca = s.split(":", 1)[1].strip()
        elif s.startswith("port:"):
            port = s.split(":", 1)[1].strip()
        elif s.startswith("state:") and hca is not None:
            ports.append({"hca": hca, "port": port,
                          "state": (s.split(":", 1)[1].strip().split() or [""])[0]})
        elif s.startswith("link_layer:") and ports:
            ports[-1]["link_layer"] = s.split(":", 1)[1].strip()
    return ports


# A node offers RDMA verbs when /dev/infiniband has a uverbsN node (an HCA's verbs device);
# rdma_cm alone (the RDMA CM module loaded, no HCA) is not RDMA.
RDMA_VERBS_PREFIX = "uverbs"


def rdma_verbs_devices(names: list[str]) -> list[str]:
    """The verbs devices among the names in /dev/infiniband (``uverbs0``...), sorted."""
    return sorted(n for n in names if n.startswith(RDMA_VERBS_PREFIX))


UCX_RDMA_PREFIXES = ("rc", "ud", "dc")


def parse_ucx_info_devices(text: str) -> list[Json]:
    """``ucx_info -d`` -> [{"transport": "rc_mlx5", "device": "mlx5_0:1"}, ...] in order."""
    found: list[Json] = []
    transport = None
    for line in text.splitlines():
        s = line.lstrip("#").strip()
        m = re.match(r"Transport:\s*(\S+)", s)
        if m:
            transport = m.group(1)
            continue
        m = re.match(r"Device:\s*(\S+)", s)
        if m and transport is not None:
            found.append({"transport": transport, "device": m.group(1)})
    return found


def ucx_rdma_transports(text: str) -> list[str]:
    """RDMA transports (rc*, ud*, dc*) that ``ucx_info -d`` lists, unique and sorted."""
    return sorted({d["transport"] for d in parse_ucx_info_devices(text)
                   if d["transport"].startswith(UCX_RDMA_PREFIXES)})


def parse_ucx_info_version(text: str) -> str | None:
    """``ucx_info -v`` (``# Library version: 1.18.0``) -> ``1.18.0``."""
    m = re.search(r"Library version:\s*(\S+)", text)
    return m.group(1) if m else None


def parse_nvidia_proc_version(text: str) -> str | None:
    """/proc/driver/nvidia/version (``NVRM version: NVIDIA UNIX ... 580.159.04  Release
    Build ...``) -> ``580.159.04``."""
    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            m = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", line + " ")
            return m.group(1) if m else None
    return None


# --------------------------------------------------------------------------- host facts (GPU)

def gpu() -> Json:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"present": False, "reason": "nvidia-smi not found"}
    rc, out, err = run_cmd(nvidia_smi_query_argv(smi), timeout=20.0)
    if rc != 0:
        return {"present": False, "reason": f"nvidia-smi failed: {(err or out).strip()[:300]}"}
    try:
        gpus = parse_nvidia_smi_csv(out)
    except ValueError as exc:
        return {"present": False, "reason": str(exc)}
    res: Json = {"present": bool(gpus), "count": len(gpus),
                 "driver_version": gpus[0]["driver_version"] if gpus else None, "gpus": gpus}
    try:
        with open("/proc/driver/nvidia/version") as fh:
            res["kernel_module_version"] = parse_nvidia_proc_version(fh.read())
    except OSError:
        res["kernel_module_version"] = None
    rc, out, _ = run_cmd([smi, "topo", "-m"], timeout=20.0)
    res["topology"] = parse_nvidia_smi_topo(out) if rc == 0 else None
    # /dev/nvidia-uvm is needed by every CUDA process (and CUDA IPC), /dev/nvidiaN per GPU
    res["device_nodes"] = sorted(n for n in os.listdir("/dev") if n.startswith("nvidia")) \
        if os.path.isdir("/dev") else []
    return res


def ucx(ucx_info: str | None = None) -> Json:
    """UCX on the host (``ucx_info -v`` / ``-d``), when a ucx_info binary is there.

    ``cuda_ipc`` tells whether UCX can move GPU memory between processes of one node
    (NIXL and LMCache on one node), ``rdma_transports`` the rc/ud/dc transports.
    """
    binary = ucx_info or shutil.which("ucx_info")
    if binary is None:
        return {"present": False, "reason": "ucx_info not found"}
    rc, out, err = run_cmd([binary, "-v"], timeout=10.0)
    res: Json = {"present": rc == 0, "binary": binary,
                 "version": parse_ucx_info_version(out) if rc == 0 else None}
    if rc != 0:
        res["reason"] = f"ucx_info -v failed (rc {rc}): {(err or out).strip()[:300]}"
        return res
    rc, out, err = run_cmd([binary, "-d"], timeout=20.0)
    devices = parse_ucx_info_devices(out) if rc == 0 else []
    res.update({
        "devices_rc": rc, "devices": devices,
        "transports": sorted({d["transport"] for d in devices}),
        "rdma_transports": ucx_rdma_transports(out) if rc == 0 else [],
        "cuda_ipc": any(d["transport"] == "cuda_ipc" for d in devices),
    })
    if rc != 0:
        res["reason"] = f"ucx_info -d failed (rc {rc}): {(err or out).strip()[:300]}"
    return res


def rdma() -> Json:
    devdir = "/dev/infiniband"
    devices = sorted(os.listdir(devdir)) if os.path.isdir(devdir) else []
    sysdir = "/sys/class/infiniband"
    hcas = sorted(os.listdir(sysdir)) if os.path.isdir(sysdir) else []
    res: Json = {
        "dev_infiniband": devices, "present": bool(rdma_verbs_devices(devices)),
        "hcas": hcas, "ibv_devinfo": None, "ports": [],
    }
    if shutil.which("ibv_devinfo"):
        rc, out, err = run_cmd(["ibv_devinfo"], timeout=10.0)
        res["ibv_devinfo"] = {"rc": rc, "error": err.strip()[:300] if rc else None}
        res["ports"] = parse_ibv_devinfo(out)
    res["active_ports"] = sum(1 for p in res["ports"] if p.get("state") == "PORT_ACTIVE")
    return res


def listening_ports() -> list[Json]:
    """TCP sockets in LISTEN state from /proc/net/tcp{,6}."""
    found = []
    for path, fam in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(path) as fh:
                next(fh, None)
                for line in fh:
                    parts = line.split()
                    if len(parts) < 4 or parts[3] != "0A":
                        continue
                    hexaddr, hexport = parts[1].split(":")
                    raw = bytes.fromhex(hexaddr)
                    # /proc stores each 32-bit word in host (little-endian) order
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                    found.append({"address": socket.inet_ntop(fam, raw),
                                  "port": int(hexport, 16)})
        except OSError:
            continue
    return found


def free_ports(address: str, start: int, end: int, count: int) -> Json:
    free: list[int] = []
    for port in range(start, end + 1):
        sock = socket.socket(family_of(address), socket.SOCK_STREAM)
        try:
            sock.bind((address, port))
            free.append(port)
        except OSError:
            pass
        finally:
            sock.close()
        if len(free) >= count:
            break
    return {"address": address, "range": [start, end], "free": free,
            "listening": sorted({p["port"] for p in listening_ports()})}


def resources(paths: list[str]) -> Json:
    mem: Json = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable", "MemFree", "HugePages_Total",
                           "HugePages_Free", "Hugepagesize"):
                    val = rest.strip().split()
                    num = int(val[0])
                    mem[key] = num * 1024 if len(val) > 1 and val[1] == "kB" else num
    except OSError:
        pass
    disks = []
    for p in paths:
        try:
            du = shutil.disk_usage(p)
            disks.append({"path": p, "total_bytes": du.total, "free_bytes": du.free})
        except OSError as exc:
            disks.append({"path": p, "error": str(exc)})
    return {
        "memory": {"total_bytes": mem.get("MemTotal"), "available_bytes": mem.get("MemAvailable"),
                   "hugepages_total": mem.get("HugePages_Total"),
                   "hugepages_free": mem.get("HugePages_Free")},
        "disk": disks, "cpus": os.cpu_count(),
    }


def host_info(paths: list[str]) -> Json:
    return {
        "probe_version": PROBE_VERSION,
        "hostname": socket.gethostname(),
        "python": sys.version.split()[0],
        "interfaces": interfaces(),
        "gpu": gpu(),
        "rdma": rdma(),
        "ucx": ucx(),
        "resources": resources(paths),
        "listening": listening_ports(),
        "tools": {t: shutil.which(t) is not None
                  for t in ("ip", "ping", "nvidia-smi", "ibv_devinfo", "ucx_info", "docker")},
    }


# --------------------------------------------------------------------------- batch

def batch(spec: Json) -> Json:
    """Connects and DF pings of one source node in parallel (bounded by spec["timeout"]),
    then throughput runs one after another."""
    timeout = float(spec.get("timeout", 3.0))
    connects = spec.get("connect", [])
    pings = spec.get("ping", [])
    funcs: list[Any] = []
    for c in connects:
        funcs.append(lambda c=c: dict(connect_one(c["host"], int(c["port"]), timeout),
                                      id=c.get("id")))
    for p in pings:
        funcs.append(lambda p=p: dict(ping_df(p["host"], int(p["size"]), timeout), id=p.get("id")))
    start = time.monotonic()
    results = parallel(funcs)
    # throughput runs last and one at a time, so streams do not share the link
    tputs = [dict(throughput(t["host"], int(t["port"]), float(t.get("seconds", 1.0)), timeout),
                  id=t.get("id"))
             for t in spec.get("throughput", [])]
    return {
        "probe_version": PROBE_VERSION,
        "hostname": socket.gethostname(),
        "elapsed_s": round(time.monotonic() - start, 3),
        "connect": results[:len(connects)],
        "ping": results[len(connects):],
        "throughput": tputs,
    }


# --------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    """The probe's command line: one subcommand per check."""
    parser = argparse.ArgumentParser(prog="pdstack_probe", description=__doc__.splitlines()[0])
    parser.add_argument("--pretty", action="store_true", help="indent the JSON output")
    sub = parser.add_subparsers(dest="cmd")
    sub.required = True

    p = sub.add_parser("listen", help="listen on ADDR:PORT for N seconds")
    p.add_argument("--bind", action="append", required=True, metavar="ADDR:PORT")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--exit-on-stdin-eof", action="store_true")

    p = sub.add_parser("connect", help="TCP connect with timeout; RTT")
    p.add_argument("targets", nargs="+", metavar="HOST:PORT")
    p.add_argument("--timeout", type=float, default=3.0)

    p = sub.add_parser("ping", help="don't-fragment ICMP echo at a payload size")
    p.add_argument("host")
    p.add_argument("--size", type=int, required=True, help="ICMP payload bytes (MTU - 28)")
    p.add_argument("--timeout", type=float, default=2.0)

    p = sub.add_parser("throughput", help="TCP throughput to a 'listen' probe")
    p.add_argument("target", metavar="HOST:PORT")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--timeout", type=float, default=3.0)

    p = sub.add_parser("info", help="interfaces, GPU, RDMA, resources in one document")
    p.add_argument("--path", action="append", default=None, help="disk paths (default /)")
    sub.add_parser("interfaces", help="interfaces, MTU, addresses")
    sub.add_parser("gpu", help="nvidia-smi GPUs and driver")
    sub.add_parser("rdma", help="/dev/infiniband and ibv_devinfo")
    p = sub.add_parser("ucx", help="ucx_info -v / -d: UCX version and transports")
    p.add_argument("--ucx-info", default=None, help="ucx_info binary (default: on PATH)")
    p = sub.add_parser("free-ports", help="free TCP ports")
    p.add_argument("--address", default="0.0.0.0")
    p.add_argument("--start", type=int, default=20000)
    p.add_argument("--end", type=int, default=40000)
    p.add_argument("--count", type=int, default=10)
    p = sub.add_parser("resources", help="memory, disk, CPUs")
    p.add_argument("--path", action="append", default=None)
    sub.add_parser("batch", help="parallel connects and pings from a JSON spec on stdin")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    pretty = args.pretty
    try:
        if args.cmd == "listen":
            return cmd_listen(args)
        if args.cmd == "connect":
            targets = [split_hostport(t) for t in args.targets]
            many = parallel([lambda h=h, pt=pt: connect_one(h, pt, args.timeout)
                             for h, pt in targets])
            emit({"connect": many}, pretty)
            return 0 if all(r.get("status") == "ok" for r in many) else 1
        if args.cmd == "ping":
            one = ping_df(args.host, args.size, args.timeout)
            emit(one, pretty)
            return 0 if one["status"] == "ok" else 1
        if args.cmd == "throughput":
            host, port = split_hostport(args.target)
            one = throughput(host, port, args.seconds, args.timeout)
            emit(one, pretty)
            return 0 if one["status"] == "ok" else 1
        if args.cmd == "info":
            emit(host_info(args.path or ["/"]), pretty)
        elif args.cmd == "interfaces":
            emit(interfaces(), pretty)
        elif args.cmd == "gpu":
            emit(gpu(), pretty)
        elif args.cmd == "rdma":
            emit(rdma(), pretty)
        elif args.cmd == "ucx":
            emit(ucx(args.ucx_info), pretty)
        elif args.cmd == "free-ports":
            emit(free_ports(args.address, args.start, args.end, args.count), pretty)
        elif args.cmd == "resources":
            emit(resources(args.path or ["/"]), pretty)
        elif args.cmd == "batch":
            emit(batch(json.loads(sys.stdin.read() or "{}")), pretty)
    except ValueError as exc:
        sys.stderr.write(f"pdstack_probe: {exc}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
