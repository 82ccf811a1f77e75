"""SQLite event journal: the advisor's durable log (embedded mode, docs/design.md §7).

Every batch is appended with its raw wire bytes *before* it is applied to the index, so
the index can always be rebuilt by folding the journal from position 1.  A batch is
identified by ``(source, epoch, seq)``; a batch already journaled (re-sent after a
reconnect, replayed, or received twice through two transports) is recognised and not
appended again (case C3).  Payloads that do not decode as KVEvent v1, or that do not
match the batch they claim to be, are refused and never enter the log.

Durability: WAL mode; ``synchronous=NORMAL`` (default) survives a crash of the process,
``FULL`` also survives power loss at the cost of one fsync per append.

Checkpoints (copying the WAL back into the database file, two or three fsyncs each) run on a
thread of the journal's own, not inside :meth:`SqliteJournal.append`: SQLite's automatic
checkpoint runs in the commit that crosses 1,000 WAL pages, about one append in 250, and the
advisor appends under its state lock, so on a busy disk every reader of the index waited for
those fsyncs. A ``PASSIVE`` checkpoint takes no writer lock (https://www.sqlite.org/wal.html,
"Checkpointing"; https://www.sqlite.org/c3ref/wal_checkpoint_v2.html): appends go on while it
runs, and the next append after a complete one starts the WAL over from its beginning.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import msgspec

from event_plane.codec import CodecError, check_batch, decode_batch, encode_batch
from event_plane.schema import EventBatch

_I64 = 1 << 63
_U64 = 1 << 64

logger = logging.getLogger(__name__)

CHECKPOINT_INTERVAL_S = 1.0
"""How often the checkpoint thread copies the WAL back when appends came in since."""


class JournalError(RuntimeError):
    """Base class of journal errors."""


class BadPayloadError(JournalError, ValueError):
    """A payload is not a valid KVEvent v1 batch, or not the batch it is appended as."""


def _to_i64(v: int) -> int:
    """Map a u64 onto SQLite's signed 64-bit INTEGER (order is not preserved, identity is)."""
    return v - _U64 if v >= _I64 else v


def _to_u64(v: int) -> int:
    return v + _U64 if v < 0 else v


_sorted_encoder = msgspec.msgpack.Encoder(order="sorted")


def _same_wire_value(a: EventBatch, b: EventBatch) -> bool:
    """Whether two batches are the same wire value: equal MessagePack encodings, the order
    of map keys aside. Python's ``==`` is no such test: a NaN never equals itself, and
    ``True == 1 == 1.0`` while the index reads them differently (``hits`` counts ints only)."""
    try:
        return _sorted_encoder.encode(a) == _sorted_encoder.encode(b)
    except Exception:  # noqa: BLE001 - non-str map keys inside extra_metadata cannot be sorted
        pass
    try:
        return encode_batch(a) == encode_batch(b)
    except Exception:  # noqa: BLE001 - a batch that does not encode is not the payload's batch
        return False


_SCHEMA = """
CREATE TABLE IF NOT EXISTS journal (
    position INTEGER PRIMARY KEY AUTOINCREMENT,
    source   TEXT    NOT NULL,
    epoch    INTEGER NOT NULL,
    seq      INTEGER NOT NULL,
    ts_ns    INTEGER NOT NULL,
    events   INTEGER NOT NULL,
    payload  BLOB    NOT NULL,
    UNIQUE (source, epoch, seq)
);
"""


class _Checkpointer:
    """A thread that runs a ``PASSIVE`` checkpoint of the WAL at ``path`` every ``interval_s``
    when appends came in (:attr:`appended`), on a connection of its own (module docstring)."""

    def __init__(self, path: Path, interval_s: float) -> None:
        self.path = path
        self.interval_s = interval_s
        self.appended = threading.Event()
        self.stop = threading.Event()
        self.done = 0
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="journal-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        db: sqlite3.Connection | None = None
        try:
            while not self.stop.wait(self.interval_s):
                if not self.appended.is_set():
                    continue
                self.appended.clear()
                try:
                    if db is None:
                        db = sqlite3.connect(str(self.path), isolation_level=None)
                        db.execute("PRAGMA busy_timeout=5000")
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    self.done += 1
                except sqlite3.Error as exc:
                    self.failures += 1
                    self.appended.set()  # not copied back: try again next period
                    logger.warning("journal %s: checkpoint failed, retried in %.1f s: %s", self.path,
                                   self.interval_s, exc)
        finally:
            if db is not None:
                db.close()

    def close(self) -> None:
        """Stop the thread and wait for it (idempotent)."""
        self.stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


class SqliteJournal:
    """Append-only log of event batches in one SQLite file.

    Thread-safe (one connection guarded by a lock).  Positions start at 1 and grow by
    one per appended batch.

    Args:
        path: database file (created with its parent directory if missing).
        synchronous: SQLite ``synchronous`` pragma, ``"NORMAL"`` or ``"FULL"``.
        checkpoint_interval_s: period of the checkpoint thread (module docstring), seconds;
            ``0`` leaves checkpoints to SQLite's automatic one inside the appends.

    Raises:
        JournalError: if the file cannot be opened as a journal.
    """

    def __init__(self, path: str | Path, synchronous: Literal["NORMAL", "FULL"] = "NORMAL", *,
                 checkpoint_interval_s: float = CHECKPOINT_INTERVAL_S) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if synchronous not in ("NORMAL", "FULL"):
            raise JournalError(f"synchronous must be NORMAL or FULL, got {synchronous!r}")
        try:
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.executescript(_SCHEMA)
            if checkpoint_interval_s > 0:
                self._db.execute("PRAGMA wal_autocheckpoint=0")
        except sqlite3.DatabaseError as exc:
            raise JournalError(f"cannot open journal {self.path}: {exc}") from exc
        self._lock = threading.Lock()
        self.duplicates = 0
        """Appends refused because ``(source, epoch, seq)`` was already journaled."""
        self.rejected = 0
        """Appends refused because the payload was bad."""
        self._checkpointer: _Checkpointer | None = None
        if checkpoint_interval_s > 0:
            self._checkpointer = _Checkpointer(self.path, checkpoint_interval_s)
            # the thread holds no reference to the journal: one dropped unclosed stops it too
            weakref.finalize(self, self._checkpointer.stop.set)

    @property
    def checkpoints(self) -> int:
        """Checkpoints the checkpoint thread ran (0 without one)."""
        return 0 if self._checkpointer is None else self._checkpointer.done

    @property
    def checkpoint_failures(self) -> int:
        """Checkpoints that raised (logged; the next period tries again, the WAL keeps the data)."""
        return 0 if self._checkpointer is None else self._checkpointer.failures

    def append(self, payload: bytes, batch: EventBatch | None = None, *, verify: bool = True) -> int | None:
        """Durably store one batch's wire bytes; call before applying it.

        Args:
            payload: the batch's KVEvent v1 wire bytes.
            batch: the decoded batch, if the caller has it (saves a decode when
                ``verify`` is false).
            verify: decode ``payload`` and check that it is ``batch`` (default: the same
                wire value, map key order aside, so ``{"hits": True}`` is not the batch of
                ``{"hits": 1}`` and a NaN is the batch of its own bytes). Pass
                ``False`` only for bytes this process just encoded from ``batch``; ``batch``
                still gets the decoder's own checks (:func:`event_plane.codec.check_batch`),
                so nothing enters the log that a replay would refuse.

        Returns:
            The new log position (>= 1), or ``None`` when the batch's
            ``(source, epoch, seq)`` is already in the journal (nothing appended).

        Raises:
            BadPayloadError: ``payload`` does not decode, or differs from ``batch``.
            JournalError: the database refused the write.
        """
        if verify or batch is None:
            try:
                decoded = decode_batch(payload)
            except CodecError as exc:
                self.rejected += 1
                raise BadPayloadError(f"payload is not a KVEvent v1 batch: {exc}") from exc
            if batch is not None and not _same_wire_value(decoded, batch):
                self.rejected += 1
                raise BadPayloadError(
                    f"payload decodes to batch {decoded.source}:{decoded.epoch}:{decoded.seq}, "
                    f"not the batch {batch.source}:{batch.epoch}:{batch.seq} it was appended as"
                )
            batch = decoded
        else:
            try:
                check_batch(batch)
            except CodecError as exc:
                self.rejected += 1
                raise BadPayloadError(f"batch is not a valid KVEvent v1 batch: {exc}") from exc
        row = (batch.source, _to_i64(batch.epoch), _to_i64(batch.seq), batch.ts_ns if batch.ts_ns < _I64 else _I64 - 1,
               len(batch.events), bytes(payload))
        with self._lock:
            try:
                cur = self._db.execute(
                    "INSERT INTO journal (source, epoch, seq, ts_ns, events, payload) VALUES (?,?,?,?,?,?)", row
                )
            except sqlite3.IntegrityError:  # UNIQUE (source, epoch, seq): already journaled
                self.duplicates += 1
                return None
            except sqlite3.DatabaseError as exc:
                raise JournalError(f"journal append failed: {exc}") from exc
            if self._checkpointer is not None:
                self._checkpointer.appended.set()
            return int(cur.lastrowid or 0)

    def contains(self, source: str, epoch: int, seq: int) -> bool:
        """Whether batch ``(source, epoch, seq)`` is journaled."""
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM journal WHERE source=? AND epoch=? AND seq=?", (source, _to_i64(epoch), _to_i64(seq))
            ).fetchone()
        return row is not None

    def read(self, from_position: int = 0, *, page: int = 1024) -> Iterator[tuple[int, EventBatch]]:
        """Yield ``(position, batch)`` for every journaled batch with position > ``from_position``.

        Reads in pages of ``page`` rows, so the log may grow while it is read (new rows
        are yielded too).  Raises :class:`JournalError` if a stored payload no longer
        decodes (disk corruption).
        """
        pos = from_position
        while True:
            with self._lock:
                rows = self._db.execute(
                    "SELECT position, payload FROM journal WHERE position > ? ORDER BY position LIMIT ?", (pos, page)
                ).fetchall()
            if not rows:
                return
            for position, payload in rows:
                try:
                    yield position, decode_batch(payload)
                except CodecError as exc:
                    raise JournalError(f"journal entry {position} is corrupt: {exc}") from exc
                pos = position

    def read_raw(self, from_position: int = 0) -> Iterator[tuple[int, bytes]]:
        """Yield ``(position, payload bytes)`` like :meth:`read`, without decoding."""
        pos = from_position
        while True:
            with self._lock:
                rows = self._db.execute(
                    "SELECT position, payload FROM journal WHERE position > ? ORDER BY position LIMIT 1024", (pos,)
                ).fetchall()
            if not rows:
                return
            for position, payload in rows:
                yield position, bytes(payload)
                pos = position

    def last_position(self) -> int:
        """Position of the newest batch, 0 when the journal is empty."""
        with self._lock:
            row = self._db.execute("SELECT MAX(position) FROM journal").fetchone()
        return int(row[0] or 0)

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM journal").fetchone()[0])

    def sources(self) -> dict[str, tuple[int, int]]:
        """Per source, ``(epoch, seq)`` of its newest journaled batch."""
        with self._lock:
            rows = self._db.execute(
                "SELECT source, epoch, seq FROM journal WHERE position IN "
                "(SELECT MAX(position) FROM journal GROUP BY source)"
            ).fetchall()
        return {s: (_to_u64(e), _to_u64(q)) for s, e, q in rows}

    def close(self) -> None:
        """Stop the checkpoint thread and close the database (idempotent; closing the last
        connection checkpoints what is left)."""
        if self._checkpointer is not None:
            self._checkpointer.close()
        with self._lock:
            try:
                self._db.close()
            except sqlite3.Error:
                pass
