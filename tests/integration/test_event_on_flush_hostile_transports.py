"""Hostile review of on_flush delivery (55b0434) over real transports: whatever threads and
the timer send, a ZMQ or NATS subscriber and ``on_flush`` see the same seqs, in order, with
the same events, also when ``on_flush`` closes the publisher from the timer thread."""

from __future__ import annotations

import secrets
import threading
import time

from event_plane import (
    EventBatch,
    EventPublisher,
    PublisherConfig,
    Subscriber,
    ZmqPublisher,
    ZmqSubscriber,
    make_publisher,
    store,
    subscribe,
)
from storage_backends.local_s3 import free_port

CFG = PublisherConfig(max_events=5, max_delay_s=0.001, adaptive_delay=False)


def ev(h: int) -> list:
    return [store(h, h, None, 1, "g1")]


def publish_from_threads(pub: EventPublisher, threads: int = 4, calls: int = 300) -> None:
    """``threads`` threads publish ``calls`` one-event batches each, pausing now and then
    so the timer sends some batches too."""

    def worker(k: int) -> None:
        for i in range(calls):
            pub.publish(ev(k * 10**6 + i + 1))
            if i % 50 == 0:
                time.sleep(0.002)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def assert_same_as_on_flush(sub: Subscriber, flushed: list[tuple[int, list]], n: int, events: int) -> None:
    got = sub.get_many(n, 10)
    assert [s for s, _ in flushed] == list(range(n))
    assert [(b.seq, b.events) for b in got] == flushed
    assert sum(len(e) for _, e in flushed) == events


def threads_then_compare(pub: EventPublisher, sub: Subscriber, flushed: list[tuple[int, list]]) -> None:
    """4 threads x 300 events, flush, compare what ``sub`` got with ``flushed``; closes both."""
    try:
        publish_from_threads(pub)
        pub.flush()
        assert_same_as_on_flush(sub, flushed, pub.next_seq, 1200)
    finally:
        pub.close()
        sub.close()


def test_zmq_subscriber_sees_the_seqs_on_flush_ran_in_the_same_order() -> None:
    pub_ep, rep_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    flushed: list[tuple[int, list]] = []
    pub = ZmqPublisher("w0", pub_ep, rep_ep, on_flush=lambda b, p: flushed.append((b.seq, b.events)), config=CFG)
    sub = ZmqSubscriber([(pub_ep, rep_ep)])
    sub.start()
    time.sleep(0.3)  # ZMQ slow joiner
    threads_then_compare(pub, sub, flushed)


def test_nats_subscriber_sees_the_seqs_on_flush_ran_in_the_same_order(nats_url: str) -> None:
    ns = "t" + secrets.token_hex(4)
    flushed: list[tuple[int, list]] = []
    sub = subscribe(f"{nats_url}?namespace={ns}")
    sub.start()
    pub = make_publisher(f"{nats_url}?namespace={ns}", "w0", config=CFG,
                         on_flush=lambda b, p: flushed.append((b.seq, b.events)))
    threads_then_compare(pub, sub, flushed)


def test_nats_close_from_on_flush_on_the_timer_thread_sends_and_runs_everything(nats_url: str) -> None:
    """on_flush closes the publisher (the NATS connection drains) from the timer thread while
    other threads publish: accepted events reach the subscriber and on_flush once each."""
    ns = "t" + secrets.token_hex(4)
    flushed: list[tuple[int, list]] = []
    closed = threading.Event()

    def on_flush(b: EventBatch, p: bytes) -> None:
        flushed.append((b.seq, b.events))
        if b.seq >= 20 and threading.current_thread() is pub._timer and not closed.is_set():
            pub.close()
            closed.set()

    sub = subscribe(f"{nats_url}?namespace={ns}")
    sub.start()
    pub = make_publisher(f"{nats_url}?namespace={ns}", "w0", config=CFG, on_flush=on_flush)
    accepted: list[int] = []

    def worker(k: int) -> None:
        for i in range(10**6):
            h = k * 10**7 + i + 1
            try:
                pub.publish(ev(h))
            except Exception as exc:  # noqa: BLE001 - PublisherClosedError ends the worker
                assert type(exc).__name__ == "PublisherClosedError", exc
                return
            accepted.append(h)
            time.sleep(0.0005)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    try:
        for t in ts:
            t.start()
        assert closed.wait(20)
        for t in ts:
            t.join(10)
        n = pub.next_seq
        assert_same_as_on_flush(sub, flushed, n, len(accepted))
        assert sorted(e.sequence_hash for _, evs in flushed for e in evs) == sorted(accepted)
    finally:
        pub.close()
        sub.close()
