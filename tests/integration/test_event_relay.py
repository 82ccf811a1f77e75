"""``kvadvisor events relay``: a vLLM engine's own ZMQ KV events (our emitter speaks its
exact wire shape) go through the vLLM adapter into a partitioned JetStream namespace set,
each event to the partition the scheme gives its block (real ZMQ sockets, a private
nats-server -js), and an engine restart carries on under a new epoch."""

from __future__ import annotations

import json
import threading
import time
import uuid

from typer.testing import CliRunner

from event_plane.adapters import PeerEmitter
from event_plane.partition import PartitionScheme
from event_plane.partitioned import partition_namespace
from kvadvisor.cli import app
from storage_backends.local_s3 import free_port
from tests import polling
from tests.logs import fold_log

SCHEME = PartitionScheme(partitions=4, trunk_depth=1, stretch=8)


def test_relay_routes_a_vllm_engines_events_to_their_partitions(js_url: str) -> None:
    port, rport = free_port(), free_port()
    ns = "v" + uuid.uuid4().hex[:8]
    host = js_url.split("//", 1)[1]
    # no advisor runs here to create the stream: the relay's publishers do (manage_stream=1)
    dst = f"jetstream://{host}?namespace={ns}&partitions=4&trunk_depth=1&stretch=8&manage_stream=1"
    src = f"vllm+zmq://127.0.0.1:{port}?replay={rport}&source=pod-a&bytes_per_token=1024"
    em = PeerEmitter(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", flavor="vllm", form="map")
    out: list[object] = []
    relay = threading.Thread(target=lambda: out.append(CliRunner().invoke(
        app, ["events", "relay", src, dst, "--duration", "6"])), daemon=True)
    relay.start()
    time.sleep(1.0)  # the relay's ZMQ subscription: slow joiner (a first batch lost is never asked again)
    # two requests sharing a 1-block system prompt, 40 and 24 blocks; the second one's tail
    # is evicted; then the engine restarts and stores a third request
    a = [1000 + i for i in range(40)]
    b = [a[0]] + [2000 + i for i in range(23)]
    c = [3000 + i for i in range(12)]
    def expected(chains: list[list[int]]) -> list[set[int]]:
        want: list[set[int]] = [set() for _ in range(SCHEME.partitions)]
        for chain in chains:
            for piece in SCHEME.pieces(chain):
                owners = range(SCHEME.partitions) if piece.partition < 0 else [piece.partition]
                for k in owners:
                    want[k] |= set(chain[piece.start:piece.end])
        return want

    def folded() -> list:  # type: ignore[type-arg]
        return [fold_log(js_url, partition_namespace(ns, k)) for k in range(SCHEME.partitions)]

    try:
        em.send([em.stored(a, None, block_size=16, medium="GPU")])
        em.send([em.stored(b[1:], b[0], block_size=16, medium="GPU")])
        em.send([em.removed(b[-5:], medium="GPU")])
        # each partition holds exactly its pieces of the chains still stored, and the trunk
        # (once the relay flushed, when idle)
        want = expected([a, b[:-5]])
        parts = polling.wait_until(lambda: (lambda ps: ps if [set(p.hashes()) for p in ps] == want else None)(folded()),
                                   30, "the relayed chains in the partitions' logs", every=0.2)
        assert len({k for k in range(SCHEME.partitions) if want[k] - {a[0]}}) > 1  # spread over partitions
        # the longest-prefix answer, asked piece by piece of its owners, is each chain's length
        for chain, n in ((a, 40), (b, 19)):
            got = 0
            for piece in SCHEME.pieces(chain):
                k = piece.partition if piece.partition >= 0 else 0
                matched = parts[k].lookup(chain[piece.start:piece.end]).get("pod-a/g1", 0)
                got += matched
                if matched < piece.end - piece.start:
                    break
            assert got == n, (chain[0], got)
        # the engine restarts: its GPU blocks are gone, and its new batches carry a new epoch
        em.restart()
        em.send([em.stored(c, None, block_size=16, medium="GPU")])
        relay.join(15)
    finally:
        em.close()
    assert out, "the relay did not end"
    result = out[0]
    assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
    summary = json.loads(result.output.strip().splitlines()[-1])  # type: ignore[attr-defined]
    assert (summary["events"], summary["unrecovered"], summary["dropped"]) == (40 + 23 + 5 + 12, 0, 0), summary
    after = folded()
    assert [set(p.hashes()) for p in after] == expected([c])
    epochs = {st.epoch for p in after for name, st in p.sources().items() if name == "pod-a"}
    assert len(epochs) == 1 and epochs != {st.epoch for p in parts for name, st in p.sources().items() if name == "pod-a"}
