"""A steady OpenAI client for the rolling-upgrade tests (one node, two nodes): a few threads
sending completions (streaming and not) through the proxy, recording every outcome."""

from __future__ import annotations

import json
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


@dataclass
class SteadyClient:
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

    @property
    def sent(self) -> int:
        return len(self.outcomes)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

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
