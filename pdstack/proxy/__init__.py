"""pdstack.proxy: the P/D-aware, prefix-aware, streaming OpenAI front door.

Modules: ``backends`` (discovery: backend table, health state, pairings, generations),
``routing`` (bounded-load consistent hashing, power of two choices, prefix index),
``metrics`` (Prometheus), ``app`` (the aiohttp server: routes, the generation entry
point, health, models), ``flows`` (one request flow per KV mode), ``legs`` (the prefill
and final legs, their retry loop, upstream calls), ``sse`` (the SSE relay, the usage
rewrite), ``admin`` (auth and the admin API), ``errors``
(OpenAI error JSON for every reply of the proxy's own, the connection protocol with a
request-head timeout), ``limits`` (body size / bytes held / read timeouts, input checks,
request ids, leg budgets, admin auth-failure limiting), ``tenants`` (named keys, per-tenant
limits), ``admission`` (KV-aware admission: when a request waits), ``kv_gate`` (the KV
projection per engine, the engines' /metrics), ``fair_queue`` (the queue of held requests,
fair across tenants), ``shares`` (what each tenant's requests occupy), ``breaker`` (fault
classification, circuit breaker), ``config``
(settings, secrets from env), ``cli`` (``pdstack proxy``), ``lmcache_pd`` (LMCache's
ProxyNotif listener and disagg_spec).

HTTP API
--------
- ``POST /v1/completions``, ``POST /v1/chat/completions`` (stream or not), ``GET /v1/models``:
  OpenAI-compatible; ``Authorization: Bearer <key>`` when ``PDSTACK_API_KEYS`` is set.
  Every response carries ``X-Request-Id`` (the client's when it is printable ASCII of at
  most 128 characters, else a new one), also sent on both upstream legs. Every error the
  proxy itself answers (400/401/403/404/405/408/413/429/502/503/504) has OpenAI's shape
  ``{"error": {"message", "type", "param", "code"}}``: a wrong ``stream`` /
  ``max_tokens`` / ``messages`` / ``prompt`` / ``model`` type is a 400 naming the field
  (``param``), a ``model`` not served a 404 as vLLM answers it; a body over
  ``--max-body-mb`` 413, one that does not arrive within ``--body-timeout`` 408, over
  ``--max-body-held-mb`` held at once 503 + ``Retry-After``; over ``--max-concurrency``
  (counted only once the body is read): 429 with ``Retry-After``; over a tenant limit
  (:mod:`pdstack.proxy.tenants`): 429, ``Retry-After``, ``code: rate_limit_exceeded`` and
  ``param`` = the limit; nothing routable: 503
  with the reason (e.g. "no healthy decoder for prefiller n1/prefill-0 on node n1"); every
  try failed: 502, or 504 when the last one ran out of its leg budget. An engine's 4xx,
  and its 5xx when its /health still passes, reach the client with the engine's status,
  message and param, in the proxy's vocabulary: ``type`` is OpenAI's for the status
  (``not_found_error``, ``invalid_request_error``, ...), never vLLM's class names
  (:func:`pdstack.proxy.errors.engine_error`).
  In P/D, ``usage.prompt_tokens_details.cached_tokens`` is the prefill leg's (its prefix
  cache hit; the engines run with ``--enable-prompt-tokens-details``).
  A stream whose upstream dies after its first byte ends with
  ``data: {"error": {...}}`` then ``data: [DONE]``.
- ``POST /tokenize``, ``POST /detokenize`` (vLLM's), ``GET /v1/models/{model}``: forwarded
  to a usable engine of the body's ``model`` (decoders / colocated first, the next one on a
  5xx or connection error); a ``model`` not served is the proxy's 404
  (:mod:`pdstack.proxy.engine_routes`).
- ``GET /health``: ``{"status": "ok"}`` (every backend healthy) or ``"degraded"``; 200
  when at least one route (prefiller with a same-generation healthy decoder, or a
  colocated engine) is usable, else 503. Backend names and states, ``kv_mode`` and the
  ``reason`` only with the admin token.
- ``GET /metrics``: Prometheus text (see :mod:`pdstack.proxy.metrics`).
- Admin (``Authorization: Bearer $PDSTACK_ADMIN_TOKEN`` or ``X-Admin-Token``; without a
  configured token the admin API answers 403; more than
  ``admin_auth_failures_per_min`` failed authentications from one address: 429 with
  ``Retry-After`` until the minute has passed):
  - ``GET /admin/backends``: ``{"kv_mode", "backends": [{"name", "role", "node", "url",
    "generation", "state" (healthy|drained|ejected|down|unknown), "in_flight", "served", ...;
    a warm standby also "standby": true, "stands_in_for"}], "pairings": [...], "in_flight"}``;
  - ``POST /admin/backends/{name}/drain`` / ``.../undrain``: drained = no new requests,
    in-flight ones finish (poll ``in_flight`` until 0 before stopping the engine);
  - ``POST /admin/backends`` ``{"name", "role", "url", "node", "generation",
    "drained"?, "standby"? (a replacement keeps its own), "pairs_with"?}``: add (201) or
    replace (200) a backend; pairings default
    to the kv_mode's rule (shared-l1: same node); the answer carries its first probe;
  - ``DELETE /admin/backends/{name}``.
  Names contain ``/`` (``node1/prefill-0``) and are used as is in the path.

kv_mode ``lmcache-pd`` (LMCache's legacy push, :mod:`pdstack.proxy.lmcache_pd`): the
proxy picks the decoder first, names it in the prefill leg's
``kv_transfer_params.disagg_spec`` (its ``lmcache_pd`` receiver host and per-TP-rank
init/alloc ports from the backend table), waits up to ``--lmcache-pd-notify-timeout``
(default 5 s) for the prefiller's ZMQ ``ProxyNotif`` on a PULL socket bound at the
table's ``lmcache_pd_notify`` (the proxy node's private address, port
``lmcache_pd_base - 1``), then decodes on that decoder; without the notification in time
it decodes anyway (the decoder recomputes) and counts
``pdstack_proxy_lmcache_pd_notify_total{outcome="timeout"}``. Ad hoc
(``--prefill/--decode``) it needs ``--lmcache-pd-receiver`` per decoder and
``--lmcache-pd-notify-port`` (see :mod:`pdstack.proxy.cli`).

Generations: a prefiller is paired only with decoders of the same ``generation``
string, and a prefiller without such a healthy decoder is not routed to, so an old
generation keeps serving until the new one has both roles healthy.
"""
