"""SQLite placement catalog, shared by several processes through one database file.

WAL mode lets readers run while one writer commits; every read-modify-write runs in a
short ``BEGIN IMMEDIATE`` transaction (the write lock is taken up front, so two processes
never both read the old state and both write), and ``busy_timeout`` makes a waiting
process block instead of failing.  Hashes are u64; SQLite integers are signed 64-bit, so
sequence hashes and checksums are stored in two's complement (``keys.u64_to_i64``).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .catalog import PlacementCatalog
from .keys import i64_to_u64, u64_to_i64, validate_block_key, validate_block_keys
from .types import (
    BlockKey,
    FENCE_NEWER_EPOCH,
    Fence,
    FencedError,
    InvalidRequestError,
    Placement,
    SegmentInfo,
    StorageError,
    VersionConflictError,
    VolumeFullError,
)

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS placements (
    ns TEXT NOT NULL, seq INTEGER NOT NULL,
    volume TEXT NOT NULL, segment INTEGER NOT NULL,
    off INTEGER NOT NULL, len INTEGER NOT NULL,
    checksum INTEGER NOT NULL, version INTEGER NOT NULL,
    PRIMARY KEY (ns, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS placements_by_segment ON placements (volume, segment, off);
CREATE TABLE IF NOT EXISTS segments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    volume TEXT NOT NULL, size INTEGER NOT NULL,
    sealed INTEGER NOT NULL DEFAULT 0, created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS segments_by_volume ON segments (volume, id);
CREATE TABLE IF NOT EXISTS volumes (id TEXT PRIMARY KEY, spec TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS fences (name TEXT PRIMARY KEY, token INTEGER NOT NULL, epoch INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS quarantine (
    ns TEXT NOT NULL, seq INTEGER NOT NULL, volume TEXT NOT NULL, segment INTEGER NOT NULL,
    off INTEGER NOT NULL, len INTEGER NOT NULL, checksum INTEGER NOT NULL,
    version INTEGER NOT NULL, reason TEXT NOT NULL, at REAL NOT NULL
);
"""

_COLS = "ns, seq, volume, segment, off, len, checksum, version"
_IN_CHUNK = 500  # keys per IN (...) query (SQLite allows 32766 parameters)
_PAIR_CHUNK = 400  # (ns, seq) pairs per row-value IN (VALUES ...) query
_U64 = 1 << 64


def _signed(keys: Sequence[BlockKey]) -> list[int]:
    """``u64_to_i64`` of every key's sequence hash (validated keys: u64 ints)."""
    if len(keys) < 64:
        return [u64_to_i64(k.sequence_hash) for k in keys]
    return np.fromiter((k.sequence_hash for k in keys), dtype=np.uint64, count=len(keys)).view(np.int64).tolist()


_NEW = object.__new__
_SET = tuple(getattr(Placement, f).__set__ for f in
             ("key", "volume_id", "segment_id", "offset", "length", "checksum", "version"))


def _fast_placement(key: BlockKey, volume_id: str, segment_id: int, offset: int, length: int,
                    checksum: int, version: int) -> Placement:
    """``Placement(...)`` of trusted catalog values, built through the slots' descriptors
    (the frozen dataclass ``__init__`` goes through ``object.__setattr__`` per field:
    2x slower).  Equal to, and indistinguishable from, a normally built one."""
    p = _NEW(Placement)
    sk, sv, ss, so, sl, sc, sver = _SET
    sk(p, key)
    sv(p, volume_id)
    ss(p, segment_id)
    so(p, offset)
    sl(p, length)
    sc(p, checksum)
    sver(p, version)
    return p


def _cacheable(p: Placement) -> bool:
    """Whether ``p`` is exactly what reading its row back gives (plain key, ``str`` volume,
    ``int`` fields, a checksum in [0, 2**64)): only such placements are cached, so the
    cache never answers something a read of the database would not."""
    k = p.key
    return (type(k) is BlockKey and type(k.namespace) is str and type(k.sequence_hash) is int
            and type(p.volume_id) is str and type(p.segment_id) is int and type(p.offset) is int
            and type(p.length) is int and type(p.version) is int and type(p.checksum) is int
            and 0 <= p.checksum < _U64)


def _row(p: Placement) -> tuple[str, int, str, int, int, int, int, int]:
    return (
        p.key.namespace, u64_to_i64(p.key.sequence_hash), p.volume_id, p.segment_id,
        p.offset, p.length, u64_to_i64(p.checksum), p.version,
    )


def _placement(r: Sequence[object]) -> Placement:
    ns, seq, vol, seg, off, ln, ck, ver = r
    return Placement(
        key=BlockKey(str(ns), i64_to_u64(int(seq))),  # type: ignore[call-overload]
        volume_id=str(vol), segment_id=int(seg), offset=int(off), length=int(ln),  # type: ignore[call-overload]
        checksum=i64_to_u64(int(ck)), version=int(ver),  # type: ignore[call-overload]
    )


class SqliteCatalog(PlacementCatalog):
    """Placement catalog in one SQLite file (embedded mode).

    Args:
        path: database file; created with its schema if missing.  Every process that
            shares the volumes opens the same path.
        busy_timeout_s: how long a call waits for another process's write lock.
        synchronous: SQLite ``synchronous`` level; ``NORMAL`` (default) survives a
            process crash (kill -9), ``FULL`` also a power loss.
        cache_entries: placements kept in this process's placement cache (0: none).

    Thread-safe: one connection guarded by a lock.

    Placement cache: :meth:`get_many` answers from an in-process map of the placements
    this connection last read or wrote, as long as no other connection (in this or
    another process) committed anything since: SQLite's ``PRAGMA data_version`` changes
    exactly when another connection commits, and is checked on every call (inside the
    read transaction when the database is read too), so the answer is always the
    database's current state.  This connection's own writes update the map in the same
    locked transaction (and empty it if the transaction fails).  A hit costs a dict
    look-up instead of a query and a ``Placement`` per row (4096 keys: ~1 ms instead of
    12-23 ms).  Absent keys are never cached; entries are keyed by the row (namespace,
    hash); only lookups of plain keys (exactly ``BlockKey``, ``str``, ``int``) read the
    map, and only placements equal to what reading their row gives back enter it.
    """

    def __init__(
        self, path: str | Path, busy_timeout_s: float = 30.0, synchronous: str = "NORMAL",
        cache_entries: int = 1 << 18,
    ) -> None:
        if synchronous.upper() not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise InvalidRequestError(f"unknown SQLite synchronous level {synchronous!r}")
        if isinstance(cache_entries, bool) or not isinstance(cache_entries, int) or cache_entries < 0:
            raise InvalidRequestError(f"cache_entries must be an int >= 0, got {cache_entries!r}")
        # (namespace, sequence hash) -> placement as of ``_cache_version`` (this
        # connection's data_version); keyed by the row's identity, not the BlockKey object,
        # so keys of any type naming one row share (and drop) one entry
        self._cache: dict[tuple[str, int], Placement] = {}
        self._cache_version: int | None = None
        self._cache_max = cache_entries
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._db: sqlite3.Connection | None = sqlite3.connect(
            str(self.path), timeout=busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        self._db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        self._set_wal(busy_timeout_s)
        self._db.execute(f"PRAGMA synchronous = {synchronous.upper()}")
        with self._write() as db:
            for stmt in _SCHEMA.split(";"):
                if stmt.strip():
                    db.execute(stmt)
            if "epoch" not in {r[1] for r in db.execute("PRAGMA table_info(fences)")}:  # a catalog of before epochs
                db.execute("ALTER TABLE fences ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0")

    def _set_wal(self, timeout_s: float) -> None:
        # journal_mode needs a moment without other writers; it is persistent, so only
        # the first opener really switches it.
        assert self._db is not None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                mode = self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if str(mode).lower() == "wal":
                    return
            except sqlite3.OperationalError:
                pass
            if time.monotonic() > deadline:
                raise StorageError(f"cannot switch {self.path} to WAL mode")
            time.sleep(0.05)

    # ------------------------------------------------------------------ plumbing
    @property
    def db(self) -> sqlite3.Connection:
        if self._db is None:
            raise StorageError("catalog is closed")
        return self._db

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A ``BEGIN IMMEDIATE`` transaction: commit on success, roll back on any error.

        The placement cache is brought up to date first (:meth:`_sync_cache`), so the
        transaction body can record its changes in it; it is emptied when the
        transaction fails."""
        with self._lock:
            db = self.db
            db.execute("BEGIN IMMEDIATE")
            try:
                self._sync_cache(db)
                yield db
            except BaseException:
                self._cache.clear()
                db.execute("ROLLBACK")
                raise
            try:
                db.execute("COMMIT")
            except BaseException:
                self._cache.clear()
                if db.in_transaction:  # a COMMIT that failed and left it open: never wedge the connection
                    try:
                        db.execute("ROLLBACK")
                    except sqlite3.Error as exc:
                        logger.warning("catalog %s: rollback after a failed COMMIT failed: %s", self.path, exc)
                raise

    # ------------------------------------------------------------------ placement cache
    def _sync_cache(self, db: sqlite3.Connection) -> bool:
        """Empty the placement cache if another connection committed since it was filled
        (``PRAGMA data_version`` moved).  Returns whether the cache was kept.  Called with
        the lock held; inside a transaction the version is that of its snapshot."""
        v = db.execute("PRAGMA data_version").fetchone()[0]
        if v == self._cache_version:
            return True
        self._cache.clear()
        self._cache_version = v
        return False

    def _cache_fill(self, placements: Sequence[Placement | None]) -> None:
        """Remember current placements (lock held, cache in sync).  Only canonical ones
        (:func:`_cacheable`: exactly what a read of their row gives back); the entry of
        any other one is dropped."""
        cache = self._cache
        if len(cache) + len(placements) > self._cache_max:
            cache.clear()  # a simple bound: start over rather than track recency
            if len(placements) > self._cache_max:
                return
        for p in placements:
            if p is None:
                continue
            k = p.key
            if _cacheable(p):
                cache[(k.namespace, k.sequence_hash)] = p
            else:
                cache.pop((k.namespace, k.sequence_hash), None)

    def _cache_drop(self, keys: Sequence[BlockKey]) -> None:
        """Forget ``keys``' rows (lock held)."""
        pop = self._cache.pop
        for k in keys:
            pop((k.namespace, k.sequence_hash), None)

    def _cached(self, keys: Sequence[BlockKey], hashes: Sequence[int]) -> list[Placement | None]:
        """Cached placements of plain ``keys`` (their ``hashes``), ``None`` where absent."""
        get = self._cache.get
        return [get((k.namespace, h)) for k, h in zip(keys, hashes)]

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """A read transaction (one snapshot for several statements)."""
        with self._lock:
            db = self.db
            db.execute("BEGIN")
            try:
                yield db
            finally:
                db.execute("COMMIT")

    @staticmethod
    def _select(db: sqlite3.Connection, key: BlockKey) -> Placement | None:
        r = db.execute(
            f"SELECT {_COLS} FROM placements WHERE ns = ? AND seq = ?",
            (key.namespace, u64_to_i64(key.sequence_hash)),
        ).fetchone()
        return _placement(r) if r is not None else None

    @staticmethod
    def _select_many(db: sqlite3.Connection, keys: Sequence[BlockKey]) -> list[Placement | None]:
        """Placements of ``keys``: one ``IN`` query per namespace and 500 keys, or, for keys
        of many namespaces, one ``(ns, seq) IN (VALUES ...)`` query per 400 keys.  The
        returned placements reuse the caller's key objects (no per-row key parsing), and
        are built without the dataclass ``__init__`` (:func:`_fast_placement`: half the
        cost, a third of a 64 KiB-block lookup)."""
        seqs = _signed(keys)
        by_ns: dict[str, dict[int, BlockKey]] = {}
        for k, q in zip(keys, seqs):
            d = by_ns.get(k.namespace)
            if d is None:
                d = by_ns[k.namespace] = {}
            d[q] = k
        rows: list[tuple[str, int, str, int, int, int, int, int]] = []
        if len(by_ns) <= 4:
            for ns, sq in by_ns.items():
                uniq = list(sq)
                for i in range(0, len(uniq), _IN_CHUNK):
                    chunk = uniq[i : i + _IN_CHUNK]
                    rows += db.execute(
                        f"SELECT {_COLS} FROM placements WHERE ns = ? AND seq IN ({','.join('?' * len(chunk))})",
                        (ns, *chunk),
                    ).fetchall()
        else:
            pairs = [(ns, q) for ns, sq in by_ns.items() for q in sq]
            for i in range(0, len(pairs), _PAIR_CHUNK):
                chunk = pairs[i : i + _PAIR_CHUNK]
                rows += db.execute(
                    f"SELECT {_COLS} FROM placements WHERE (ns, seq) IN (VALUES {','.join(['(?,?)'] * len(chunk))})",
                    [v for pair in chunk for v in pair],
                ).fetchall()
        found: dict[tuple[str, int], Placement] = {}
        make = _fast_placement
        for ns, seq, vol, seg, off, ln, ck, ver in rows:
            found[(ns, seq)] = make(by_ns[ns][seq], vol, seg, off, ln, ck + _U64 if ck < 0 else ck, ver)
        get = found.get
        return [get((k.namespace, q)) for k, q in zip(keys, seqs)]

    @staticmethod
    def _check_segment(db: sqlite3.Connection, p: Placement) -> None:
        r = db.execute("SELECT volume FROM segments WHERE id = ?", (p.segment_id,)).fetchone()
        if r is None or r[0] != p.volume_id:
            raise StorageError(
                f"placement of {p.key} names segment {p.segment_id} of volume {p.volume_id!r}, "
                "which the catalog does not hold"
            )

    # ------------------------------------------------------------------ placements
    def get(self, key: BlockKey) -> Placement | None:
        """See :meth:`PlacementCatalog.get`."""
        validate_block_key(key)
        with self._lock:
            return self._select(self.db, key)

    def get_many(self, keys: Sequence[BlockKey]) -> list[Placement | None]:
        """See :meth:`PlacementCatalog.get_many` (answered from the placement cache where
        it can: see the class docstring).  Keys that are not all plain (exactly
        ``BlockKey``, ``str`` namespace, ``int`` hash) are looked up in the database only."""
        if not isinstance(keys, (list, tuple)):
            keys = list(keys)
        hashes = validate_block_keys(keys)
        with self._lock:
            db = self.db
            cache = self._cache
            if hashes is not None and cache and self._sync_cache(db):
                got = self._cached(keys, hashes)  # in sync with the database: its current state
                missing = [i for i, p in enumerate(got) if p is None]
                if not missing:
                    return got
            with self._read() as db:
                if not self._cache_max or hashes is None:
                    return self._select_many(db, keys)
                # the snapshot of this transaction: cached entries are valid in it only if
                # nobody committed since they were read
                if not self._sync_cache(db) or not cache:
                    got = self._select_many(db, keys)
                    self._cache_fill(got)
                    return got
                got = self._cached(keys, hashes)
                missing = [i for i, p in enumerate(got) if p is None]
                found = self._select_many(db, [keys[i] for i in missing])
                for i, p in zip(missing, found):
                    got[i] = p
                self._cache_fill(found)
                return got

    def insert_if_absent(self, placements: Sequence[Placement]) -> list[Placement]:
        """See :meth:`PlacementCatalog.insert_if_absent`."""
        validate_block_keys([p.key for p in placements])
        out: list[Placement] = []
        with self._write() as db:
            stored = self._select_many(db, [p.key for p in placements])
            checked: set[tuple[str, int]] = set()
            batch: dict[BlockKey, Placement] = {}
            for p, cur in zip(placements, stored):
                win = cur if cur is not None else batch.get(p.key)
                if win is not None:
                    out.append(win)
                    continue
                if (p.volume_id, p.segment_id) not in checked:
                    self._check_segment(db, p)
                    checked.add((p.volume_id, p.segment_id))
                batch[p.key] = p
                out.append(p)
            db.executemany(f"INSERT INTO placements ({_COLS}) VALUES (?,?,?,?,?,?,?,?)",
                           [_row(p) for p in batch.values()])
            self._cache_fill(out)  # every winner is the key's current placement
        return out

    @staticmethod
    def _fence(db: sqlite3.Connection, fence: Fence) -> int:
        """Raise ``fence`` inside a write transaction; returns the stored token
        (:data:`~storage_backends.types.FENCE_NEWER_EPOCH` when the stored epoch is higher)."""
        row = db.execute("SELECT epoch, token FROM fences WHERE name=?", (fence.name,)).fetchone()
        if row is not None:
            if int(row[0]) > fence.epoch:
                return FENCE_NEWER_EPOCH
            if int(row[0]) == fence.epoch and int(row[1]) >= fence.token:
                return int(row[1])
        db.execute("INSERT OR REPLACE INTO fences (name, token, epoch) VALUES (?, ?, ?)",
                   (fence.name, fence.token, fence.epoch))
        return fence.token

    def raise_fence(self, fence: Fence) -> int:
        """See :meth:`PlacementCatalog.raise_fence`."""
        with self._write() as db:
            return self._fence(db, fence)

    def compare_and_set(self, expected: Placement, new: Placement, fence: Fence | None = None) -> Placement:
        """See :meth:`PlacementCatalog.compare_and_set`."""
        validate_block_key(expected.key)
        if new.key != expected.key:
            raise InvalidRequestError(f"compare_and_set of {expected.key} with a placement of {new.key}")
        with self._write() as db:
            if fence is not None:
                stored = self._fence(db, fence)
                if stored > fence.token:
                    raise FencedError(f"fence {fence.name!r} is at token {stored}, above this writer's "
                                      f"{fence.token}: a newer lease holder acts on it")
            cur = self._select(db, expected.key)
            if cur is None:
                raise VersionConflictError(f"{expected.key} was deleted (expected version {expected.version})")
            if (cur.version, cur.volume_id, cur.segment_id) != (
                expected.version, expected.volume_id, expected.segment_id
            ):
                raise VersionConflictError(
                    f"{expected.key} is at version {cur.version} on {cur.volume_id!r}/{cur.segment_id}, "
                    f"expected version {expected.version} on {expected.volume_id!r}/{expected.segment_id}"
                )
            stored = Placement(
                key=new.key, volume_id=new.volume_id, segment_id=new.segment_id, offset=new.offset,
                length=new.length, checksum=new.checksum, version=expected.version + 1,
            )
            self._check_segment(db, stored)
            db.execute(
                "UPDATE placements SET volume=?, segment=?, off=?, len=?, checksum=?, version=? "
                "WHERE ns=? AND seq=?",
                (*_row(stored)[2:], stored.key.namespace, u64_to_i64(stored.key.sequence_hash)),
            )
            self._cache_fill([stored])
        return stored

    def delete(self, key: BlockKey, expected_version: int | None = None) -> Placement | None:
        """See :meth:`PlacementCatalog.delete`."""
        validate_block_key(key)
        with self._write() as db:
            cur = self._select(db, key)
            if cur is None:
                return None
            if expected_version is not None and cur.version != expected_version:
                raise VersionConflictError(f"{key} is at version {cur.version}, expected {expected_version}")
            db.execute("DELETE FROM placements WHERE ns=? AND seq=?", (key.namespace, u64_to_i64(key.sequence_hash)))
            self._cache_drop([key])
            return cur

    def delete_many(self, keys: Sequence[BlockKey]) -> list[Placement | None]:
        """See :meth:`PlacementCatalog.delete_many` (one transaction)."""
        validate_block_keys(keys)
        with self._write() as db:
            stored = self._select_many(db, keys)
            gone: set[BlockKey] = set()
            out: list[Placement | None] = []
            for k, cur in zip(keys, stored):
                out.append(cur if cur is not None and k not in gone else None)
                if cur is not None:
                    gone.add(k)
            db.executemany("DELETE FROM placements WHERE ns=? AND seq=?",
                           [(k.namespace, u64_to_i64(k.sequence_hash)) for k in gone])
            self._cache_drop(list(gone))
        return out

    def iter_volume(self, volume_id: str) -> Iterator[Placement]:
        """See :meth:`PlacementCatalog.iter_volume` (materialized: safe to modify while iterating)."""
        with self._lock:
            rows = self.db.execute(
                f"SELECT {_COLS} FROM placements WHERE volume = ? ORDER BY segment, off", (volume_id,)
            ).fetchall()
        return iter([_placement(r) for r in rows])

    def namespace_counts(self) -> dict[str, dict[str, int]]:
        """Placements per key namespace and volume: ``{namespace: {volume id: blocks}}`` (one
        grouped scan of the placements)."""
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            rows = self.db.execute("SELECT ns, volume, COUNT(*) FROM placements GROUP BY ns, volume").fetchall()
        for ns, vol, n in rows:
            out.setdefault(str(ns), {})[str(vol)] = int(n)
        return out

    def iter_segment(self, volume_id: str, segment_id: int) -> Iterator[Placement]:
        """See :meth:`PlacementCatalog.iter_segment`."""
        with self._lock:
            rows = self.db.execute(
                f"SELECT {_COLS} FROM placements WHERE volume = ? AND segment = ? ORDER BY off",
                (volume_id, segment_id),
            ).fetchall()
        return iter([_placement(r) for r in rows])

    def quarantine(self, placement: Placement, reason: str) -> bool:
        """See :meth:`PlacementCatalog.quarantine`."""
        with self._write() as db:
            cur = self._select(db, placement.key)
            if cur != placement:
                return False
            db.execute(f"INSERT INTO quarantine ({_COLS}, reason, at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                       (*_row(cur), reason, time.time()))
            db.execute("DELETE FROM placements WHERE ns=? AND seq=?",
                       (cur.key.namespace, u64_to_i64(cur.key.sequence_hash)))
            self._cache_drop([cur.key])
            return True

    def quarantined(self) -> list[tuple[Placement, str]]:
        """Every quarantined placement with the reason."""
        with self._lock:
            rows = self.db.execute(f"SELECT {_COLS}, reason FROM quarantine ORDER BY at").fetchall()
        return [(_placement(r[:8]), str(r[8])) for r in rows]

    # ------------------------------------------------------------------ segments
    def new_segment(self, volume_id: str, size_bytes: int, *, capacity_bytes: int | None = None) -> int:
        """See :meth:`PlacementCatalog.new_segment`."""
        if size_bytes < 0:
            raise InvalidRequestError(f"segment size must be >= 0, got {size_bytes}")
        with self._write() as db:
            if capacity_bytes is not None:
                used = int(db.execute("SELECT COALESCE(SUM(size), 0) FROM segments WHERE volume = ?",
                                      (volume_id,)).fetchone()[0])
                if used + size_bytes > capacity_bytes:
                    raise VolumeFullError(
                        f"volume {volume_id!r}: {size_bytes} more bytes would exceed its capacity "
                        f"({used} of {capacity_bytes} bytes used)"
                    )
            cur = db.execute("INSERT INTO segments (volume, size, sealed, created) VALUES (?, ?, 0, ?)",
                             (volume_id, size_bytes, time.time()))
            seg = cur.lastrowid
        assert seg is not None
        return int(seg)

    def seal_segment(self, volume_id: str, segment_id: int) -> None:
        """See :meth:`PlacementCatalog.seal_segment`."""
        with self._write() as db:
            db.execute("UPDATE segments SET sealed = 1 WHERE id = ? AND volume = ?", (segment_id, volume_id))

    _SEG_SQL = (
        "SELECT s.id, s.volume, s.size, COALESCE(SUM(p.len), 0), COUNT(p.seq), s.sealed, s.created "
        "FROM segments s LEFT JOIN placements p ON p.volume = s.volume AND p.segment = s.id "
    )

    @staticmethod
    def _seg(r: Sequence[object]) -> SegmentInfo:
        return SegmentInfo(int(r[0]), str(r[1]), int(r[2]), int(r[3]), int(r[4]), bool(r[5]), float(r[6]))  # type: ignore[call-overload]

    def segments(self, volume_id: str) -> list[SegmentInfo]:
        """See :meth:`PlacementCatalog.segments`."""
        with self._lock:
            rows = self.db.execute(self._SEG_SQL + "WHERE s.volume = ? GROUP BY s.id ORDER BY s.id",
                                   (volume_id,)).fetchall()
        return [self._seg(r) for r in rows]

    def segment(self, volume_id: str, segment_id: int) -> SegmentInfo | None:
        """See :meth:`PlacementCatalog.segment`."""
        with self._lock:
            r = self.db.execute(self._SEG_SQL + "WHERE s.volume = ? AND s.id = ? GROUP BY s.id",
                                (volume_id, segment_id)).fetchone()
        return self._seg(r) if r is not None else None

    @staticmethod
    def _live(db: sqlite3.Connection, volume_id: str, segment_id: int) -> int:
        return int(db.execute("SELECT COUNT(*) FROM placements WHERE volume = ? AND segment = ?",
                              (volume_id, segment_id)).fetchone()[0])

    def drop_segment(self, volume_id: str, segment_id: int) -> bool:
        """See :meth:`PlacementCatalog.drop_segment`."""
        with self._write() as db:
            live = self._live(db, volume_id, segment_id)
            if live:
                raise StorageError(f"segment {segment_id} of {volume_id!r} still holds {live} live blocks")
            return db.execute("DELETE FROM segments WHERE id = ? AND volume = ?", (segment_id, volume_id)).rowcount > 0

    def drop_segment_if_empty(self, volume_id: str, segment_id: int) -> bool:
        """See :meth:`PlacementCatalog.drop_segment_if_empty`."""
        with self._write() as db:
            if self._live(db, volume_id, segment_id):
                return False
            return db.execute("DELETE FROM segments WHERE id = ? AND volume = ? AND sealed = 1",
                              (segment_id, volume_id)).rowcount > 0

    # ------------------------------------------------------------------ volumes
    def catalog_id(self) -> str:
        """See :meth:`PlacementCatalog.catalog_id` (row ``catalog_id`` of table ``meta``,
        created by the first caller)."""
        with self._write() as db:
            db.execute("INSERT OR IGNORE INTO meta (k, v) VALUES ('catalog_id', ?)", (uuid.uuid4().hex,))
            return str(db.execute("SELECT v FROM meta WHERE k = 'catalog_id'").fetchone()[0])

    def record_volume(self, volume_id: str, spec: str) -> str:
        """See :meth:`PlacementCatalog.record_volume`."""
        with self._write() as db:
            r = db.execute("SELECT spec FROM volumes WHERE id = ?", (volume_id,)).fetchone()
            if r is not None:
                return str(r[0])
            db.execute("INSERT INTO volumes (id, spec) VALUES (?, ?)", (volume_id, spec))
            return spec

    def forget_volume(self, volume_id: str) -> None:
        """See :meth:`PlacementCatalog.forget_volume`."""
        with self._write() as db:
            n = int(db.execute("SELECT COUNT(*) FROM placements WHERE volume = ?", (volume_id,)).fetchone()[0])
            if n:
                raise StorageError(f"volume {volume_id!r} still holds {n} blocks")
            db.execute("DELETE FROM segments WHERE volume = ?", (volume_id,))
            db.execute("DELETE FROM volumes WHERE id = ?", (volume_id,))

    def volume_specs(self) -> dict[str, str]:
        """See :meth:`PlacementCatalog.volume_specs`."""
        with self._lock:
            return {str(i): str(s) for i, s in self.db.execute("SELECT id, spec FROM volumes ORDER BY id")}

    def close(self) -> None:
        """See :meth:`PlacementCatalog.close`."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
            self._cache.clear()
