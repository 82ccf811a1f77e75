"""A prefill worker in its own process that exports its G2 over NIXL (for tests and demos).

Run: ``python -m kvbm_runtime.testing.remote_peer --tokens 1,2,3,... [--page-size 4]``.
It serves the tokens with synthetic KV (:func:`kvbm_runtime.fill_synthetic_kv`), exports
its G2 with :class:`~kvbm_runtime.remote.RemoteExporter`, binds a ZMQ REP socket on a free
loopback port and prints ``PORT <n>`` on stdout.  Requests (MessagePack arrays):

* ``["export", [hash, ...]]`` → the :class:`~kvbm_runtime.remote.BlockExport` bytes
* ``["release", lease]``      → number of blocks unpinned
* ``["stop"]``                → ``"ok"``, then the process exits
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import msgspec  # noqa: E402
import zmq  # noqa: E402

from event_plane import NullPublisher  # noqa: E402

from ..config import RuntimeConfig  # noqa: E402
from ..manager import BlockManager  # noqa: E402
from ..remote import RemoteExporter  # noqa: E402
from ..synthetic import fill_synthetic_kv  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Entry point (see module doc)."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", required=True, help="comma-separated token ids")
    ap.add_argument("--page-size", type=int, default=4)
    ap.add_argument("--inner-dim", type=int, default=16)
    ap.add_argument("--layout", default="FullyContiguous")
    ap.add_argument("--model", default="it/remote")
    args = ap.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    cfg = RuntimeConfig(
        model_name=args.model,
        page_size=args.page_size,
        inner_dim=args.inner_dim,
        layout=args.layout,
        g1_blocks=16,
        g2_blocks=32,
    )
    mgr = BlockManager(cfg, NullPublisher("prefill-peer"))
    mgr.serve(tokens, fill_synthetic_kv)
    exporter = RemoteExporter(mgr.g2, "prefill-peer-g2")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"PORT {port}", flush=True)
    try:
        while True:
            if not sock.poll(60_000):
                return 2  # the test went away
            req = msgspec.msgpack.decode(sock.recv())
            if req[0] == "export":
                sock.send(exporter.export([int(h) for h in req[1]]).to_bytes())
            elif req[0] == "release":
                sock.send(msgspec.msgpack.encode(exporter.release(int(req[1]))))
            elif req[0] == "stop":
                sock.send(msgspec.msgpack.encode("ok"))
                return 0
            else:
                sock.send(msgspec.msgpack.encode(f"unknown request {req[0]!r}"))
    finally:
        exporter.close()
        mgr.close()
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
