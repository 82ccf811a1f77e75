"""The journal's disk syncs stay off the append path: the advisor appends under its state
lock, which every reader of the index takes, so a checkpoint's fsyncs (SQLite's automatic
checkpoint runs inside the commit that crosses 1,000 WAL pages) or the run state's per-commit
fsync (SQLite's default ``synchronous=FULL`` on its own connection to the same file) made
every reader wait for the disk (advisor/ingest/journal.py, module docstring)."""

from __future__ import annotations

import gc
import sqlite3
import weakref
from pathlib import Path

import pytest

from advisor.embedded.run_state import RunStateStore
from advisor.ingest.journal import SqliteJournal
from event_plane.codec import encode_batch
from event_plane.schema import EventBatch, store
from tests.polling import wait_until

AUTOCHECKPOINT_PAGES = 1000  # SQLite's default wal_autocheckpoint


def _append(j: SqliteJournal, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        b = EventBatch(1, "w0", 1, i, 1_000 + i, [store(k, k, None, 4096, "g1") for k in range(i * 40, i * 40 + 40)])
        j.append(encode_batch(b), b, verify=False)


def _wal_pages(path: Path) -> float:
    wal = Path(f"{path}-wal")
    return wal.stat().st_size / 4096 if wal.exists() else 0.0


def _backfilled(path: Path) -> bool:
    """Whether every frame of the WAL is in the database file (a PASSIVE checkpoint that
    finds nothing left to copy reports log == checkpointed)."""
    db = sqlite3.connect(str(path))
    try:
        busy, log, done = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return busy == 0 and log == done
    finally:
        db.close()


def test_appends_never_checkpoint_the_wal(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    j = SqliteJournal(path, checkpoint_interval_s=3600)  # the checkpoint thread idle
    _append(j, 3000)
    # SQLite's automatic checkpoint would have copied the WAL back and started it over at
    # 1,000 pages (one of these appends paying the fsyncs); no append did
    assert _wal_pages(path) > 3 * AUTOCHECKPOINT_PAGES
    assert j.checkpoints == 0
    j.close()
    j2 = SqliteJournal(path)
    assert len(j2) == 3000 and j2.last_position() == 3000
    j2.close()


def test_the_checkpoint_thread_copies_the_wal_back_while_appends_go_on(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    j = SqliteJournal(path, checkpoint_interval_s=0.05)
    _append(j, 1500)
    wait_until(lambda: j.checkpoints >= 1, what="a checkpoint by the journal's thread")
    _append(j, 1500, start=1500)  # the WAL starts over after a complete checkpoint
    wait_until(lambda: _backfilled(path), what="the WAL copied back")
    assert j.checkpoint_failures == 0
    assert len(j) == 3000
    thread = j._checkpointer._thread  # type: ignore[union-attr]
    j.close()
    assert not thread.is_alive()


def test_a_journal_dropped_unclosed_stops_its_checkpoint_thread(tmp_path: Path) -> None:
    """The thread holds no reference to its journal: one a caller forgets to close is still
    collected (its connection closed) and its thread ends."""
    j = SqliteJournal(tmp_path / "journal.sqlite", checkpoint_interval_s=0.05)
    _append(j, 10)
    ref = weakref.ref(j)
    thread = j._checkpointer._thread  # type: ignore[union-attr]
    del j
    gc.collect()
    assert ref() is None
    wait_until(lambda: not thread.is_alive(), what="the checkpoint thread ended")


def test_without_the_thread_sqlite_checkpoints_inside_the_appends(tmp_path: Path) -> None:
    """``checkpoint_interval_s=0`` keeps SQLite's automatic checkpoint: the contrast that
    shows the first test measures what it claims."""
    path = tmp_path / "journal.sqlite"
    j = SqliteJournal(path, checkpoint_interval_s=0)
    _append(j, 3000)
    assert _wal_pages(path) < 2 * AUTOCHECKPOINT_PAGES
    j.close()


@pytest.mark.parametrize(("setting", "level"), [("NORMAL", 1), ("FULL", 2)])
def test_the_run_state_commits_with_the_journals_synchronous_setting(tmp_path: Path, setting: str, level: int) -> None:
    path = tmp_path / "journal.sqlite"
    j = SqliteJournal(path)
    rs = RunStateStore(path, synchronous=setting)  # type: ignore[arg-type]
    assert rs._db.execute("PRAGMA synchronous").fetchone()[0] == level
    assert rs._db.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0  # the journal's thread checkpoints
    rs.save_admin({"registrations": [{"instance_id": 1}]})
    assert rs.admin() == {"registrations": [{"instance_id": 1}]}
    rs.close()
    j.close()


def test_the_run_state_refuses_an_unknown_synchronous_setting(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="NORMAL or FULL"):
        RunStateStore(tmp_path / "journal.sqlite", synchronous="OFF")  # type: ignore[arg-type]
