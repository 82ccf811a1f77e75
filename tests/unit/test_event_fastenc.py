"""The compiled event encoder (``event_plane._fastenc``) and the publisher paths that take
its bytes (``publish_encoded``) or no events at all (``null://``: events off).

Every byte a pool puts on the wire this way must be the byte msgspec would have written for
the equivalent ``KVEvent`` objects, and every subscriber must see the same events.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from event_plane import (
    EventBatch,
    EventType,
    KVEvent,
    NullPublisher,
    PublisherConfig,
    ZmqPublisher,
    ZmqSubscriber,
    decode_batch,
    encode_batch,
    make_publisher,
    subscribe,
)
from event_plane._fastenc import encode_meta_events, event_tail
from event_plane.codec import encode_batch_parts, encode_event
from event_plane.errors import InvalidEventError, PublisherClosedError
from kvbm_runtime import BlockMeta, BlockPool, LayoutConfig
from kvbm_runtime.layout import FullyContiguous
from storage_backends.local_s3 import free_port

U64 = st.integers(0, 2**64 - 1)
LOCATION = st.text(min_size=1, max_size=255)
CFG = LayoutConfig(num_layers=1, outer_dim=1, page_size=4, inner_dim=8, dtype=torch.float16)


def objects(kind: int, metas: list, bb: int, loc: str) -> list[KVEvent]:
    return [KVEvent(EventType(kind), m.sequence_hash, m.prefix_hash, m.parent_hash, bb, loc) for m in metas]


def reference(kind: int, metas: list, bb: int, loc: str) -> bytes:
    return b"".join(encode_event(e) for e in objects(kind, metas, bb, loc))


# ------------------------------------------------------------------ the encoder


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from([0, 1]),
    rows=st.lists(st.tuples(U64, U64, st.none() | U64), max_size=40),
    bb=st.integers(0, 2**32 - 1),
    loc=LOCATION,
)
def test_bytes_identical_to_msgspec_of_the_equivalent_kvevents(kind: int, rows: list, bb: int, loc: str) -> None:
    metas = [SimpleNamespace(sequence_hash=s, prefix_hash=p, parent_hash=par) for s, p, par in rows]
    body = encode_meta_events(kind, metas, event_tail(bb, loc))
    assert body == reference(kind, metas, bb, loc)
    # and as a batch: the same payload encode_batch writes for those KVEvents
    evs = objects(kind, metas, bb, loc)
    assert encode_batch_parts("w", 3, 4, 5, [body], len(rows)) == encode_batch(EventBatch(1, "w", 3, 4, 5, evs))


@pytest.mark.parametrize(
    "h",
    [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1],
)
def test_every_integer_width_boundary(h: int) -> None:
    metas = [BlockMeta(h, None, h, 0), BlockMeta(h ^ 1, h, h, 0)]
    for bb in (0, 127, 128, 65536, 2**32 - 1):
        for loc in ("g1", "x" * 31, "y" * 32, "z" * 255, "é" * 200):
            assert encode_meta_events(1, metas, event_tail(bb, loc)) == reference(1, metas, bb, loc)


def _doc_vectors() -> list[dict[str, str]]:
    doc = Path(__file__).resolve().parents[2] / "docs" / "events.md"
    out = []
    for body in re.findall(r"```kvevent-vector\n(.*?)```", doc.read_text(encoding="utf-8"), re.S):
        fields = {}
        for line in body.strip().splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
        out.append(fields)
    return out


def test_docs_events_md_vectors_byte_exact() -> None:
    """Every valid vector of docs/events.md §9 made of runs of Store / Remove events without
    metadata, rebuilt from its identities by the compiled encoder, is the vector's bytes."""
    done = 0
    for v in _doc_vectors():
        if v.get("expect") == "error":
            continue
        batch = msgspec.convert(json.loads(v["value"]), EventBatch)
        if not batch.events or any(e.type > 1 or e.extra_metadata is not None for e in batch.events):
            continue
        parts = []
        for e in batch.events:  # one part per event: each may have its own type / location
            meta = SimpleNamespace(sequence_hash=e.sequence_hash, prefix_hash=e.prefix_hash, parent_hash=e.parent_hash)
            parts.append(encode_meta_events(int(e.type), [meta], event_tail(e.block_size, e.storage_location)))
        wire = encode_batch_parts(batch.source, batch.epoch, batch.seq, batch.ts_ns, parts, len(parts))
        assert wire == bytes.fromhex(v["hex"]), v["name"]
        done += 1
    assert done >= 1


def test_bad_input_is_refused_with_a_clear_error() -> None:
    tail = event_tail(16, "g1")
    ok = SimpleNamespace(sequence_hash=1, prefix_hash=1, parent_hash=None)
    with pytest.raises(ValueError, match="event_type"):
        encode_meta_events(2, [ok], tail)
    with pytest.raises(TypeError, match="sequence_hash must be an int, got bool"):
        encode_meta_events(0, [SimpleNamespace(sequence_hash=True, prefix_hash=1, parent_hash=None)], tail)
    with pytest.raises(TypeError, match="parent_hash must be an int, got str"):
        encode_meta_events(0, [SimpleNamespace(sequence_hash=1, prefix_hash=1, parent_hash="1")], tail)
    with pytest.raises(OverflowError):
        encode_meta_events(0, [SimpleNamespace(sequence_hash=-1, prefix_hash=1, parent_hash=None)], tail)
    with pytest.raises(OverflowError):
        encode_meta_events(0, [ok, SimpleNamespace(sequence_hash=1, prefix_hash=2**64, parent_hash=None)], tail)
    with pytest.raises(AttributeError):
        encode_meta_events(0, [object()], tail)
    with pytest.raises(TypeError):
        encode_meta_events(0, (ok,), tail)  # a list only
    for bb, loc in ((-1, "g1"), (2**32, "g1"), (True, "g1"), (1, ""), (1, "x" * 256), (1, b"g1")):
        with pytest.raises(ValueError):
            event_tail(bb, loc)
    assert encode_meta_events(0, [], tail) == b""


# ------------------------------------------------------------------ the publisher


def _collect(pub_cfg: PublisherConfig, feed) -> list[bytes]:  # type: ignore[no-untyped-def]
    payloads: list[bytes] = []
    pub = NullPublisher("w0", epoch=9, config=pub_cfg, on_flush=lambda b, p: payloads.append(p))
    feed(pub)
    pub.close()
    return payloads


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.lists(st.lists(st.tuples(U64, U64, st.none() | U64), min_size=0, max_size=20), max_size=12),
    max_events=st.integers(1, 40),
    max_bytes_events=st.integers(1, 30),
    kinds=st.lists(st.sampled_from(["encoded", "checked", "valid", "lazy"]), min_size=12, max_size=12),
)
def test_publish_encoded_sends_the_batches_publish_sends(
    chunks: list, max_events: int, max_bytes_events: int, kinds: list[str]
) -> None:
    """Same batches, same seqs, same bytes as ``publish`` of the equivalent KVEvents, for any
    mix with the other entry points and any batch limits (events and bytes)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(time, "time_ns", lambda: 1_700_000_000_000_000_000)
        _check_same_batches(chunks, max_events, max_bytes_events, kinds)


def _check_same_batches(chunks: list, max_events: int, max_bytes_events: int, kinds: list[str]) -> None:
    tail = event_tail(4096, "g2")
    big = len(encode_event(KVEvent(EventType.REMOVE, 2**64 - 1, 2**64 - 1, 2**64 - 1, 4096, "g2")))
    cfg = PublisherConfig(max_events=max_events, max_bytes=max_bytes_events * big, max_delay_s=60.0)
    metas = [[SimpleNamespace(sequence_hash=s, prefix_hash=p, parent_hash=par) for s, p, par in c] for c in chunks]

    def ours(pub: NullPublisher) -> None:
        for i, ms in enumerate(metas):
            kind = kinds[i]
            if kind == "encoded":
                pub.publish_encoded(encode_meta_events(i % 2, ms, tail), len(ms))
            elif kind == "checked":
                pub.publish(objects(i % 2, ms, 4096, "g2"))
            elif kind == "valid":
                pub.publish_valid(objects(i % 2, ms, 4096, "g2"))
            else:
                pub.publish_valid(objects(i % 2, ms, 4096, "g2"), big)

    def theirs(pub: NullPublisher) -> None:
        for i, ms in enumerate(metas):
            pub.publish(objects(i % 2, ms, 4096, "g2"))

    got, want = _collect(cfg, ours), _collect(cfg, theirs)
    assert got == want
    for p in got:
        batch = decode_batch(p)
        assert 1 <= len(batch.events) <= max_events
        assert sum(len(encode_event(e)) for e in batch.events) <= cfg.max_bytes


def test_on_flush_sees_the_events_of_encoded_parts() -> None:
    seen: list[EventBatch] = []
    pub = NullPublisher("w0", config=PublisherConfig(max_events=4), on_flush=lambda b, p: seen.append(b))
    ms = [BlockMeta(10 + i, (9 + i) if i else None, 10, 0) for i in range(6)]
    pub.publish_encoded(encode_meta_events(0, ms, event_tail(64, "g1")), 6)
    pub.flush()
    assert [len(b.events) for b in seen] == [4, 2]
    assert [e for b in seen for e in b.events] == objects(0, ms, 64, "g1")
    assert pub.stats().events == 6 and pub.stats().batches == 2
    pub.close()
    with pytest.raises(PublisherClosedError):
        pub.publish_encoded(encode_meta_events(0, ms, event_tail(64, "g1")), 6)


def test_publish_encoded_refuses_bad_parts_and_keeps_what_it_has() -> None:
    seen: list[EventBatch] = []
    pub = NullPublisher("w0", config=PublisherConfig(max_events=2), on_flush=lambda b, p: seen.append(b))
    ms = [BlockMeta(10 + i, None, 10 + i, 0) for i in range(3)]
    good = encode_meta_events(0, ms, event_tail(64, "g1"))
    pub.publish_encoded(good[: len(good) // 3], 1)
    with pytest.raises(TypeError, match="body must be bytes"):
        pub.publish_encoded(bytearray(good), 3)  # type: ignore[arg-type]
    with pytest.raises(InvalidEventError):
        pub.publish_encoded(good[:-3], 3)  # must be split (max_events 2), cannot be decoded
    with pytest.raises(InvalidEventError, match="body is not 2 encoded events"):
        pub.publish_encoded(good, 2)
    pub.flush()
    assert [e for b in seen for e in b.events] == objects(0, ms[:1], 64, "g1")


# ------------------------------------------------------------------ pools on real transports


def _pool_traffic(pool: BlockPool) -> list[BlockMeta]:
    """Registers 3 chains of 4 blocks in a 6-block pool (so some are evicted)."""
    out = []
    for c in range(3):
        hs = [(c + 1) * 2**60 + i for i in range(4)]
        metas = [BlockMeta(h, hs[i - 1] if i else None, hs[0], 0) for i, h in enumerate(hs)]
        pool.release_blocks(pool.register_blocks(pool.allocate_complete(metas)))
        out += metas
    return out


def _expected(pool_tier: str) -> list[KVEvent]:
    """What the same traffic publishes through a plain KVEvent sink."""

    class Sink:
        events: list[KVEvent] = []

        def publish(self, events: list[KVEvent]) -> None:
            self.events.extend(events)

    sink = Sink()
    sink.events = []
    _pool_traffic(BlockPool(pool_tier, FullyContiguous(CFG, 6), sink))  # type: ignore[arg-type]
    return sink.events


def test_pool_through_zmq_subscriber_sees_the_same_events() -> None:
    pub_ep, rep_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = ZmqPublisher("w-zmq", pub_ep, rep_ep, config=PublisherConfig(max_events=5))
    assert pub._payload_only  # no EventBatch is built on this path
    sub = ZmqSubscriber([(pub_ep, rep_ep)])
    sub.start()
    time.sleep(0.3)
    try:
        _pool_traffic(BlockPool("g2", FullyContiguous(CFG, 6), pub))
        pub.flush()
        want = _expected("g2")
        assert len(want) == 12 + 6
        got = sub.get_many(4, 5.0)
        assert [b.seq for b in got] == [0, 1, 2, 3]
        assert [e for b in got for e in b.events] == want
        assert sub.stats().decode_errors == 0
    finally:
        sub.close()
        pub.close()


def test_pool_through_nats_subscriber_sees_the_same_events(nats_url: str) -> None:
    ns = "t" + secrets.token_hex(4)
    sub = subscribe(f"{nats_url}?namespace={ns}")
    sub.start()
    pub = make_publisher(f"{nats_url}?namespace={ns}", "w-nats", config=PublisherConfig(max_events=7))
    try:
        assert pub._payload_only
        _pool_traffic(BlockPool("g2", FullyContiguous(CFG, 6), pub))
        pub.flush()
        got = sub.get_many(3, 5.0)
        assert [b.seq for b in got] == [0, 1, 2]
        assert [e for b in got for e in b.events] == _expected("g2")
    finally:
        pub.close()
        sub.close()


def test_null_publisher_without_on_flush_is_events_off() -> None:
    """``null://``: the pool builds no events, the publisher counts them and sends no batch;
    the pool's own counters are unchanged."""
    pub = make_publisher("null://", "w-null")
    assert pub.wants_events is False
    pool = BlockPool("g2", FullyContiguous(CFG, 6), pub)
    _pool_traffic(pool)
    pool.evict()  # the slow path too
    pub.flush()
    st = pool.stats()
    assert (st.stores_published, st.removes_published) == (12, 12)
    ps = pub.stats()
    assert ps.events == 24 and ps.batches == 0 and ps.payload_bytes == 0 and pub.next_seq == 0
    # events given to it directly are still batched and numbered
    pub.publish(objects(0, [BlockMeta(1, None, 1, 0)], 64, "g1"))
    pub.flush()
    assert pub.stats().batches == 1 and pub.next_seq == 1
    pub.close()
    # with an on_flush callback it wants them (embedded setups, tests)
    assert NullPublisher("w", on_flush=lambda b, p: None).wants_events is True


@settings(max_examples=100, deadline=None)
@given(kind=st.sampled_from([0, 1]), rows=st.lists(st.tuples(U64, U64, st.none() | U64), max_size=20))
def test_make_meta_events_builds_the_same_objects(kind: int, rows: list) -> None:
    """The C-built KVEvents a pool hands a plain sink equal the ones Python would build,
    for slotted identities (read from their slots) and any other object (getattr)."""
    from event_plane._fastenc import make_meta_events

    ns = [SimpleNamespace(sequence_hash=s, prefix_hash=p, parent_hash=par) for s, p, par in rows]
    metas = [BlockMeta(s, par, p, 0) for s, p, par in rows if par != s]
    for ms in (ns, metas):
        assert make_meta_events(KVEvent, EventType(kind), ms, 4096, "g1") == objects(kind, ms, 4096, "g1")


def test_make_meta_events_refuses_objects_without_the_fields() -> None:
    from event_plane._fastenc import make_meta_events

    with pytest.raises(AttributeError):
        make_meta_events(KVEvent, EventType.STORE, [BlockMeta(1, None, 1, 0), object()], 1, "g1")


class _Slotted:
    __slots__ = ("sequence_hash", "prefix_hash", "parent_hash")


class _Overrides(_Slotted):
    """A subclass whose sequence_hash is no slot read: getattr must be used."""

    __slots__ = ()

    @property  # type: ignore[misc]
    def sequence_hash(self) -> int:  # type: ignore[override]
        return 77


def test_slot_reads_fall_back_to_getattr_where_they_would_differ() -> None:
    tail = event_tail(16, "g1")
    a = _Slotted()
    a.sequence_hash, a.prefix_hash, a.parent_hash = 5, 5, None
    b = _Overrides()
    b.prefix_hash, b.parent_hash = 5, 5  # its sequence_hash comes from the property
    want = [SimpleNamespace(sequence_hash=5, prefix_hash=5, parent_hash=None), SimpleNamespace(sequence_hash=77, prefix_hash=5, parent_hash=5)]
    for _ in range(2):  # and with each class learned first
        assert encode_meta_events(0, [a, b, a], tail) == reference(0, [want[0], want[1], want[0]], 16, "g1")
        assert encode_meta_events(0, [b, a], tail) == reference(0, [want[1], want[0]], 16, "g1")
    unset = _Slotted()
    unset.sequence_hash, unset.prefix_hash = 1, 1
    with pytest.raises(AttributeError):
        encode_meta_events(0, [a, unset], tail)


def test_a_sink_that_wants_no_events_gets_none() -> None:
    """Any sink saying ``wants_events = False`` gets no event (with or without
    ``skip_events``); the pool still counts what it would have published."""

    class Off:
        wants_events = False

        def publish(self, events: list) -> None:
            raise AssertionError("no event should be built")

    pool = BlockPool("g2", FullyContiguous(CFG, 6), Off())  # type: ignore[arg-type]
    _pool_traffic(pool)
    pool.evict()
    st = pool.stats()
    assert (st.stores_published, st.removes_published) == (12, 12)
