"""An exclusive, crash-safe ownership lock on a file or directory (``filelock``: an
``flock`` the kernel releases when the owner dies, so a crash never leaves it stale).

The owner writes its pid and task next to the lock (``<lock>.owner``), so that a refused
second owner can say who holds it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from filelock import FileLock, Timeout


class OwnedError(RuntimeError):
    """Another process owns it."""


class OwnerLock:
    """Hold ``lock_path`` exclusively; refuse at once when another process holds it.

    Args:
        lock_path: the lock file (created; its directory must exist).
        what: the thing owned, for messages (e.g. ``"journal /var/lib/kvadvisor/journal.sqlite"``).
        task: what the owner does (written for a refused second owner to read).
    """

    def __init__(self, lock_path: str | Path, what: str, task: str) -> None:
        self.path = Path(lock_path)
        self.owner_path = self.path.with_name(self.path.name + ".owner")
        self.what = what
        self.task = task
        self._lock = FileLock(str(self.path))

    def acquire(self) -> None:
        """Take the lock now.

        Raises:
            OwnedError: another process holds it (message: its pid and task).
        """
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            try:
                who = self.owner_path.read_text().strip()
            except OSError:
                who = "unknown"
            raise OwnedError(f"{self.what} is in use by another process ({who}); wait for it to finish "
                             "or use another one") from None
        self.owner_path.write_text(f"pid {os.getpid()}: {self.task} ({' '.join(sys.argv[:2])})\n")

    def release(self) -> None:
        """Give the lock back (idempotent)."""
        if self._lock.is_locked:
            self.owner_path.unlink(missing_ok=True)
            self._lock.release()

    def __enter__(self) -> OwnerLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
