"""ZMQ transport end to end on real sockets: order, replay frames, gaps, restarts, late join."""

from __future__ import annotations

import time

import pytest
import zmq

from event_plane import (
    EventBatch,
    PublisherConfig,
    TransportError,
    ZmqPublisher,
    ZmqSubscriber,
    decode_batch,
    encode_batch,
    store,
)
from event_plane.frames import END_SEQ, seq_to_bytes
from storage_backends.local_s3 import free_port
from tests.polling import wait_until

ONE = PublisherConfig(max_events=1)


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def ev(i: int, loc: str = "g1") -> object:
    return store(1000 + i, 1000, (999 + i) if i else None, 65536, loc)


def started(sub: ZmqSubscriber, pub: ZmqPublisher | None = None) -> ZmqSubscriber:
    """Start ``sub`` and wait out ZMQ's slow-joiner window."""
    sub.start()
    time.sleep(0.3)
    return sub


def drain(sub: ZmqSubscriber, n: int, timeout: float = 5.0) -> list[EventBatch]:
    got = sub.get_many(n, timeout)
    assert len(got) == n, f"got {len(got)} of {n} batches; stats {sub.stats()}"
    return got


def test_pub_sub_exact_order_of_batches_and_events() -> None:
    pub_ep, rep_ep = endpoints()
    pub = ZmqPublisher("w0", pub_ep, rep_ep, config=PublisherConfig(max_events=3))
    sub = started(ZmqSubscriber([(pub_ep, rep_ep)]))
    try:
        evs = [ev(i) for i in range(30)]
        pub.publish(evs)
        got = drain(sub, 10)
        assert [b.seq for b in got] == list(range(10))
        assert [e for b in got for e in b.events] == evs
        st = sub.stats()
        assert (st.batches, st.events, st.gaps, st.duplicates, st.decode_errors) == (10, 30, 0, 0, 0)
    finally:
        pub.close()
        sub.close()


def test_replay_frames_from_seq_2(tmp_path: object) -> None:
    """Six batches with topic kv@podA@modelX; a replay from seq 2 yields seq 2..5 as exactly
    three frames each with the same topic, then the end marker."""
    pub_ep, rep_ep = endpoints()
    topic = "kv@podA@modelX"
    pub = ZmqPublisher("podA", pub_ep, rep_ep, topic, config=ONE)
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(rep_ep)
    try:
        payloads = {}
        for i in range(6):
            pub.publish([ev(i)])
        assert pub.buffered_seqs() == [0, 1, 2, 3, 4, 5]
        dealer.send_multipart([b"", seq_to_bytes(2)])
        messages = []
        while True:
            assert dealer.poll(3000), "replay answer timed out"
            frames = dealer.recv_multipart()
            assert frames[0] == b""  # ROUTER envelope delimiter
            messages.append(frames[1:])
            if frames[2] == END_SEQ:
                break
        assert all(len(m) == 3 for m in messages)
        assert [m[0] for m in messages] == [topic.encode()] * 5
        assert [m[1] for m in messages] == [seq_to_bytes(s) for s in (2, 3, 4, 5)] + [END_SEQ]
        assert messages[-1][2] == b""
        for m in messages[:-1]:
            batch = decode_batch(m[2])
            payloads[batch.seq] = batch
            assert batch.source == "podA" and batch.seq == int.from_bytes(m[1], "big")
        assert [payloads[s].events[0].sequence_hash for s in (2, 3, 4, 5)] == [1002, 1003, 1004, 1005]
        # vLLM-style client that omits the delimiter gets exactly 3 frames per message
        dealer.send_multipart([seq_to_bytes(4)])
        seen = []
        while True:
            assert dealer.poll(3000)
            frames = dealer.recv_multipart()
            assert len(frames) == 3 and frames[0] == topic.encode()
            seen.append(frames[1])
            if frames[1] == END_SEQ:
                break
        assert seen == [seq_to_bytes(4), seq_to_bytes(5), END_SEQ]
        # a malformed request gets only the end marker; the server keeps serving
        dealer.send_multipart([b"", b"bad"])
        assert dealer.poll(3000)
        assert dealer.recv_multipart() == [b"", topic.encode(), END_SEQ, b""]
    finally:
        dealer.close()
        pub.close()


class LossyZmqPublisher(ZmqPublisher):
    """Fault injection: batches whose seq is in ``skip_live`` go to the replay buffer only
    (as if the network lost them between PUB and SUB)."""

    skip_live: set[int] = set()

    def _send(self, batch: EventBatch, payload: bytes) -> None:
        if batch.seq in self.skip_live:
            with self._buffer_lock:
                self._buffer.append((batch.seq, payload))
            return
        super()._send(batch, payload)


def test_gap_is_replayed_in_order_and_restart_handled() -> None:
    """seq 0..5 arrive, 6..8 are lost, 9 arrives: 6..8 are fetched by replay and delivered
    in order before 9. The publisher then restarts (new epoch, seq 0 again) on the same
    endpoints and its batches are all delivered, none dropped as stale."""
    pub_ep, rep_ep = endpoints()
    gaps: list[tuple[str, int, int, int]] = []
    pub = LossyZmqPublisher("w0", pub_ep, rep_ep, epoch=111, config=ONE)
    pub.skip_live = {6, 7, 8}
    sub = started(ZmqSubscriber([(pub_ep, rep_ep)], on_gap=lambda *g: gaps.append(g)))
    try:
        for i in range(10):
            pub.publish([ev(i)])
        got = drain(sub, 10)
        assert [(b.epoch, b.seq) for b in got] == [(111, s) for s in range(10)]
        assert [b.events[0].sequence_hash for b in got] == [1000 + i for i in range(10)]
        assert gaps == [("w0", 111, 6, 8)]
        st = sub.stats()
        assert (st.gaps, st.replayed, st.unrecovered) == (1, 3, 0)
        pub.close()

        pub = ZmqPublisher("w0", pub_ep, rep_ep, epoch=222, config=ONE)
        time.sleep(0.3)  # SUB reconnects (ZMQ reconnect interval 100 ms)
        for i in range(4):
            pub.publish([ev(i, "g2")])
        got = drain(sub, 4)
        assert [(b.epoch, b.seq) for b in got] == [(222, s) for s in range(4)]
        assert all(b.events[0].storage_location == "g2" for b in got)
        st = sub.stats()
        assert st.restarts == 1 and st.unrecovered == 0 and st.duplicates == 0
    finally:
        pub.close()
        sub.close()


def test_late_subscriber_recovers_first_batches_by_replay() -> None:
    pub_ep, rep_ep = endpoints()
    pub = ZmqPublisher("w0", pub_ep, rep_ep, config=ONE)
    try:
        for i in range(5):
            pub.publish([ev(i)])  # nobody listens yet
        sub = started(ZmqSubscriber([(pub_ep, rep_ep)]))
        try:
            pub.publish([ev(5)])
            got = drain(sub, 6)
            assert [b.seq for b in got] == [0, 1, 2, 3, 4, 5]
            st = sub.stats()
            # 0..4 come from the start-up catch-up (replay buffer), 5 live: no gap at all
            assert (st.gaps, st.replayed, st.unrecovered, st.duplicates) == (0, 5, 0, 0)
        finally:
            sub.close()
    finally:
        pub.close()


def test_subscriber_joining_after_the_last_batch_gets_the_buffered_history() -> None:
    """No later batch will ever reveal the gap, so only the start-up catch-up can help."""
    pub_ep, rep_ep = endpoints()
    pub = ZmqPublisher("w0", pub_ep, rep_ep, config=ONE)
    try:
        for i in range(3):
            pub.publish([ev(i)])
        sub = started(ZmqSubscriber([(pub_ep, rep_ep)]))
        try:
            got = drain(sub, 3)
            assert [b.seq for b in got] == [0, 1, 2]
            assert [b.events[0].sequence_hash for b in got] == [ev(i).sequence_hash for i in range(3)]
            assert sub.get(timeout=0.3) is None  # nothing doubled
        finally:
            sub.close()
    finally:
        pub.close()


def test_batches_evicted_from_replay_buffer_are_unrecovered() -> None:
    pub_ep, rep_ep = endpoints()
    pub = ZmqPublisher("w0", pub_ep, rep_ep, config=PublisherConfig(max_events=1, replay_buffer=2))
    try:
        for i in range(5):
            pub.publish([ev(i)])
        sub = started(ZmqSubscriber([(pub_ep, rep_ep)]))
        try:
            pub.publish([ev(5)])
            got = drain(sub, 3)
            # catch-up found seq 3, 4 buffered (0..2 evicted: one gap, 3 unrecovered); 5 live
            assert [b.seq for b in got] == [3, 4, 5]
            st = sub.stats()
            assert (st.gaps, st.replayed, st.unrecovered) == (1, 2, 3)
        finally:
            sub.close()
    finally:
        pub.close()


def test_no_replay_endpoint_counts_loss_and_garbage_is_skipped() -> None:
    pub_ep = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    raw.bind(pub_ep)
    sub = started(ZmqSubscriber([(pub_ep, None)]))
    good = EventBatch(1, "ext", 9, 0, 0, [ev(0)])
    later = EventBatch(1, "ext", 9, 3, 0, [ev(3)])
    try:
        raw.send_multipart([b"", seq_to_bytes(0), encode_batch(good)])
        raw.send_multipart([b"", seq_to_bytes(1), b"\x93garbage"])
        raw.send_multipart([b"", b"short", encode_batch(good)])
        raw.send_multipart([b"only-one-frame"])
        raw.send_multipart([b"", seq_to_bytes(3), encode_batch(later)])
        got = drain(sub, 2)
        assert got == [good, later]
        st = sub.stats()
        assert (st.decode_errors, st.gaps, st.unrecovered) == (3, 1, 2)
    finally:
        sub.close()
        raw.close()


def test_full_delivery_queue_counts_drops() -> None:
    pub_ep, rep_ep = endpoints()
    pub = ZmqPublisher("w0", pub_ep, rep_ep, config=ONE)
    # one source (and one endpoint) holds at most a quarter of the queue: 5 of 20
    sub = started(ZmqSubscriber([(pub_ep, rep_ep)], queue_capacity=20))
    try:
        for i in range(20):
            pub.publish([ev(i)])
        wait_until(lambda: sub.stats().dropped + sub.stats().batches >= 20, what="20 batches received or dropped")
        st = sub.stats()
        assert (st.batches, st.dropped) == (5, 15)
        assert [b.seq for b in sub.get_many(10, 0.5)] == [0, 1, 2, 3, 4]
    finally:
        pub.close()
        sub.close()


def test_two_publishers_one_subscriber_per_source_order() -> None:
    a_pub, a_rep = endpoints()
    b_pub, b_rep = endpoints()
    pa = ZmqPublisher("a", a_pub, a_rep, config=ONE)
    pb = ZmqPublisher("b", b_pub, b_rep, config=ONE)
    sub = started(ZmqSubscriber([(a_pub, a_rep), (b_pub, b_rep)]))
    try:
        for i in range(20):
            pa.publish([ev(i)])
            pb.publish([ev(i, "g2")])
        got = drain(sub, 40)
        assert [x.seq for x in got if x.source == "a"] == list(range(20))
        assert [x.seq for x in got if x.source == "b"] == list(range(20))
    finally:
        pa.close()
        pb.close()
        sub.close()


def test_port_in_use_is_a_clear_error() -> None:
    pub_ep, rep_ep = endpoints()
    first = ZmqPublisher("w0", pub_ep, rep_ep)
    try:
        with pytest.raises(TransportError, match="cannot bind PUB"):
            ZmqPublisher("w1", pub_ep, None, bind_retry_s=0.2)
        other = f"tcp://127.0.0.1:{free_port()}"
        with pytest.raises(TransportError, match="cannot bind ROUTER"):
            ZmqPublisher("w1", other, rep_ep, bind_retry_s=0.2)
        again = ZmqPublisher("w1", other, None, bind_retry_s=0.2)  # the failed one freed its PUB
        again.close()
    finally:
        first.close()


def test_a_lying_or_implausible_seq_cannot_silence_its_source() -> None:
    """A decodable batch whose seq frame disagrees with its payload, or whose seq jumps
    absurdly far, is counted and dropped; the source's real later batches still arrive."""
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = started(ZmqSubscriber([(f"tcp://127.0.0.1:{port}", None)]))

    def frames(frame_seq: int, batch_seq: int) -> list[bytes]:
        return [b"", seq_to_bytes(frame_seq), encode_batch(EventBatch(1, "w", 7, batch_seq, 0, [ev(batch_seq % 100)]))]

    try:
        for f in (frames(0, 0), frames(1, 1), frames(2, 2**64 - 1), frames(2**64 - 2, 2**64 - 2), frames(2, 2), frames(3, 3)):
            pub.send_multipart(f)
        got = drain(sub, 4)
        assert [b.seq for b in got] == [0, 1, 2, 3]
        st = sub.stats()
        assert (st.decode_errors, st.gaps, st.unrecovered) == (2, 0, 0)
    finally:
        sub.close()
        pub.close(linger=0)


def test_implausible_seq_from_a_new_source_or_epoch_is_refused_and_counted() -> None:
    """The implausible-seq rule holds for a source never seen (its seqs start at 0) and for a
    new epoch of a known one: a first batch with seq 2**64-1 (or just past MAX_GAP) is
    dropped and counted, adds nothing to ``unrecovered``, and does not retire the epoch it
    claims to replace; honest batches keep flowing."""
    from event_plane.ordering import MAX_GAP

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = started(ZmqSubscriber([(f"tcp://127.0.0.1:{port}", None)]))

    def frames(source: str, epoch: int, seq: int) -> list[bytes]:
        return [b"", seq_to_bytes(seq), encode_batch(EventBatch(1, source, epoch, seq, 0, [ev(seq % 100)]))]

    try:
        for f in (frames("evil", 1, 2**64 - 1), frames("w", 7, 0), frames("evil2", 1, MAX_GAP + 1),
                  frames("w", 8, 2**64 - 1), frames("w", 7, 1), frames("ok", 1, MAX_GAP)):
            pub.send_multipart(f)
        got = drain(sub, 3)
        assert [(b.source, b.seq) for b in got] == [("w", 0), ("w", 1), ("ok", MAX_GAP)]
        st = sub.stats()
        assert (st.decode_errors, st.restarts, st.duplicates) == (3, 0, 0)
        assert (st.gaps, st.unrecovered) == (1, MAX_GAP)  # the plausible late joiner only
    finally:
        sub.close()
        pub.close(linger=0)


@pytest.mark.parametrize("path", ["gap-replay", "catch-up", "url"])
def test_late_joiner_recovers_thousands_of_buffered_batches_with_a_short_inactivity_timeout(path: str) -> None:
    """6,000 buffered batches take longer to answer than the 0.2 s timeout, but the timeout
    is one of inactivity: every reply moves it forward, so the late joiner gets them all
    (through a gap replay, with the timeout from the URL, or through the start-up catch-up)."""
    from event_plane import subscribe

    n = 6_000
    port, replay = free_port(), free_port()
    pub = ZmqPublisher("w0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}",
                       config=PublisherConfig(max_events=8))
    try:
        for i in range(n):
            pub.publish([ev(8 * i + k) for k in range(8)])
        assert len(pub.buffered_seqs()) == n
        eps = [(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")]
        if path == "url":
            sub = subscribe(f"zmq://127.0.0.1:{port}?replay={replay}&replay_timeout=0.2", catch_up=False)
            assert sub._replay_timeout_s == 0.2
        elif path == "gap-replay":
            sub = ZmqSubscriber(eps, catch_up=False, replay_timeout_s=0.2)
        else:
            sub = ZmqSubscriber(eps, catch_up_timeout_s=0.2, replay_timeout_s=0.2)
        started(sub)
        try:
            pub.publish([ev(8 * n + k) for k in range(8)])  # live batch n: reveals the gap if any
            got = drain(sub, n + 1, timeout=60)
            assert [b.seq for b in got] == list(range(n + 1))
            st = sub.stats()
            assert (st.unrecovered, st.replayed, st.resyncs) == (0, n, 0)
        finally:
            sub.close()
    finally:
        pub.close()


def test_publisher_that_binds_late_and_goes_quiet_is_still_caught_up() -> None:
    """The subscriber connects first; the publisher binds, sends one batch while the
    subscription is still travelling, and sends nothing more. No later batch reveals the
    loss, so the idle probe of the replay socket must."""
    pub_ep, rep_ep = endpoints()
    sub = ZmqSubscriber([(pub_ep, rep_ep)], idle_probe_s=0.5)
    sub.start()
    try:
        pub = ZmqPublisher("late", pub_ep, rep_ep, config=ONE)
        try:
            pub.publish([ev(0)])
            got = drain(sub, 1, timeout=5.0)
            assert [(b.source, b.seq) for b in got] == [("late", 0)]
            assert sub.get(timeout=1.2) is None  # later probes deliver nothing twice
            assert sub.stats().duplicates == 0
        finally:
            pub.close()
    finally:
        sub.close()
