"""SqliteCatalog's in-process placement cache: answers must always be the database's
current state, whichever connection (this one, another one in this process, another
process) changed it; and the column-wise key validation must reject what the per-key
one rejects."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from storage_backends import (
    BlockKey,
    InvalidRequestError,
    Placement,
    SqliteCatalog,
    StorageError,
    VersionConflictError,
)
from storage_backends.keys import validate_block_key, validate_block_keys

ROOT = Path(__file__).resolve().parents[2]
N = 40  # keys per call: above validate_block_keys' column-wise threshold


def _fill(cat: SqliteCatalog, n: int = N, ns: str = "ns") -> tuple[int, list[Placement]]:
    seg = cat.new_segment("v", n * 100)
    ps = [Placement(BlockKey(ns, i), "v", seg, i * 100, 100, 1000 + i, 0) for i in range(n)]
    assert cat.insert_if_absent(ps) == ps
    cat.seal_segment("v", seg)
    return seg, ps


def _cached_move(reader: SqliteCatalog, writer: SqliteCatalog, ps: list[Placement], i: int) -> Placement:
    """``reader`` caches every placement of ``ps``, then ``writer`` moves ``ps[i]`` to a
    new segment; returns the committed placement."""
    assert reader.get_many([p.key for p in ps]) == ps
    seg2 = writer.new_segment("v", 100)
    return writer.compare_and_set(ps[i], Placement(ps[i].key, "v", seg2, 0, 100, ps[i].checksum, 0))


@pytest.fixture
def two(tmp_path: Path):  # type: ignore[no-untyped-def]
    a = SqliteCatalog(tmp_path / "c.sqlite")
    b = SqliteCatalog(tmp_path / "c.sqlite")
    yield a, b
    a.close()
    b.close()


def test_hits_come_from_the_cache(two: tuple[SqliteCatalog, SqliteCatalog]) -> None:
    a, _ = two
    _, ps = _fill(a)
    keys = [p.key for p in ps]
    assert len(a._cache) == N  # filled by the put
    assert a.get_many(keys) == ps
    # a value that only the cache holds proves the hit path is taken (test-only poke)
    marked = Placement(keys[0], "v", ps[0].segment_id, 0, 100, 1, 99)
    a._cache[(keys[0].namespace, keys[0].sequence_hash)] = marked
    assert a.get_many(keys)[0] is marked
    a._cache.clear()
    assert a.get_many(keys) == ps  # refilled from the database
    assert len(a._cache) == N


def test_delete_by_another_connection_is_seen(two: tuple[SqliteCatalog, SqliteCatalog]) -> None:
    a, b = two
    _, ps = _fill(a)
    keys = [p.key for p in ps]
    assert a.get_many(keys) == ps
    assert b.delete_many(keys[:3]) == ps[:3]
    assert a.get_many(keys) == [None] * 3 + ps[3:]
    assert b.delete(keys[5]) == ps[5]
    assert a.get_many(keys)[5] is None


def test_move_and_quarantine_by_another_connection_are_seen(two: tuple[SqliteCatalog, SqliteCatalog]) -> None:
    a, b = two
    _, ps = _fill(a)
    keys = [p.key for p in ps]
    moved = _cached_move(a, b, ps, 1)
    got = a.get_many(keys)
    assert got[1] == moved and moved.version == 1 and got[0] == ps[0]
    assert b.quarantine(ps[2], "test")
    assert a.get_many(keys)[2] is None
    # the stale placement can no longer be committed over by a
    with pytest.raises(VersionConflictError):
        a.compare_and_set(ps[1], Placement(keys[1], "v", moved.segment_id, 0, 100, 1001, 0))
    assert a.get_many([keys[1]]) == [moved]


def test_change_by_another_connection_between_partial_hits(two: tuple[SqliteCatalog, SqliteCatalog]) -> None:
    a, b = two
    _, ps = _fill(a)
    keys = [p.key for p in ps]
    _, more = _fill(b, ns="other")  # a does not have these cached
    b.delete_many([keys[0]])
    got = a.get_many(keys + [p.key for p in more])
    assert got == [None] + ps[1:] + more


def test_own_writes_update_the_cache(two: tuple[SqliteCatalog, SqliteCatalog]) -> None:
    a, _ = two
    _, ps = _fill(a)
    keys = [p.key for p in ps]
    moved = _cached_move(a, a, ps, 0)
    seg2 = moved.segment_id
    assert a.get_many(keys)[0] == moved
    assert a.delete(keys[1]) == ps[1]
    assert a.quarantine(ps[2], "test")
    assert a.delete_many(keys[3:5]) == ps[3:5]
    assert a.get_many(keys)[:5] == [moved, None, None, None, None]
    # re-stored after the delete: the new placement, not the old one
    new = Placement(keys[1], "v", seg2, 0, 100, 7, 0)
    assert a.insert_if_absent([new]) == [new]
    assert a.get_many([keys[1]]) == [new]


def test_failed_write_leaves_no_stale_entry(two: tuple[SqliteCatalog, SqliteCatalog]) -> None:
    a, _ = two
    _, ps = _fill(a)
    keys = [p.key for p in ps]
    bad = Placement(BlockKey("ns", 10_000), "v", 987654, 0, 100, 1, 0)  # segment not recorded
    with pytest.raises(StorageError):
        a.insert_if_absent([bad])
    assert a.get_many([bad.key]) == [None]
    with pytest.raises(VersionConflictError):
        a.compare_and_set(Placement(keys[0], "v", ps[0].segment_id, 0, 100, 1000, 5), ps[0])
    assert a.get_many(keys) == ps


def test_other_process_changes_are_seen(tmp_path: Path) -> None:
    a = SqliteCatalog(tmp_path / "c.sqlite")
    try:
        _, ps = _fill(a)
        keys = [p.key for p in ps]
        assert a.get_many(keys) == ps
        code = (
            f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "from storage_backends import SqliteCatalog, BlockKey, Placement\n"
            f"c = SqliteCatalog({str(tmp_path / 'c.sqlite')!r})\n"
            "c.delete_many([BlockKey('ns', 0), BlockKey('ns', 1)])\n"
            "p = c.get_many([BlockKey('ns', 2)])[0]\n"
            "seg = c.new_segment('v', 100)\n"
            "c.compare_and_set(p, Placement(p.key, 'v', seg, 0, 100, p.checksum, 0))\n"
            "c.close()\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
        got = a.get_many(keys)
        assert got[:2] == [None, None]
        assert got[2] is not None and got[2].version == 1 and got[2].segment_id != ps[2].segment_id
        assert got[3:] == ps[3:]
    finally:
        a.close()


def test_threads_sharing_one_catalog_see_each_others_writes(tmp_path: Path) -> None:
    a = SqliteCatalog(tmp_path / "c.sqlite")
    _, ps = _fill(a, n=200)
    keys = [p.key for p in ps]
    errors: list[BaseException] = []

    def deleter() -> None:
        try:
            for k in keys:
                a.delete(k)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=deleter)
    t.start()
    seen_gone: set[BlockKey] = set()
    while t.is_alive():
        for k, p in zip(keys, a.get_many(keys)):
            if p is None:
                seen_gone.add(k)
            else:
                assert k not in seen_gone, "a deleted key came back from the cache"
    t.join()
    assert not errors
    assert a.get_many(keys) == [None] * len(keys)
    a.close()


def test_cache_bounds(tmp_path: Path) -> None:
    off = SqliteCatalog(tmp_path / "c.sqlite", cache_entries=0)
    _, ps = _fill(off)
    assert off.get_many([p.key for p in ps]) == ps and not off._cache
    small = SqliteCatalog(tmp_path / "c.sqlite", cache_entries=N // 2)
    assert small.get_many([p.key for p in ps]) == ps
    assert len(small._cache) <= N // 2
    assert small.get_many([p.key for p in ps[:10]]) == ps[:10]
    assert len(small._cache) <= N // 2
    with pytest.raises(InvalidRequestError):
        SqliteCatalog(tmp_path / "c.sqlite", cache_entries=-1)
    off.close()
    small.close()


def test_closed_catalog_raises(tmp_path: Path) -> None:
    a = SqliteCatalog(tmp_path / "c.sqlite")
    _, ps = _fill(a)
    a.close()
    with pytest.raises(StorageError):
        a.get_many([p.key for p in ps])


class _SubKey(BlockKey):  # type: ignore[misc]
    __slots__ = ()


class _SubInt(int):
    pass


@pytest.mark.parametrize("bad", [
    BlockKey("ns", True), BlockKey("ns", 1.0), BlockKey("ns", -1), BlockKey("ns", 1 << 64),  # type: ignore[arg-type]
    BlockKey("", 1), BlockKey(b"ns", 1), ("ns", 1), None,  # type: ignore[arg-type]
])
def test_column_wise_validation_rejects_what_the_per_key_one_does(bad: object) -> None:
    keys = [BlockKey("ns", i) for i in range(N)]
    keys[N // 2] = bad  # type: ignore[call-overload]
    with pytest.raises(InvalidRequestError) as per_key:
        for k in keys:
            validate_block_key(k)
    with pytest.raises(InvalidRequestError) as columns:
        validate_block_keys(keys)
    assert str(columns.value) == str(per_key.value)


def test_column_wise_validation_accepts_what_the_per_key_one_does(tmp_path: Path) -> None:
    keys = [BlockKey("ns", i) for i in range(N)] + [BlockKey("ns", (1 << 64) - 1), _SubKey("ns", 3),
                                                     BlockKey("ns", _SubInt(4))]
    validate_block_keys(keys)
    cat = SqliteCatalog(tmp_path / "c.sqlite")
    assert cat.get_many(keys) == [None] * len(keys)
    cat.close()
