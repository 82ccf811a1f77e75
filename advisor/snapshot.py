"""Index snapshots: the fold state at a known log position (docs/design.md §7).

A snapshot is ``PrefixIndex.export_state()`` encoded as MessagePack, stored with the log
position it covers (journal position in embedded mode, JetStream stream sequence in
scaled mode) and an XXH3-64 checksum of the payload.  Start-up loads the newest snapshot
whose position the log still has, then folds only the tail; a snapshot that fails its
checksum or does not import is skipped for the next older one (and, with none left, the
whole log is folded).

Stores:
    * :class:`SqliteSnapshotStore` — embedded mode, a SQLite file next to the journal;
    * :class:`RedisSnapshotStore` — scaled mode, keys under a prefix on a Redis server.

Both keep the ``keep`` newest snapshots and drop older ones after each save.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
import xxhash

from advisor.frequency import FrequencySketch
from advisor.index import IndexStateError, PrefixIndex
from event_plane.nats_auth import redact_url

logger = logging.getLogger(__name__)


class SnapshotError(RuntimeError):
    """A snapshot could not be written, read or decoded."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One stored snapshot.

    Attributes:
        position: log position the state covers (every entry ``<= position`` is folded in).
        created_ns: wall-clock time of the save (ns since the Unix epoch).
        payload: MessagePack bytes of ``PrefixIndex.export_state()``.
        checksum: XXH3-64 of ``payload``.
    """

    position: int
    created_ns: int
    payload: bytes
    checksum: int

    def verify(self) -> bool:
        """Whether ``payload`` still matches ``checksum``."""
        return xxhash.xxh3_64_intdigest(self.payload) == self.checksum


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def encode_index(index: PrefixIndex) -> bytes:
    """MessagePack bytes of ``index.export_state()`` (call under the index's lock)."""
    return _encoder.encode(index.export_state())


def decode_index(payload: bytes, frequency: FrequencySketch | None = None) -> PrefixIndex:
    """Rebuild a :class:`PrefixIndex` from :func:`encode_index` bytes.

    Raises:
        SnapshotError: the bytes are not MessagePack or not an index state.
    """
    try:
        return PrefixIndex.from_state(_decoder.decode(payload), frequency)
    except (msgspec.DecodeError, IndexStateError) as exc:
        raise SnapshotError(f"snapshot payload is not an index state: {exc}") from exc
    except (RecursionError, MemoryError, ValueError, TypeError, KeyError, AttributeError, OverflowError) as exc:
        # a payload whose checksum was recomputed by whoever wrote it (anyone who can write
        # the store) may nest deeper than the stack or hold any type: refused, never fatal
        raise SnapshotError(f"snapshot payload is not an index state: {type(exc).__name__}: {exc}") from exc


def make_snapshot(position: int, payload: bytes) -> Snapshot:
    """A :class:`Snapshot` of ``payload`` at ``position``, stamped now, with its checksum."""
    if position < 0:
        raise SnapshotError(f"snapshot position must be >= 0, got {position}")
    return Snapshot(position, time.time_ns(), bytes(payload), xxhash.xxh3_64_intdigest(payload))


class SnapshotStore(Protocol):
    """Where snapshots live."""

    def save(self, snapshot: Snapshot) -> None:
        """Store ``snapshot`` durably, then drop snapshots older than the ``keep`` newest."""

    def iter_newest(self, max_position: int | None = None) -> Iterator[Snapshot]:
        """Snapshots with ``position <= max_position`` (all if ``None``), newest first."""

    def close(self) -> None:
        """Release the connection (idempotent)."""


def load_latest(
    store: SnapshotStore, max_position: int | None = None, frequency: FrequencySketch | None = None,
    on_skip: Callable[[int, str], None] | None = None,
) -> tuple[Snapshot, PrefixIndex] | None:
    """The newest usable snapshot at or below ``max_position`` and its rebuilt index.

    Snapshots that fail their checksum or do not decode (whatever their bytes) are skipped
    (older ones tried) and reported to ``on_skip(position, why)``; so are entries of the
    store that are not snapshots at all (:meth:`RedisSnapshotStore.iter_newest`).

    Returns:
        ``(snapshot, index)``, or ``None`` when no usable snapshot exists.
    """
    for snap in store.iter_newest(max_position):
        if not snap.verify():
            why = "checksum mismatch"
        else:
            try:
                return snap, decode_index(snap.payload, frequency)
            except SnapshotError as exc:
                why = str(exc)
        logger.warning("snapshot at position %d skipped: %s", snap.position, why[:200])
        if on_skip is not None:
            on_skip(snap.position, why)
    return None


_SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
    position   INTEGER PRIMARY KEY,
    created_ns INTEGER NOT NULL,
    checksum   INTEGER NOT NULL,
    payload    BLOB    NOT NULL
);
"""
_I64 = 1 << 63
_U64 = 1 << 64


class SqliteSnapshotStore:
    """Snapshots in one SQLite file (WAL, ``synchronous=NORMAL``); thread-safe.

    Args:
        path: database file (its directory is created).
        keep: snapshots kept (>= 1).

    Raises:
        SnapshotError: the file cannot be opened, or ``keep < 1``.
    """

    def __init__(self, path: str | Path, keep: int = 2) -> None:
        if keep < 1:
            raise SnapshotError(f"keep must be >= 1, got {keep}")
        self.path = Path(path)
        self.keep = keep
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise SnapshotError(f"cannot open snapshot store {self.path}: {exc}") from exc
        self._lock = threading.Lock()

    def save(self, snapshot: Snapshot) -> None:
        """Insert (or replace) the snapshot at its position, then prune to ``keep``."""
        c = snapshot.checksum - _U64 if snapshot.checksum >= _I64 else snapshot.checksum
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute(
                    "INSERT OR REPLACE INTO snapshots (position, created_ns, checksum, payload) VALUES (?,?,?,?)",
                    (snapshot.position, snapshot.created_ns, c, snapshot.payload),
                )
                self._db.execute(
                    "DELETE FROM snapshots WHERE position NOT IN "
                    "(SELECT position FROM snapshots ORDER BY position DESC LIMIT ?)", (self.keep,)
                )
                self._db.execute("COMMIT")
            except sqlite3.DatabaseError as exc:
                try:
                    self._db.execute("ROLLBACK")
                except sqlite3.DatabaseError:
                    pass
                raise SnapshotError(f"snapshot save failed: {exc}") from exc

    def iter_newest(self, max_position: int | None = None) -> Iterator[Snapshot]:
        """Stored snapshots at or below ``max_position``, newest first."""
        limit = max_position if max_position is not None else _I64 - 1
        with self._lock:
            rows = self._db.execute(
                "SELECT position FROM snapshots WHERE position <= ? ORDER BY position DESC", (limit,)
            ).fetchall()
        for (pos,) in rows:
            with self._lock:
                row = self._db.execute(
                    "SELECT position, created_ns, checksum, payload FROM snapshots WHERE position = ?", (pos,)
                ).fetchone()
            if row is not None:
                p, created, c, payload = row
                yield Snapshot(p, created, bytes(payload), c + _U64 if c < 0 else c)

    def positions(self) -> list[int]:
        """Positions of the stored snapshots, oldest first."""
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT position FROM snapshots ORDER BY position")]

    def close(self) -> None:
        with self._lock:
            try:
                self._db.close()
            except sqlite3.Error:
                pass


class RedisSnapshotStore:
    """Snapshots on a Redis server (scaled mode).

    Keys: ``<prefix>:snapshots`` (sorted set, member and score = position) and
    ``<prefix>:snapshot:<position>`` (hash: ``created_ns``, ``checksum``, ``payload``).
    A save writes the hash and the sorted-set entry in one MULTI/EXEC transaction.

    Args:
        url: ``redis://HOST:PORT/DB``.
        key_prefix: prefix of every key (one per advisor / partition).
        keep: snapshots kept (>= 1).

    Raises:
        SnapshotError: ``keep < 1`` or the server cannot be reached.
    """

    def __init__(self, url: str, key_prefix: str = "kvadvisor:advisor", keep: int = 2) -> None:
        import redis

        if keep < 1:
            raise SnapshotError(f"keep must be >= 1, got {keep}")
        self.keep = keep
        self.prefix = key_prefix
        self._zkey = f"{key_prefix}:snapshots"
        try:
            self._r: Any = redis.Redis.from_url(url)
            self._r.ping()
        except redis.RedisError as exc:
            raise SnapshotError(f"cannot reach Redis at {redact_url(url)}: {exc}") from exc
        self._err = redis.RedisError

    def _key(self, position: int) -> str:
        return f"{self.prefix}:snapshot:{position}"

    def save(self, snapshot: Snapshot) -> None:
        """Write the snapshot and its index entry atomically, then prune to ``keep``."""
        try:
            pipe = self._r.pipeline(transaction=True)
            pipe.hset(self._key(snapshot.position), mapping={
                "created_ns": snapshot.created_ns, "checksum": snapshot.checksum, "payload": snapshot.payload})
            pipe.zadd(self._zkey, {str(snapshot.position): snapshot.position})
            pipe.execute()
            old = self._r.zrevrange(self._zkey, self.keep, -1)
            if old:
                pipe = self._r.pipeline(transaction=True)
                pipe.zrem(self._zkey, *old)
                pipe.delete(*(self._key(int(p)) for p in old if p.isdigit()))  # members only this store wrote
                pipe.execute()
        except self._err as exc:
            raise SnapshotError(f"snapshot save to Redis failed: {exc}") from exc

    def iter_newest(self, max_position: int | None = None) -> Iterator[Snapshot]:
        """Stored snapshots at or below ``max_position``, newest first."""
        hi: Any = max_position if max_position is not None else "+inf"
        try:
            members = self._r.zrevrangebyscore(self._zkey, hi, "-inf")
        except self._err as exc:
            raise SnapshotError(f"snapshot listing from Redis failed: {exc}") from exc
        for m in members:
            try:
                pos = int(m)
            except ValueError:
                continue  # not a position: nothing this store wrote
            try:
                h = self._r.hgetall(self._key(pos))
            except self._err as exc:
                raise SnapshotError(f"snapshot read from Redis failed: {exc}") from exc
            if not h or b"payload" not in h:
                continue
            try:
                created, checksum = int(h.get(b"created_ns", 0)), int(h.get(b"checksum", 0))
            except ValueError:
                # fields that are not integers: yielded empty with a checksum that cannot
                # match (XXH3 of no bytes is not 0), so that the loader skips and counts it
                yield Snapshot(pos, 0, b"", 0)
                continue
            yield Snapshot(pos, created, bytes(h[b"payload"]), checksum)

    def positions(self) -> list[int]:
        """Positions of the stored snapshots, oldest first."""
        return [int(m) for m in self._r.zrange(self._zkey, 0, -1)]

    def close(self) -> None:
        try:
            self._r.close()
        except Exception:  # noqa: BLE001 - closing must not raise
            pass


__all__ = [
    "RedisSnapshotStore",
    "Snapshot",
    "SnapshotError",
    "SnapshotStore",
    "SqliteSnapshotStore",
    "decode_index",
    "encode_index",
    "load_latest",
    "make_snapshot",
]
