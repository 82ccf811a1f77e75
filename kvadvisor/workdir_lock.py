"""An exclusive lock on a working directory (``<workdir>/.kvadvisor.lock``,
:class:`advisor.embedded.owner_lock.OwnerLock`): released by the kernel when its owner dies, so a
crashed demo never leaves a stale lock; the owner's pid and task are written beside it
(``.kvadvisor.lock.owner``) for a refused second owner to name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from advisor.embedded.owner_lock import OwnedError, OwnerLock

LOCK_NAME = ".kvadvisor.lock"

WorkdirLockedError = OwnedError
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
    with OwnerLock(workdir / LOCK_NAME, f"working directory {workdir}", what):
        yield
