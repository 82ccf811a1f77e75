"""Case: a slow subscriber behind a fast publisher (real ZMQ sockets).

Queue capacity 100, a consumer that takes 10 ms per batch, 10,000 batches published as fast
as possible: the delivery queue never holds more than its capacity, every batch is either
delivered or counted as dropped, a resync of the source is scheduled exactly once, and the
subscriber's memory stays bounded.
"""

from __future__ import annotations

import threading
import time
import tracemalloc

from event_plane import PublisherConfig, ZmqPublisher, ZmqSubscriber, store
from storage_backends.local_s3 import free_port

N_BATCHES = 10_000
CAPACITY = 100
EVENTS_PER_BATCH = 4


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_slow_consumer_bounded_queue_drops_counted_resync_scheduled() -> None:
    pub_ep, rep_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    resyncs: list[str] = []
    # a small replay buffer: the publisher's own memory is not what this test measures
    pub = ZmqPublisher("w0", pub_ep, rep_ep, config=PublisherConfig(max_events=EVENTS_PER_BATCH, replay_buffer=100))
    sub = ZmqSubscriber([(pub_ep, rep_ep)], queue_capacity=CAPACITY, on_resync=resyncs.append)
    sub.start()
    time.sleep(0.3)  # ZMQ slow joiner
    max_qsize = 0
    consumed: list[int] = []
    stop = threading.Event()

    def consumer() -> None:
        nonlocal max_qsize
        while not stop.is_set():
            max_qsize = max(max_qsize, sub._queue.qsize())  # noqa: SLF001 - the bound under test
            batch = sub.get(timeout=0.05)
            if batch is None:
                continue
            consumed.append(batch.seq)
            time.sleep(0.010)  # 10 ms of work per batch

    events = [store(1 + i, 1, i or None, 65536, "g1") for i in range(N_BATCHES * EVENTS_PER_BATCH)]
    worker = threading.Thread(target=consumer)
    rss0 = _rss_bytes()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    worker.start()
    try:
        for k in range(N_BATCHES):
            pub.publish(events[k * EVENTS_PER_BATCH : (k + 1) * EVENTS_PER_BATCH])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            st = sub.stats()
            if st.batches + st.dropped >= N_BATCHES:
                break
            time.sleep(0.02)
        time.sleep(0.3)  # the consumer keeps working on a full queue for a while
        _, peak = tracemalloc.get_traced_memory()
    finally:
        stop.set()
        worker.join()
        tracemalloc.stop()
        pub.close()
        sub.close()
    st = sub.stats()
    assert st.batches + st.dropped == N_BATCHES, st  # each batch delivered or counted
    assert st.gaps == 0 and st.unrecovered == 0  # the loss is the queue's, not the wire's
    # a 10 ms consumer cannot keep up: the subscriber dropped, so the publisher never waited for it
    assert st.dropped > N_BATCHES // 2, st
    assert max_qsize <= CAPACITY
    assert st.batches <= CAPACITY + len(consumed) + 1
    assert consumed == sorted(consumed) and len(set(consumed)) == len(consumed)  # in order, no repeats
    assert sub.resync_needed == frozenset({"w0"})
    assert resyncs == ["w0"] and st.resyncs == 1  # scheduled once, not once per drop
    sub.resync_done("w0")
    assert sub.resync_needed == frozenset()
    # Memory: holding all 10,000 decoded batches would take ~7 MB of Python objects; the
    # bounded queue keeps the traced peak (publisher and subscriber together) under 2 MiB.
    assert peak - base < 2 * 2**20, peak - base
    assert _rss_bytes() - rss0 < 64 * 2**20
