"""The advisor's run state that must survive a restart: its counters, the mover's counters,
the recent plan results, the move guard's memory (which block moved when) and the operator's
changes (volumes registered at run time, volumes draining), kept in the journal's SQLite file
(tables ``run_counters``, ``run_plans``, ``run_moves`` and ``run_admin``, beside the event
log; docs/operations.md, "Restarts").

Written at the end of every policy round and on a clean stop; read at start, so
``/v1/stats`` and ``/v1/plans`` go on from where the previous run left them instead of
starting again at 0 and ``[]``.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal

import msgspec

from advisor.policy.plan import PlanResult

_SCHEMA = """
CREATE TABLE IF NOT EXISTS run_counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS run_plans (id INTEGER PRIMARY KEY AUTOINCREMENT, result BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS run_moves (h INTEGER PRIMARY KEY, moved_at REAL NOT NULL, last_access INTEGER);
CREATE TABLE IF NOT EXISTS run_admin (name TEXT PRIMARY KEY, value BLOB NOT NULL);
"""

_I64 = 1 << 63


def _i64(h: int) -> int:
    return h - (1 << 64) if h >= _I64 else h


def _u64(v: int) -> int:
    return v + (1 << 64) if v < 0 else v

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(PlanResult)


class RunStateStore:
    """Counters and plan results in one SQLite file (thread-safe).

    Args:
        path: the SQLite file (the advisor's journal file).
        keep_plans: plan results kept (older ones are deleted when new ones are saved).
        synchronous: SQLite ``synchronous`` pragma, the journal's own
            (``AdvisorSettings.journal_synchronous``). It is a setting of each connection,
            and SQLite's default, ``FULL``, fsyncs the WAL in every commit while holding the
            file's one write lock, which the journal's appends (under the advisor's state
            lock) then wait for: with ``NORMAL`` a commit survives a crash of the process,
            as the journal's do.

    Raises:
        sqlite3.Error: the file cannot be opened.
        ValueError: ``synchronous`` is neither ``"NORMAL"`` nor ``"FULL"``.
    """

    def __init__(self, path: str | Path, keep_plans: int = 1000, *,
                 synchronous: Literal["NORMAL", "FULL"] = "NORMAL") -> None:
        if synchronous not in ("NORMAL", "FULL"):
            raise ValueError(f"synchronous must be NORMAL or FULL, got {synchronous!r}")
        self.keep_plans = keep_plans
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        # the journal's checkpoint thread copies the shared WAL back (advisor.ingest.journal);
        # SQLite's automatic one would run in whichever commit crosses 1,000 pages, this one's too
        self._db.execute("PRAGMA wal_autocheckpoint=0")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def save(self, counters: Mapping[str, int], plans: Iterable[PlanResult] = (),
             moves: Iterable[tuple[int, float, int | None]] | None = None) -> None:
        """Replace the stored counters with ``counters``, append ``plans`` and, when given,
        replace the move guard's memory with ``moves`` (one transaction).

        Args:
            moves: ``(sequence hash, wall-clock seconds of the move, the block's last
                access in ns then or None)`` per remembered block
                (:meth:`advisor.moves.move_guard.MoveGuard.export`).
        """
        rows = [(_enc.encode(p),) for p in plans]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if moves is not None:
                    self._db.execute("DELETE FROM run_moves")
                    self._db.executemany("INSERT OR REPLACE INTO run_moves (h, moved_at, last_access) VALUES (?, ?, ?)",
                                         [(_i64(h), float(t), None if a is None else _i64(a)) for h, t, a in moves])
                self._db.executemany("INSERT OR REPLACE INTO run_counters (name, value) VALUES (?, ?)",
                                     [(k, int(v)) for k, v in counters.items()])
                if rows:
                    self._db.executemany("INSERT INTO run_plans (result) VALUES (?)", rows)
                    self._db.execute("DELETE FROM run_plans WHERE id <= (SELECT MAX(id) FROM run_plans) - ?",
                                     (self.keep_plans,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def save_admin(self, values: Mapping[str, object]) -> None:
        """Store operator state (JSON-encodable values by name, e.g. ``"volumes"``,
        ``"draining"``), replacing the values of those names (one transaction)."""
        rows = [(k, _enc.encode(v)) for k, v in values.items()]
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.executemany("INSERT OR REPLACE INTO run_admin (name, value) VALUES (?, ?)", rows)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def admin(self) -> dict[str, object]:
        """The stored operator state by name (empty on a first start)."""
        with self._lock:
            rows = self._db.execute("SELECT name, value FROM run_admin").fetchall()
        return {k: msgspec.json.decode(v) for k, v in rows}

    def counters(self) -> dict[str, int]:
        """The stored counters (empty on a first start)."""
        with self._lock:
            return {k: int(v) for k, v in self._db.execute("SELECT name, value FROM run_counters")}

    def moves(self) -> list[tuple[int, float, int | None]]:
        """The move guard's stored memory: ``(sequence hash, wall-clock s, last access ns or None)``."""
        with self._lock:
            rows = self._db.execute("SELECT h, moved_at, last_access FROM run_moves").fetchall()
        return [(_u64(h), float(t), None if a is None else _u64(a)) for h, t, a in rows]

    def plans(self) -> list[PlanResult]:
        """The stored plan results, oldest first (at most ``keep_plans``)."""
        with self._lock:
            rows = self._db.execute("SELECT result FROM run_plans ORDER BY id DESC LIMIT ?", (self.keep_plans,)).fetchall()
        return [_dec.decode(r[0]) for r in reversed(rows)]

    def close(self) -> None:
        """Close the connection (idempotent)."""
        with self._lock:
            try:
                self._db.close()
            except sqlite3.Error:
                pass
