"""Files that hold secrets (CURVE secret keys, NATS passwords, tokens, creds and nkey
seeds): read only when no one but their owner may read or write them, and written with
mode 0600.

A secret file that group or others may read is already exposed, so it is refused rather
than used (docs/security.md, "What holds by default": secrets). Errors name the file,
never its content.

Imports nothing else of ours but :mod:`event_plane.errors`.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from event_plane.errors import ConfigError

__all__ = ["check_private_file", "write_private_file"]


def check_private_file(path: str | os.PathLike[str], what: str) -> None:
    """Refuse the secret file ``path`` unless it is a regular file that group and others
    may neither read nor write (no ``0o077`` mode bit).

    Args:
        path: the file.
        what: what it holds, for the message (e.g. ``"CURVE secret key file"``).

    Raises:
        ConfigError: the file is missing or unreadable, not a regular file, or its mode has
            any of the ``0o077`` bits (the message says ``chmod 600 FILE``).
    """
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} {path} is not a regular file")
    if st.st_mode & 0o077:
        raise ConfigError(
            f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: other users may read it; "
            f"run chmod 600 {path}"
        )


def write_private_file(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600, atomically: a reader sees the old file or
    the new one, never a part (a temporary file of a unique name in the same directory,
    then :func:`os.replace`). The directory must exist.

    Raises:
        OSError: the directory cannot be written.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
