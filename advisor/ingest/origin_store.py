"""Durable source → origin bindings of the advisor (:mod:`event_plane.origins`).

A small SQLite file (``AdvisorSettings.origins_path``, default ``<journal_path>.origins``)
next to the journal: a binding is written before the batch that made it is admitted, so
after a restart (clean or not) every source journaled so far is still bound to the origin
that delivered it. Bindings are rare (one per source), so each is committed at once.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS origins (
    source   TEXT PRIMARY KEY,
    origin   TEXT NOT NULL,
    bound_at REAL NOT NULL
)
"""


class SqliteOriginStore:
    """Source → origin bindings in SQLite table ``origins(source, origin, bound_at)``.

    Thread-safe: bindings are written from the subscribers' receiver threads.

    Args:
        path: the SQLite file (created if missing).

    Raises:
        sqlite3.Error / OSError: the file cannot be opened or is not a SQLite database.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(_SCHEMA)

    def load(self) -> dict[str, str]:
        """Every binding (source → origin)."""
        with self._lock:
            return dict(self._db.execute("SELECT source, origin FROM origins").fetchall())

    def bind(self, source: str, origin: str) -> None:
        """Record ``source`` as bound to ``origin`` (replacing any older binding), durably."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO origins (source, origin, bound_at) VALUES (?, ?, ?)",
                             (source, origin, time.time()))

    def release(self, source: str) -> bool:
        """Forget ``source``'s binding; whether there was one."""
        with self._lock:
            return self._db.execute("DELETE FROM origins WHERE source = ?", (source,)).rowcount > 0

    def close(self) -> None:
        """Close the file. Idempotent."""
        with self._lock:
            self._db.close()


__all__ = ["SqliteOriginStore"]
