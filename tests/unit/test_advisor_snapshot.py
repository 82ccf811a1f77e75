"""Snapshots + event sourcing: fold twice, or snapshot + tail, gives the same index."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advisor.index.prefix_index import IndexStateError, PrefixIndex
from advisor.index.snapshot import (
    RedisSnapshotStore,
    SnapshotError,
    SqliteSnapshotStore,
    decode_index,
    encode_index,
    load_latest,
    make_snapshot,
)
from event_plane.schema import EventBatch, cleared, remove, store

BS = 4096
HASHES = [1, 2, 3, 4, 5, 6, 7, 8, (1 << 64) - 1, (1 << 63) + 5]
LOCS = ["g1", "g2", "fast", "s3"]

op = st.tuples(
    st.sampled_from(["store", "store", "store", "remove", "remove", "cleared", "new_epoch", "stale"]),
    st.integers(0, 2),  # source
    st.sampled_from(HASHES),
    st.sampled_from([None, "same", *HASHES[:4]]),  # parent (same = self-parented, C11)
    st.sampled_from(LOCS),
    st.sampled_from([None, {"hits": 3}, {"moved_from": "fast"}, {"hits": True, "x": [1]}]),
    st.integers(1, 4),  # events in the batch this op starts
)


def build_log(ops: list[tuple]) -> list[EventBatch]:  # noqa: C901 - a small interpreter
    """Turn ops into batches with correct per-(source, epoch) seqs, new and stale epochs."""
    epochs = {s: [100 + s] for s in range(3)}
    seqs = {s: 0 for s in range(3)}
    log: list[EventBatch] = []
    ts = 1_000
    i = 0
    while i < len(ops):
        kind, src, _h, _p, _loc, _x, n = ops[i]
        name = f"w{src}"
        if kind == "new_epoch":
            epochs[src].append(epochs[src][-1] + 1000)
            seqs[src] = 0
            i += 1
            continue
        epoch = epochs[src][-1]
        if kind == "stale" and len(epochs[src]) > 1:
            epoch = epochs[src][0]
        events = []
        for kind2, _s, h, p, loc, extra, _n in ops[i:i + n]:
            if kind2 in ("new_epoch", "stale"):
                kind2 = "store"
            parent = h if p == "same" else p
            if kind2 == "store":
                events.append(store(h, HASHES[0], parent, BS + h % 7, loc, extra))
            elif kind2 == "remove":
                events.append(remove(h, HASHES[0], parent, BS, loc))
            else:
                events.append(cleared(loc))
        i += n
        ts += 10
        log.append(EventBatch(1, name, epoch, seqs[src] if epoch == epochs[src][-1] else 0, ts, events))
        if epoch == epochs[src][-1]:
            seqs[src] += 1
    return log


def fold(log: list[EventBatch], index: PrefixIndex | None = None) -> PrefixIndex:
    idx = index if index is not None else PrefixIndex()
    for b in log:
        idx.apply_batch(b)
    return idx


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=1, max_size=60), st.data())
def test_fold_twice_and_snapshot_plus_tail_give_the_same_state(ops: list[tuple], data: st.DataObject) -> None:
    log = build_log(ops)
    whole = fold(log).dump()
    assert fold(log).dump() == whole  # same log, same state
    cut = data.draw(st.integers(0, len(log)))
    head = fold(log[:cut])
    restored = decode_index(encode_index(head))
    assert restored.dump() == head.dump()  # the snapshot itself is exact
    assert fold(log[cut:], restored).dump() == whole  # snapshot + tail == whole fold
    # derived structures agree too (children, per-location sets, lookups)
    full = fold(log)
    for h in HASHES:
        assert restored.children(h) == full.children(h)
    for loc in full.locations():
        assert restored.blocks_at(loc) == full.blocks_at(loc)
    assert restored.lookup(HASHES[:4]) == full.lookup(HASHES[:4])


def test_state_rejects_other_versions_and_shapes() -> None:
    idx = fold(build_log([("store", 0, 1, None, "g1", None, 1)]))
    state = idx.export_state()
    with pytest.raises(IndexStateError, match="version"):
        PrefixIndex.from_state([99, *state[1:]])
    with pytest.raises(IndexStateError, match="multiple of 7"):
        PrefixIndex.from_state([state[0], state[1], state[2][:-1], *state[3:]])
    with pytest.raises(IndexStateError, match="6-item"):
        PrefixIndex.from_state([1, 2])
    with pytest.raises(SnapshotError, match="not an index state"):
        decode_index(b"\xc1garbage")


def test_masks_beyond_64_locations_survive_a_snapshot() -> None:
    idx = PrefixIndex()
    idx.apply_batch(EventBatch(1, "w", 1, 0, 5, [store(9, 9, None, BS, f"vol{i}") for i in range(70)]))
    again = decode_index(encode_index(idx))
    assert again.dump() == idx.dump()
    assert again.block(9) is not None and len(again.block(9).locations) == 70  # type: ignore[union-attr]


def test_sqlite_store_keeps_the_newest_and_skips_corrupt_snapshots(tmp_path) -> None:  # noqa: ANN001
    log = build_log([("store", s % 3, HASHES[s % 10], None, LOCS[s % 4], None, 2) for s in range(40)])
    store_ = SqliteSnapshotStore(tmp_path / "snaps.sqlite", keep=2)
    dumps = {}
    for cut in (5, 10, 15):
        idx = fold(log[:cut])
        dumps[cut] = idx.dump()
        store_.save(make_snapshot(cut, encode_index(idx)))
    assert store_.positions() == [10, 15]
    snap, idx = load_latest(store_)  # type: ignore[misc]
    assert snap.position == 15 and idx.dump() == dumps[15]
    snap, idx = load_latest(store_, max_position=12)  # type: ignore[misc]
    assert snap.position == 10 and idx.dump() == dumps[10]
    assert load_latest(store_, max_position=9) is None
    # flip a byte of the newest: its checksum fails and the older one is used
    store_._db.execute("UPDATE snapshots SET payload = CAST(? AS BLOB) WHERE position = 15", (b"\x00" * 10,))
    snap, idx = load_latest(store_)  # type: ignore[misc]
    assert snap.position == 10 and idx.dump() == dumps[10]
    store_.close()
    with pytest.raises(SnapshotError, match="keep"):
        SqliteSnapshotStore(tmp_path / "x.sqlite", keep=0)


def test_redis_store_round_trip_and_prune(redis_url: str) -> None:
    prefix = f"kvadvisor-test:{os.getpid()}:{time.monotonic_ns()}"
    store_ = RedisSnapshotStore(redis_url, prefix, keep=2)
    try:
        log = build_log([("store", s % 3, HASHES[s % 10], HASHES[(s + 1) % 4], LOCS[s % 4], None, 3)
                         for s in range(30)])
        dumps = {}
        for cut in (3, 6, 9):
            idx = fold(log[:cut])
            dumps[cut] = idx.dump()
            store_.save(make_snapshot(cut, encode_index(idx)))
        assert store_.positions() == [6, 9]
        snap, idx = load_latest(store_)  # type: ignore[misc]
        assert snap.position == 9 and idx.dump() == dumps[9]
        assert fold(log[9:], idx).dump() == fold(log).dump()
        snap, idx = load_latest(store_, max_position=8)  # type: ignore[misc]
        assert snap.position == 6 and idx.dump() == dumps[6]
        store_._r.hset(f"{prefix}:snapshot:9", "payload", b"broken")  # checksum now fails
        snap, _ = load_latest(store_)  # type: ignore[misc]
        assert snap.position == 6
    finally:
        keys = list(store_._r.scan_iter(f"{prefix}:*"))
        if keys:
            store_._r.delete(*keys)
        store_.close()
    with pytest.raises(SnapshotError, match="Redis"):
        RedisSnapshotStore("redis://127.0.0.1:1/0", prefix)
