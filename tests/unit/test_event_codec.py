"""Codec: round trips, hostile bytes, event validation, wire size."""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from event_plane import (
    CodecError,
    EventBatch,
    EventType,
    InvalidEventError,
    KVEvent,
    cleared,
    decode_batch,
    encode_batch,
    remove,
    store,
)
from event_plane.codec import decode_event, encode_batch_parts, encode_event
from event_plane.validate import encode_checked

u64 = st.integers(min_value=0, max_value=2**64 - 1)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
names = st.text(min_size=1, max_size=20)
meta_values = st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=8), st.booleans(), st.none())
metadata = st.one_of(st.none(), st.dictionaries(st.text(max_size=8), meta_values, max_size=3))

events = st.builds(
    KVEvent,
    st.sampled_from(list(EventType)),
    u64,
    u64,
    st.one_of(st.none(), u64),
    u32,
    names,
    metadata,
)
batches = st.builds(EventBatch, st.just(1), names, u64, u64, u64, st.lists(events, max_size=40))


@settings(max_examples=300, deadline=None)
@given(batches)
def test_encode_decode_round_trip(batch: EventBatch) -> None:
    wire = encode_batch(batch)
    assert decode_batch(wire) == batch


@settings(max_examples=300, deadline=None)
@given(batches)
def test_batch_from_parts_is_byte_identical(batch: EventBatch) -> None:
    parts = [encode_event(ev) for ev in batch.events]
    assert encode_batch_parts(batch.source, batch.epoch, batch.seq, batch.ts_ns, parts) == encode_batch(batch)


def test_batch_from_parts_array_headers_16_and_65536() -> None:
    for n in (15, 16, 65535, 65536):
        evs = [store(i, 0, None, 1, "g1") for i in range(n)]
        batch = EventBatch(1, "w", 1, 2, 3, evs)
        parts = [encode_event(ev) for ev in evs]
        assert encode_batch_parts("w", 1, 2, 3, parts) == encode_batch(batch)


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_codec_error(data: bytes) -> None:
    try:
        batch = decode_batch(data)
    except CodecError:
        return
    assert isinstance(batch, EventBatch) and batch.version == 1
    assert all(isinstance(ev, KVEvent) for ev in batch.events)


@settings(max_examples=500, deadline=None)
@given(batches, st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_corrupted_batches_decode_or_codec_error(batch: EventBatch, pos: int, byte: int) -> None:
    wire = bytearray(encode_batch(batch))
    wire[pos % len(wire)] = byte
    for candidate in (bytes(wire), bytes(wire[: pos % len(wire)])):
        try:
            decoded = decode_batch(candidate)
        except CodecError:
            continue
        assert isinstance(decoded, EventBatch)


@pytest.mark.parametrize(
    "value",
    [
        [1, "w", 1, 0, 0, [[0, 2**64, 1, None, 1, "g1", None]]],  # hash > u64 (encoded as... float)
        [1, "w", 1, 0, 0, [[0, 1, 1, None, 2**32, "g1", None]]],  # block_size > u32
        [1, "", 1, 0, 0, []],  # empty source
        [1, "w", 1, 0, 0, [[0, 1, 1, None, 1, "", None]]],  # empty location
        [1, "w", 1, 0, 0, [[9, 1, 1, None, 1, "g1", None]]],  # unknown type
        [1, "w", 1, 0, 0, [[0, 1, 1, None, 1, "g1", {1: 2}]]],  # non-str metadata key
        [1, "w", 1, 0],  # short batch
        [2, "w", 1, 0, 0, []],  # version 2
        {"version": 1},  # map form
    ],
)
def test_malformed_values_raise_codec_error(value: object) -> None:
    try:
        wire = msgspec.msgpack.encode(value)
    except OverflowError:
        wire = b"\x96\x01\xa1w\x01\x00\x00\x91\x97\x00\xcb" + b"\x43\xf0" + b"\x00" * 6 + b"\x01\xc0\x01\xa2g1\xc0"
    with pytest.raises(CodecError):
        decode_batch(wire)


def test_trailing_bytes_are_rejected() -> None:
    wire = encode_batch(EventBatch(1, "w", 1, 0, 0, [cleared("g1")]))
    with pytest.raises(CodecError):
        decode_batch(wire + b"\xc0")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (store(-1, 0, None, 1, "g1"), "sequence_hash"),
        (store(2**64, 0, None, 1, "g1"), "sequence_hash"),
        (store(1, 2**64, None, 1, "g1"), "prefix_hash"),
        (store(1, 1, -5, 1, "g1"), "parent_hash"),
        (store(1, 1, None, 2**32, "g1"), "block_size"),
        (store(1, 1, None, 1, ""), "storage_location"),
        (store(1, 1, None, 1, "x" * 256), "storage_location"),
        (store(1, 1, None, 1, "g1", {1: "a"}), "extra_metadata"),
        (store(1, 1, None, 1, "g1", {"a": object()}), "encoded"),
        (KVEvent(7, 1, 1, None, 1, "g1"), "type"),  # type: ignore[arg-type]
        ("not an event", "KVEvent"),
    ],
)
def test_encode_checked_rejects_bad_events(bad: object, message: str) -> None:
    with pytest.raises(InvalidEventError, match=message):
        encode_checked(bad)


def test_typical_store_is_38_bytes_and_batch_under_64_bytes_per_event() -> None:
    rng = random.Random(7)
    hashes = [rng.getrandbits(64) for _ in range(1025)]
    evs = [store(hashes[i + 1], hashes[0], hashes[i], 65536, "g1") for i in range(1024)]
    assert {len(encode_event(ev)) for ev in evs} <= {36, 37, 38}  # a random hash < 2^32 is rare but shorter
    wire = encode_batch(EventBatch(1, "worker-0", rng.getrandbits(64), 12345, 1_700_000_000_000_000_000, evs))
    per_event = len(wire) / len(evs)
    assert per_event <= 38.1
    rm = remove(hashes[1], hashes[0], hashes[0], 65536, "vol-fast")
    assert len(encode_event(rm)) <= 64


def test_encode_checked_all_matches_encode_checked_and_its_errors() -> None:
    from event_plane.errors import InvalidEventError
    from event_plane.schema import EventType, KVEvent, cleared, remove, store
    from event_plane.validate import encode_checked, encode_checked_all

    good = [store(1, 1, None, 16, "g1"), remove(2**64 - 1, 1, 1, 2**32 - 1, "v" * 255), cleared("g2"),
            store(3, 1, 2, 16, "g2", {"hits": 3}), KVEvent(0, 4, 1, 3, 16, "g1")]
    assert encode_checked_all(good) == [encode_checked(ev) for ev in good]
    bad = [store(-1, 1, None, 16, "g1"), store(2**64, 1, None, 16, "g1"), store(1, 1, 2**64, 16, "g1"),
           store(1, 1, None, 2**32, "g1"), store(1, 1, None, 16, ""), store(1, 1, None, 16, "x" * 256),
           store(EventType.REMOVE, 1, None, 16, "g1"), store(True, 1, None, 16, "g1"),
           store(1, 1, None, 16, "g1", {1: 2}), KVEvent(7, 1, 1, None, 16, "g1"), (0, 1, 1, None, 16, "g1", None)]
    for ev in bad:
        with pytest.raises(InvalidEventError) as want:
            encode_checked(ev)
        with pytest.raises(InvalidEventError) as got:
            encode_checked_all([good[0], ev])
        assert str(got.value) == str(want.value)


def nested(depth: int) -> bytes:
    """MessagePack of an ``extra_metadata`` map nested ``depth`` levels: {"a": {"a": ... 1}}."""
    return b"\x81\xa1a" * depth + b"\x01"


def deep_payload(depth: int, seq: int = 0) -> bytes:
    """A batch of two Stores, the second carrying metadata ``depth`` levels deep, built from
    bytes (a hostile publisher's encoder need not be ours)."""
    head = encode_event(store(2, 1, 1, 4096, "g1"))
    assert head[-1] == 0xC0  # nil extra_metadata, swapped for the nested map
    return encode_batch_parts("w0", 7, seq, 0, [encode_event(store(1, 1, None, 4096, "g1")), head[:-1] + nested(depth)])


def _at_stack_depth(frames_left: int, fn):  # noqa: ANN001, ANN202
    """Call ``fn()`` with only about ``frames_left`` frames left below the recursion limit."""
    import sys

    import inspect

    def down(n: int):  # noqa: ANN202
        return fn() if n <= 0 else down(n - 1)

    return down(sys.getrecursionlimit() - len(inspect.stack()) - frames_left)


def test_metadata_depth_limit_is_exact_and_the_same_at_any_stack_depth() -> None:
    """One decoder, one limit: a batch at MAX_METADATA_DEPTH decodes, one level more is a
    CodecError, and both answers stay the same when the decoder runs on a deep stack (a
    journal replay) as on a shallow one (a live subscriber)."""
    from event_plane.codec import MAX_METADATA_DEPTH

    ok, deep, very_deep = deep_payload(MAX_METADATA_DEPTH), deep_payload(MAX_METADATA_DEPTH + 1), deep_payload(980)
    assert decode_batch(ok).events[1].extra_metadata is not None
    for frames_left in (None, 80):
        run = (lambda f: f()) if frames_left is None else (lambda f: _at_stack_depth(frames_left, f))
        assert run(lambda: decode_batch(ok)) == decode_batch(ok)
        for bad in (deep, very_deep):
            with pytest.raises(CodecError, match="nests more than 32 levels|RecursionError"):
                run(lambda: decode_batch(bad))  # noqa: B023
    with pytest.raises(CodecError, match="nests more than 32 levels"):
        decode_batch(deep)
    with pytest.raises(CodecError, match="nests more than 32 levels"):
        decode_event(encode_event(store(2, 1, 1, 4096, "g1"))[:-1] + nested(MAX_METADATA_DEPTH + 1))


def test_metadata_depth_counts_maps_and_arrays() -> None:
    from event_plane.codec import MAX_METADATA_DEPTH, metadata_depth_error

    meta: object = 1
    for i in range(MAX_METADATA_DEPTH - 1):
        meta = [meta] if i % 2 else {"k": meta}
    assert metadata_depth_error({"top": meta}) is None  # exactly the limit
    assert metadata_depth_error({"top": [meta]}) is not None
    assert metadata_depth_error({"wide": [[1]] * 10_000}) is None


def test_encode_checked_rejects_metadata_receivers_would_refuse() -> None:
    from event_plane.codec import MAX_METADATA_DEPTH

    meta: dict = {}
    for _ in range(MAX_METADATA_DEPTH):
        meta = {"a": meta}
    with pytest.raises(InvalidEventError, match="nests more than 32 levels"):
        encode_checked(store(1, 1, None, 1, "g1", meta))
    encode_checked(store(1, 1, None, 1, "g1", meta["a"]))  # 32 levels: accepted


def test_metadata_depth_counts_arrays_used_as_map_keys() -> None:
    """A MessagePack array used as a map key inside ``extra_metadata`` decodes as a tuple
    key; it nests like any array. Uncounted, such keys carried any nesting past the limit,
    and whether the batch decoded depended again on the decoder's stack depth (a batch a
    live subscriber accepted could fail a replay on a deep stack)."""
    from event_plane.codec import MAX_METADATA_DEPTH, metadata_depth_error

    def with_key(levels: int) -> bytes:
        # {"k": {[[...1...]]: 1}}: the maps are levels 1 and 2, the key's arrays 3 and up
        head = encode_event(store(2, 1, 1, 4096, "fast"))[:-1]
        meta = b"\x81\xa1k\x81" + b"\x91" * levels + b"\x01" + b"\x01"
        return encode_batch_parts("w0", 7, 0, 0, [head + meta])

    key = decode_batch(with_key(MAX_METADATA_DEPTH - 2)).events[0].extra_metadata
    assert isinstance(next(iter(key["k"])), tuple)  # exactly the limit: accepted
    for levels in (MAX_METADATA_DEPTH - 1, 300):
        with pytest.raises(CodecError, match="nests more than 32 levels"):
            decode_batch(with_key(levels))
    assert metadata_depth_error({"k": {((1,),): 1}}, limit=4) is None
    assert metadata_depth_error({"k": {(((1,),),): 1}}, limit=4) is not None
