"""Partitioned advisors (advisor/cluster/node.py) bind a source to its subject: a batch published
on another source's subject (a forged new epoch under the victim's name) changes nothing in
the partition and is counted, over a real nats-server and Redis."""

from __future__ import annotations

import asyncio
import time
import uuid

import nats

from advisor.cluster.node import ClusterClient, ClusterNode, ClusterSettings, PartitionUnavailable
from event_plane.codec import encode_batch
from event_plane.partition import PartitionScheme
from event_plane.partitioned import PartitionedPublisher, partition_namespace, partition_url
from event_plane.schema import WIRE_VERSION, EventBatch, store
from event_plane.urls import make_publisher

SCHEME = PartitionScheme(partitions=1, trunk_depth=1, stretch=64)


def _status(client: ClusterClient, timeout_s: float = 20.0) -> dict:
    end = time.monotonic() + timeout_s
    while True:
        try:
            return client.status()[0]
        except PartitionUnavailable:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)


def test_a_batch_on_another_sources_subject_is_refused(js_url: str, redis_url: str) -> None:
    ns = "o" + uuid.uuid4().hex[:8]
    node = ClusterNode(ClusterSettings(nats_url=js_url, redis_url=redis_url, advisor_id="adv", scheme=SCHEME,
                                       namespace=ns, lease_ttl_s=3.0, heartbeat_s=0.5)).start()
    client = ClusterClient(js_url, SCHEME, ns)
    try:
        chain = [11, 12, 13]
        victim = PartitionedPublisher(SCHEME, lambda k: make_publisher(
            partition_url(f"jetstream://{js_url.split('://')[1]}?namespace={ns}", k), "w0", epoch=7))
        victim.publish([store(h, chain[0], chain[i - 1] if i else None, 64, "g1") for i, h in enumerate(chain)])
        victim.flush()
        attacker = PartitionedPublisher(SCHEME, lambda k: make_publisher(
            partition_url(f"jetstream://{js_url.split('://')[1]}?namespace={ns}", k), "w1", epoch=9))
        attacker.publish([store(99, 99, None, 64, "g1")])
        attacker.flush()

        # the forgery: w0's name, a new epoch (would drop w0's g1 blocks), on w1's subject
        forged = EventBatch(WIRE_VERSION, "w0", 12345, 0, 1, [store(500, 500, None, 64, "g2")])

        async def send() -> None:
            nc = await nats.connect(js_url)
            js = nc.jetstream()
            await js.publish(f"kvadvisor.events.{partition_namespace(ns, 0)}.w1", encode_batch(forged),
                             headers={"Nats-Msg-Id": "forged-1"})
            await nc.close()

        asyncio.run(send())
        end = time.monotonic() + 20
        while time.monotonic() < end:
            st = _status(client)
            if st["origin_refused"] >= 1 and st["applied"] >= 2:
                break
            time.sleep(0.1)
        assert st["origin_refused"] == 1, st
        assert client.blocks_at("w0/g1") == set(chain)  # the victim keeps its blocks
        assert client.blocks_at("w0/g2") == set()  # the forged Store changed nothing
        assert client.blocks_at("w1/g1") == {99}  # the attacker's own batch is its own business
        assert st["sources"]["w0"][0] == 7  # w0's epoch was not replaced
        victim.close()
        attacker.close()
    finally:
        client.close()
        node.stop()
