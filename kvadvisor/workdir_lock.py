"""An exclusive lock on a working directory (``<workdir>/.kvadvisor.lock``, ``filelock``).

The lock is an ``flock`` on the file, so the kernel releases it when its owner dies: a
crashed demo never leaves a stale lock.  The owner's pid and command are written next to it
(``.kvadvisor.owner``) so that a refused second owner can say who holds it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

LOCK_NAME = ".kvadvisor.lock"
OWNER_NAME = ".kvadvisor.owner"


class WorkdirLockedError(RuntimeError):
    """Another process owns the working directory."""


@contextmanager
def workdir_lock(workdir: Path, what: str) -> Iterator[None]:
    """Hold the working directory's lock for the body; refuse at once if it is held.

    Args:
        workdir: the directory (must exist).
        what: what the caller does there (written for a refused second owner to read).

    Raises:
        WorkdirLockedError: another process holds the lock (message: its pid and task).
    """
    lock = FileLock(str(workdir / LOCK_NAME))
    owner = workdir / OWNER_NAME
    try:
        lock.acquire(timeout=0)
    except Timeout:
        try:
            who = owner.read_text().strip()
        except OSError:
            who = "unknown"
        raise WorkdirLockedError(f"working directory {workdir} is in use by another process ({who}); "
                                 "wait for it to finish or use another directory") from None
    try:
        owner.write_text(f"pid {os.getpid()}: {what} ({' '.join(sys.argv[:2])})\n")
        yield
    finally:
        owner.unlink(missing_ok=True)
        lock.release()
