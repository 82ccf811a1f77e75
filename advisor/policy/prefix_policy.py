"""Prefix-value eviction: the advisor's default policy for a fast tier of prefix blocks.

A block is only useful as part of a cached *prefix* (a hit is the longest run of cached
blocks from a request's first block), so its value is the chance that the prefix it ends
is requested again soon.  This module estimates that chance online, without any future
knowledge, and turns it into an eviction priority:

    priority(block) = last_access_clock + horizon × P(reuse | class of the block)

* ``clock`` counts block references (one tick per block of each request served);
* the *class* of a block at its last access is ``(times seen before, capped; position
  from the request's end, capped; whether the request continued an earlier prefix)``.
  The last block of a request is usually partial and almost never reused (the next turn
  re-hashes it with more tokens), a block seen again is reused far more often than a new
  one, and so on: :class:`ReuseStats` learns ``P(reuse | class)`` from the trace itself
  (a reference to a block credits the class the block had at its previous access);
* ``horizon`` = ``horizon_multiplier`` × the mean observed reuse distance (in clock
  ticks), so one setting fits every capacity and trace;
* the block with the *lowest* priority is evicted; within a request, deeper blocks get
  a slightly lower priority (leaves first), and evicting a block also evicts its cached
  descendants (a child without its parent can never be hit).

This pure-Python replay is kept as the reference of ``bench/evaluator.py``; the live
advisor ranks blocks with the evaluator's own rule (:mod:`advisor.policy.eviction.live_scoring`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, Field

ReuseClass = tuple[int, int, bool]
"""``(times seen before (capped), blocks from the request's end (capped), continuation)``."""


class PrefixPolicySettings(BaseModel):
    """Settings of the prefix-value policy (one set for every capacity).

    Attributes:
        horizon_multiplier: horizon = this × mean observed reuse distance (clock ticks).
        initial_horizon: horizon (clock ticks) before any reuse was observed.
        max_seen: "times seen before" is capped at this value in the class.
        max_from_end: "blocks from the request's end" is capped at this value.
        prior_reuse: prior reuse probability of a class (pseudo-count ``prior_weight``).
        prior_weight: pseudo-count of the prior.
        cascade: evicting a block also evicts its cached descendants.
    """

    horizon_multiplier: float = Field(8.0, gt=0.0)
    initial_horizon: float = Field(100_000.0, gt=0.0)
    max_seen: int = Field(4, ge=0)
    max_from_end: int = Field(1, ge=0)
    prior_reuse: float = Field(0.3, ge=0.0, le=1.0)
    prior_weight: float = Field(1.0, gt=0.0)
    cascade: bool = True


class ReuseStats:
    """Online ``P(reuse | class)`` and mean reuse distance, learned from accesses.

    Every access of a block counts one *insertion* in the block's current class; the next
    access of the same block credits one *reuse* to the class it had before and records
    the distance (clock ticks since the previous access).
    """

    __slots__ = ("_settings", "_ins", "_reuse", "_dist_sum", "_dist_n")

    def __init__(self, settings: PrefixPolicySettings) -> None:
        self._settings = settings
        self._ins: dict[ReuseClass, float] = {}
        self._reuse: dict[ReuseClass, float] = {}
        self._dist_sum = 0.0
        self._dist_n = 0

    def classify(self, seen_before: int, from_end: int, continuation: bool) -> ReuseClass:
        """Class of a block accessed for the ``seen_before + 1``-th time, ``from_end`` blocks
        before the end of its request (0 = last block)."""
        s = self._settings
        return (min(seen_before, s.max_seen), min(from_end, s.max_from_end), continuation)

    def record_insert(self, cls: ReuseClass) -> None:
        """One access of a block in class ``cls``."""
        self._ins[cls] = self._ins.get(cls, 0.0) + 1.0

    def record_reuse(self, previous_cls: ReuseClass, distance: int) -> None:
        """A block last accessed in class ``previous_cls`` was accessed again ``distance``
        clock ticks later."""
        self._reuse[previous_cls] = self._reuse.get(previous_cls, 0.0) + 1.0
        self._dist_sum += distance
        self._dist_n += 1

    def probability(self, cls: ReuseClass) -> float:
        """Smoothed ``P(reuse | cls)`` in [0, 1]."""
        s = self._settings
        w = s.prior_weight
        return (self._reuse.get(cls, 0.0) + w * s.prior_reuse) / (self._ins.get(cls, 0.0) + w)

    def horizon(self) -> float:
        """Horizon in clock ticks: ``horizon_multiplier`` × mean reuse distance."""
        if not self._dist_n:
            return self._settings.initial_horizon
        return self._settings.horizon_multiplier * self._dist_sum / self._dist_n

    def table(self) -> dict[ReuseClass, tuple[float, float]]:
        """``{class: (accesses, P(reuse))}`` (for explanations and reports)."""
        return {c: (n, self.probability(c)) for c, n in sorted(self._ins.items())}


@dataclass(slots=True)
class _Meta:
    """What the policy remembers of a block it has seen (cached or not)."""

    seen: int
    last_clock: int
    cls: ReuseClass
    parent: int | None


class PrefixValueCache:
    """A fast tier of ``capacity`` blocks managed by prefix-value eviction.

    Serve requests with :meth:`access` in arrival order.  Memory: one small record per
    distinct block ever seen (the class statistics need the block's previous access).

    Args:
        capacity: blocks the tier holds (> 0).
        settings: policy settings (defaults are the project's default policy).

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int, settings: PrefixPolicySettings | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self.settings = settings or PrefixPolicySettings()
        self.stats = ReuseStats(self.settings)
        self._cached: dict[int, float] = {}  # h -> priority currently in the heap
        self._heap: list[tuple[float, int]] = []
        self._meta: dict[int, _Meta] = {}
        self._children: dict[int, list[int]] = {}
        self.clock = 0
        self.evictions = 0

    def __contains__(self, h: object) -> bool:
        return h in self._cached

    def __len__(self) -> int:
        return len(self._cached)

    def parent_of(self, h: int) -> int | None:
        """Parent of a block seen before (``None`` for a first block or an unseen one)."""
        m = self._meta.get(h)
        return m.parent if m is not None else None

    def cached(self) -> set[int]:
        """Blocks held now (a copy)."""
        return set(self._cached)

    def cached_prefix(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``hashes`` held (no side effect)."""
        n = 0
        cached = self._cached
        for h in hashes:
            if h not in cached:
                break
            n += 1
        return n

    def access(self, hashes: Sequence[int]) -> int:
        """Serve one request: return its hit (cached prefix, in blocks), then insert all its
        blocks and evict down to capacity.

        Args:
            hashes: the request's prefix-chained block ids, first block first.

        Returns:
            Leading blocks of ``hashes`` that were cached before the request.
        """
        hit = self.cached_prefix(hashes)
        meta = self._meta
        stats = self.stats
        seen_prefix = 0
        for h in hashes:
            if h not in meta:
                break
            seen_prefix += 1
        continuation = seen_prefix > 1
        horizon = stats.horizon()
        n = len(hashes)
        clock = self.clock
        cached = self._cached
        heap = self._heap
        parent: int | None = None
        parent_prio = float("inf")
        for pos, h in enumerate(hashes):
            m = meta.get(h)
            if m is None:
                cls = stats.classify(0, n - 1 - pos, continuation)
                m = meta[h] = _Meta(1, clock, cls, parent)
                if parent is not None and self.settings.cascade:
                    self._children.setdefault(parent, []).append(h)
            else:
                stats.record_reuse(m.cls, clock - m.last_clock)
                cls = stats.classify(m.seen, n - 1 - pos, continuation)
                m.seen += 1
                m.last_clock = clock
                m.cls = cls
            stats.record_insert(cls)
            prio = clock + horizon * stats.probability(cls) - pos * 1e-6
            if prio > parent_prio:
                prio = parent_prio - 1e-6  # leaves first: never above its parent
            parent_prio = prio
            cached[h] = prio
            heapq.heappush(heap, (prio, h))
            parent = h
        self.clock = clock + n
        self._evict()
        return hit

    def _evict(self) -> None:
        cached = self._cached
        heap = self._heap
        children = self._children
        cascade = self.settings.cascade
        while len(cached) > self.capacity:
            prio, h = heapq.heappop(heap)
            if cached.get(h) != prio:
                continue  # stale heap entry
            del cached[h]
            self.evictions += 1
            if cascade and h in children:
                stack = [h]
                while stack:
                    for c in children.get(stack.pop(), ()):
                        if c in cached:
                            del cached[c]
                            self.evictions += 1
                            stack.append(c)
        if len(heap) > 4 * self.capacity + 1024:  # drop stale entries
            self._heap = [(p, h) for h, p in cached.items()]
            heapq.heapify(self._heap)


__all__ = ["PrefixPolicySettings", "PrefixValueCache", "ReuseClass", "ReuseStats"]
