"""The advisor's JetStream log reads a replicated stream completely right after a node
restart (real 3-node nats-server cluster on loopback).

A consumer is served from its leader's own copy of the stream.  A node just restarted is
still catching up, and nats-server 2.9 hands a consumer placed there only what that copy
holds, without an error: without the placement check in ``JetStreamLog`` about half of
these reads got the 300 events published before the node died instead of 3,300 (and a
rebuilt partition missed the Removes in the part it did not get).  A durable consumer may
be served by a replica the leader reports current: it may come with the newest entries a
moment later, but in order."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from advisor.ingest.jslog import JetStreamLog
from event_plane.codec import decode_batch
from event_plane.config import StreamLimits
from event_plane.schema import store
from event_plane.urls import make_publisher
from kvadvisor.localcluster import NatsCluster


def _read(url: str, ns: str, durable: str | None, until: int = 0) -> tuple[list[int], JetStreamLog]:
    """The events' hashes of the entries pending at start, then of whatever comes within
    10 s until there are ``until`` of them."""
    log = JetStreamLog(url, ns, stream=StreamLimits(replicas=3), durable=durable)
    log.start()
    hashes: list[int] = []
    try:
        for _ in range(log.pending_at_start):
            item = log.get(timeout=30)
            assert item is not None, "the log ended early"
            hashes += [ev.sequence_hash for ev in decode_batch(item[1]).events]
        end = time.monotonic() + 10
        while len(hashes) < until and time.monotonic() < end:
            if (item := log.get(timeout=0.2)) is not None:
                hashes += [ev.sequence_hash for ev in decode_batch(item[1]).events]
    finally:
        log.close()
    return hashes, log


def test_a_reader_gets_the_whole_stream_right_after_a_node_restart(tmp_path: Path) -> None:
    ns = "q" + uuid.uuid4().hex[:8]
    with NatsCluster(tmp_path / "nats", nodes=3) as cluster:
        # as the advisor, which makes the R3 stream (a worker's publisher calls no JetStream API)
        node0 = cluster.advisor_url.split(",")[0].replace("nats://", "jetstream://")
        url0 = f"{node0}?namespace={ns}&replicas=3&manage_stream=1"
        with make_publisher(url0, "w0", epoch=1) as pub:
            want: list[int] = []

            def publish(first: int, n: int) -> None:
                for h in range(first, first + n):
                    pub.publish([store(h, h, None, 64, "g1")])
                    want.append(h)
                    if h % 20 == 0:
                        pub.flush()
                pub.flush()

            publish(1000, 300)
            cluster.kill(2)
            publish(5000, 3000)
            assert pub.stats().dropped == 0
            cluster.start_node(2)
            cluster.wait_ready(30)
            # at once, while node 2 catches up: ephemeral readers (placed on any copy) get
            # everything the stream holds now; durable ones (an owner's fold, which may be
            # served by a current replica) get it all too, the newest entries perhaps a little
            # later, in order
            for k in range(8):
                got, _ = _read(cluster.advisor_url, ns, None)
                assert got == want, f"read {k}: {len(got)} of {len(want)} events"
            for k in range(3):
                got, log = _read(cluster.advisor_url, ns, f"d{k}-{ns}", until=len(want))
                assert got == want, f"durable read {k}: {len(got)} of {len(want)} events"
                assert log.misplaced == 0
