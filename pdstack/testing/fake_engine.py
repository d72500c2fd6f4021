"""FakeEngine: a TEST DOUBLE of an OpenAI-compatible vLLM server (aiohttp).

It is for unit tests, fault-injection tests and proxy overhead benchmarks only;
it never runs a model. Real-engine tests use real vLLM.

Endpoints
---------
- ``POST /v1/completions`` and ``POST /v1/chat/completions``, streaming (SSE,
  ``stream: true``) and not. Output is ``n`` tokens, ``n = min(max_tokens,
  output_tokens)``; token ``i`` is the text `` t<k>`` where ``k`` depends only on
  the prompt and ``i`` (so every engine answers a prompt identically, like greedy
  decoding of one model). Prompt tokens are counted as whitespace-separated words.
  Headers are sent at once (like vLLM), the first token after ``ttft_ms``, then
  one SSE event per token every ``itl_ms``. ``stream_options.include_usage``
  adds a usage event; the stream ends with ``data: [DONE]``. Usage carries
  ``prompt_tokens_details.cached_tokens`` (vLLM's ``--enable-prompt-tokens-details``):
  all prompt tokens for a prompt this engine has seen before, and for a decode leg
  carrying ``do_remote_prefill`` (its KV came from the prefiller), else 0.
- ``return_token_ids`` (vLLM's): each token event's choice carries ``token_ids`` (output
  token `` t<k>`` is ``OUTPUT_ID_BASE + k``) and the first event the prompt's
  ``prompt_token_ids`` (its characters' code points; a chat stream's role event, at its
  top level). A token-id prompt that holds output ids (a stream continued elsewhere:
  prompt ids + the output's so far) is answered as that prompt's continuation: the tokens
  that follow, up to ``output_tokens`` in all, as greedy decoding of one model would.
- ``api_key``: when set, generation requests without ``Authorization: Bearer <it>``
  get 401 (vLLM's ``--api-key`` / ``VLLM_API_KEY``).
- ``kv_transfer_params`` (the vLLM NIXL P/D protocol): a request with
  ``{"do_remote_decode": true}`` is a prefill leg: the response carries
  ``kv_transfer_params = {"do_remote_prefill": true, "remote_engine_id": <name>,
  "remote_block_ids": [...], "remote_host": <host>, "remote_port": <port>,
  "request_id": <X-Request-Id>}``. A request carrying ``do_remote_prefill`` is a
  decode leg: its prompt tokens count as ``external_kv_transfer`` in /metrics.
- LMCache's legacy P/D push (kv_mode ``lmcache-pd``): built with
  ``lmcache_pd_notify="HOST:PORT"`` (a prefiller's ``LMCACHE_PD_PROXY_HOST``/``PORT``),
  a request carrying ``kv_transfer_params.disagg_spec`` makes the engine "push the KV"
  and then send LMCache's ``ProxyNotif(req_id)`` (msgspec msgpack, over a ZMQ PUSH
  socket) ``lmcache_pd_notify_delay_ms`` after the request arrived; sent notifications
  are listed in ``lmcache_pd_notified`` as ``(req_id, time.time())``. Without the
  option a ``disagg_spec`` is only recorded (no notification: LMCache's push failed).
- ``max_running``: a fixed capacity (vLLM's ``--max-num-seqs``): at most that many
  requests are served at once; the others wait in the engine, in arrival order (their
  TTFT includes the wait).
- ``GET /v1/models``: one model, ``model`` (default ``"fake"``).
- ``POST /tokenize`` (``prompt`` or chat ``messages``) and ``POST /detokenize``
  (``tokens``), vLLM's shapes (``count``, ``max_model_len``, ``tokens`` / ``prompt``): one
  token per whitespace-separated word, ids assigned in order of first sight (so
  detokenize inverts tokenize); a ``model`` other than ``model`` is vLLM's 404.
- Errors carry vLLM's ``type`` names (its exception classes: ``BadRequestError``,
  ``NotFoundError``, ``InternalServerError``, ...), as the real engine does. With
  ``max_model_len`` set, a generate request whose prompt tokens + ``max_tokens`` exceed it
  is vLLM's 400 (``max_tokens`` too large).
- ``GET /health``: 200, or ``faults.health_status``.
- ``GET /metrics``: Prometheus text with vLLM's names:
  ``vllm:num_requests_running``, ``vllm:prompt_tokens_total``,
  ``vllm:generation_tokens_total``, ``vllm:request_success_total``,
  ``vllm:prompt_tokens_by_source_total{source="local_compute"|"external_kv_transfer"}``,
  and ``fake_engine_requests_total`` (``metrics_reads`` counts the reads). With
  ``kv_capacity_tokens`` set, also the gauges KV-aware admission reads:
  ``vllm:cache_config_info{num_gpu_blocks, block_size} 1`` (``kv_block_size``: 1 unless a
  test sets it -- the fake counts KV in tokens, not in vLLM's whole blocks),
  ``vllm:kv_cache_usage_perc`` = (running requests' prompt tokens + ``kv_held_tokens``)
  / capacity, capped at 1, ``vllm:num_requests_waiting`` = ``num_waiting`` and
  ``vllm:num_preemptions_total`` = ``num_preemptions``; tests set ``kv_held_tokens`` (KV
  "held by other requests"), ``num_waiting`` and ``num_preemptions`` at any time.
- ``GET /fake/requests`` (JSON list of what it saw; header names lower-cased),
  ``DELETE /fake/requests``,
  ``GET /fake/faults``, ``PUT /fake/faults`` (JSON body = ``Faults`` fields;
  replaces the faults): control from another process, e.g. a benchmark.

Faults (``FakeEngine.faults``, a :class:`Faults`; applies to generation requests)
--------------------------------------------------------------------------------
- ``status`` (e.g. 500): answer that HTTP status with an OpenAI error JSON
  before any byte of the body (a retryable failure).
- ``delay_ms``: extra delay before the response headers.
- ``hang``: never answer (headers never sent) until the client goes away.
- ``hang_after_chunks`` N: stream N token events, then stall forever.
- ``close_after_chunks`` N: stream N token events (0 = right after the headers),
  then abort the TCP connection (the engine "died" mid-stream). For a
  non-streaming request: abort before answering.
- ``error_event_after_chunks`` N: stream N token events, then vLLM's error event
  ``data: {"error": {"message", "type", "param", "code"}}`` and ``data: [DONE]``; the
  HTTP status stays 200 (vLLM's failure during generation, e.g. of a NIXL KV pull: after
  a chat stream's role event, as vLLM sends it, with 0 tokens for N = 0).
  ``error_event_status`` (default 500: its ``InternalServerError`` "Internal server
  error"; 400: ``BadRequestError``) is the event's ``code``. For a non-streaming request:
  that status with the error JSON (vLLM answers a failed generation so).
- ``end_delay_ms``: a stream's body ends that long after its ``data: [DONE]`` (a client
  that closes on ``[DONE]`` then goes before the proxy's relay has ended).
- ``times``: apply the fault to that many more requests, then clear it
  (``None`` = every request).
- ``poison`` (a string) with ``poison_status``: a request whose prompt contains it is
  answered ``poison_status`` (default 500) with an OpenAI error JSON, while ``/health``
  stays 200: a "bad request" that makes an engine fail without the engine being sick.
  Independent of the other faults and of ``times``.
- ``health_status``: what ``/health`` answers (e.g. 503).
- ``health_hang``: ``/health`` and ``/metrics`` never answer (the engine's host cannot be
  reached: its link is down), until the client goes away.
- ``health_delay_ms``: ``/health`` answers that much later (a busy API server); ``/metrics``
  answers at once.

In-process use (tests)
----------------------
::

    engine = FakeEngine(name="d0", ttft_ms=5, itl_ms=1, output_tokens=8)
    url = await engine.start()            # port 0 = pick a free port
    engine.faults = Faults(status=500, times=1)
    ...
    engine.requests                        # list[SeenRequest]: path, headers, body
    await engine.kill()                    # abort every open connection, stop listening
    await engine.start()                   # same port again (a "restart")
    await engine.stop()

Or ``async with FakeEngine(...) as engine:``.

Command line
------------
``python -m pdstack.testing.fake_engine --port 8100 --ttft-ms 20 --itl-ms 5``
(also ``--host``, ``--output-tokens``, ``--model``, ``--name``, ``--no-record``).

Where it lives
--------------
``fake_server`` (the server: state, lifecycle, routes, the generate pipeline), ``fake_replies``
(one answer as unary JSON or an SSE stream, with its fault) and ``fake_wire`` (faults, recorded
requests, prompts, tokens and token ids, vLLM's error JSON); this module names them and is
the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os

from pdstack.testing.fake_server import FakeEngine
from pdstack.testing.fake_wire import OUTPUT_ID_BASE, Faults, SeenRequest

__all__ = ["OUTPUT_ID_BASE", "FakeEngine", "Faults", "SeenRequest", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdstack.testing.fake_engine",
        description="Fake OpenAI-compatible engine (TEST DOUBLE; no model).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--itl-ms", type=float, default=0.0)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--model", default="fake")
    parser.add_argument("--name", default=None, help="engine name (default fake-<port>)")
    parser.add_argument("--no-record", action="store_true", help="do not keep seen requests")
    parser.add_argument(
        "--kv-capacity-tokens", type=int, default=None,
        help="export the KV gauges KV-aware admission reads, for this capacity",
    )  # fmt: skip
    parser.add_argument(
        "--lmcache-pd-notify",
        metavar="HOST:PORT",
        default=None,
        help="send LMCache's ProxyNotif there for prefill legs carrying a disagg_spec",
    )
    parser.add_argument("--lmcache-pd-notify-delay-ms", type=float, default=0.0)
    parser.add_argument(
        "--api-key-env",
        default=None,
        metavar="NAME",
        help="require the API key in this environment variable (e.g. VLLM_API_KEY)",
    )
    args = parser.parse_args(argv)
    engine = FakeEngine(
        name=args.name or f"fake-{args.port}",
        host=args.host,
        port=args.port,
        ttft_ms=args.ttft_ms,
        itl_ms=args.itl_ms,
        output_tokens=args.output_tokens,
        model=args.model,
        record=not args.no_record,
        lmcache_pd_notify=args.lmcache_pd_notify,
        lmcache_pd_notify_delay_ms=args.lmcache_pd_notify_delay_ms,
        api_key=os.environ.get(args.api_key_env) if args.api_key_env else None,
        kv_capacity_tokens=args.kv_capacity_tokens,
    )
    try:
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    except ImportError:
        pass

    async def run() -> None:
        await engine.start()
        print(f"fake engine {engine.name} listening on {engine.url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await engine.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
