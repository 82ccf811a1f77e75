"""Waiting in a test: poll for a condition, never sleep a fixed time and hope it happened.

A fixed ``time.sleep`` before an ``assert`` passes on an idle machine and fails on a loaded
one (CI, or two busy processes per core beside the suite).  :func:`wait_until` polls instead,
and returns as soon as the condition holds; its deadline only bounds the wait, so it is long
(a loaded machine may be many times slower than this one when idle).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(pred: Callable[[], T], timeout: float = 60.0, what: str = "condition", every: float = 0.05) -> T:
    """Call ``pred()`` every ``every`` seconds until it returns a true value, and return that
    value.  Raises :class:`AssertionError` naming ``what`` after ``timeout`` seconds (the
    deadline bounds a wait; it is not a speed the test asserts)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not reached in {timeout:g} s")
        time.sleep(every)


def hold_for(pred: Callable[[], object], seconds: float, what: str = "condition", every: float = 0.05) -> None:
    """Check that ``pred()`` stays true for ``seconds`` (something must *not* happen: a
    message must not arrive, a lease must not move).  Raises :class:`AssertionError` naming
    ``what`` the first time it is false.  The time here is let pass on purpose: a loaded
    machine only makes the check weaker, never wrong."""
    end = time.monotonic() + seconds
    while True:
        assert pred(), f"{what} stopped holding"
        if time.monotonic() >= end:
            return
        time.sleep(every)
