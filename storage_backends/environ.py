"""Environment variables set for the length of a block (settings that libraries read from
the process environment only: the aws-sdk's retry strategy, vLLM's worker processes)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def environment(env: Mapping[str, str] | None) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the block (child processes started in it inherit
    it), then restore the previous values: a variable that was unset is unset again.

    The process environment is shared by every thread: callers that may run at once
    serialize around it themselves."""
    old = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
