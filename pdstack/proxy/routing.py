"""Routing: prefix-affinity consistent hashing with bounded load, power-of-two-choices
least-outstanding, and the per-node prefix index that drives skip-prefill.

All pure in-memory structures; the event loop is single-threaded, so no locks.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeGuard

from pdstack.proxy.backends import BackendState
from pdstack.proxy.kv_index import Held


def stable_hash(text: str) -> int:
    """64-bit hash that is the same in every process (affinity survives proxy restarts)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent-hash ring with ``vnodes`` virtual nodes per member."""

    def __init__(self, names: Iterable[str], vnodes: int = 64) -> None:
        points: list[tuple[int, str]] = []
        for name in sorted(set(names)):
            for i in range(vnodes):
                points.append((stable_hash(f"{name}#{i}"), name))
        points.sort()
        self._keys = [p[0] for p in points]
        self._names = [p[1] for p in points]
        self.members = len({p[1] for p in points})

    def walk(self, key_hash: int) -> Iterator[str]:
        """Distinct members in ring order, starting at ``key_hash``."""
        n = len(self._keys)
        if n == 0:
            return
        start = bisect.bisect_left(self._keys, key_hash) % n
        seen: set[str] = set()
        for i in range(n):
            name = self._names[(start + i) % n]
            if name not in seen:
                seen.add(name)
                yield name
                if len(seen) == self.members:
                    return


def bound(candidates: Iterable[BackendState], load_factor: float) -> int:
    """The bounded-load capacity: ``ceil(load_factor * (in flight + 1) / n)``."""
    items = list(candidates)
    total = sum(b.in_flight for b in items)
    return math.ceil(load_factor * (total + 1) / max(1, len(items)))


def pick_bounded_load(
    ring: HashRing,
    key_hash: int,
    candidates: dict[str, BackendState],
    load_factor: float,
) -> BackendState | None:
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

    Walk the ring from the key; take the first candidate whose in-flight count is below
    ``ceil(load_factor * (total + 1) / n)``. A hot prefix therefore stays on one backend
    until it carries ``load_factor`` times its fair share, then spills to the next one.
    """
    if not candidates:
        return None
    capacity = bound(candidates.values(), load_factor)
    first: BackendState | None = None
    for name in ring.walk(key_hash):
        backend = candidates.get(name)
        if backend is None:
            continue
        if first is None:
            first = backend
        if backend.in_flight < capacity:
            return backend
    # every candidate is at capacity (cannot happen with load_factor >= 1) or not on ring
    if first is not None:
        return first
    return min(candidates.values(), key=lambda b: b.in_flight)


def pick_p2c(candidates: Sequence[BackendState], rng: random.Random) -> BackendState | None:
    """Power of two choices: of two random candidates, the one with fewer in flight."""
    n = len(candidates)
    if n == 0:
        return None
    if n == 1:
        return candidates[0]
    i = rng.randrange(n)
    j = rng.randrange(n - 1)
    if j >= i:
        j += 1
    a, b = candidates[i], candidates[j]
    return a if a.in_flight <= b.in_flight else b


def pick_by_cost(
    costed: Sequence[tuple[BackendState, Held]],
    prompt_tokens: int,
    cpu_hit_cost: float,
    queued: Mapping[str, float],
    *,
    miss_weight: float,
    closed: Mapping[str, float] | None = None,
) -> tuple[BackendState, float]:
    """The cheapest engine for a request, from what each holds of its prompt (its KV events:
    :mod:`pdstack.proxy.kv_events_route`): cost = the prompt tokens it would compute (a
    block its CPU tier holds counts ``cpu_hit_cost`` of one it computes: loading it is not
    free) + the prompt tokens this proxy already routed to it that it has not answered yet
    (``queued[name]``: the prefills ahead of this one). Requests that are decoding cost
    nothing here: a decode takes one token of a step, a prefill thousands, and counting them
    as prefills broke affinity under load (issue 56, results/h200x1-routing run 1: hit ratio
    0.42-0.47 by cost vs 0.57-0.71 for a sticky router, 30-90 req/s); the load bound
    (:func:`bound`) keeps them spread. Nor does the engine's own count (its last scrape):
    compared with the requests in flight now it reads a finished burst as another proxy's
    work, and that too sent prompts away from their holder (benchmarks/README.md,
    ``kv_route_hits.py``). The first of equals wins: callers pass ``costed`` in hash-ring
    order, so ties keep prefix affinity. ``miss_weight`` scales the tokens to compute against
    the queued ones (above 1: stickier); ``closed``: engines without KV headroom for the
    request, with the tokens their wait costs (``--kv-headroom cost``). Returns the engine
    and the tokens it has to compute. ``costed`` must not be empty."""
    best: tuple[BackendState, float] | None = None
    best_cost = math.inf
    for backend, held in costed:
        gpu = min(held.gpu_blocks * held.block_size, prompt_tokens)
        cpu = min(held.cpu_blocks * held.block_size, prompt_tokens - gpu)
        miss = prompt_tokens - gpu - cpu + cpu_hit_cost * cpu
        cost = miss_weight * miss + queued.get(backend.name, 0.0)
        if closed:
            cost += closed.get(backend.name, 0.0)
        if cost < best_cost:
            best, best_cost = (backend, miss), cost
    assert best is not None, "pick_by_cost needs a candidate"
    return best


def block_hashes(text: str, block_chars: int) -> list[int]:
    """``text`` cut into ``block_chars``-character blocks, hashed as a chain: a block's hash
    stands for the whole prefix up to it (like vLLM's block hashes). In-process only."""
    hashes: list[int] = []
    prev = 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        prev = hash((prev, text[start : start + block_chars]))
        hashes.append(prev)
    return hashes


class PrefixIndex:
    """Which prompt prefixes each (node, generation) LMCache store probably holds.

    Prompts are cut into ``block_chars``-character blocks and hashed as a chain, so a
    block hash stands for the whole prefix up to it (like vLLM's and LMCache's block
    hashes). Each store keeps at most ``capacity`` block hashes, least recently used
    dropped first. This is the proxy's belief, not the store's truth: a wrong "hit"
    only makes the decoder compute more, never gives a wrong answer.
    """

    def __init__(self, block_chars: int = 256, capacity: int = 200_000) -> None:
        self.block_chars = block_chars
        self.capacity = capacity
        self._stores: dict[tuple[str, str], OrderedDict[int, None]] = {}

    def block_hashes(self, text: str) -> list[int]:
        return block_hashes(text, self.block_chars)

    def cached_chars(self, store: tuple[str, str], hashes: list[int]) -> int:
        entries = self._stores.get(store)
        if not entries:
            return 0
        hit = 0
        for h in hashes:
            if h not in entries:
                break
            entries.move_to_end(h)
            hit += 1
        return hit * self.block_chars

    def best_store(
        self, stores: Iterable[tuple[str, str]], hashes: list[int]
    ) -> tuple[tuple[str, str] | None, int]:
        best: tuple[str, str] | None = None
        best_chars = 0
        for store in stores:
            chars = self.cached_chars(store, hashes)
            if chars > best_chars:
                best, best_chars = store, chars
        return best, best_chars

    def insert(self, store: tuple[str, str], hashes: list[int]) -> None:
        entries = self._stores.setdefault(store, OrderedDict())
        for h in hashes:
            entries[h] = None
            entries.move_to_end(h)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def forget(self, store: tuple[str, str]) -> None:
        self._stores.pop(store, None)

    def stats(self) -> dict[str, Any]:
        return {f"{n}@{g}": len(e) for (n, g), e in self._stores.items()}


def is_token_ids(value: Any) -> TypeGuard[Sequence[int]]:
    """A non-empty list or tuple of ints (bools are not): a token-id prompt."""
    return isinstance(value, list | tuple) and bool(value) and set(map(type, value)) == {int}


def settle_prompt(body: dict[str, Any]) -> None:
    """A token-id prompt (``[ids]`` or ``[[ids]]``) as a tuple from here on. CPython's
    collector walks every item of a list at each collection of the list's generation, and
    a tuple of ints once (then it stops tracking it): each request's 1.5-5 k prompt ids,
    held for its whole stream, were most of the references a full collection walked
    (benchmarks/loop_lag.py)."""
    prompt = body.get("prompt")
    if type(prompt) is not list or not prompt:
        return
    if is_token_ids(prompt):
        body["prompt"] = tuple(prompt)
    elif len(prompt) == 1 and type(prompt[0]) is list and is_token_ids(prompt[0]):
        body["prompt"] = [tuple(prompt[0])]


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt as one string, system prompt first (for affinity and the prefix index)."""
    messages = body.get("messages")
    if messages is not None:
        parts: list[str] = []
        for message in messages if isinstance(messages, list) else []:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(str(c.get("text", "")) for c in content if isinstance(c, dict))
            parts.append(f"{message.get('role', '')}:{content or ''}\n")
        return "".join(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list | tuple) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, int):
            return " ".join(map(str, prompt))
        if isinstance(first, list | tuple):
            return " ".join(map(str, first))
    return ""
