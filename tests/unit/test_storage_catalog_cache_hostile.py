"""Hostile review of SqliteCatalog's placement cache (commit 7290f78).

Every test compares what the cached catalog answers with the database truth, read through
a SEPARATE plain ``sqlite3`` connection (or a fresh uncached catalog), while other
connections, threads, processes and failing transactions change the file underneath.
Raw SQL is only ever run through such a separate connection, to play "another writer"
(what ``PRAGMA data_version`` tracks).  The tests under "bugs" reproduced real bugs of
the cache (marked ``xfail(strict=True)`` until they were fixed); the others guard the
behaviour that held.
"""

from __future__ import annotations

import mmap
import os
import random
import sqlite3
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from storage_backends import (
    BlockKey,
    Placement,
    SqliteCatalog,
    StorageError,
    VersionConflictError,
)

ROOT = Path(__file__).resolve().parents[2]
TOP = (1 << 64) - 1
EDGE_HASHES = [0, 1, (1 << 63) - 1, 1 << 63, (1 << 63) + 1, TOP - 1, TOP]


# ---------------------------------------------------------------------------- truth
def _u(v: int) -> int:
    return v + (1 << 64) if v < 0 else v


def _s(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def truth(path: Path, keys: Sequence[BlockKey]) -> list[Placement | None]:
    """The database's committed placements of ``keys``, read through a new plain sqlite3
    connection (independent of SqliteCatalog's code and cache)."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        out: list[Placement | None] = []
        for k in keys:
            r = db.execute(
                "SELECT volume, segment, off, len, checksum, version FROM placements WHERE ns=? AND seq=?",
                (k.namespace, _s(k.sequence_hash)),
            ).fetchone()
            out.append(None if r is None else Placement(
                BlockKey(k.namespace, k.sequence_hash), r[0], r[1], r[2], r[3], _u(r[4]), r[5]))
        return out
    finally:
        db.close()


def _norm(p: Placement | None) -> tuple[object, ...] | None:
    """A placement's fields with their types (the key as a plain (namespace, hash) pair:
    a BlockKey subclass naming the same row compares equal)."""
    if p is None:
        return None
    vals = (p.key.namespace, p.key.sequence_hash, p.volume_id, p.segment_id, p.offset, p.length,
            p.checksum, p.version)
    return tuple((type(v).__name__, v) for v in vals)


def assert_truth(cat: SqliteCatalog, keys: Sequence[BlockKey]) -> None:
    """``cat.get_many`` (cached), ``cat.get`` (uncached) and a separate connection agree
    (field by field, types included)."""
    want = [_norm(p) for p in truth(cat.path, keys)]
    assert [_norm(p) for p in cat.get_many(keys)] == want
    assert [_norm(cat.get(k)) for k in keys] == want


def _fill(cat: SqliteCatalog, hashes: Sequence[int], ns: str = "ns", vol: str = "v") -> list[Placement]:
    seg = cat.new_segment(vol, 100 * len(hashes))
    ps = [Placement(BlockKey(ns, h), vol, seg, 100 * i, 100, (h * 7919 + 1) % (1 << 64), 0)
          for i, h in enumerate(hashes)]
    assert cat.insert_if_absent(ps) == ps
    cat.seal_segment(vol, seg)
    return ps


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "c.sqlite"


@pytest.fixture
def cats(path: Path) -> Iterator[tuple[SqliteCatalog, SqliteCatalog]]:
    a = SqliteCatalog(path)
    b = SqliteCatalog(path)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def filled(cats: tuple[SqliteCatalog, SqliteCatalog]) -> tuple[SqliteCatalog, SqliteCatalog, list[Placement], list[BlockKey]]:
    """``a`` (which wrote, so cached) and ``b`` on one file holding a placement per edge hash."""
    a, b = cats
    ps = _fill(a, EDGE_HASHES)
    return a, b, ps, [p.key for p in ps]


def _raw(path: Path) -> sqlite3.Connection:
    """Another writer: a plain connection, autocommit, waiting for the write lock."""
    c = sqlite3.connect(str(path), isolation_level=None, timeout=30)
    c.execute("PRAGMA busy_timeout = 30000")
    return c


# ---------------------------------------------------------------------------- randomized model check
@pytest.mark.parametrize("cache_entries", [0, 1, 3, 64, 1 << 20])
def test_random_writes_by_three_connections_never_show_a_stale_placement(path: Path, cache_entries: int) -> None:
    """A cached catalog ``a`` (several cache bounds), another catalog ``b`` and a raw
    sqlite3 writer ``c`` interleave inserts, moves, deletes, quarantines and raw UPDATE /
    DELETE / INSERT at random; after every step ``a``'s answers (random subsets with
    duplicates, hashes at and past 2**63, one and many namespaces) are the database's."""
    rnd = random.Random(cache_entries * 7 + 1)
    a = SqliteCatalog(path, cache_entries=cache_entries)
    b = SqliteCatalog(path)
    c = _raw(path)
    try:
        spaces = ["ns"] + [f"n{i}" for i in range(6)]
        hashes = EDGE_HASHES + [(1 << 63) + 977 * i for i in range(2, 8)] + list(range(2, 8))
        keys = [BlockKey(rnd.choice(spaces), h) for h in hashes] + [BlockKey("ns", h) for h in hashes]
        keys = list(dict.fromkeys(keys))
        segs = [a.new_segment("v", 1 << 20) for _ in range(3)]

        def place(k: BlockKey) -> Placement:
            return Placement(k, "v", rnd.choice(segs), rnd.randrange(0, 1 << 20, 64), 64, rnd.randrange(1 << 64), 0)

        for step in range(250):
            op = rnd.randrange(12)
            who = rnd.choice([a, b])
            k = rnd.choice(keys)
            try:
                if op == 0:
                    who.insert_if_absent([place(rnd.choice(keys)) for _ in range(rnd.randrange(1, 6))])
                elif op in (1, 2):  # move what the writer last saw (may be stale: conflicts are fine)
                    cur = who.get_many([k])[0]
                    if cur is not None:
                        who.compare_and_set(cur, place(k))
                elif op == 3:
                    who.delete(k)
                elif op == 4:
                    who.delete_many(rnd.sample(keys, 4) + [k, k])
                elif op == 5:
                    cur = who.get_many([k])[0]
                    if cur is not None:
                        who.quarantine(cur, "test")
                elif op == 6:
                    c.execute("DELETE FROM placements WHERE ns=? AND seq=?", (k.namespace, _s(k.sequence_hash)))
                elif op == 7:
                    c.execute("UPDATE placements SET segment=?, version=version+1 WHERE ns=? AND seq=?",
                              (rnd.choice(segs), k.namespace, _s(k.sequence_hash)))
                elif op == 8:
                    p = place(k)
                    c.execute("INSERT OR IGNORE INTO placements VALUES (?,?,?,?,?,?,?,?)",
                              (k.namespace, _s(k.sequence_hash), p.volume_id, p.segment_id, p.offset,
                               p.length, _s(p.checksum), 0))
                elif op == 9:  # a write of a's that changes no placement, after someone else's
                    a.seal_segment("v", rnd.choice(segs))
            except VersionConflictError:
                pass
            sub = rnd.sample(keys, rnd.randrange(1, len(keys)))
            sub += rnd.sample(sub, min(3, len(sub)))  # duplicates
            want = truth(path, sub)
            assert a.get_many(sub) == want, f"step {step} op {op}"
            assert a.get(sub[0]) == want[0]
            if cache_entries:
                assert len(a._cache) <= cache_entries
        assert_truth(a, keys)
    finally:
        c.close()
        a.close()
        b.close()


# ---------------------------------------------------------------------------- concurrency
def test_reads_are_linearizable_against_a_writer_thread_on_another_connection(cats) -> None:  # type: ignore[no-untyped-def]
    """A reader thread on ``a`` must see every move that ``b`` (another thread) finished
    before the read started, never a version older than that, and never go backwards; a
    third thread writes through ``a`` itself at the same time."""
    a, b = cats
    ps = _fill(a, EDGE_HASHES + list(range(10, 50)))
    keys = [p.key for p in ps]
    seg2 = b.new_segment("v", 1 << 20)
    done = [0]  # version of keys[0] b has committed (written after the commit returns)
    stop = threading.Event()
    errors: list[BaseException] = []

    def mover() -> None:
        try:
            cur = ps[0]
            for _ in range(300):
                cur = b.compare_and_set(cur, Placement(cur.key, "v", seg2, 0, 100, cur.checksum, 0))
                done[0] = cur.version
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            stop.set()

    def own_writer() -> None:
        try:
            while not stop.is_set():
                for p in ps[5:10]:
                    a.delete(p.key)
                a.insert_if_absent(ps[5:10])
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    ts = [threading.Thread(target=mover), threading.Thread(target=own_writer)]
    for t in ts:
        t.start()
    last = -1
    reads = 0
    while not stop.is_set() or reads < 10:
        before = done[0]
        got = a.get_many(keys)
        assert got[0] is not None and got[0].version >= before, "a committed move was not seen"
        assert got[0].version >= last, "versions went backwards"
        last = got[0].version
        assert got[1:5] == ps[1:5] and got[10:] == ps[10:]
        reads += 1
    for t in ts:
        t.join(30)
    assert not errors
    assert a.get_many(keys)[0].version == 300
    assert_truth(a, keys)


_CHILD = r"""
import mmap, struct, sys
sys.path.insert(0, sys.argv[1])
from storage_backends import SqliteCatalog, BlockKey, Placement
cat = SqliteCatalog(sys.argv[2])
f = open(sys.argv[3], "r+b"); m = mmap.mmap(f.fileno(), 8)
k = BlockKey("ns", int(sys.argv[4]))
seg = cat.new_segment("v", 1 << 20)
cur = cat.get_many([k])[0]
for i in range(200):
    cur = cat.compare_and_set(cur, Placement(k, "v", seg, 64 * (i % 50), 100, cur.checksum, 0))
    m[:8] = struct.pack("<q", cur.version)   # after the commit returned
cat.delete(k)
m[:8] = struct.pack("<q", -1)
cat.close()
"""


def test_reads_are_linearizable_against_a_writer_process(tmp_path: Path, path: Path) -> None:
    """Another process moves a key 200 times then deletes it; every read of this process
    started after a commit returned there sees that commit (shared-memory handshake)."""
    a = SqliteCatalog(path)
    try:
        ps = _fill(a, [TOP, 1 << 63, 5])
        keys = [p.key for p in ps]
        shm = tmp_path / "shm"
        shm.write_bytes(struct.pack("<q", 0))
        with open(shm, "r+b") as f:
            m = mmap.mmap(f.fileno(), 8)
            proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(ROOT), str(path), str(shm), str(TOP)])
            deleted_seen = False
            while proc.poll() is None or not deleted_seen:
                before = struct.unpack("<q", m[:8])[0]
                got = a.get_many(keys)
                assert got[1:] == ps[1:]
                if before == -1:
                    assert got[0] is None, "a delete committed by another process was not seen"
                    deleted_seen = True
                elif got[0] is not None:
                    assert got[0].version >= before, f"saw version {got[0].version} after {before} committed"
                else:
                    deleted_seen = True
                if proc.poll() is not None and proc.returncode != 0:
                    break
            assert proc.wait(60) == 0
            m.close()
        assert a.get_many(keys) == [None] + ps[1:]
        assert_truth(a, keys)
    finally:
        a.close()


# ---------------------------------------------------------------------------- failing transactions
def test_failed_writes_roll_back_and_the_cache_follows(filled) -> None:  # type: ignore[no-untyped-def]
    a, b, ps, keys = filled
    seg = ps[0].segment_id
    new = Placement(BlockKey("ns", 424242), "v", seg, 0, 100, 1, 0)
    # a batch whose second placement names an unknown segment: the first must not stick
    with pytest.raises(StorageError):
        a.insert_if_absent([new, Placement(BlockKey("ns", 424243), "v", 987654, 0, 100, 1, 0)])
    assert_truth(a, keys + [new.key])
    assert a.get_many([new.key]) == [None]
    # an error raised while binding, in the middle of the body (checksum 2**66: past i64 even
    # after the u64 -> i64 shift)
    with pytest.raises(OverflowError):
        a.insert_if_absent([new, Placement(BlockKey("ns", 424244), "v", seg, 0, 100, 1 << 66, 0)])
    assert a.get_many([new.key, BlockKey("ns", 424244)]) == [None, None]
    # b moved keys[3]: a's compare-and-set of its stale copy fails, and a sees b's move
    moved = b.compare_and_set(ps[3], Placement(keys[3], "v", seg, 900, 100, 5, 0))
    with pytest.raises(VersionConflictError):
        a.compare_and_set(ps[3], Placement(keys[3], "v", seg, 800, 100, 5, 0))
    assert a.get_many([keys[3]]) == [moved]
    with pytest.raises(VersionConflictError):
        a.delete(keys[3], expected_version=0)
    assert_truth(a, keys)
    # the compare-and-set's segment is not in the catalog: StorageError after the select
    with pytest.raises(StorageError):
        a.compare_and_set(moved, Placement(keys[3], "v", 987654, 0, 100, 5, 0))
    assert_truth(a, keys)


def test_interrupt_after_the_cache_was_updated_but_before_commit(filled) -> None:  # type: ignore[no-untyped-def]
    """A KeyboardInterrupt (any BaseException) between the body's cache update and the
    COMMIT rolls the transaction back: the cache must not serve the rolled-back state."""
    a, _, ps, keys = filled
    assert a.get_many(keys) == ps
    real = a._cache_fill

    def fill_then_interrupt(placements):  # type: ignore[no-untyped-def]
        real(placements)
        raise KeyboardInterrupt

    a._cache_fill = fill_then_interrupt  # type: ignore[method-assign]
    new = Placement(keys[2], "v", ps[0].segment_id, 4000, 100, 9, 0)
    with pytest.raises(KeyboardInterrupt):
        a.compare_and_set(ps[2], new)
    with pytest.raises(KeyboardInterrupt):
        a.insert_if_absent([Placement(BlockKey("ns", 77), "v", ps[0].segment_id, 0, 1, 1, 0)])
    del a._cache_fill
    assert not a.db.in_transaction
    assert_truth(a, keys + [BlockKey("ns", 77)])
    assert a.get_many([keys[2], BlockKey("ns", 77)]) == [ps[2], None]


class _CommitFails:
    """Proxy of a sqlite3 connection whose next COMMIT fails the way SQLite fails an I/O
    error at commit time: the transaction is rolled back and the statement raises."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        self.armed = True

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        if self.armed and sql == "COMMIT":
            self.armed = False
            self._db.execute("ROLLBACK")
            raise sqlite3.OperationalError("disk I/O error")
        return self._db.execute(sql, *args)

    def __getattr__(self, name: str) -> object:
        return getattr(self._db, name)


@pytest.mark.parametrize("op", ["insert", "cas", "delete", "delete_many", "quarantine"])
def test_commit_that_fails_leaves_no_uncommitted_placement_in_the_cache(filled, op: str) -> None:  # type: ignore[no-untyped-def]
    a, _, ps, keys = filled
    assert a.get_many(keys) == ps
    real = a._db
    a._db = _CommitFails(real)  # type: ignore[assignment]
    try:
        with pytest.raises(sqlite3.OperationalError):
            if op == "insert":
                a.insert_if_absent([Placement(BlockKey("ns", 99), "v", ps[0].segment_id, 0, 1, 1, 0)])
            elif op == "cas":
                a.compare_and_set(ps[1], Placement(keys[1], "v", ps[0].segment_id, 5000, 100, 1, 0))
            elif op == "delete":
                a.delete(keys[1])
            elif op == "delete_many":
                a.delete_many(keys[:4])
            else:
                a.quarantine(ps[1], "test")
    finally:
        a._db = real
    assert_truth(a, keys + [BlockKey("ns", 99)])
    assert a.get_many(keys) == ps


class _CommitFailsOpen(_CommitFails):
    """A COMMIT that raises and leaves the transaction open (SQLITE_BUSY at commit time
    does that): the write lock stays held unless the catalog rolls back."""

    def execute(self, sql: str, *args: object) -> sqlite3.Cursor:
        if self.armed and sql == "COMMIT":
            self.armed = False
            raise sqlite3.OperationalError("database is locked")
        return self._db.execute(sql, *args)


def test_commit_that_fails_open_is_rolled_back_so_the_connection_and_the_lock_are_free(filled, path: Path) -> None:  # type: ignore[no-untyped-def]
    a, _, ps, keys = filled
    real = a._db
    a._db = _CommitFailsOpen(real)  # type: ignore[assignment]
    try:
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            a.delete(keys[1])
    finally:
        a._db = real
    assert not real.in_transaction  # rolled back, not left holding the write lock
    other = SqliteCatalog(path, busy_timeout_s=0.5)  # another writer gets the lock at once
    try:
        other.delete(keys[2])
    finally:
        other.close()
    assert a.get_many(keys[:3]) == [ps[0], ps[1], None]  # the failed delete changed nothing
    a.delete(keys[1])  # and this connection still writes
    assert_truth(a, keys)


def test_write_lock_held_by_another_writer(path: Path) -> None:
    """Another connection holds the write lock with uncommitted changes: a's writes time
    out (short busy timeout), a's reads answer the committed state, and once the other
    writer commits, a sees its changes."""
    a = SqliteCatalog(path, busy_timeout_s=0.05)
    c = _raw(path)
    try:
        ps = _fill(a, EDGE_HASHES)
        keys = [p.key for p in ps]
        assert a.get_many(keys) == ps
        c.execute("BEGIN IMMEDIATE")
        c.execute("DELETE FROM placements WHERE ns='ns' AND seq=?", (_s(keys[0].sequence_hash),))
        c.execute("UPDATE placements SET off=12345, version=version+1 WHERE ns='ns' AND seq=?",
                  (_s(keys[3].sequence_hash),))
        for write in (lambda: a.delete(keys[1]),
                      lambda: a.compare_and_set(ps[2], Placement(keys[2], "v", ps[2].segment_id, 7, 100, 1, 0)),
                      lambda: a.insert_if_absent([Placement(BlockKey("ns", 99), "v", ps[0].segment_id, 0, 1, 1, 0)])):
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                write()
            assert a.get_many(keys) == ps  # committed state only
        assert truth(path, keys) == ps
        c.execute("COMMIT")
        got = a.get_many(keys)
        assert got[0] is None and got[3] is not None and got[3].offset == 12345 and got[3].version == 1
        assert_truth(a, keys)
        # and a can write again
        assert a.delete(keys[1]) == ps[1]
        assert_truth(a, keys)
    finally:
        c.close()
        a.close()


_HOLDER = r"""
import sqlite3, sys, time
c = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
c.execute("BEGIN IMMEDIATE")
c.execute("DELETE FROM placements")
c.execute("UPDATE segments SET sealed = 0")
print("locked", flush=True)
time.sleep(120)
"""


def test_other_process_killed_while_holding_the_write_lock(path: Path) -> None:
    """Another process deletes every placement in a write transaction and is killed -9
    before it commits: a's cached answers stay the committed state, and a can write once
    the dead process's lock is gone."""
    a = SqliteCatalog(path, busy_timeout_s=5)
    try:
        ps = _fill(a, EDGE_HASHES)
        keys = [p.key for p in ps]
        proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
            assert a.get_many(keys) == ps
        finally:
            proc.kill()
            proc.wait(30)
        assert a.get_many(keys) == ps
        assert_truth(a, keys)
        assert a.delete(keys[0]) == ps[0]
        moved = a.compare_and_set(ps[1], Placement(keys[1], "v", ps[1].segment_id, 4242, 100, 1, 0))
        assert a.get_many(keys[:2]) == [None, moved]
        assert_truth(a, keys)
    finally:
        a.close()


# ---------------------------------------------------------------------------- the file itself
def test_database_restored_in_place_from_a_backup(tmp_path: Path, path: Path) -> None:
    """An operator restores the catalog file from a backup (sqlite3 backup API into the
    live file) while a has it cached: a must answer the restored content."""
    a = SqliteCatalog(path)
    try:
        ps = _fill(a, EDGE_HASHES)
        keys = [p.key for p in ps]
        snap = sqlite3.connect(str(tmp_path / "backup.sqlite"))
        with sqlite3.connect(str(path)) as src:
            src.backup(snap)
        a.delete_many(keys[:3])
        a.compare_and_set(ps[4], Placement(keys[4], "v", ps[4].segment_id, 7777, 100, 1, 0))
        assert a.get_many(keys)[:3] == [None] * 3
        dst = sqlite3.connect(str(path), timeout=30)
        snap.backup(dst)
        dst.close()
        snap.close()
        assert a.get_many(keys) == ps
        assert_truth(a, keys)
    finally:
        a.close()


def test_database_file_deleted_and_recreated_under_an_open_catalog(path: Path) -> None:
    """The files are unlinked and a new catalog is created at the same path: the open
    catalog keeps its (now unlinked) database; cached and uncached reads must still agree
    with each other, and the new file holds only what was written to it."""
    a = SqliteCatalog(path)
    try:
        ps = _fill(a, EDGE_HASHES)
        keys = [p.key for p in ps]
        assert a.get_many(keys) == ps
        for suffix in ("", "-wal", "-shm"):
            p = Path(str(path) + suffix)
            if p.exists():
                p.unlink()
        b = SqliteCatalog(path)
        other = _fill(b, EDGE_HASHES[:2], ns="ns")
        assert truth(path, keys) == other + [None] * (len(keys) - 2)
        got = a.get_many(keys)
        assert got == [a.get(k) for k in keys]
        b.close()
    finally:
        a.close()


def test_writer_through_a_symlink_to_the_file(tmp_path: Path, path: Path) -> None:
    """Another catalog opens the same file through a symlink (another path spelling):
    SQLite resolves it to the same WAL, so its commits must reach a's cache too."""
    a = SqliteCatalog(path)
    try:
        ps = _fill(a, EDGE_HASHES)
        keys = [p.key for p in ps]
        link = tmp_path / "link.sqlite"
        link.symlink_to(path)
        b = SqliteCatalog(link)
        assert a.get_many(keys) == ps
        b.delete_many(keys[:2])
        b.compare_and_set(ps[2], Placement(keys[2], "v", ps[2].segment_id, 9999, 100, 3, 0))
        got = a.get_many(keys)
        assert got[:2] == [None, None] and got[2] is not None and got[2].offset == 9999
        assert_truth(a, keys)
        b.close()
    finally:
        a.close()


def test_close_then_reopen(filled) -> None:  # type: ignore[no-untyped-def]
    a, b, ps, keys = filled
    assert a.get_many(keys) == ps
    a.close()
    a.close()  # idempotent
    with pytest.raises(StorageError):
        a.get_many(keys)
    with pytest.raises(StorageError):
        a.get_many([])
    b.delete_many(keys[:2])
    a2 = SqliteCatalog(a.path)
    try:
        assert a2.get_many(keys) == [None, None] + ps[2:]
        assert_truth(a2, keys)
    finally:
        a2.close()


# ---------------------------------------------------------------------------- shapes of calls
@pytest.mark.parametrize("cache_entries", [0, 100, 1 << 20])
def test_huge_key_lists_across_namespaces(path: Path, cache_entries: int) -> None:
    """12 000 keys of 6 namespaces (the ``(ns, seq) IN (VALUES ...)`` path), hashes spread
    over the whole u64 range, every key asked twice; another connection deletes and moves
    a scattered subset in one transaction between two reads."""
    rnd = random.Random(5)
    a = SqliteCatalog(path, cache_entries=cache_entries)
    c = _raw(path)
    try:
        hashes = list({rnd.randrange(1 << 64) for _ in range(2000)} | set(EDGE_HASHES))
        ps: list[Placement] = []
        for i in range(6):
            ps += _fill(a, hashes, ns=f"space{i}")
        keys = [p.key for p in ps]
        ask = keys + keys[::-1]
        assert a.get_many(ask) == ps + ps[::-1]
        c.execute("BEGIN IMMEDIATE")
        for p in ps[::7]:
            c.execute("DELETE FROM placements WHERE ns=? AND seq=?", (p.key.namespace, _s(p.key.sequence_hash)))
        for p in ps[3::13]:
            c.execute("UPDATE placements SET off=off+1, version=version+1 WHERE ns=? AND seq=?",
                      (p.key.namespace, _s(p.key.sequence_hash)))
        c.execute("COMMIT")
        want = truth(path, keys)
        assert a.get_many(ask) == want + want[::-1]
        assert a.get_many(ask) == want + want[::-1]  # from the cache this time
        if cache_entries:
            assert len(a._cache) <= cache_entries
    finally:
        c.close()
        a.close()


def test_duplicate_keys_and_get_agree_with_get_many(filled) -> None:  # type: ignore[no-untyped-def]
    a, b, ps, keys = filled
    dup = [keys[0], keys[0], keys[5], keys[0], BlockKey("ns", 31337), keys[5]]
    assert a.get_many(dup) == [ps[0], ps[0], ps[5], ps[0], None, ps[5]]
    b.delete(keys[0])
    assert a.get_many(dup) == [None, None, ps[5], None, None, ps[5]]
    # equal keys built separately (other objects) hit the same entries
    fresh = [BlockKey("ns", h) for h in EDGE_HASHES]
    assert a.get_many(fresh) == [None] + ps[1:]
    assert [a.get(k) for k in fresh] == a.get_many(fresh)
    assert a.delete_many([keys[1], keys[1]]) == [ps[1], None]
    assert_truth(a, keys + [BlockKey("ns", 31337)])


# ---------------------------------------------------------------------------- bugs
class _SubKey(BlockKey):  # type: ignore[misc]
    """A BlockKey subclass: ``validate_block_key`` accepts it (isinstance), SQLite maps it
    to the same row, but the dataclass ``__eq__`` makes it unequal to a plain BlockKey
    with the same fields (same hash, different dict key)."""

    __slots__ = ()


# Was xfail(strict), now fixed. BUG: the cache is keyed by BlockKey objects, so a BlockKey subclass
# (accepted by validate_block_key) and a plain BlockKey naming the same row are two cache entries; a
# write through one leaves the other's entry stale
@pytest.mark.parametrize("op", ["delete", "delete_many", "quarantine", "compare_and_set", "reverse_delete"])
def test_block_key_subclass_write_leaves_a_stale_entry(filled, op: str) -> None:  # type: ignore[no-untyped-def]
    a, _, ps, _ = filled
    p = ps[1]
    plain, sub = BlockKey("ns", 1), _SubKey("ns", 1)
    assert a.get_many([plain]) == [p]  # cached under the plain key
    assert a.get_many([sub])[0] is not None  # and under the subclass key
    if op == "delete":
        assert a.delete(sub) is not None
    elif op == "delete_many":
        assert a.delete_many([sub]) != [None]
    elif op == "quarantine":  # quarantine drops cur.key (a plain key) only
        assert a.quarantine(p, "test")
    elif op == "compare_and_set":
        old = Placement(sub, p.volume_id, p.segment_id, p.offset, p.length, p.checksum, p.version)
        a.compare_and_set(old, Placement(sub, "v", p.segment_id, 5000, 100, 3, 0))
    else:
        assert a.delete(plain) == p
    assert_truth(a, [plain, sub])


# Was xfail(strict), now fixed. BUG: insert_if_absent / compare_and_set cache the caller's Placement
# as given, not the row SQLite stored (affinity turns '0' into 0, a negative checksum is read back as
# its u64), so get_many answers something get and every other process do not
@pytest.mark.parametrize("field", ["checksum", "checksum_2_64", "offset", "segment_id", "cas_checksum"])
def test_non_canonical_placement_fields_are_cached_as_given(cats, field: str) -> None:  # type: ignore[no-untyped-def]
    a, _ = cats
    seg = a.new_segment("v", 1000)
    k = BlockKey("ns", 7)
    base = Placement(k, "v", seg, 0, 100, 5, 0)
    if field == "cas_checksum":
        a.insert_if_absent([base])
        a.compare_and_set(base, Placement(k, "v", seg, 0, 100, -1, 0))
    else:
        name, bad = {"checksum": ("checksum", -1), "checksum_2_64": ("checksum", 1 << 64),
                     "offset": ("offset", "0"), "segment_id": ("segment_id", str(seg))}[field]
        p = Placement(k, "v", seg, 0, 100, 5, 0)
        object.__setattr__(p, name, bad)  # the dataclass does not check types either
        assert a.insert_if_absent([p]) == [p]
    assert_truth(a, [k])


# Was xfail(strict), now fixed. BUG: get_many indexes keys[i] on a partial cache hit: a set / dict
# view of keys (accepted before 7290f78, and still when all or none hit) raises TypeError, so the
# outcome depends on what the cache holds
def test_keys_that_are_not_a_sequence_answer_the_same_whatever_the_cache_holds(filled) -> None:  # type: ignore[no-untyped-def]
    a, _, ps, _ = filled
    keys = {ps[0].key, BlockKey("ns", 3)}
    a._cache.clear()
    cold = a.get_many(keys)  # type: ignore[arg-type]
    assert sorted(p is None for p in cold) == [False, True]
    a.get_many([ps[0].key])
    warm = a.get_many(keys)  # type: ignore[arg-type]
    assert warm == cold
