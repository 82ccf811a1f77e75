"""Dead sources in scaled mode (advisor/cluster/expiry.py), on a real nats-server and Redis.

A worker that stopped has its g1 blocks dropped from every partition once it has been
silent on all of them for the TTL; its block on a shared volume stays.  A live worker that
keeps publishing to one partition only keeps its g1 blocks in the partitions it has not
touched since (silence is judged on the whole stream, not per partition).  The expiry is
in the log: a fresh fold of each partition gives the same index.
"""

from __future__ import annotations

import threading
import time
import uuid

from advisor.cluster.node import ClusterClient, ClusterNode, ClusterSettings, wait_until
from event_plane.partition import PartitionScheme
from event_plane.partitioned import PartitionedPublisher, partition_namespace, partition_url
from event_plane.schema import store
from event_plane.urls import make_publisher
from tests.logs import fold_log

SCHEME = PartitionScheme(partitions=4, trunk_depth=1, stretch=64)
TTL = 2.0


def _chain_in(partition: int, base: int, n: int) -> list[int]:
    """A chain of ``n`` blocks whose blocks below the trunk all belong to ``partition``."""
    while True:
        chain = [base + i for i in range(n)]
        if SCHEME.partition_of_head(chain[1]) == partition:
            return chain
        base += 1000


def _stores(chain: list[int], loc: str) -> list:  # noqa: ANN401 - event list
    return [store(h, chain[0], chain[i - 1] if i else None, 64, loc) for i, h in enumerate(chain)]


def test_a_source_silent_everywhere_is_expired_and_one_alive_elsewhere_is_not(js_url: str, redis_url: str) -> None:
    ns = "x" + uuid.uuid4().hex[:8]
    node = ClusterNode(ClusterSettings(nats_url=js_url, redis_url=redis_url, advisor_id="adv-x", scheme=SCHEME,
                                       namespace=ns, lease_ttl_s=3.0, heartbeat_s=0.5, source_ttl_s=TTL)).start()
    url = f"jetstream://{js_url.split('://')[1]}?namespace={ns}"

    def publisher(name: str) -> PartitionedPublisher:
        return PartitionedPublisher(SCHEME, lambda k: make_publisher(partition_url(url, k), name, epoch=5))

    client = ClusterClient(js_url, SCHEME, ns, timeout_s=2.0)
    live: PartitionedPublisher | None = None
    stop_beat = threading.Event()
    beat: threading.Thread | None = None
    beat_errors: list[BaseException] = []
    try:
        assert wait_until(lambda: len(node.owned()) == SCHEME.partitions, 20)
        dead_chain = _chain_in(1, 10_000, 6)
        live_a = _chain_in(1, 50_000, 5)  # the live worker's chain in partition 1, never touched again
        live_b = _chain_in(2, 90_000, 3)
        dead, live = publisher("dead"), publisher("live")
        dead.publish(_stores(dead_chain, "g1") + [store(dead_chain[2], dead_chain[0], dead_chain[1], 64, "slow")])
        dead.close()
        live.publish(_stores(live_a, "g1") + _stores(live_b, "g1"))
        live.flush()
        assert wait_until(lambda: client.blocks_at("dead/g1") == set(dead_chain), 20)

        # the live worker keeps publishing, to partition 2 only, every 0.3 s until the advisor
        # has stopped: alive however long the test takes to look (it stopped after 3 TTLs, and
        # an expiry pass of the dead worker coming over a TTL after that, on a loaded machine,
        # made it the newest message and expired the live worker too)
        def heartbeat(pub: PartitionedPublisher) -> None:
            h = live_b[-1]
            try:
                while not stop_beat.wait(0.3):
                    nxt = h + 1
                    pub.publish([store(nxt, live_b[0], h, 64, "g1")])
                    pub.flush()
                    h = nxt
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                beat_errors.append(exc)

        beat = threading.Thread(target=heartbeat, args=(live,), daemon=True)
        beat.start()
        time.sleep(3 * TTL)  # time passes: several TTLs in which partition 1 hears nothing of the live worker
        assert wait_until(lambda: not client.blocks_at("dead/g1"), 30), (client.blocks_at("dead/g1"),
                                                                       node.expiry.counters)
        assert node.expiry is not None
        # partition 1 asked about the live worker (it is silent there), and found it alive
        assert wait_until(lambda: node.expiry.counters["alive_elsewhere"] >= 1, 30), node.expiry.counters
        assert client.blocks_at("slow") == {dead_chain[2]}  # shared volumes stay
        held = client.blocks_at("live/g1")
        assert set(live_a) <= held and set(live_b) <= held  # alive: nothing of it dropped
        counters = dict(node.expiry.counters)
        # the dead worker's root (trunk) was in every partition, its chain in partition 1
        assert counters["expired"] == SCHEME.partitions, counters
    finally:
        client.close()
        node.stop()
        stop_beat.set()
        if beat is not None:
            beat.join(30)
        if live is not None:
            live.close()
    assert not beat_errors, beat_errors
    # the expiries are in the log: a fresh fold of every partition agrees
    for p in range(SCHEME.partitions):
        idx = fold_log(js_url, partition_namespace(ns, p))
        assert not idx.blocks_at("dead/g1"), p
        assert idx.blocks_at("live/g1"), p
    assert fold_log(js_url, partition_namespace(ns, 1)).blocks_at("slow") == {dead_chain[2]}
