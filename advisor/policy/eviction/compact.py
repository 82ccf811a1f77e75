"""Compact form of a block-reuse trace for the compiled policy kernels.

A trace is a list of requests, each a list of prefix-chained block ids (sequence hashes or
a trace's own ids, any int64).  Kernels want dense ids and flat arrays:

* ``flat``: int32 ``[refs]``, every block reference in request order, ids remapped to
  ``0 .. n_blocks-1`` in increasing order of the original id (ties broken the same way);
* ``offsets``: int64 ``[requests + 1]``, request ``i`` is ``flat[offsets[i]:offsets[i+1]]``;
* ``parent``: int32 ``[n_blocks]``, the block before it in the first request that used it
  (``-1`` for a first block): its prefix parent;
* ``next_use``: int64 ``[refs]``, for each reference the index of the next request using
  the same block (``requests`` = never), built on demand (Belady, lookahead);
* ``finishes``: when the trace has them, each request's arrival and finish times and the
  class of its finish reason (:class:`RequestFinishes`, the finish-aware expert's input).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numba
import numpy as np


@numba.njit(cache=True)
def _parents(flat: np.ndarray, offsets: np.ndarray, n_blocks: int) -> np.ndarray:
    parent = np.full(n_blocks, -2, dtype=np.int32)
    for i in range(offsets.shape[0] - 1):
        prev = -1
        for j in range(offsets[i], offsets[i + 1]):
            b = flat[j]
            if parent[b] == -2:
                parent[b] = prev
            prev = b
    for b in range(n_blocks):
        if parent[b] == -2:
            parent[b] = -1
    return parent


@numba.njit(cache=True)
def _next_uses(flat: np.ndarray, offsets: np.ndarray, n_blocks: int) -> np.ndarray:
    n_req = offsets.shape[0] - 1
    last = np.full(n_blocks, n_req, dtype=np.int64)
    out = np.empty(flat.shape[0], dtype=np.int64)
    for i in range(n_req - 1, -1, -1):
        for j in range(offsets[i], offsets[i + 1]):
            out[j] = last[flat[j]]
        for j in range(offsets[i], offsets[i + 1]):
            last[flat[j]] = i
    return out


@numba.njit(cache=True, inline="always")
def add_block(x: int, cached: np.ndarray, children: np.ndarray, parent: np.ndarray) -> int:
    """Cache block ``x`` in the prefix tree (see :func:`drop_leaf`); returns 1 when it was
    not cached (the tier holds one block more), else 0."""
    if cached[x]:
        return 0
    cached[x] = True
    p = parent[x]
    if p >= 0:
        children[p] += 1
    return 1


@numba.njit(cache=True, inline="always")
def drop_leaf(v: int, cached: np.ndarray, children: np.ndarray, parent: np.ndarray) -> int:
    """Un-cache leaf ``v`` of the cached prefix tree (``cached`` bool, ``children`` int32
    counts of cached children, ``parent`` as :attr:`CompactTrace.parent`); returns its
    parent when that is cached and has become a leaf (a new eviction candidate), else -1."""
    cached[v] = False
    p = parent[v]
    if p < 0:
        return -1
    children[p] -= 1
    return p if cached[p] and children[p] == 0 else -1


@dataclass(frozen=True)
class RequestFinishes:
    """When each request arrived and finished, and how its answer ended.

    Attributes:
        arrival: float64 ``[requests]``, seconds from the trace's start, non-decreasing.
        finish: float64 ``[requests]``, seconds; ``finish >= arrival`` (equal: unknown).
        reason: int8 ``[requests]``, the finish reason's class
            (:data:`advisor.policy.eviction.finish_aware.FINISH_CLASSES`, 0 = unknown).

    Raises:
        ValueError: shapes differ, a time is not finite, a finish precedes its arrival,
            arrivals go back in time, or a class is outside 0..3.
    """

    arrival: np.ndarray
    finish: np.ndarray
    reason: np.ndarray

    def __post_init__(self) -> None:
        n = self.arrival.shape
        if self.finish.shape != n or self.reason.shape != n or len(n) != 1:
            raise ValueError(f"arrival, finish and reason must be 1-d of one length, got {n}, "
                             f"{self.finish.shape}, {self.reason.shape}")
        if n[0] and not (np.isfinite(self.arrival).all() and np.isfinite(self.finish).all()):
            raise ValueError("arrival and finish times must be finite numbers")
        if n[0] and ((self.finish < self.arrival).any() or (np.diff(self.arrival) < 0).any()
                     or self.reason.min() < 0 or self.reason.max() > 3):
            raise ValueError("need finish >= arrival, arrivals in order and reason classes in 0..3")


@dataclass
class CompactTrace:
    """A trace as flat arrays (see the module docstring for shapes)."""

    flat: np.ndarray
    offsets: np.ndarray
    n_blocks: int
    parent: np.ndarray
    keys: np.ndarray | None = field(default=None, repr=False)
    """int64 ``[blocks]``: the original id of each dense id (sorted), ``None`` when not kept."""
    finishes: RequestFinishes | None = field(default=None, repr=False)
    """Arrival, finish and finish reason of each request, ``None`` when the trace has none."""
    _next_use: np.ndarray | None = field(default=None, repr=False)

    @property
    def requests(self) -> int:
        """Number of requests."""
        return int(self.offsets.shape[0] - 1)

    @property
    def refs(self) -> int:
        """Number of block references."""
        return int(self.flat.shape[0])

    def next_use(self) -> np.ndarray:
        """int64 ``[refs]``: index of the next request referencing each reference's block."""
        if self._next_use is None:
            self._next_use = _next_uses(self.flat, self.offsets, self.n_blocks)
        return self._next_use


def compact(requests: Sequence[Sequence[int]], finishes: RequestFinishes | None = None) -> CompactTrace:
    """Remap a trace's block ids to dense ids and flatten it.

    Args:
        requests: block id lists (int64 range) in arrival order.
        finishes: each request's arrival, finish and finish reason, when known.

    Returns:
        The :class:`CompactTrace`; dense ids keep the order of the original ids.

    Raises:
        ValueError: a block id is not an integer in int64 range (the message names the
            request), or ``finishes`` has another number of requests.
    """
    if finishes is not None and finishes.arrival.shape[0] != len(requests):
        raise ValueError(f"finishes cover {finishes.arrival.shape[0]} requests, the trace has {len(requests)}")
    lengths = np.fromiter((len(r) for r in requests), dtype=np.int64, count=len(requests))
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    raw = np.empty(total, dtype=np.int64)
    pos = 0
    for i, r in enumerate(requests):
        n = len(r)
        if n:
            try:
                raw[pos:pos + n] = r
            except (OverflowError, TypeError, ValueError) as exc:
                raise ValueError(f"request {i}: block ids must be integers in int64 range ({exc})") from exc
        pos += n
    uniq, inv = np.unique(raw, return_inverse=True)
    flat = inv.astype(np.int32).reshape(-1)
    n_blocks = int(uniq.shape[0])
    return CompactTrace(flat, offsets, n_blocks, _parents(flat, offsets, n_blocks), uniq, finishes)


__all__ = ["CompactTrace", "RequestFinishes", "add_block", "compact", "drop_leaf"]
