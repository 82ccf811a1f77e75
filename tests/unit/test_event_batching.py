"""Batching publisher: count / bytes / time limits, seq numbering, bad input, threads."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest

from event_plane import (
    ConfigError,
    EventBatch,
    EventType,
    InvalidEventError,
    KVEvent,
    NullPublisher,
    PublisherClosedError,
    PublisherConfig,
    decode_batch,
    encode_batch,
    store,
)
from event_plane.codec import encode_event
from tests import polling


class Journal:
    """Collects what on_flush reports, checking payload == encode(batch)."""

    def __init__(self) -> None:
        self.batches: list[EventBatch] = []
        self.lock = threading.Lock()

    def __call__(self, batch: EventBatch, payload: bytes) -> None:
        assert decode_batch(payload) == batch
        assert encode_batch(batch) == payload
        with self.lock:
            self.batches.append(batch)


def chain(n: int, start: int = 1, loc: str = "g1") -> list:
    return [store(start + i, start, (start + i - 1) if i else None, 4096, loc) for i in range(n)]


def test_flush_on_count_limit_keeps_order_and_seq() -> None:
    j = Journal()
    pub = NullPublisher("w0", epoch=42, config=PublisherConfig(max_events=4), on_flush=j)
    evs = chain(10)
    pub.publish(evs)
    assert [len(b.events) for b in j.batches] == [4, 4]
    assert [b.seq for b in j.batches] == [0, 1]
    pub.close()
    assert [len(b.events) for b in j.batches] == [4, 4, 2]
    assert [b.seq for b in j.batches] == [0, 1, 2]
    assert [ev for b in j.batches for ev in b.events] == evs
    assert {(b.source, b.epoch, b.version) for b in j.batches} == {("w0", 42, 1)}
    st = pub.stats()
    assert (st.events, st.batches, st.dropped) == (10, 3, 0)
    assert st.event_bytes == sum(len(encode_event(e)) for e in evs)
    assert st.payload_bytes == sum(len(encode_batch(b)) for b in j.batches)


def test_flush_on_bytes_limit() -> None:
    j = Journal()
    size = len(encode_event(chain(2)[1]))
    pub = NullPublisher("w0", config=PublisherConfig(max_bytes=3 * size), on_flush=j)
    pub.publish(chain(2) + chain(5, start=10)[1:])  # 6 events of the same size
    assert [len(b.events) for b in j.batches] == [3]
    pub.flush()
    assert [len(b.events) for b in j.batches] == [3, 3]
    # an event larger than max_bytes travels alone
    big = store(99, 99, None, 1, "g1", {"blob": "x" * (4 * size)})
    pub.publish([chain(1, start=50)[0], big, chain(1, start=60)[0]])
    pub.close()
    assert [len(b.events) for b in j.batches] == [3, 3, 1, 1, 1]
    assert j.batches[3].events == [big]


def test_time_limit_flushes_without_help() -> None:
    j = Journal()
    pub = NullPublisher("w0", config=PublisherConfig(max_delay_s=0.15), on_flush=j)
    t0 = time.monotonic()
    pub.publish(chain(3))
    assert j.batches == []
    while not j.batches and time.monotonic() - t0 < 3:
        time.sleep(0.01)
    waited = time.monotonic() - t0
    assert [len(b.events) for b in j.batches] == [3]
    # max_delay_s is a deadline the product promises: flushed after it (not before), and
    # within 1 s, over 6x the 0.15 s promised (measured 0.15-0.16 s here)
    assert 0.14 <= waited < 1.0
    # the timer restarts for the next batch
    pub.publish(chain(1, start=100))
    polling.wait_until(lambda: len(j.batches) == 2, 30, "the second batch flushed by the timer")
    assert [b.seq for b in j.batches] == [0, 1]
    pub.close()
    assert len(j.batches) == 2  # nothing pending: close sends no empty batch


def test_empty_batches_are_never_sent() -> None:
    j = Journal()
    pub = NullPublisher("w0", on_flush=j)
    pub.flush()
    pub.publish([])
    pub.flush()
    pub.close()
    pub.close()  # idempotent
    assert j.batches == [] and pub.stats().batches == 0


def test_bad_event_rejects_whole_call_and_keeps_accepted_ones() -> None:
    j = Journal()
    pub = NullPublisher("w0", on_flush=j)
    pub.publish(chain(2))
    with pytest.raises(InvalidEventError, match="sequence_hash"):
        pub.publish([store(7, 7, None, 1, "g1"), store(-1, 7, 7, 1, "g1")])
    pub.close()
    assert [ev.sequence_hash for b in j.batches for ev in b.events] == [1, 2]
    with pytest.raises(PublisherClosedError):
        pub.publish(chain(1))


@pytest.mark.parametrize(
    "kw",
    [
        {"max_events": 0},
        {"max_bytes": -1},
        {"max_delay_s": 0},
        {"replay_buffer": 0},
        {"queue_capacity": 1.5},
        {"overflow": "wait"},
    ],
)
def test_config_rejects_bad_limits(kw: dict) -> None:
    with pytest.raises(ConfigError):
        PublisherConfig(**kw)


def test_bad_source_and_epoch_rejected() -> None:
    with pytest.raises(InvalidEventError):
        NullPublisher("")
    with pytest.raises(InvalidEventError):
        NullPublisher("w", epoch=2**64)
    a, b = NullPublisher("w"), NullPublisher("w")
    assert a.epoch != b.epoch and 0 <= a.epoch < 2**64


def test_concurrent_publishers_threads_lose_nothing_and_seq_is_dense() -> None:
    j = Journal()
    pub = NullPublisher("w0", config=PublisherConfig(max_events=7, max_delay_s=0.01), on_flush=j)
    per_thread = 500

    def worker(k: int) -> None:
        for i in range(per_thread):
            pub.publish([store(k * 10_000 + i + 1, k, None, 1, "g1")])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pub.close()
    assert [b.seq for b in j.batches] == list(range(len(j.batches)))
    hashes = [ev.sequence_hash for b in j.batches for ev in b.events]
    assert sorted(hashes) == sorted(k * 10_000 + i + 1 for k in range(4) for i in range(per_thread))
    for k in range(4):  # each thread's events keep their order
        mine = [h for h in hashes if h // 10_000 == k]
        assert mine == sorted(mine)


def test_on_flush_may_publish_again() -> None:
    seen: list[int] = []
    pub: NullPublisher

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        seen.append(batch.seq)
        if batch.seq == 0:
            pub.publish([store(500, 500, None, 1, "g2")])

    pub = NullPublisher("w0", on_flush=on_flush)
    pub.publish(chain(1))
    pub.flush()
    pub.close()
    assert seen == [0, 1]


# ---------------------------------------------------------------- publish_valid (trusted producers)


@pytest.mark.parametrize(
    ("cfg", "calls"),
    [
        (PublisherConfig(), [5, 20, 1, 3]),  # everything fits one batch
        (PublisherConfig(max_events=4), [3, 3, 10, 1, 4]),  # count limit inside and across calls
        (PublisherConfig(max_bytes=5 * len(encode_event(store(1, 1, None, 4096, "g1")))), [2, 9, 1, 17]),  # bytes
        (PublisherConfig(max_events=20), [16, 4, 40, 3]),  # a call exactly filling, one of 40 (array16 header)
    ],
)
def test_publish_valid_sends_the_same_batches_as_publish(cfg: PublisherConfig, calls: list[int]) -> None:
    """Same input, same limits: identical batches, payloads and byte counters."""
    bound = len(encode_event(KVEvent(EventType.REMOVE, 2**64 - 1, 2**64 - 1, 2**64 - 1, 4096, "g1")))
    runs = []
    # the checked path; the trusted one encoding at once; queuing by a true bound; queuing
    # by a bound far too small (re-batched by real sizes when encoded)
    for method, max_event_bytes in (("publish", None), ("publish_valid", None), ("publish_valid", bound), ("publish_valid", 1)):
        got: list[tuple[EventBatch, bytes]] = []
        pub = NullPublisher("w0", epoch=9, config=cfg, on_flush=lambda b, p, got=got: got.append((b, p)))
        start = 1
        for n in calls:
            evs = chain(n, start)
            evs[-1] = KVEvent(EventType.REMOVE, *list(msgspec.structs.astuple(evs[-1]))[1:])  # mixed types
            if method == "publish":
                pub.publish(evs)
            else:
                pub.publish_valid(evs, max_event_bytes)
            start += n
        pub.close()
        st = pub.stats()
        for b, p in got:
            assert decode_batch(p) == b and encode_batch(b) == p
            assert st.batches == 0 or sum(len(encode_event(e)) for e in b.events) <= cfg.max_bytes or len(b.events) == 1
        runs.append(([(b.seq, b.events, p) for b, p in got], st.events, st.batches, st.event_bytes, st.dropped))
    (a, *ra) = runs[0]
    for b, *rb in runs[1:]:
        assert [(s, e) for s, e, _ in a] == [(s, e) for s, e, _ in b]
        assert ra == rb
        # payloads differ only in the flush timestamp: compare them with ts_ns taken out
        for (_, _ea, pa), (_, _eb, pb) in zip(a, b):
            da, db = decode_batch(pa), decode_batch(pb)
            assert encode_batch(msgspec.structs.replace(da, ts_ns=0)) == encode_batch(msgspec.structs.replace(db, ts_ns=0))


def test_publish_valid_accepts_tuples_and_empty_calls() -> None:
    j = Journal()
    pub = NullPublisher("w0", on_flush=j)
    pub.publish_valid([])
    pub.publish_valid(tuple(chain(3)))
    pub.close()
    assert [ev.sequence_hash for b in j.batches for ev in b.events] == [1, 2, 3]


def test_publish_valid_rejects_unencodable_events_and_keeps_accepted_ones() -> None:
    """An event msgpack cannot encode (a hash over 64 bits) goes through publish's checks:
    same error, nothing of that call accepted; the closed publisher refuses as publish does."""
    j = Journal()
    pub = NullPublisher("w0", on_flush=j)
    pub.publish_valid(chain(2))
    with pytest.raises(InvalidEventError, match="sequence_hash"):
        pub.publish_valid([store(7, 7, None, 1, "g1"), store(2**64, 7, 7, 1, "g1")])
    with pytest.raises(InvalidEventError, match="expected KVEvent"):
        pub.publish_valid([store(8, 8, None, 1, "g1"), object()])  # type: ignore[list-item]
    pub.close()
    assert [ev.sequence_hash for b in j.batches for ev in b.events] == [1, 2]
    with pytest.raises(PublisherClosedError):
        pub.publish_valid(chain(1))


@pytest.mark.parametrize("max_event_bytes", [None, 64])
def test_publish_valid_time_limit_still_flushes(max_event_bytes: int | None) -> None:
    """Queued (not yet encoded) events go out with the timer's flush too."""
    j = Journal()
    pub = NullPublisher("w0", config=PublisherConfig(max_delay_s=0.1, adaptive_delay=False), on_flush=j)
    pub.publish_valid(chain(3), max_event_bytes)
    pub.publish_valid(chain(2, 10), max_event_bytes)
    polling.wait_until(lambda: j.batches, what="the timer's first batch")
    assert [len(b.events) for b in j.batches] == [5]
    # a second batch, opened while the timer sleeps: sent by the timer too
    pub.publish_valid(chain(1, 20), max_event_bytes)
    polling.wait_until(lambda: len(j.batches) >= 2, what="the timer's second batch")
    assert [len(b.events) for b in j.batches] == [5, 1]
    pub.close()


def test_queued_events_keep_their_order_with_checked_publishes_between() -> None:
    """publish_valid with a bound queues events unencoded; a publish (checked) or an
    unbounded publish_valid after them encodes the queue first: the order is kept."""
    j = Journal()
    pub = NullPublisher("w0", on_flush=j)
    pub.publish_valid(chain(2, 1), 64)  # opens the batch (encoded at once)
    pub.publish_valid(chain(2, 3), 64)  # queued
    pub.publish(chain(2, 5))
    pub.publish_valid(chain(2, 7), 64)  # queued
    pub.publish_valid(chain(2, 9))
    pub.publish_valid(chain(2, 11), 64)  # queued, sent by close
    pub.close()
    assert [ev.sequence_hash for b in j.batches for ev in b.events] == list(range(1, 13))
    assert pub.stats().event_bytes == sum(len(encode_event(e)) for b in j.batches for e in b.events)


def test_a_queued_event_msgpack_cannot_encode_is_dropped_and_counted_not_the_others() -> None:
    """Breaking publish_valid's contract with a bound (an object msgpack cannot encode,
    queued unencoded) loses that object only, counted in ``dropped``."""
    j = Journal()
    pub = NullPublisher("w0", on_flush=j)
    pub.publish_valid(chain(2, 1), 64)
    pub.publish_valid([object()], 64)  # type: ignore[list-item]
    pub.publish_valid(chain(1, 3), 64)
    pub.close()
    got = [ev.sequence_hash for b in j.batches for ev in b.events]
    assert got == [1, 2, 3] and pub.stats().dropped == 1
