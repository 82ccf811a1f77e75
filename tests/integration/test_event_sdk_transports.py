"""Vendor SDK over real transports: a BlockTracker fed by a ZMQ or core-NATS subscriber
handles orphans, duplicate Stores, out-of-order and unknown Removes, and self-parented
Stores exactly as the receiver rules say."""

from __future__ import annotations

import secrets
import time

import zmq

from event_plane import (
    EventBatch,
    NatsPublisher,
    NatsSubscriber,
    PublisherConfig,
    Subscriber,
    ZmqPublisher,
    ZmqSubscriber,
    encode_batch,
    remove,
    store,
)
from event_plane.frames import seq_to_bytes
from event_plane.sdk import BlockTracker
from storage_backends.local_s3 import free_port

SIZE = 65536


def zmq_pair(**pub_kw: object) -> tuple[ZmqPublisher, ZmqSubscriber]:
    pub_ep, rep_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = ZmqPublisher("w0", pub_ep, rep_ep, **pub_kw)  # type: ignore[arg-type]
    sub = ZmqSubscriber([(pub_ep, rep_ep)])
    sub.start()
    time.sleep(0.3)  # ZMQ slow joiner
    return pub, sub


def feed(sub: Subscriber, tracker: BlockTracker, n_batches: int, timeout: float = 5.0) -> list[EventBatch]:
    got = sub.get_many(n_batches, timeout)
    assert len(got) == n_batches, (len(got), sub.stats())
    for batch in got:
        tracker.apply_batch(batch)
    return got


def test_orphans_after_an_empty_start_link_when_parent_arrives_over_zmq() -> None:
    pub, sub = zmq_pair(config=PublisherConfig(max_events=2))
    tracker = BlockTracker()
    b1, b3, b4 = 0xB1, 0xB3, 0xB4
    try:
        pub.publish([store(b3, b1, b1, SIZE, "g1"), store(b4, b1, b3, SIZE, "g1")])
        feed(sub, tracker, 1)
        st = tracker.stats()
        assert (st.blocks, st.orphans, st.orphan_stores) == (2, 1, 1)
        assert tracker.match([b1, b3, b4]) == 0
        pub.publish([store(b1, b1, None, SIZE, "g1")])
        pub.flush()
        feed(sub, tracker, 1)
        st = tracker.stats()
        assert (st.blocks, st.orphans, st.orphans_linked) == (3, 0, 1)
        assert tracker.match([b1, b3, b4]) == 3
    finally:
        pub.close()
        sub.close()


def test_duplicate_store_batch_resent_after_reconnect_counts_once_over_nats(nats_url: str) -> None:
    ns = "sdk" + secrets.token_hex(4)
    sub = NatsSubscriber(nats_url, ns)
    sub.start()
    tracker = BlockTracker()
    chain = [store(1, 1, None, SIZE, "g2"), store(2, 1, 1, SIZE, "g2"), store(3, 1, 2, SIZE, "g2")]
    first = NatsPublisher("w0", nats_url, ns, epoch=7)
    try:
        first.publish(chain)
        first.close()  # the worker's connection drops ...
        again = NatsPublisher("w0", nats_url, ns, epoch=7)  # ... and it re-sends after reconnect
        again.publish(chain)  # seq 0 again: the very same batch
        again.flush()
        again.publish(chain)  # and the same Stores once more under seq 1
        again.close()
        got = feed(sub, tracker, 2)
        assert [b.seq for b in got] == [0, 1]
        assert sub.get(timeout=0.3) is None
        assert sub.stats().duplicates == 1
        st = tracker.stats()
        assert tracker.count_at("g2") == 3 and tracker.count_at("g2", "w0") == 3
        assert (st.blocks, st.stores, st.duplicate_stores) == (3, 3, 3)
        # the exact same batch applied twice to the tracker is ignored too
        assert tracker.apply_batch(got[1]) is False and tracker.count_at("g2") == 3
    finally:
        sub.close()


def test_removes_out_of_order_and_unknown_over_nats(nats_url: str) -> None:
    ns = "sdk" + secrets.token_hex(4)
    sub = NatsSubscriber(nats_url, ns)
    sub.start()
    tracker = BlockTracker()
    a, b_, c, z = 0xA, 0xB, 0xC, 0x2
    pub = NatsPublisher("w0", nats_url, ns)
    try:
        pub.publish([store(a, a, None, SIZE, "g1"), store(b_, a, a, SIZE, "g1"), store(c, a, b_, SIZE, "g1")])
        pub.flush()
        pub.publish([remove(a, a, None, SIZE, "g1"), remove(c, a, b_, SIZE, "g1")])
        pub.flush()
        pub.publish([remove(b_, a, a, SIZE, "g1"), remove(z, z, None, SIZE, "g1")])
        pub.flush()
        feed(sub, tracker, 3)
        st = tracker.stats()
        assert (st.blocks, st.removes, st.unknown_removes) == (0, 3, 1) and len(tracker) == 0
        pub.publish([store(a, a, None, SIZE, "g1"), store(b_, a, a, SIZE, "g1")])
        pub.flush()
        feed(sub, tracker, 1)
        assert tracker.match([a, b_]) == 2 and tracker.match([a, b_, c]) == 2
    finally:
        pub.close()
        sub.close()


def test_self_parented_store_is_rejected_alone_over_zmq() -> None:
    pub_ep = f"tcp://127.0.0.1:{free_port()}"
    raw = zmq.Context.instance().socket(zmq.PUB)  # a foreign publisher that sends it
    raw.setsockopt(zmq.LINGER, 0)
    raw.bind(pub_ep)
    sub = ZmqSubscriber([(pub_ep, None)])
    sub.start()
    time.sleep(0.3)
    tracker = BlockTracker()
    try:
        batch = EventBatch(
            1, "ext", 5, 0, 0,
            [store(1, 1, None, SIZE, "g1"), store(2, 1, 2, SIZE, "g1"), store(3, 1, 1, SIZE, "g1"), remove(9, 9, None, SIZE, "g1")],
        )
        raw.send_multipart([b"", seq_to_bytes(0), encode_batch(batch)])
        got = feed(sub, tracker, 1)
        assert got[0].events[1].parent_hash == got[0].events[1].sequence_hash  # travelled intact
        st = tracker.stats()
        assert (st.self_parent, st.stores, st.unknown_removes, st.blocks) == (1, 2, 1, 2)
        assert 2 not in tracker and tracker.match([1, 3]) == 2  # never "clear everything"
    finally:
        sub.close()
        raw.close()
