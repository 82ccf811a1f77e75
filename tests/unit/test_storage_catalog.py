"""SqliteCatalog: placements, versions, segments and sharing one file between connections."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from storage_backends import (
    BlockKey,
    InvalidRequestError,
    Placement,
    SqliteCatalog,
    StorageError,
    VersionConflictError,
    VolumeFullError,
)


@pytest.fixture
def cat(tmp_path: Path) -> SqliteCatalog:
    c = SqliteCatalog(tmp_path / "catalog.sqlite")
    yield c
    c.close()


def _p(key: BlockKey, seg: int, off: int = 0, vol: str = "v", version: int = 0, ck: int = 7) -> Placement:
    return Placement(key, vol, seg, off, 100, ck, version)


def test_wal_mode_and_u64_extremes_round_trip(cat: SqliteCatalog) -> None:
    assert cat.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    seg = cat.new_segment("v", 300)
    keys = [BlockKey("ns", 0), BlockKey("ns", 1 << 63), BlockKey("ns", (1 << 64) - 1)]
    ps = [Placement(k, "v", seg, i * 100, 100, (1 << 64) - 1 - i, 0) for i, k in enumerate(keys)]
    assert cat.insert_if_absent(ps) == ps
    assert cat.get_many(keys) == ps
    assert cat.get(BlockKey("ns", 5)) is None
    assert [p.key for p in cat.iter_volume("v")] == keys


def test_insert_if_absent_keeps_the_first_placement(cat: SqliteCatalog) -> None:
    s1, s2 = cat.new_segment("v", 200), cat.new_segment("v", 200)
    a, b = BlockKey("ns", 1), BlockKey("ns", 2)
    first = cat.insert_if_absent([_p(a, s1)])
    assert first == [_p(a, s1)]
    # a again (other segment) plus b, and b twice in the same batch
    won = cat.insert_if_absent([_p(a, s2), _p(b, s2, 0), _p(b, s2, 100)])
    assert won == [_p(a, s1), _p(b, s2, 0), _p(b, s2, 0)]
    assert [(s.segment_id, s.live_blocks, s.live_bytes) for s in cat.segments("v")] == [(s1, 1, 100), (s2, 1, 100)]


def test_insert_into_unknown_segment_is_refused_and_records_nothing(cat: SqliteCatalog) -> None:
    seg = cat.new_segment("v", 100)
    a, b = BlockKey("ns", 1), BlockKey("ns", 2)
    with pytest.raises(StorageError, match="does not hold"):
        cat.insert_if_absent([_p(a, seg), _p(b, seg + 99)])
    assert cat.get_many([a, b]) == [None, None]
    with pytest.raises(StorageError):  # right id, wrong volume
        cat.insert_if_absent([_p(a, seg, vol="other")])


def test_compare_and_set_bumps_version_and_detects_conflicts(cat: SqliteCatalog) -> None:
    s1, s2, s3 = (cat.new_segment("v", 100) for _ in range(3))
    k = BlockKey("ns", 9)
    (old,) = cat.insert_if_absent([_p(k, s1)])
    new = cat.compare_and_set(old, _p(k, s2, ck=7))
    assert (new.segment_id, new.version) == (s2, 1)
    assert cat.get(k) == new
    with pytest.raises(VersionConflictError, match="version 1"):
        cat.compare_and_set(old, _p(k, s3))  # stale expectation
    assert cat.get(k) == new
    with pytest.raises(InvalidRequestError):
        cat.compare_and_set(new, _p(BlockKey("ns", 10), s3))
    cat.delete(k)
    with pytest.raises(VersionConflictError, match="deleted"):
        cat.compare_and_set(new, _p(k, s3, version=1))


def test_delete_with_expected_version(cat: SqliteCatalog) -> None:
    seg = cat.new_segment("v", 100)
    k = BlockKey("ns", 3)
    cat.insert_if_absent([_p(k, seg)])
    with pytest.raises(VersionConflictError):
        cat.delete(k, expected_version=4)
    assert cat.delete(k, expected_version=0) == _p(k, seg)
    assert cat.delete(k) is None


def test_segments_accounting_capacity_and_drop(cat: SqliteCatalog) -> None:
    s1 = cat.new_segment("v", 600, capacity_bytes=1000)
    with pytest.raises(VolumeFullError, match="capacity"):
        cat.new_segment("v", 500, capacity_bytes=1000)
    assert [s.segment_id for s in cat.segments("v")] == [s1]  # nothing recorded
    s2 = cat.new_segment("v", 400, capacity_bytes=1000)
    assert s2 > s1
    keys = [BlockKey("ns", i) for i in range(3)]
    cat.insert_if_absent([_p(k, s1, off=i * 100) for i, k in enumerate(keys)])
    info = cat.segment("v", s1)
    assert info is not None and (info.live_blocks, info.live_bytes, info.dead_bytes, info.sealed) == (3, 300, 300, False)
    with pytest.raises(StorageError, match="3 live blocks"):
        cat.drop_segment("v", s1)
    cat.delete_many(keys)
    assert cat.drop_segment_if_empty("v", s1) is False  # not sealed: its writer may still commit
    cat.seal_segment("v", s1)
    assert cat.drop_segment_if_empty("v", s1) is True
    assert cat.drop_segment("v", s2) is True
    assert cat.drop_segment("v", s2) is False
    # ids are never reused
    assert cat.new_segment("v", 1) > s2


def test_two_connections_share_one_file(tmp_path: Path) -> None:
    a = SqliteCatalog(tmp_path / "c.sqlite")
    b = SqliteCatalog(tmp_path / "c.sqlite")
    try:
        sa, sb = a.new_segment("v", 100), b.new_segment("v", 100)
        assert sa != sb
        k = BlockKey("ns", 1)
        a.insert_if_absent([_p(k, sa)])
        assert b.insert_if_absent([_p(k, sb)]) == [_p(k, sa)]
        assert b.record_volume("v", "spec-1") == "spec-1"
        assert a.record_volume("v", "spec-2") == "spec-1"
        assert a.volume_specs() == {"v": "spec-1"}
    finally:
        a.close()
        b.close()


def test_quarantine_only_the_current_placement(cat: SqliteCatalog) -> None:
    s1, s2 = cat.new_segment("v", 100), cat.new_segment("v", 100)
    k = BlockKey("ns", 1)
    (p,) = cat.insert_if_absent([_p(k, s1)])
    moved = cat.compare_and_set(p, _p(k, s2))
    assert cat.quarantine(p, "stale") is False
    assert cat.quarantine(moved, "bad bytes") is True
    assert cat.get(k) is None
    assert cat.quarantined() == [(moved, "bad bytes")]


def test_bad_keys_and_closed_catalog(cat: SqliteCatalog) -> None:
    with pytest.raises(InvalidRequestError):
        cat.get(BlockKey("ns", -1))
    with pytest.raises(InvalidRequestError):
        cat.get(BlockKey("ns", 1 << 64))
    with pytest.raises(InvalidRequestError):
        cat.get(BlockKey("", 1))
    cat.close()
    cat.close()  # idempotent
    with pytest.raises(StorageError, match="closed"):
        cat.get(BlockKey("ns", 1))


def test_rolled_back_transaction_leaves_no_partial_insert(cat: SqliteCatalog) -> None:
    seg = cat.new_segment("v", 100)
    good = _p(BlockKey("ns", 1), seg)
    with pytest.raises(InvalidRequestError):
        cat.insert_if_absent([good, _p(BlockKey("ns", -5), seg)])
    assert cat.get(good.key) is None
    assert isinstance(cat.db, sqlite3.Connection) and not cat.db.in_transaction
