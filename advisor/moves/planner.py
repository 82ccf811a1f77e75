"""Planner: rate-limits the policies' plan items (per round, bytes per second, in flight).

Limits, checked in this order for each proposed item (all from :class:`PlannerSettings`):

* ``max_moves_per_round`` / ``max_compactions_per_round``: items of one round;
* ``max_bytes_per_round``: bytes copied by one round;
* ``max_concurrent_moves``: items planned and not yet :meth:`Planner.release` d, across
  rounds and threads;
* ``max_bytes_per_s`` with ``burst_bytes``: a token bucket on copied bytes across rounds.

An item that does not fit is deferred (a later, smaller item may still fit) and the
reason is counted in :attr:`Plan.deferred_reasons`; each accepted item keeps the
policy's own ``reason``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from advisor.policy.plan import PlanItem, PlanKind
from advisor.policy.policies import PlannerSettings


@dataclass
class Plan:
    """The items a round will execute, and how many were held back by the limits.

    Attributes:
        items: accepted items, in execution order (each with the policy's reason).
        deferred: items left for a later round (limits reached).
        duplicates: items dropped because the same block / segment was already planned.
        deferred_reasons: deferred items per limit name (``moves_per_round``,
            ``compactions_per_round``, ``bytes_per_round``, ``concurrent_moves``,
            ``bytes_per_s``).
    """

    items: list[PlanItem] = field(default_factory=list)
    deferred: int = 0
    duplicates: int = 0
    deferred_reasons: dict[str, int] = field(default_factory=dict)


class TokenBucket:
    """Bytes-per-second token bucket (thread-safe).

    Args:
        rate: tokens (bytes) added per second; must be > 0.
        burst: bucket depth in bytes (starts full).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError(f"token bucket needs rate > 0 and burst > 0, got {rate}, {burst}")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._t = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
        self._t = now

    def available(self) -> float:
        """Tokens (bytes) available now."""
        with self._lock:
            self._refill()
            return self._tokens

    def try_take(self, n: float) -> bool:
        """Take ``n`` tokens if available now. An item larger than ``burst`` is taken
        once the bucket is full (it drives the bucket negative), so it is never starved."""
        with self._lock:
            self._refill()
            if self._tokens >= n or (n > self.burst and self._tokens >= self.burst):
                self._tokens -= n
                return True
            return False


class Planner:
    """Keeps the proposed order and accepts items while the budgets last.

    Args:
        settings: :class:`PlannerSettings`.
        clock: monotonic seconds for the token bucket (injectable for tests).
    """

    def __init__(self, settings: PlannerSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.bucket: TokenBucket | None = None
        if settings.max_bytes_per_s > 0:
            burst = settings.burst_bytes or settings.max_bytes_per_s
            self.bucket = TokenBucket(settings.max_bytes_per_s, burst, clock)
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        """Items planned and not yet released."""
        return self._in_flight

    def release(self, n: int) -> None:
        """Mark ``n`` planned items as finished (done, skipped or failed)."""
        with self._lock:
            self._in_flight = max(0, self._in_flight - n)

    def plan(self, proposed: Sequence[PlanItem]) -> Plan:
        """Accept items in order while the limits allow (see the module docstring).

        A block or segment is planned at most once per round.  The accepted items count
        as in flight until :meth:`release`.
        """
        s = self.settings
        out = Plan()
        moves = compactions = 0
        nbytes = 0
        seen_blocks: set[int] = set()
        seen_segments: set[tuple[str, int]] = set()

        def defer(why: str) -> None:
            out.deferred += 1
            out.deferred_reasons[why] = out.deferred_reasons.get(why, 0) + 1

        with self._lock:
            for it in proposed:
                compact = it.kind is PlanKind.COMPACT
                if compact:
                    key = (it.src_volume, it.segment_id if it.segment_id is not None else -1)
                    if key in seen_segments:
                        out.duplicates += 1
                        continue
                    if compactions >= s.max_compactions_per_round:
                        defer("compactions_per_round")
                        continue
                else:
                    h = it.sequence_hash if it.sequence_hash is not None else -1
                    if h in seen_blocks:
                        out.duplicates += 1
                        continue
                    if moves >= s.max_moves_per_round:
                        defer("moves_per_round")
                        continue
                if nbytes + it.bytes > s.max_bytes_per_round:
                    defer("bytes_per_round")
                    continue
                if s.max_concurrent_moves and self._in_flight >= s.max_concurrent_moves:
                    defer("concurrent_moves")
                    continue
                if self.bucket is not None and not self.bucket.try_take(it.bytes):
                    defer("bytes_per_s")
                    continue
                if compact:
                    seen_segments.add(key)
                    compactions += 1
                else:
                    seen_blocks.add(h)
                    moves += 1
                self._in_flight += 1
                nbytes += it.bytes
                out.items.append(it)
        return out


__all__ = ["Plan", "Planner", "TokenBucket"]
