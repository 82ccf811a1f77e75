"""Pausing Python's cyclic garbage collector around a put / get (``gc_paused``).

A call over thousands of blocks allocates a few container objects per block (placements,
index tuples) that live until it returns and are freed by reference counting: none is
cyclic garbage.  With the collector on, they survive its young collections, get promoted,
and trigger full collections that walk the whole heap of a process that imported torch
(hundreds of thousands of objects): measured 10-15 ms a 4,096-block get on average, spikes
of 90 ms.  Paused, they die young, are never promoted, and trigger nothing.

The pause is meant for CPU-bound stretches: a call that ends up waiting long (a transfer
still running after a second, a retry's backoff) calls :func:`gc_pause_yield`, which turns
the collector back on for the rest of the pause, so the process's other threads never go
without it for long.  Nor does a stream of calls that overlap (several threads, one always
inside, so the shared pause never ends): a pause older than :data:`MAX_PAUSE_S` seconds is
ended by the next call that enters or leaves it.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any, TypeVar

_lock = threading.Lock()
_users = 0
_was_enabled = False
_since = 0.0  # time.monotonic() when the current shared pause began
_F = TypeVar("_F", bound=Callable[..., Any])
#: the longest a shared pause keeps the collector off (seconds): overlapping calls that
#: keep the pause open past it turn the collector back on until the last one is out
MAX_PAUSE_S = 1.0


def _end_if_old() -> None:
    """Hold ``_lock``: re-enable the collector when the current pause is too old."""
    if _was_enabled and time.monotonic() - _since > MAX_PAUSE_S and not gc.isenabled():
        gc.enable()


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic collector while the block runs (see the module docstring).

    Nested and concurrent pauses (several threads) share one pause: the first one in
    records whether the collector was enabled, the last one out re-enables it, and only
    if it was.  An application that disabled it keeps it disabled.  A shared pause that
    overlapping calls keep open for more than :data:`MAX_PAUSE_S` seconds is ended by
    the next call in or out (the collector runs again until the last one is out).
    """
    global _users, _was_enabled, _since
    with _lock:
        if _users == 0:
            _was_enabled = gc.isenabled()
            _since = time.monotonic()
            gc.disable()
        else:
            _end_if_old()
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                if _was_enabled:
                    gc.enable()
            else:
                _end_if_old()


def gc_pause_yield() -> None:
    """End the current pause early (the collector runs again until the last pauser is
    out): called where a paused call starts waiting for long.  A no-op outside a pause
    or when the application had the collector disabled."""
    with _lock:
        if _users and _was_enabled and not gc.isenabled():
            gc.enable()


def gc_paused_call(fn: _F) -> _F:
    """Decorator: run ``fn`` inside :func:`gc_paused`."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
