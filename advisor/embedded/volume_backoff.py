"""Backoff of moves into a full volume.

A move whose destination answered "full" (``VolumeFullError``: its capacity, ENOSPC or
EDQUOT) is not planned again into that volume for ``base_s`` seconds, doubling at every
further failure up to ``max_s``; the first move that lands there resets it.  Without it
every policy round re-reads the same blocks and fails the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _State:
    delay_s: float
    until: float
    failures: int


class FullVolumeBackoff:
    """Per-volume exponential backoff after "volume full" failures (not thread-safe; the
    advisor calls it under its round lock).

    Args:
        base_s: first wait after a failure (seconds, >= 0; 0 disables the backoff).
        max_s: longest wait (seconds).
        clock: monotonic clock (seconds).
    """

    def __init__(self, base_s: float, max_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.base_s = base_s
        self.max_s = max(max_s, base_s)
        self._clock = clock
        self._state: dict[str, _State] = {}

    def failed(self, volume_id: str) -> float:
        """Record a "full" failure of ``volume_id``; return the wait now imposed (s)."""
        st = self._state.get(volume_id)
        delay = self.base_s if st is None else min(st.delay_s * 2, self.max_s)
        self._state[volume_id] = _State(delay, self._clock() + delay, (st.failures if st else 0) + 1)
        return delay

    def succeeded(self, volume_id: str) -> None:
        """A move landed on ``volume_id``: no more backoff."""
        self._state.pop(volume_id, None)

    def waiting(self, volume_id: str | None) -> bool:
        """Whether moves into ``volume_id`` are held back now."""
        st = self._state.get(volume_id) if volume_id is not None else None
        return st is not None and self._clock() < st.until

    def status(self) -> dict[str, dict[str, float]]:
        """Per volume in backoff: ``{"failures", "delay_s", "remaining_s"}``."""
        now = self._clock()
        return {v: {"failures": st.failures, "delay_s": st.delay_s, "remaining_s": max(0.0, st.until - now)}
                for v, st in self._state.items()}
