"""A partition briefly served by two advisors (the old owner still stopping while the new
one rebuilds) must not split the log between them: each owner reads through its own
durable consumer, so the new owner's fold is the whole log (real nats-server and Redis)."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

from advisor.cluster.parts import ClusterSettings, Replica
from advisor.index.prefix_index import PrefixIndex
from event_plane.partition import PartitionScheme
from event_plane.partitioned import partition_namespace, partition_url
from event_plane.schema import remove, store
from event_plane.urls import make_publisher

SCHEME = PartitionScheme(partitions=1)


def test_two_owners_of_one_partition_each_read_the_whole_log(js_url: str, redis_url: str) -> None:
    ns = "r" + uuid.uuid4().hex[:8]
    pub = make_publisher(partition_url(f"jetstream://{js_url.split('://')[1]}?namespace={ns}", 0), "w0", epoch=3,
                         manage_stream=True)  # first on its server
    reference = PrefixIndex()

    def publish(lo: int, hi: int) -> None:
        for h in range(lo, hi):
            events = [store(h, h, None, 64, "g1")] + ([remove(h - 5, h - 5, None, 64, "g1")] if h % 2 else [])
            pub.publish(events)
            pub.flush()

    def settings(name: str) -> SimpleNamespace:
        return SimpleNamespace(mover=None, settings=ClusterSettings(nats_url=js_url, redis_url=redis_url, advisor_id=name,
                                                        scheme=SCHEME, namespace=ns))

    publish(1000, 1200)
    old = Replica(settings("old"), 0)  # type: ignore[arg-type]
    new = Replica(settings("new"), 0)  # type: ignore[arg-type]
    try:
        publish(1200, 1400)  # both are reading now
        pub.close()
        from advisor.ingest.jslog import JetStreamLog

        log = JetStreamLog(js_url, partition_namespace(ns, 0), start_seq=1)
        log.start()
        for _ in range(log.pending_at_start):
            item = log.get(timeout=10)
            assert item is not None
            reference.apply_payload(item[1])
        log.close()
        want = reference.blocks_at("w0/g1")
        end = time.monotonic() + 30
        while time.monotonic() < end:
            with new.lock:
                got = new.index.blocks_at("w0/g1")
            if got == want:
                break
            time.sleep(0.1)
        assert got == want, (len(got), len(want))
        with old.lock:
            assert old.index.blocks_at("w0/g1") == want  # the old owner was not starved either
    finally:
        old.stop(save=False)
        new.stop(save=False)
