"""A partitioned advisor (advisor/cluster/node.py) skips a partition snapshot that fails to
load and counts it, over a real nats-server and Redis: whoever can write Redis can recompute
the checksum, so a payload nested deeper than the stack and fields that are not integers
must leave the partition rebuilt from the newest good snapshot, never a failed start."""

from __future__ import annotations

import time
import uuid

import redis
import xxhash

from advisor.cluster.node import ClusterClient, ClusterNode, ClusterSettings, PartitionUnavailable
from advisor.index.prefix_index import PrefixIndex
from advisor.index.snapshot import RedisSnapshotStore, encode_index, make_snapshot
from event_plane.partition import PartitionScheme
from event_plane.schema import WIRE_VERSION, EventBatch, store

SCHEME = PartitionScheme(partitions=1, trunk_depth=1, stretch=64)


def test_tampered_partition_snapshots_are_skipped_and_counted(js_url: str, redis_url: str) -> None:
    ns = "s" + uuid.uuid4().hex[:8]
    prefix = f"kvadvisor:{ns}:p0"
    good = PrefixIndex()
    good.apply_batch(EventBatch(WIRE_VERSION, "w0", 1, 0, 1, [store(42, 42, None, 64, "g1")]))
    RedisSnapshotStore(redis_url, key_prefix=prefix, keep=10).save(make_snapshot(0, encode_index(good)))
    r = redis.Redis.from_url(redis_url)
    deep = b"\x91" * 200_000 + b"\xc0"  # an array in an array ... 200,000 deep
    r.hset(f"{prefix}:snapshot:5", mapping={"payload": deep, "created_ns": 1, "checksum": xxhash.xxh3_64_intdigest(deep)})
    r.hset(f"{prefix}:snapshot:6", mapping={"payload": b"\x90", "created_ns": "soon", "checksum": "x"})
    r.zadd(f"{prefix}:snapshots", {"5": 5, "6": 6})
    node = ClusterNode(ClusterSettings(nats_url=js_url, redis_url=redis_url, advisor_id="adv", scheme=SCHEME,
                                       namespace=ns, lease_ttl_s=3.0, heartbeat_s=0.5)).start()
    client = ClusterClient(js_url, SCHEME, ns)
    try:
        end = time.monotonic() + 30
        while True:
            try:
                st = client.status()[0]
                break
            except PartitionUnavailable:
                assert time.monotonic() < end, "the partition never became available"
                time.sleep(0.1)
        assert st["snapshots_skipped"] == 2, st
        assert client.blocks_at("w0/g1") == {42}  # from the good snapshot, older than both
    finally:
        client.close()
        node.stop()
        for k in r.scan_iter(f"{prefix}:*"):
            r.delete(k)
