"""Routing colocated engines and prefillers by what they hold (issue 56): the glue between
the proxy, the KV-event index (:mod:`pdstack.proxy.kv_index`, :mod:`pdstack.proxy.kv_events`)
and the cost policy (:func:`pdstack.proxy.routing.pick_by_cost`).

Per request, only when some candidate's events are *fresh* and its hashing verified:

1. the prompt's token ids: the request's own (a token-id prompt), else the engine's
   ``POST /tokenize`` (the same tokenizer and chat template as the generation will use;
   its latency is ``pdstack_proxy_kv_tokenize_seconds``);
2. its block hashes per scheme the engines hash with (with ``cache_salt``);
3. the pick: the hash ring's choice is kept when its events are not fresh (today's hashing,
   counted as ``hash_<state>``); otherwise every fresh candidate is costed (blocks it does
   not hold, a CPU-tier hit at ``cpu_hit_cost``, plus the prompt tokens already routed to it
   that it has not answered yet: :meth:`KvRouting.prefilled` takes a request's share off at
   its first byte or end) and the cheapest wins, ring order breaking ties (``cost``); an
   engine at the ring's load bound (``load_factor`` x its share of the requests in flight)
   is not a candidate; a prompt that no candidate holds (beyond a first block) goes to its
   ring home, the first candidate in ring order (``ring_unheld``: one home per prefix while
   caches thrash); engines without KV headroom for it (the gate's) are no candidates while
   one has headroom (``headroom`` "filter"), or are costed a whole prompt's tokens more
   ("cost": a prefix's holder near its mark keeps it unless computing it elsewhere is
   cheaper; ``cost_no_headroom`` when one is chosen);
4. the chosen engine's blocks of the prompt count as held there for ``pending_s`` until its
   events tell (:meth:`KvIndex.route`): the next request with that prefix follows it even
   while the first is still being prefilled.

Every decision is counted in ``pdstack_proxy_kv_route_total{decision}``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Histogram

from pdstack.proxy.backends import BackendState
from pdstack.proxy.kv_events import KvEventsCollector, KvEventsSubscriber
from pdstack.proxy.kv_index import HashScheme, Held, KvIndex, hashes_by_scheme
from pdstack.proxy.routing import (
    HashRing,
    bound,
    is_token_ids,
    pick_bounded_load,
    pick_by_cost,
)

log = logging.getLogger("pdstack.proxy.kv_events")

# chat fields that change the rendered prompt (vLLM's /tokenize takes them as chat does)
CHAT_TOKENIZE_KEYS = (
    "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
    "chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs",
)
DECISIONS = ("cost", "ring_unheld", "cost_no_headroom", "hash_missing", "hash_stale",
             "hash_unverified", "hash_no_tokens", "hash_bound")
HEADROOM = ("filter", "cost")  # what an engine without KV headroom is to the router
QUEUED_TTL_S = 120.0  # a request still queued after this long is dropped from the count
TOKENIZE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class KvEventsConfig:
    """The proxy's side of the engines' KV events (the backend table's ``kv_events`` and
    each backend's ``kv_events.replay``; empty ``sources``: off)."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 0
    hash_seed: str = "0"
    sources: dict[str, str] = field(default_factory=dict)  # backend name -> replay endpoint
    heartbeat_s: float = 5.0
    stale_after_s: float = 15.0
    replay_timeout_s: float = 2.0
    capacity: int = 400_000  # block hashes per engine
    cpu_hit_cost: float = 0.25  # a native-tier hit costs this share of computing the block
    # a routed prompt's blocks count as held on its engine this long before its events tell
    # (KvIndex.route; 0: only what events told)
    pending_s: float = 10.0
    # a prompt token to compute against one queued ahead of it: a token computed again is
    # paid by this request and by every prompt queued behind it on that engine, one queued
    # ahead only delays this one (1 sent a burst's second request of a new prefix, queued
    # behind its first, to an idle engine to compute it again)
    miss_weight: float = 8.0  # routing run 4 (one H100): 8 beat 2 at 90, 120 and 150 req/s
    # a prompt that no candidate holds (:func:`_unheld`) goes to its
    # ring home (the first candidate under the load bound in ring order), not to the least
    # queued engine: each prefix then has one home while caches thrash. Past capacity
    # (routing run 3, one H100, 120 req/s, no gate) least-queued spread evicted prefixes
    # over every engine: hit ratio 0.46 vs 0.64 for cache_aware's sticky tree. False: the
    # cost decides among equals too
    unheld_home: bool = True
    tokenize_timeout_s: float = 1.0  # then the request goes by hash (hash_no_tokens)
    # an engine without KV headroom for a request (the gate's): "filter" = no candidate
    # while another has some; "cost" = costed the prompt's tokens more (docs/kv-events.md)
    headroom: str = "filter"

    @classmethod
    def from_table(cls, table: Any, **overrides: Any) -> KvEventsConfig:
        data = table if isinstance(table, dict) else table.model_dump(mode="json")
        listen = data.get("kv_events") or {}
        sources = {
            b["name"]: b["kv_events"]["replay"] for b in data.get("backends") or []
            if b.get("kv_events")
        }
        if not listen or not sources:
            return cls(**{**overrides, "enabled": False})
        return cls(host=listen["host"], port=int(listen["port"]),
                   hash_seed=str(listen.get("hash_seed", "0")), sources=sources, **overrides)

    @property
    def active(self) -> bool:
        return self.enabled and bool(self.sources) and self.port > 0


UNHELD_SHARE = 0.1  # of a prompt: an engine holding less of it holds it not (:func:`_unheld`)


def _unheld(costed: list[tuple[BackendState, Held]], prompt_tokens: int) -> bool:
    """Of two or more candidates, none holds more of the prompt than a block or
    ``UNHELD_SHARE`` of it (a chat template's first block everywhere is not a holding):
    nothing says where it belongs. Engines that all hold it are not unheld: the cost
    spreads a hot prefix by what is queued."""
    if len(costed) < 2:
        return False
    size = max(h.block_size for _, h in costed)
    return max(h.tokens for _, h in costed) <= max(size, UNHELD_SHARE * prompt_tokens)


@dataclass
class RequestBlocks:
    """One request's token count and block hashes per (scheme, block size)."""

    tokens: int
    hashes: dict[tuple[HashScheme, int], list[int]]
    reason: str = ""  # why there are none (the decision it counts as)


@dataclass(frozen=True)
class Decision:
    request_id: str
    backend: str
    decision: str
    predicted_cached_tokens: int


class KvRouting:
    """The KV-event router of one proxy (idle when ``config.active`` is false)."""

    def __init__(
        self,
        config: KvEventsConfig,
        session: Callable[[], aiohttp.ClientSession | None],
        auth_headers: Callable[[], dict[str, str]],
        registry: CollectorRegistry,
    ) -> None:
        self.config = config
        self._session = session
        self._auth = auth_headers
        self.index = KvIndex(config.hash_seed, config.capacity)
        self.subscriber: KvEventsSubscriber | None = None
        if config.active:
            self.subscriber = KvEventsSubscriber(
                self.index, config.host, config.port, config.sources,
                config.heartbeat_s, config.stale_after_s, config.replay_timeout_s,
            )
            registry.register(KvEventsCollector(self.subscriber))  # type: ignore[arg-type]
        self.decisions = Counter(
            "pdstack_proxy_kv_route", "engine choices (colocated engines, prefillers): cost (by "
            "the engines' KV events) or hash_<why> (the prefix ring)", ["decision"],
            registry=registry,
        )
        self._decision = {d: self.decisions.labels(d) for d in DECISIONS}
        self.tokenize_seconds = Histogram(
            "pdstack_proxy_kv_tokenize_seconds", "the engine's /tokenize for routing",
            buckets=TOKENIZE_BUCKETS, registry=registry,
        )
        self.tokenize_failures = Counter(
            "pdstack_proxy_kv_tokenize_failures", "/tokenize calls that failed", registry=registry,
        )
        self.decoder_decisions = Counter(
            "pdstack_proxy_kv_decoder_route", "P/D decoder choices: cost (by the decoders' KV "
            "events: the blocks they hold need no transfer) or load (events missing)",
            ["decision"], registry=registry,
        )
        self.load_tokens = 0.0  # EWMA of the tokens routed requests had to compute
        # prompt tokens routed to each engine by cost that it has not answered yet (the
        # prefills queued ahead of a new request there), and each request's share of them
        self.queued_tokens: dict[str, float] = {}
        self._queued: OrderedDict[str, tuple[str, float, float]] = OrderedDict()
        self.recent: deque[Decision] = deque(maxlen=256)
        # a request's token ids and blocks, for its next lookups (P/D: the decoders, the
        # prefillers, the decode leg's pick)
        self._tokens: deque[tuple[dict[str, Any], Sequence[int]]] = deque(maxlen=64)
        self._blocks: deque[tuple[dict[str, Any], RequestBlocks]] = deque(maxlen=64)

    async def start(self) -> None:
        if self.subscriber is not None:
            await self.subscriber.start()

    async def close(self) -> None:
        if self.subscriber is not None:
            await self.subscriber.close()

    def state(self, name: str) -> str:
        return "missing" if self.subscriber is None else self.subscriber.state(name)

    # ------------------------------------------------------------------ per request
    async def blocks_for(
        self, body: dict[str, Any], path: str, candidates: Iterable[BackendState]
    ) -> RequestBlocks | None:
        """The request's block hashes for its fresh candidates; None when the router is
        off or has nothing to choose (one usable engine per role: no ``/tokenize``, no
        hashing: a one-engine stack pays nothing for the router), a RequestBlocks with only
        ``reason`` when nothing can be looked up."""
        if self.subscriber is None:
            return None
        candidates = list(candidates)
        roles = [b.role for b in candidates if b.usable]
        if all(roles.count(role) < 2 for role in roles):
            return None
        fresh = [b for b in candidates if b.usable and self.state(b.name) == "fresh"]
        if not fresh:
            return self._keep(body, RequestBlocks(0, {}, "no_fresh"))
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        wanted: dict[tuple[HashScheme, int], None] = {}
        for b in fresh:
            size = self.index.engine(b.name).block_size
            for scheme in self.index.schemes_for(b.name, salt is not None):
                if size > 0:
                    wanted[(scheme, size)] = None
        tokens = await self._token_ids(body, path, fresh)
        if tokens is None or not wanted:
            return self._keep(body, RequestBlocks(0, {}, "hash_no_tokens"))
        hashes: dict[tuple[HashScheme, int], list[int]] = {}
        for size in {s for _, s in wanted}:
            schemes = [sc for sc, s in wanted if s == size]
            for scheme, hs in hashes_by_scheme(tokens, size, schemes, salt).items():
                hashes[(scheme, size)] = hs
        return self._keep(body, RequestBlocks(len(tokens), hashes))

    def _keep(self, body: dict[str, Any], blocks: RequestBlocks) -> RequestBlocks:
        self._blocks.append((body, blocks))
        return blocks

    async def _token_ids(
        self, body: dict[str, Any], path: str, engines: list[BackendState]
    ) -> Sequence[int] | None:
        prompt = body.get("prompt")
        if is_token_ids(prompt):
            return prompt
        if isinstance(prompt, list) and len(prompt) == 1 and is_token_ids(prompt[0]):
            return prompt[0]
        if "chat" in path:
            if not isinstance(body.get("messages"), list):
                return None
            payload = {k: body[k] for k in CHAT_TOKENIZE_KEYS if k in body}
        elif isinstance(prompt, str):
            payload = {"prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
        elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            payload = {"prompt": prompt[0],
                       "add_special_tokens": body.get("add_special_tokens", True)}
        else:
            return None  # several prompts in one request: no one prefix to route
        if "model" in body:
            payload["model"] = body["model"]
        for seen, ids in self._tokens:
            if seen is body:
                return ids
        # a prefiller if one is fresh (it computes prompts anyway), the least busy one
        engine = min(engines, key=lambda b: (b.role == "decode", b.in_flight))
        tokens = await self.tokenize(engine, payload)
        if tokens is not None:
            self._tokens.append((body, tokens))
        return tokens

    async def tokenize(self, engine: BackendState, payload: dict[str, Any]) -> list[int] | None:
        session = self._session()
        if session is None:
            return None
        started = time.perf_counter()
        try:
            async with session.post(
                engine.url + "/tokenize", json=payload, headers=self._auth(),
                timeout=aiohttp.ClientTimeout(total=self.config.tokenize_timeout_s),
            ) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                data = await resp.json()
            tokens = data.get("tokens")
            if not isinstance(tokens, list):
                raise ValueError("no tokens in the answer")
            return tokens
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            self.tokenize_failures.inc()
            log.debug("kv events: /tokenize on %s failed: %s", engine.name, exc)
            return None
        finally:
            self.tokenize_seconds.observe(time.perf_counter() - started)

    def held(self, name: str, blocks: RequestBlocks, salted: bool = False,
             now: float | None = None) -> Held:
        """What ``name`` holds of the request (the best of its schemes); with ``now``, the
        blocks routed there and not yet told of count (:meth:`KvIndex.route`)."""
        eng = self.index.engines.get(name)
        if eng is None or eng.block_size <= 0:
            return Held(0, 0, 0)
        best = Held(0, 0, eng.block_size)
        for scheme in self.index.schemes_for(name, salted):
            hs = blocks.hashes.get((scheme, eng.block_size))
            if hs is not None:
                h = self.index.held(name, hs, now)
                if h.tokens > best.tokens:
                    best = h
        return best

    def _routed(self, name: str, blocks: RequestBlocks, salted: bool, now: float) -> None:
        """The request goes to ``name``: its blocks are pending there (every scheme it may
        hash with: one, or two while a salted first block has not told which)."""
        eng = self.index.engines.get(name)
        if eng is None or eng.block_size <= 0 or self.config.pending_s <= 0:
            return
        for scheme in self.index.schemes_for(name, salted):
            hs = blocks.hashes.get((scheme, eng.block_size))
            if hs:
                self.index.route(name, hs, now, self.config.pending_s)

    def pick(
        self,
        ring: HashRing,
        key_hash: int,
        candidates: Mapping[str, BackendState],
        load_factor: float,
        blocks: RequestBlocks | None,
        request_id: str = "",
        salted: bool = False,
        closed: frozenset[str] = frozenset(),
    ) -> BackendState | None:
        """The engine (colocated, or prefiller) for a request (the module's docstring);
        ``closed``: candidates without KV headroom for it (``headroom`` "cost")."""
        roomy = {n: b for n, b in candidates.items() if n not in closed} or dict(candidates)
        by_hash = pick_bounded_load(ring, key_hash, roomy, load_factor)  # the filter's pick
        if blocks is None or by_hash is None:
            return by_hash
        state = self.state(by_hash.name)
        if state != "fresh" or not blocks.hashes:
            why = f"hash_{state}" if state != "fresh" else blocks.reason or "hash_no_tokens"
            self._decision.get(why, self._decision["hash_no_tokens"]).inc()
            self._note(request_id, by_hash.name, why, blocks, salted)
            return by_hash
        order = [n for n in ring.walk(key_hash) if n in candidates]
        # the ring's load bound holds here too: a hot prefix's holder takes at most
        # load_factor x its share of the requests in flight, then the next cheapest does
        cap = bound(candidates.values(), load_factor)
        now = time.monotonic()
        costed: list[tuple[BackendState, Held]] = []
        for name in order:
            b = candidates[name]
            if self.state(name) == "fresh" and b.in_flight < cap:
                costed.append((b, self.held(name, blocks, salted, now)))
        if not costed:  # every fresh one is at its bound: the ring's pick is not
            self._decision["hash_bound"].inc()
            self._note(request_id, by_hash.name, "hash_bound", blocks, salted)
            self._routed(by_hash.name, blocks, salted, now)
            return by_hash
        if self.config.unheld_home and _unheld(costed, blocks.tokens):
            home = next((c for c in costed if c[0].name not in closed), costed[0])
            chosen, miss, why = home[0], float(blocks.tokens), "ring_unheld"
        else:
            chosen, miss = pick_by_cost(
                costed, blocks.tokens, self.config.cpu_hit_cost, self.queued_tokens,
                miss_weight=self.config.miss_weight,
                closed=dict.fromkeys(closed, float(blocks.tokens)),
            )
            why = "cost_no_headroom" if chosen.name in closed else "cost"
        self.load_tokens += 0.1 * (miss - self.load_tokens)
        self._queue(request_id, chosen.name, miss)
        self._decision[why].inc()
        self._note(request_id, chosen.name, why, blocks, salted, now)
        self._routed(chosen.name, blocks, salted, now)
        return chosen

    def _queue(self, request_id: str, name: str, tokens: float) -> None:
        self.prefilled(request_id)  # a retry's earlier pick
        now = time.monotonic()
        self._queued[request_id] = (name, tokens, now)
        self.queued_tokens[name] = self.queued_tokens.get(name, 0.0) + tokens
        while self._queued:  # one whose end never came (a bug elsewhere) ages out
            oldest, (_, _, at) = next(iter(self._queued.items()))
            if now - at < QUEUED_TTL_S:
                break
            self.prefilled(oldest)

    def prefilled(self, request_id: str) -> None:
        """The request's first byte went out (or it ended): its prompt tokens are no longer
        queued on its engine. Idempotent."""
        entry = self._queued.pop(request_id, None)
        if entry is not None:
            name, tokens, _ = entry
            self.queued_tokens[name] = max(0.0, self.queued_tokens.get(name, 0.0) - tokens)

    def blocks_of(self, body: dict[str, Any]) -> RequestBlocks | None:
        """What :meth:`blocks_for` found for this request body (the last with hashes, for
        P/D asks for the decoders and the prefillers apart), if it was asked."""
        found = [blocks for seen, blocks in self._blocks if seen is body]
        return next((b for b in reversed(found) if b.hashes), found[-1] if found else None)

    def pick_decoder(
        self,
        decoders: list[BackendState],
        blocks: RequestBlocks | None,
        load_factor: float,
        salted: bool = False,
        count: bool = True,
    ) -> BackendState | None:
        """A P/D request's decoder by cost (the prompt tokens it would pull from the
        prefiller: those its own cache lacks, + the decodes queued or planned on it), when
        every candidate's events are fresh; else None (the caller's own rule)."""
        if blocks is None or not decoders:
            return None
        if not blocks.hashes or any(self.state(d.name) != "fresh" for d in decoders):
            if count:
                self.decoder_decisions.labels("load").inc()
            return None
        cap = bound(decoders, load_factor)
        best: BackendState | None = None
        best_cost = 0.0
        per_request = max(self.load_tokens, 1.0)
        for d in [d for d in decoders if d.in_flight < cap] or decoders:
            miss = blocks.tokens - min(self.held(d.name, blocks, salted).tokens, blocks.tokens)
            cost = miss + per_request * (max(d.in_flight, d.engine_held) + d.planned_decodes)
            if best is None or cost < best_cost:
                best, best_cost = d, cost
        if count:
            self.decoder_decisions.labels("cost").inc()
        return best

    def _note(
        self, request_id: str, name: str, decision: str, blocks: RequestBlocks, salted: bool,
        now: float | None = None,
    ) -> None:
        predicted = self.held(name, blocks, salted, now).tokens if blocks.hashes else 0
        self.recent.append(Decision(request_id, name, decision, predicted))
        log.debug("kv route %s -> %s (%s, %d cached tokens predicted)",
                  request_id, name, decision, predicted)
