"""Move guard: a block is not moved twice within ``min_move_interval_s`` unless new events touch it.

The policy rounds are stateless (each sees the volumes and the index as they are); without
memory, a block demoted by one round may be promoted by the next and back again.  The guard
remembers, per block, when it was last moved and its last access (``last_access_ns``, from the
index) at that moment.  A later plan item moving the same block is held back while the
interval has not passed and the block's last access is unchanged (no new event accessed it).
The policies get the same view (:meth:`MoveGuard.view`, ``PolicyInput.held``), so a round
plans the next best blocks instead of moves the guard would refuse; :meth:`MoveGuard.filter`
stays the last gate (for items planned elsewhere, and for blocks moved meanwhile).

The memory is kept on the advisor's monotonic clock; :meth:`MoveGuard.export` and
:meth:`MoveGuard.restore` carry it over a restart in wall-clock time (the embedded advisor
stores it with its run state, :mod:`advisor.embedded.run_state`), so a restart does not shorten the
interval.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from advisor.policy.plan import PlanItem, PlanKind, PlanResult, PlanStatus


class MoveGuard:
    """Holds back moves of blocks moved less than ``interval_s`` ago and untouched since.

    Args:
        interval_s: minimum seconds between two moves of one block (``0`` = no limit).
        last_access: the block's last access (ns) in the index, ``None`` if unknown.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, interval_s: float, last_access: Callable[[int], int | None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0:
            raise ValueError(f"min_move_interval_s must be >= 0, got {interval_s}")
        self.interval_s = interval_s
        self._last_access = last_access
        self._clock = clock
        self._moved: dict[int, tuple[float, int | None]] = {}  # h -> (when, last access then)
        self._lock = threading.Lock()
        self.held_back = 0

    def _recent(self, h: int, now: float) -> bool:
        got = self._moved.get(h)
        if got is None:
            return False
        when, access = got
        if now - when >= self.interval_s:
            del self._moved[h]
            return False
        return self._last_access(h) == access

    def view(self, last_access: Callable[[int], int | None] | None = None) -> Callable[[int], bool]:
        """The guard as the policies see it (``PolicyInput.held``): ``held(sequence hash)``
        is ``True`` when a move of that block now would be held back, so a round plans the
        next best candidates instead of moves that :meth:`filter` then drops.

        Args:
            last_access: how to read a block's last access (ns) while planning (default:
                the guard's own reader); pass one that takes no lock when the caller
                already holds the index's lock.

        Returns:
            A predicate on sequence hashes, at the time of this call (one clock read, so
            one round sees one view).
        """
        if self.interval_s <= 0:
            return lambda h: False
        read = self._last_access if last_access is None else last_access
        now = self._clock()

        def held(h: int) -> bool:
            with self._lock:
                got = self._moved.get(h)
                if got is None or now - got[0] >= self.interval_s:
                    return False
                access = got[1]
            return read(h) == access

        return held

    def filter(self, items: Sequence[PlanItem]) -> tuple[list[PlanItem], int]:
        """The items to plan, and how many moves were held back.

        Compactions always pass (they rewrite a segment in place, no block changes tier).
        """
        if self.interval_s <= 0:
            return list(items), 0
        now = self._clock()
        out: list[PlanItem] = []
        held = 0
        with self._lock:
            for it in items:
                if it.kind is not PlanKind.COMPACT and it.sequence_hash is not None and self._recent(it.sequence_hash, now):
                    held += 1
                    continue
                out.append(it)
            self.held_back += held
        return out, held

    def record(self, results: Sequence[PlanResult]) -> None:
        """Remember the blocks that ``results`` moved (status ``done``), with their last access
        now, and forget the moves older than the interval (the memory holds at most the
        blocks moved within the last ``interval_s``)."""
        if self.interval_s <= 0:
            return
        now = self._clock()
        with self._lock:
            for r in results:
                h = r.item.sequence_hash
                if r.item.kind is PlanKind.COMPACT or h is None or r.status is not PlanStatus.DONE:
                    continue
                self._moved.pop(h, None)  # re-inserted at the end: the dict stays in order of time
                self._moved[h] = (now, self._last_access(h))
            self._forget_expired(now)

    def _forget_expired(self, now: float) -> None:
        """Drop the oldest entries while they are past the interval (call under the lock)."""
        moved = self._moved
        while moved:
            h, (when, _access) = next(iter(moved.items()))
            if now - when < self.interval_s:
                break
            del moved[h]

    def export(self, wall_now: float | None = None) -> list[tuple[int, float, int | None]]:
        """The blocks still within the interval: ``(sequence hash, wall-clock seconds of the
        move, last access ns then)``, for :meth:`restore` after a restart.

        Args:
            wall_now: wall-clock seconds now (default ``time.time()``).
        """
        wall = time.time() if wall_now is None else wall_now
        now = self._clock()
        with self._lock:
            return [(h, wall - (now - when), access) for h, (when, access) in self._moved.items()
                    if now - when < self.interval_s]

    def restore(self, entries: Sequence[tuple[int, float, int | None]], wall_now: float | None = None) -> int:
        """Remember the moves of :meth:`export` (of a previous run); returns how many are
        still within the interval (the others are dropped).  A wall-clock time in the
        future (a clock step) counts as now."""
        if self.interval_s <= 0:
            return 0
        wall = time.time() if wall_now is None else wall_now
        now = self._clock()
        n = 0
        with self._lock:
            for h, moved_at, access in sorted(entries, key=lambda e: e[1]):  # oldest first: time order
                age = max(0.0, wall - moved_at)
                if age < self.interval_s:
                    self._moved.pop(int(h), None)
                    self._moved[int(h)] = (now - age, access)
                    n += 1
        return n

    def __len__(self) -> int:
        return len(self._moved)


__all__ = ["MoveGuard"]
