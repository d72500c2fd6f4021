"""A steady OpenAI client for the rolling-upgrade tests (one node, two nodes): a few threads
sending completions (streaming and not) through the proxy, recording every outcome; and the
same in a process of its own at real-time priority (SteadyClientProcess), for a lab whose
nodes share the test's cores."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Outcome:
    ok: bool
    started: float
    seconds: float
    stream: bool
    detail: str = ""
    request_id: str = ""


class _Tally:
    outcomes: list[Outcome]

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]


@dataclass
class SteadyClient(_Tally):
    base_url: str
    model: str = "tiny"
    workers: int = 2
    max_tokens: int = 8
    timeout_s: float = 180.0
    pause_s: float = 0.05  # between one worker's requests
    api_key: str = ""  # sent as a bearer token when the proxy requires client keys
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        for i in range(self.workers):
            t = threading.Thread(target=self._loop, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 10)

    def _loop(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            stream = n % 2 == 0
            prompt = f"user {worker} asks question {n % 7}: tell me about the proxy and the cache"
            outcome = self.one(prompt, stream)
            with self._lock:
                self.outcomes.append(outcome)
            self._stop.wait(self.pause_s)

    def one(self, prompt: str, stream: bool) -> Outcome:
        body: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": self.max_tokens,
            "temperature": 0, "stream": stream,
        }
        req = urllib.request.Request(
            f"{self.base_url}/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}
            | ({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}),
            method="POST",
        )
        t0 = time.monotonic()
        rid = ""
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                rid = resp.headers.get("X-Request-Id", "")
                raw = resp.read().decode()
            if stream:
                events = [ln[6:] for ln in raw.splitlines() if ln.startswith("data: ")]
                if not events or events[-1] != "[DONE]":
                    return Outcome(False, t0, time.monotonic() - t0, stream,
                                   f"stream without [DONE]: {raw[-300:]}", rid)
                text = ""
                for ev in events[:-1]:
                    data = json.loads(ev)
                    if "error" in data:
                        return Outcome(False, t0, time.monotonic() - t0, stream,
                                       f"error event: {ev[:300]}", rid)
                    text += data["choices"][0].get("text", "")
            else:
                data = json.loads(raw)
                if "error" in data or not data.get("choices"):
                    return Outcome(False, t0, time.monotonic() - t0, stream, raw[:300], rid)
            return Outcome(True, t0, time.monotonic() - t0, stream, "", rid)
        except urllib.error.HTTPError as exc:
            detail = f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:300]}"
            return Outcome(False, t0, time.monotonic() - t0, stream, detail, rid)
        except (OSError, ValueError) as exc:
            return Outcome(False, t0, time.monotonic() - t0, stream, repr(exc), rid)


API_KEY_ENV = "PDSTACK_STEADY_API_KEY"  # the key reaches the client process by its environment


@dataclass
class SteadyClientProcess(_Tally):
    """A :class:`SteadyClient` in a process of its own whose threads run at real-time
    priority (``SCHED_FIFO`` 1), as a client on a machine of its own: an answer is read as
    soon as it arrives. In a lab whose nodes share this machine's cores, a client thread of
    the test process waited ~1 s for a core after the proxy had answered, at every request,
    while node1's engines spun (its run-queue wait, /proc/thread-self/schedstat: 1.0-2.8 s of
    1.05-2.83 s requests). The client needs ~1 ms of CPU a request: it takes nothing the
    engines or the proxy need. Started from a thread that is in a network namespace, the
    process is in that namespace too. Same interface as SteadyClient: start, stop, outcomes
    (``started`` is CLOCK_MONOTONIC, comparable with this process's time.monotonic)."""

    base_url: str
    workers: int = 2
    max_tokens: int = 8
    timeout_s: float = 180.0
    pause_s: float = 0.05
    api_key: str = ""
    outcomes: list[Outcome] = field(default_factory=list)
    _proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "pdstack.testing.steady", self.base_url,
                "--workers", str(self.workers), "--max-tokens", str(self.max_tokens),
                "--timeout", str(self.timeout_s), "--pause", str(self.pause_s)]
        env = {**os.environ, API_KEY_ENV: self.api_key}
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env)
        ready = self._proc.stdout.readline() if self._proc.stdout else ""
        if ready.strip() != "ready":
            _out, err = self._proc.communicate(timeout=30)
            raise RuntimeError(f"steady client process did not start: {ready}{err[-2000:]}")

    def stop(self) -> None:
        assert self._proc is not None, "not started"
        out, err = self._proc.communicate("", timeout=self.timeout_s + 30)  # stdin closed: stop
        if self._proc.returncode != 0:
            raise RuntimeError(f"steady client process failed ({self._proc.returncode}): "
                               f"{err[-2000:]}")
        self.outcomes = [Outcome(**o) for o in json.loads(out)]

    def kill(self) -> None:
        """End the process without its outcomes (a test that failed before stop)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.communicate(timeout=30)


def main(argv: list[str] | None = None) -> int:
    """The process of SteadyClientProcess: runs until its stdin closes, then prints every
    outcome as JSON."""
    parser = argparse.ArgumentParser(prog="python -m pdstack.testing.steady")
    parser.add_argument("base_url")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--pause", type=float, default=0.05)
    args = parser.parse_args(argv)
    # threads started after this inherit the policy; EPERM (no CAP_SYS_NICE) fails loudly
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    client = SteadyClient(args.base_url, workers=args.workers, max_tokens=args.max_tokens,
                          timeout_s=args.timeout, pause_s=args.pause,
                          api_key=os.environ.get(API_KEY_ENV, ""))
    client.start()
    print("ready", flush=True)
    sys.stdin.read()
    client.stop()
    print(json.dumps([dataclasses.asdict(o) for o in client.outcomes]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
