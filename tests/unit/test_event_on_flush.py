"""``on_flush`` runs outside the publisher's lock, one thread at a time, in seq order
(event_plane/publisher.py ``_deliver``): another thread can publish while it runs, a
batch sent meanwhile is run next by the running thread, ``flush``/``close`` return after
every sent batch was run, and its errors reach the caller that ran it."""

from __future__ import annotations

import threading
import time

import pytest

from event_plane import EventBatch, NullPublisher, PublisherClosedError, PublisherConfig, store
from tests.polling import wait_until


def ev(h: int) -> list:
    return [store(h, h, None, 1, "g1")]


def test_on_flush_runs_outside_the_lock_so_another_thread_can_publish_meanwhile() -> None:
    """The old lock order (on_flush under the publisher's lock) made this wait forever:
    the callback waits for a thread that needs the publisher's lock."""
    published = threading.Event()
    seqs: list[int] = []

    def other() -> None:
        pub.publish(ev(99))  # takes the publisher's lock while on_flush of seq 0 runs
        published.set()

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        seqs.append(batch.seq)
        if batch.seq == 0:
            t = threading.Thread(target=other)
            t.start()
            assert published.wait(5), "publish from another thread blocked while on_flush ran"
            t.join()

    pub = NullPublisher("w0", config=PublisherConfig(max_events=1, max_delay_s=10), on_flush=on_flush)
    pub.publish(ev(1))  # fills a batch: sent, then on_flush on this thread
    pub.close()
    assert seqs == [0, 1]  # seq 1 (the other thread's) ran after seq 0, by this thread's loop


def test_a_batch_sent_while_another_thread_runs_on_flush_is_left_and_run_later_in_order() -> None:
    """The thread running on_flush runs its own batch and returns; the batches left to it
    meanwhile run next, in seq order, on another thread."""
    gate, inside = threading.Event(), threading.Event()
    runs: list[tuple[int, str]] = []

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        runs.append((batch.seq, threading.current_thread().name))
        if batch.seq == 0:
            inside.set()
            assert gate.wait(30)

    pub = NullPublisher("w0", config=PublisherConfig(max_events=1, max_delay_s=10), on_flush=on_flush)
    t = threading.Thread(target=lambda: pub.publish(ev(1)), name="first")
    t.start()
    assert inside.wait(5)
    for h in (2, 3):
        pub.publish(ev(h))  # sent at once; "first" is running on_flush: left to it
    assert t.is_alive() and not gate.is_set()  # did not wait for the running callback (held on the gate)
    assert [s for s, _ in runs] == [0]
    gate.set()
    t.join(5)
    assert not t.is_alive()
    pub.flush()  # returns once seqs 1 and 2 ran
    assert [s for s, _ in runs] == [0, 1, 2]
    # "first" ran only its own batch; the others ran on the delivery thread, or on this
    # one when its flush() found no thread running on_flush (either is right)
    assert runs[0][1] == "first" and all(name != "first" for _, name in runs[1:])
    pub.close()


def test_flush_waits_until_every_sent_batch_ran() -> None:
    gate, inside = threading.Event(), threading.Event()
    ran: list[int] = []

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        if batch.seq == 0:
            inside.set()
            assert gate.wait(5)
        ran.append(batch.seq)

    pub = NullPublisher("w0", config=PublisherConfig(max_events=1, max_delay_s=10), on_flush=on_flush)
    t = threading.Thread(target=lambda: pub.publish(ev(1)))
    t.start()
    assert inside.wait(5)
    done = threading.Event()

    def flusher() -> None:
        pub.publish(ev(2))
        pub.flush()
        done.set()

    f = threading.Thread(target=flusher)
    f.start()
    assert not done.wait(0.3)  # seq 0 and 1 have not run: flush still waits
    gate.set()
    assert done.wait(5)
    assert ran == [0, 1]
    t.join(5)
    f.join(5)
    pub.close()


def test_timed_flushes_from_many_threads_run_on_flush_once_each_in_seq_order() -> None:
    seqs: list[int] = []
    lock = threading.Lock()
    active = [0]

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        with lock:
            active[0] += 1
            assert active[0] == 1, "two threads ran on_flush at once"
        seqs.append(batch.seq)
        time.sleep(0.0002)
        with lock:
            active[0] -= 1

    pub = NullPublisher("w0", config=PublisherConfig(max_events=3, max_delay_s=0.001, min_delay_s=0.0005,
                                                     adaptive_delay=False), on_flush=on_flush)

    def worker(k: int) -> None:
        for i in range(300):
            pub.publish(ev(k * 10_000 + i + 1))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pub.close()
    assert seqs == list(range(pub.next_seq)) and pub.next_seq >= 400


def test_an_error_in_on_flush_reaches_the_caller_after_the_queued_batches_ran() -> None:
    ran: list[int] = []

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        ran.append(batch.seq)
        if batch.seq == 0:
            raise RuntimeError("journal full")

    pub = NullPublisher("w0", config=PublisherConfig(max_events=2, max_delay_s=10), on_flush=on_flush)
    with pytest.raises(RuntimeError, match="journal full"):
        pub.publish(ev(1) + ev(2) + ev(3) + ev(4))  # two batches sent by this call
    assert ran == [0, 1]
    pub.publish(ev(5))
    pub.close()  # the publisher still works: seq 2 runs
    assert ran == [0, 1, 2]


def test_flush_and_close_from_inside_on_flush_do_not_wait_for_themselves() -> None:
    ran: list[int] = []

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        ran.append(batch.seq)
        if batch.seq == 0:
            pub.publish(ev(7))
            pub.flush()  # sends seq 1 and returns at once (it cannot wait for itself)
        if batch.seq == 1:
            pub.close()  # on the delivery thread: returns, and that thread then ends

    pub = NullPublisher("w0", config=PublisherConfig(max_events=100, max_delay_s=10), on_flush=on_flush)
    pub.publish(ev(1))
    t = threading.Thread(target=pub.flush)
    t.start()
    t.join(5)
    assert not t.is_alive()  # the outer flush() returned once seq 0 ran
    wait_until(lambda: ran == [0, 1], what="on_flush ran for seqs 0 and 1")
    assert ran == [0, 1]  # seq 1, sent from inside on_flush, ran next (delivery thread)
    with pytest.raises(PublisherClosedError):
        pub.publish(ev(8))
    assert pub._delivery_thread is not None  # type: ignore[attr-defined]
    pub._delivery_thread.join(5)  # type: ignore[attr-defined]
    assert not pub._delivery_thread.is_alive()  # type: ignore[attr-defined]


def test_close_sends_and_runs_what_on_flush_publishes_while_close_waits() -> None:
    """CI found it (stop 10): close() refused the events an on_flush it was waiting for
    published re-entrantly (PublisherClosedError inside on_flush), so events a callback
    produced at shutdown were lost.  Now close() sends them and runs on_flush for them,
    round after round (here a chain of three), before it returns."""
    delivered: list[int] = []

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        for e in batch.events:
            delivered.append(e.sequence_hash)
            if e.sequence_hash < 4:
                pub.publish(ev(e.sequence_hash + 1))  # 1 -> 2 -> 3 -> 4, each a new batch at close

    pub = NullPublisher("w0", config=PublisherConfig(max_events=100, max_delay_s=10), on_flush=on_flush)
    pub.publish(ev(1))  # pending: close() sends it
    pub.close()
    assert delivered == [1, 2, 3, 4]
    assert pub.next_seq == 4 and pub.stats().events == 4
    with pytest.raises(PublisherClosedError):
        pub.publish(ev(5))  # after close() returned: refused


def test_close_refuses_other_threads_while_it_drains() -> None:
    """Only the on_flush calls close() waits for may still publish: another thread that
    publishes while close() runs the last batches gets PublisherClosedError."""
    gate, inside = threading.Event(), threading.Event()
    other_error: list[BaseException] = []

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        inside.set()
        gate.wait(5)

    def other() -> None:
        try:
            pub.publish(ev(2))
        except BaseException as exc:  # noqa: BLE001 - the assertion reads it
            other_error.append(exc)

    pub = NullPublisher("w0", config=PublisherConfig(max_events=100, max_delay_s=10), on_flush=on_flush)
    pub.publish(ev(1))
    c = threading.Thread(target=pub.close)
    c.start()
    assert inside.wait(5)  # close() runs on_flush of seq 0 on its thread and blocks in it
    t = threading.Thread(target=other)
    t.start()
    t.join(5)
    gate.set()
    c.join(5)
    assert not c.is_alive()
    assert len(other_error) == 1 and isinstance(other_error[0], PublisherClosedError)
    assert pub.next_seq == 1


def test_close_ends_even_when_on_flush_publishes_for_every_batch() -> None:
    """A callback that publishes for every batch it sees would keep close() draining for
    ever: after _MAX_CLOSE_ROUNDS rounds its publish is refused, close() raises that error
    and the publisher is closed."""
    from event_plane.publisher import _MAX_CLOSE_ROUNDS

    runs = [0]

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        runs[0] += 1
        pub.publish(ev(runs[0] + 1))

    pub = NullPublisher("w0", config=PublisherConfig(max_events=100, max_delay_s=10), on_flush=on_flush)
    pub.publish(ev(1))
    with pytest.raises(PublisherClosedError):
        pub.close()
    assert runs[0] == _MAX_CLOSE_ROUNDS + 1  # the first batch, then one per round
    assert pub.next_seq == _MAX_CLOSE_ROUNDS + 1
    with pytest.raises(PublisherClosedError):
        pub.publish(ev(10**6))
