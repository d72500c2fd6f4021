"""How preflight runs commands on a node: SSH (paramiko) or, for a node that is this
machine, a local shell.  Every call is bounded by a deadline; nothing here can hang."""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import paramiko  # type: ignore[import-untyped]  # no stubs in the venv

from pdstack.plan import SshTarget

LOCAL_HOSTS = {"local", "localhost", "127.0.0.1", "::1"}


class TransportError(Exception):
    """Could not reach or use a node; ``cause`` is a report cause code."""

    def __init__(self, cause: str, message: str):
        self.cause = cause
        super().__init__(message)


@dataclass
class ExecResult:
    rc: int
    stdout: str
    stderr: str


class Spawned(Protocol):
    def write(self, data: bytes) -> None: ...
    def readline(self, timeout: float) -> str: ...
    def finish(self, timeout: float) -> str: ...


class Transport(Protocol):
    description: str
    host_key_note: str | None

    def exec(self, command: str, stdin: bytes | None = None,
             timeout: float = 10.0) -> ExecResult: ...
    def spawn(self, command: str) -> Spawned: ...
    def close(self) -> None: ...


# ---------------------------------------------------------------------------- SSH


def _ssh_options(common_args: str | None) -> dict[str, str]:
    """``-o Key=Value`` pairs from ansible_ssh_common_args (keys lower-cased)."""
    opts: dict[str, str] = {}
    if not common_args:
        return opts
    words = shlex.split(common_args)
    for i, w in enumerate(words):
        text = None
        if w == "-o" and i + 1 < len(words):
            text = words[i + 1]
        elif w.startswith("-o") and len(w) > 2:
            text = w[2:]
        if text and "=" in text:
            k, v = text.split("=", 1)
            opts[k.strip().lower()] = v.strip()
        elif text and " " in text:
            k, v = text.split(None, 1)
            opts[k.strip().lower()] = v.strip()
    return opts


class _NoteUnknownHost(paramiko.MissingHostKeyPolicy):
    """Accept a host key that is in no known_hosts file, and say so in the report."""

    def __init__(self) -> None:
        self.note: str | None = None

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str,
                         key: paramiko.PKey) -> None:
        self.note = (f"host key of {hostname} ({key.get_name()}) is in no known_hosts file; "
                     "accepted for this run")


class _ChannelSpawn:
    def __init__(self, chan: paramiko.Channel):
        self.chan = chan
        self._buf = b""

    def write(self, data: bytes) -> None:
        """Best effort: a process that needs no input may already be gone; whatever it
        printed (or why it failed) comes from :meth:`readline`."""
        self.chan.settimeout(10.0)
        with contextlib.suppress(OSError, EOFError):
            self.chan.sendall(data)

    def readline(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError("probe_error", f"no output within {timeout:.1f}s")
            self.chan.settimeout(min(left, 0.5))
            try:
                data = self.chan.recv(65536)
            except TimeoutError:
                continue
            if not data:
                err = _drain_stderr(self.chan)
                raise TransportError("probe_error", f"process ended early: {err.strip()[:300]}")
            self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode(errors="replace")

    def finish(self, timeout: float) -> str:
        """Close stdin (the probe exits), return what it still prints."""
        with contextlib.suppress(OSError, EOFError):
            self.chan.shutdown_write()
        out = _read_all(self.chan, time.monotonic() + timeout)
        self.chan.close()
        return (self._buf + out).decode(errors="replace")


def _drain_stderr(chan: paramiko.Channel) -> str:
    data = b""
    while chan.recv_stderr_ready():
        data += chan.recv_stderr(65536)
    return data.decode(errors="replace")


def _read_all(chan: paramiko.Channel, deadline: float) -> bytes:
    out = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        chan.settimeout(min(left, 0.5))
        try:
            data = chan.recv(65536)
        except TimeoutError:
            continue
        if not data:
            break
        out += data
    return out


class SshTransport:
    def __init__(self, name: str, target: SshTarget, timeout: float):
        self.name = name
        self.target = target
        self.description = f"{target.user}@{target.host}:{target.port}"
        self.host_key_note: str | None = None
        self.client = paramiko.SSHClient()
        opts = _ssh_options(target.common_args)
        known = opts.get("userknownhostsfile")
        strict = opts.get("stricthostkeychecking", "").lower()
        # like OpenSSH: UserKnownHostsFile (one or more files) replaces ~/.ssh/known_hosts
        files = [Path(k).expanduser() for k in known.split()] if known else [
            Path("~/.ssh/known_hosts").expanduser()]
        for f in files:
            if f.is_file():
                with contextlib.suppress(OSError):
                    self.client.load_host_keys(str(f))
        policy: paramiko.MissingHostKeyPolicy
        self._note_policy = _NoteUnknownHost()
        policy = paramiko.RejectPolicy() if strict in ("yes", "true") else self._note_policy
        self.client.set_missing_host_key_policy(policy)
        key_file = os.path.expanduser(target.key_file) if target.key_file else None
        try:
            self.client.connect(
                target.host, port=target.port, username=target.user, key_filename=key_file,
                timeout=timeout, banner_timeout=timeout, auth_timeout=timeout,
                channel_timeout=timeout, look_for_keys=key_file is None,
                allow_agent=key_file is None,
            )
        except paramiko.BadHostKeyException as exc:
            self.client.close()
            raise TransportError("host_key", f"host key mismatch for {target.host}: {exc}") from exc
        except paramiko.SSHException as exc:
            self.client.close()
            text = str(exc)
            if "not found in known_hosts" in text:
                raise TransportError("host_key", f"{text} (StrictHostKeyChecking=yes)") from exc
            if isinstance(exc, paramiko.AuthenticationException):
                raise TransportError("ssh_auth", f"authentication failed: {text}") from exc
            raise TransportError("ssh_unreachable", f"ssh error: {text}") from exc
        except TimeoutError as exc:
            self.client.close()
            raise TransportError("ssh_unreachable", f"timed out after {timeout:.1f}s") from exc
        except OSError as exc:
            self.client.close()
            raise TransportError("ssh_unreachable", exc.strerror or str(exc)) from exc
        self.host_key_note = self._note_policy.note
        transport = self.client.get_transport()
        if transport is not None:
            transport.set_keepalive(5)

    def _open(self, command: str, timeout: float) -> paramiko.Channel:
        transport = self.client.get_transport()
        if transport is None or not transport.is_active():
            raise TransportError("ssh_unreachable", "ssh connection lost")
        try:
            chan = transport.open_session(timeout=timeout)
            chan.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise TransportError("ssh_unreachable", f"cannot open a channel: {exc}") from exc
        return chan

    def exec(self, command: str, stdin: bytes | None = None, timeout: float = 10.0) -> ExecResult:
        deadline = time.monotonic() + timeout
        chan = self._open(command, timeout)
        try:
            if stdin:
                chan.settimeout(timeout)
                chan.sendall(stdin)
            chan.shutdown_write()
            out = b""
            err = b""
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError("probe_error",
                                         f"{command.split()[0]}... still running after "
                                         f"{timeout:.1f}s")
                chan.settimeout(min(left, 0.2))
                try:
                    data = chan.recv(65536)
                    if data:
                        out += data
                except TimeoutError:
                    data = b"?"
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                if not data and chan.exit_status_ready():
                    break
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
            rc = chan.recv_exit_status()
            return ExecResult(rc, out.decode(errors="replace"), err.decode(errors="replace"))
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise TransportError("ssh_unreachable", f"ssh channel failed: {exc}") from exc
        finally:
            chan.close()

    def spawn(self, command: str) -> Spawned:
        return _ChannelSpawn(self._open(command, 10.0))

    def close(self) -> None:
        self.client.close()


# ---------------------------------------------------------------------------- local


class _ProcSpawn:
    def __init__(self, command: str):
        self.proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self._eof = False
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with self._cond:
                self._lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.write(data)
            self.proc.stdin.flush()

    def readline(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._lines:
                left = deadline - time.monotonic()
                if self._eof:
                    self.proc.wait()
                    err = self.proc.stderr.read() if self.proc.stderr else b""
                    raise TransportError(
                        "probe_error",
                        f"process ended early: {err.decode(errors='replace').strip()[:300]}",
                    )
                if left <= 0:
                    raise TransportError("probe_error", f"no output within {timeout:.1f}s")
                self._cond.wait(left)
            return self._lines.pop(0)

    def finish(self, timeout: float) -> str:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with self._cond:
            while not self._eof:
                self._cond.wait(1.0)
            return "\n".join(self._lines)


class LocalTransport:
    """A node that is this machine (``ansible_connection: local`` inventories)."""

    def __init__(self, name: str):
        self.name = name
        self.description = f"local ({socket.gethostname()})"
        self.host_key_note: str | None = None

    def exec(self, command: str, stdin: bytes | None = None, timeout: float = 10.0) -> ExecResult:
        try:
            proc = subprocess.run(["/bin/sh", "-c", command], input=stdin or b"",
                                  capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise TransportError("probe_error", f"still running after {timeout:.1f}s") from exc
        return ExecResult(proc.returncode, proc.stdout.decode(errors="replace"),
                          proc.stderr.decode(errors="replace"))

    def spawn(self, command: str) -> Spawned:
        return _ProcSpawn(command)

    def close(self) -> None:
        pass


def connect(name: str, target: SshTarget, timeout: float) -> Transport:
    if target.connection == "local" or target.host in LOCAL_HOSTS:
        return LocalTransport(name)
    return SshTransport(name, target, timeout)
