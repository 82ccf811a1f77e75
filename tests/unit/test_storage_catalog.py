"""The placement-catalog contract, run on SqliteCatalog and on RedisCatalog (real Redis).

Every contract test takes ``new_cat``: a factory of catalogs that share one store (one
SQLite file, or one key prefix on the real Redis server), so tests can also open a second
"process"' view.  The Redis prefix is unique per test and deleted afterwards.
"""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from storage_backends.types import FENCE_NEWER_EPOCH
from storage_backends import (
    BlockKey,
    Fence,
    FencedError,
    InvalidRequestError,
    Placement,
    PlacementCatalog,
    RedisCatalog,
    SqliteCatalog,
    StorageError,
    VersionConflictError,
    VolumeFullError,
)

CatFactory = Callable[[], PlacementCatalog]


@pytest.fixture(params=["sqlite", "redis"])
def new_cat(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CatFactory]:
    made: list[PlacementCatalog] = []
    prefix = f"kvadvisor-test:{uuid.uuid4().hex}"

    def make() -> PlacementCatalog:
        if request.param == "sqlite":
            c: PlacementCatalog = SqliteCatalog(tmp_path / "catalog.sqlite")
        else:
            c = RedisCatalog(request.getfixturevalue("redis_url"), prefix=prefix)
        made.append(c)
        return c

    yield make
    if request.param == "redis":
        cleaner = RedisCatalog(request.getfixturevalue("redis_url"), prefix=prefix)
        cleaner.destroy()
        assert cleaner.client.keys("{" + prefix + "}*") == []
        cleaner.close()
    for c in made:
        c.close()


@pytest.fixture
def cat(new_cat: CatFactory) -> PlacementCatalog:
    return new_cat()


def _p(key: BlockKey, seg: int, off: int = 0, vol: str = "v", version: int = 0, ck: int = 7) -> Placement:
    return Placement(key, vol, seg, off, 100, ck, version)


def test_sqlite_uses_wal(tmp_path: Path) -> None:
    c = SqliteCatalog(tmp_path / "c.sqlite")
    assert c.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    c.close()


def test_u64_extremes_round_trip(cat: PlacementCatalog) -> None:
    seg = cat.new_segment("v", 300)
    keys = [BlockKey("ns", 0), BlockKey("ns", 1 << 63), BlockKey("ns", (1 << 64) - 1)]
    ps = [Placement(k, "v", seg, i * 100, 100, (1 << 64) - 1 - i, 0) for i, k in enumerate(keys)]
    assert cat.insert_if_absent(ps) == ps
    assert cat.get_many(keys) == ps
    assert cat.get(BlockKey("ns", 5)) is None
    assert [p.key for p in cat.iter_volume("v")] == keys


def test_insert_if_absent_keeps_the_first_placement(cat: PlacementCatalog) -> None:
    s1, s2 = cat.new_segment("v", 200), cat.new_segment("v", 200)
    a, b = BlockKey("ns", 1), BlockKey("ns", 2)
    first = cat.insert_if_absent([_p(a, s1)])
    assert first == [_p(a, s1)]
    # a again (other segment) plus b, and b twice in the same batch
    won = cat.insert_if_absent([_p(a, s2), _p(b, s2, 0), _p(b, s2, 100)])
    assert won == [_p(a, s1), _p(b, s2, 0), _p(b, s2, 0)]
    assert [(s.segment_id, s.live_blocks, s.live_bytes) for s in cat.segments("v")] == [(s1, 1, 100), (s2, 1, 100)]


def test_insert_into_unknown_segment_is_refused_and_records_nothing(cat: PlacementCatalog) -> None:
    seg = cat.new_segment("v", 100)
    a, b = BlockKey("ns", 1), BlockKey("ns", 2)
    with pytest.raises(StorageError, match="does not hold"):
        cat.insert_if_absent([_p(a, seg), _p(b, seg + 99)])
    assert cat.get_many([a, b]) == [None, None]
    with pytest.raises(StorageError):  # right id, wrong volume
        cat.insert_if_absent([_p(a, seg, vol="other")])


def test_compare_and_set_bumps_version_and_detects_conflicts(cat: PlacementCatalog) -> None:
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


def test_fenced_compare_and_set_refuses_a_stale_lease_holder(cat: PlacementCatalog) -> None:
    """A fence only rises; a writer whose token is below it changes nothing, one at or
    above it commits (and raises it in the same step)."""
    s1, s2, s3, s4 = (cat.new_segment("v", 100) for _ in range(4))
    k = BlockKey("ns", 11)
    (old,) = cat.insert_if_absent([_p(k, s1)])
    assert cat.raise_fence(Fence("ns.p3", 5)) == 5
    assert cat.raise_fence(Fence("ns.p3", 4)) == 5  # never lowered
    with pytest.raises(FencedError, match="token 5"):
        cat.compare_and_set(old, _p(k, s2), Fence("ns.p3", 4))
    assert cat.get(k) == old  # nothing changed
    moved = cat.compare_and_set(old, _p(k, s2), Fence("ns.p3", 5))
    assert (moved.segment_id, moved.version) == (s2, 1)
    # a commit with a newer token raises the fence: the token-5 holder is fenced off now
    moved = cat.compare_and_set(moved, _p(k, s3), Fence("ns.p3", 9))
    assert cat.raise_fence(Fence("ns.p3", 0)) == 9
    with pytest.raises(FencedError):
        cat.compare_and_set(moved, _p(k, s4), Fence("ns.p3", 5))
    assert cat.get(k) == moved
    # fences are independent by name, and an unfenced write is not checked
    assert cat.compare_and_set(moved, _p(k, s4), Fence("ns.p4", 1)).segment_id == s4
    assert cat.raise_fence(Fence("ns.p4", 0)) == 1
    with pytest.raises(InvalidRequestError):
        Fence("", 1)
    with pytest.raises(InvalidRequestError):
        Fence("x", -1)


def test_a_fence_of_a_newer_epoch_outranks_every_token_of_the_former(cat: PlacementCatalog) -> None:
    """Fences compare by (epoch, token): the tokens of a lease bucket created again start at
    1, and its epoch (creation time) puts them above the former bucket's, however high;
    within one epoch the tokens order as before, and an older epoch is refused."""
    s1, s2, s3 = (cat.new_segment("v", 100) for _ in range(3))
    k = BlockKey("ns", 12)
    (old,) = cat.insert_if_absent([_p(k, s1)])
    assert cat.raise_fence(Fence("ns.p0", 5000)) == 5000  # the former bucket (epoch 0)
    assert cat.raise_fence(Fence("ns.p0", 3, epoch=1_700_000_000_000_000)) == 3
    assert cat.raise_fence(Fence("ns.p0", 2, epoch=1_700_000_000_000_000)) == 3
    assert cat.raise_fence(Fence("ns.p0", 9000)) == FENCE_NEWER_EPOCH  # the former epoch: above its tokens
    with pytest.raises(FencedError):
        cat.compare_and_set(old, _p(k, s2), Fence("ns.p0", 9000))
    moved = cat.compare_and_set(old, _p(k, s2), Fence("ns.p0", 4, epoch=1_700_000_000_000_000))
    assert moved.segment_id == s2
    with pytest.raises(FencedError, match="token 4"):
        cat.compare_and_set(moved, _p(k, s3), Fence("ns.p0", 3, epoch=1_700_000_000_000_000))
    assert cat.compare_and_set(moved, _p(k, s3), Fence("ns.p0", 1, epoch=1_800_000_000_000_000)).segment_id == s3
    with pytest.raises(InvalidRequestError):
        Fence("x", 1, epoch=-1)


def test_sqlite_fences_of_a_catalog_without_epochs_read_as_epoch_0(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(str(path))
    db.execute("CREATE TABLE fences (name TEXT PRIMARY KEY, token INTEGER NOT NULL)")
    db.execute("INSERT INTO fences VALUES ('ns.p0', 7)")
    db.commit()
    db.close()
    cat = SqliteCatalog(path)
    try:
        assert cat.raise_fence(Fence("ns.p0", 3)) == 7
        assert cat.raise_fence(Fence("ns.p0", 1, epoch=5)) == 1
    finally:
        cat.close()


def test_delete_with_expected_version(cat: PlacementCatalog) -> None:
    seg = cat.new_segment("v", 100)
    k = BlockKey("ns", 3)
    cat.insert_if_absent([_p(k, seg)])
    with pytest.raises(VersionConflictError):
        cat.delete(k, expected_version=4)
    assert cat.delete(k, expected_version=0) == _p(k, seg)
    assert cat.delete(k) is None


def test_segments_accounting_capacity_and_drop(cat: PlacementCatalog) -> None:
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


def test_two_connections_share_one_store(new_cat: CatFactory) -> None:
    a, b = new_cat(), new_cat()
    sa, sb = a.new_segment("v", 100), b.new_segment("v", 100)
    assert sa != sb
    k = BlockKey("ns", 1)
    a.insert_if_absent([_p(k, sa)])
    assert b.insert_if_absent([_p(k, sb)]) == [_p(k, sa)]
    assert b.record_volume("v", "spec-1") == "spec-1"
    assert a.record_volume("v", "spec-2") == "spec-1"
    assert a.volume_specs() == {"v": "spec-1"}
    # b sees a's segment accounting
    assert [(s.segment_id, s.live_blocks) for s in b.segments("v")] == [(sa, 1), (sb, 0)]


def test_quarantine_only_the_current_placement(cat: PlacementCatalog) -> None:
    s1, s2 = cat.new_segment("v", 100), cat.new_segment("v", 100)
    k = BlockKey("ns", 1)
    (p,) = cat.insert_if_absent([_p(k, s1)])
    moved = cat.compare_and_set(p, _p(k, s2))
    assert cat.quarantine(p, "stale") is False
    assert cat.quarantine(moved, "bad bytes") is True
    assert cat.get(k) is None
    assert cat.quarantined() == [(moved, "bad bytes")]  # type: ignore[attr-defined]
    info = cat.segment("v", s2)
    assert info is not None and info.live_blocks == 0


def test_bad_keys_and_closed_catalog(cat: PlacementCatalog) -> None:
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


def test_rolled_back_transaction_leaves_no_partial_insert(cat: PlacementCatalog) -> None:
    seg = cat.new_segment("v", 100)
    good = _p(BlockKey("ns", 1), seg)
    with pytest.raises(InvalidRequestError):
        cat.insert_if_absent([good, _p(BlockKey("ns", -5), seg)])
    assert cat.get(good.key) is None
    assert cat.segment("v", seg).live_blocks == 0  # type: ignore[union-attr]
    if isinstance(cat, SqliteCatalog):
        assert isinstance(cat.db, sqlite3.Connection) and not cat.db.in_transaction


def test_cas_and_delete_keep_live_accounting_and_ordering(cat: PlacementCatalog) -> None:
    s1, s2 = cat.new_segment("v", 1000), cat.new_segment("v", 1000)
    other = cat.new_segment("w", 50)
    keys = [BlockKey("ns", h) for h in (5, 1, 9, 3)]
    # inserted out of offset order: iteration is by (segment, offset), not by insertion
    ps = cat.insert_if_absent([_p(k, s1, off=off) for k, off in zip(keys, (300, 0, 200, 100))])
    cat.insert_if_absent([Placement(BlockKey("ns", 77), "w", other, 0, 50, 1, 0)])
    assert [p.key.sequence_hash for p in cat.iter_segment("v", s1)] == [1, 3, 9, 5]
    moved = cat.compare_and_set(ps[2], Placement(keys[2], "v", s2, 0, 100, 7, 0))
    assert moved.version == 1
    assert [(p.key.sequence_hash, p.segment_id) for p in cat.iter_volume("v")] == [(1, s1), (3, s1), (5, s1), (9, s2)]
    assert [(s.segment_id, s.live_blocks, s.live_bytes, s.dead_bytes) for s in cat.segments("v")] == [
        (s1, 3, 300, 700), (s2, 1, 100, 900)]
    assert list(cat.iter_segment("w", s1)) == []  # a segment of another volume
    assert cat.delete(keys[0]) == ps[0]
    assert cat.delete_many([keys[1], keys[2], BlockKey("ns", 404)]) == [ps[1], moved, None]
    assert [(s.segment_id, s.live_blocks, s.live_bytes) for s in cat.segments("v")] == [(s1, 1, 100), (s2, 0, 0)]
    with pytest.raises(StorageError, match="still holds 1 blocks"):
        cat.forget_volume("v")
    cat.delete(keys[3])
    cat.record_volume("v", "spec")
    cat.forget_volume("v")
    assert cat.segments("v") == [] and cat.volume_specs() == {}
    assert [s.segment_id for s in cat.segments("w")] == [other]
    # capacity counts only the volume's remaining segments
    assert cat.new_segment("v", 900, capacity_bytes=1000) > other


def test_cas_to_an_unknown_segment_changes_nothing(cat: PlacementCatalog) -> None:
    s1 = cat.new_segment("v", 100)
    k = BlockKey("ns", 1)
    (p,) = cat.insert_if_absent([_p(k, s1)])
    with pytest.raises(StorageError, match="does not hold"):
        cat.compare_and_set(p, _p(k, s1 + 50))
    assert cat.get(k) == p and cat.segment("v", s1).live_blocks == 1  # type: ignore[union-attr]


@pytest.mark.timeout(60)
def test_a_move_and_a_concurrent_put_never_both_win(new_cat: CatFactory) -> None:
    """Two movers (compare-and-set to their own new segment) race a putter that replaces the
    block (delete expecting version 0, then insert a new placement), each thread on its own
    connection.  Per round exactly one of the three wins, and the catalog holds its placement."""
    cats = [new_cat() for _ in range(3)]
    rounds = 60
    barrier = threading.Barrier(3)
    setup = cats[0]
    plan = []
    for r in range(rounds):
        k = BlockKey("race", r)
        src, m1, m2, put = (setup.new_segment("v", 100) for _ in range(4))
        (p0,) = setup.insert_if_absent([_p(k, src)])
        plan.append((p0, _p(k, m1, ck=1), _p(k, m2, ck=2), _p(k, put, ck=3)))
    wins: list[list[str]] = [[] for _ in range(rounds)]
    errors: list[BaseException] = []

    def mover(idx: int) -> None:
        c = cats[idx]
        try:
            for r, (p0, n1, n2, _) in enumerate(plan):
                barrier.wait(timeout=20)
                try:
                    c.compare_and_set(p0, n1 if idx == 0 else n2)
                    wins[r].append(f"move{idx}")
                except VersionConflictError:
                    pass
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    def putter() -> None:
        c = cats[2]
        try:
            for r, (p0, _, _, np_) in enumerate(plan):
                barrier.wait(timeout=20)
                try:
                    c.delete(p0.key, expected_version=0)
                except VersionConflictError:
                    continue
                assert c.insert_if_absent([np_]) == [np_]
                wins[r].append("put")
        except BaseException as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=mover, args=(0,)), threading.Thread(target=mover, args=(1,)),
               threading.Thread(target=putter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert all(len(w) == 1 for w in wins), [w for w in wins if len(w) != 1]
    final = setup.get_many([p0.key for p0, *_ in plan])
    for (p0, n1, n2, np_), w, f in zip(plan, wins, final):
        want = {"move0": (n1, 1), "move1": (n2, 1), "put": (np_, 0)}[w[0]]
        assert f is not None and (f.segment_id, f.checksum, f.version) == (want[0].segment_id, want[0].checksum, want[1])
    # live accounting matches the placements exactly: one live block per round
    live = {s.segment_id: s.live_blocks for s in setup.segments("v")}
    assert sum(live.values()) == rounds
    assert all(live[f.segment_id] == 1 for f in final if f is not None)
