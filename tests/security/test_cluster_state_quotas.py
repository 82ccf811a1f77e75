"""Scaled mode applies the state quotas in each partition's fold (advisor/cluster/partition_fold.py),
over a real nats-server with JetStream and Redis.

A worker user may publish anything on its own subject, and the partition's stream keeps it:
before, every Store of a flooding worker entered the partition's index (50 of 50 here with a
per-source quota of 20).  Now the excess is refused and counted, another worker's blocks still
get in, and a fold of the partition's log from the start (what a new owner or a restart
does) refuses exactly the same.  A worker opening a new epoch per batch leaves the fold's
per-epoch sequence marks bounded as the index bounds its retired epochs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import nats

from advisor.cluster.node import ClusterClient, ClusterNode, ClusterSettings, PartitionUnavailable
from event_plane.codec import encode_batch
from event_plane.ordering import MAX_RETIRED_EPOCHS
from event_plane.partition import PartitionScheme
from event_plane.partitioned import PartitionedPublisher, partition_namespace, partition_url
from event_plane.schema import WIRE_VERSION, EventBatch, store
from event_plane.urls import make_publisher
from tests.logs import fold_log

SCHEME = PartitionScheme(partitions=1, trunk_depth=1, stretch=64)


def _status_when(client: ClusterClient, cond, what: str, timeout_s: float = 30.0) -> dict:
    """The partition's status once ``cond(status)`` holds (polled)."""
    end = time.monotonic() + timeout_s
    st: dict = {}
    while time.monotonic() < end:
        try:
            st = client.status()[0]
        except PartitionUnavailable:
            st = {}
        if st and cond(st):
            return st
        time.sleep(0.1)  # time passes: the partition's owner folds the stream
    raise AssertionError(f"timed out waiting for {what}: {st}")


def _publisher(js_url: str, ns: str, source: str) -> PartitionedPublisher:
    return PartitionedPublisher(SCHEME, lambda k: make_publisher(
        partition_url(f"jetstream://{js_url.split('://')[1]}?namespace={ns}", k), source, epoch=1))


def test_a_worker_past_its_block_quota_is_refused_the_same_in_every_fold(js_url: str, redis_url: str) -> None:
    ns = "q" + uuid.uuid4().hex[:8]
    settings = ClusterSettings(nats_url=js_url, redis_url=redis_url, advisor_id="adv", scheme=SCHEME, namespace=ns,
                               lease_ttl_s=3.0, heartbeat_s=0.5, quota_max_source_blocks=20, quota_max_locations=2)
    node = ClusterNode(settings).start()
    client = ClusterClient(js_url, SCHEME, ns)
    flood, other = _publisher(js_url, ns, "w0"), _publisher(js_url, ns, "w1")
    try:
        chain = list(range(1000, 1050))
        for i in range(0, 50, 10):  # 5 batches of 10 Stores at w0's g1: 50 blocks, 20 allowed
            flood.publish([store(h, chain[0], chain[j - 1] if j else None, 64, "g1")
                           for j, h in enumerate(chain[i:i + 10], start=i)])
            flood.flush()
        # new volume names: 2 allowed in the partition, the 3rd refused
        flood.publish([store(chain[0], chain[0], None, 64, f"vol{k}") for k in range(3)])
        flood.flush()
        mine = [7001, 7002, 7003]
        other.publish([store(h, mine[0], mine[j - 1] if j else None, 64, "g1") for j, h in enumerate(mine)])
        other.flush()
        st = _status_when(client, lambda s: s["applied"] >= 7, "the 7 batches folded")

        assert client.blocks_at("w0/g1") == set(chain[:20])  # 30 Stores past the quota refused
        assert client.blocks_at("w1/g1") == set(mine)  # another worker's blocks still get in
        assert client.blocks_at("vol0") == {chain[0]} and client.blocks_at("vol1") == {chain[0]}
        assert client.blocks_at("vol2") == set()
        q = st["quotas"]
        assert q["quota_refused_events_source_blocks"] == 30, q
        assert q["quota_refused_events_locations"] == 1, q
        assert st["blocks"] == 23

        # /v1/stats (summed over partitions) and /metrics (per partition) show the refusals
        from advisor.cluster.metrics import cluster_registry
        from advisor.cluster.query import ClusterQuery

        reg = cluster_registry(node)
        assert reg.get_sample_value("kvadvisor_cluster_quota_refused_events_total",
                                    {"advisor": "adv", "partition": "0", "reason": "source_blocks"}) == 30
        stats = ClusterQuery(client).stats()
        assert stats["ingest"]["quota_refused_events_source_blocks"] == 30, stats["ingest"]

        # a fold of the partition's log from the start, with the same limits, refuses the same
        rebuilt = fold_log(js_url, partition_namespace(ns, 0), limits=settings.quota_limits())
        for loc in ("w0/g1", "w1/g1", "vol0", "vol1", "vol2"):
            assert rebuilt.blocks_at(loc) == client.blocks_at(loc), loc
        assert len(rebuilt) == st["blocks"]
        # and a new owner (snapshot at the stop, then the log) refuses the rest the same way
        node.stop()
        node = ClusterNode(dataclasses.replace(settings, advisor_id="adv2")).start()
        flood.publish([store(h, h, None, 64, "g1") for h in range(2000, 2005)])
        flood.flush()
        st = _status_when(client, lambda s: s["applied"] >= 1 and s["position"] >= 8, "the new owner folded")
        assert client.blocks_at("w0/g1") == set(chain[:20])
        assert st["quotas"]["quota_refused_events_source_blocks"] == 5
    finally:
        flood.close()
        other.close()
        client.close()
        node.stop()


def test_an_epoch_per_batch_flood_leaves_the_folds_marks_bounded(js_url: str, redis_url: str) -> None:
    ns = "e" + uuid.uuid4().hex[:8]
    node = ClusterNode(ClusterSettings(nats_url=js_url, redis_url=redis_url, advisor_id="adv", scheme=SCHEME,
                                       namespace=ns, lease_ttl_s=3.0, heartbeat_s=0.5)).start()
    client = ClusterClient(js_url, SCHEME, ns)
    n = 200
    try:
        _status_when(client, lambda s: True, "the partition served (its stream made)")

        async def send() -> None:
            nc = await nats.connect(js_url)
            js = nc.jetstream()
            for epoch in range(1, n + 1):  # a new epoch per batch, on the worker's own subject
                batch = EventBatch(WIRE_VERSION, "w2", epoch, 1, epoch, [store(epoch, epoch, None, 64, "g1")])
                await js.publish(f"kvadvisor.events.{partition_namespace(ns, 0)}.w2", encode_batch(batch),
                                 headers={"Nats-Msg-Id": f"w2-{epoch}"})
            await nc.close()

        asyncio.run(send())
        st = _status_when(client, lambda s: s["applied"] >= n, f"the {n} batches folded")
        assert st["tracked_epochs"] <= MAX_RETIRED_EPOCHS + 1, st["tracked_epochs"]
        assert st["sources"]["w2"][0] == n
        assert client.blocks_at("w2/g1") == {n}  # each new epoch dropped the one before's blocks
    finally:
        client.close()
        node.stop()
