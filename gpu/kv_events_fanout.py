"""pdstack's engines' vLLM KV events, published again one engine per endpoint, for a router
that subscribes to each engine's own PUB (vllm-router ``--kv-event-source URL=ENDPOINT``,
issue 56's ``kv_aware`` baseline) on the same engines pdstack routes.

pdstack plans every engine's PUB to *connect* to its proxy's SUB (vLLM binds a PUB endpoint
only for ``*``, ``::`` or ipc: pdstack.plan_engine.kv_events_config), topic = the backend name
(``NODE/engine-N``). This binds that SUB instead (run it with pdstack's proxy stopped) and
sends each message on the PUB bound for its topic, with the topic vLLM's default config
publishes (``""``: ``--keep-topic`` sends pdstack's) and the sequence and payload unchanged:
what the router would read from an engine that binds its own PUB with vLLM's defaults.
Replays need nothing: the engines' ROUTER sockets are bound (``--kv-event-replay-source``).

    python gpu/kv_events_fanout.py --sub tcp://127.0.0.1:5590 \\
        --pub h200/engine-0=tcp://127.0.0.1:5601 --pub h200/engine-1=tcp://127.0.0.1:5602

Counts per topic go to stdout every 10 s (the driver's log); SIGTERM ends it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

import zmq


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sub", required=True, help="the endpoint the engines' PUBs connect to")
    p.add_argument("--pub", action="append", required=True, metavar="TOPIC=ENDPOINT",
                   help="bind a PUB at ENDPOINT for the engine publishing TOPIC (repeat)")
    p.add_argument("--keep-topic", action="store_true",
                   help="send pdstack's topic (NODE/engine-N), not vLLM's default empty one")
    args = p.parse_args(argv)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(args.sub)
    pubs: dict[bytes, zmq.Socket] = {}
    for spec in args.pub:
        topic, sep, endpoint = spec.partition("=")
        if not sep or not topic or not endpoint:
            p.error(f"--pub {spec!r}: expected TOPIC=ENDPOINT")
        pub = ctx.socket(zmq.PUB)
        pub.bind(endpoint)
        pubs[topic.encode()] = pub
    counts = {t: 0 for t in pubs}
    unknown = 0
    stop = False

    def _stop(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(f"fanout: SUB {args.sub} -> {', '.join(args.pub)}", flush=True)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    last = time.monotonic()
    while not stop:
        if poller.poll(500):
            frames = sub.recv_multipart()
            pub = pubs.get(frames[0])
            if pub is None:
                unknown += 1
            else:
                pub.send_multipart(frames if args.keep_topic else [b"", *frames[1:]])
                counts[frames[0]] += 1
        if time.monotonic() - last >= 10:
            last = time.monotonic()
            shown = " ".join(f"{t.decode()}={n}" for t, n in counts.items())
            print(f"fanout: messages {shown} unknown-topic={unknown}", flush=True)
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
