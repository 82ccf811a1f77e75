"""Compact form of a block-reuse trace for the compiled policy kernels.

A trace is a list of requests, each a list of prefix-chained block ids (sequence hashes or
a trace's own ids, any int64).  Kernels want dense ids and flat arrays:

* ``flat``: int32 ``[refs]``, every block reference in request order, ids remapped to
  ``0 .. n_blocks-1`` in increasing order of the original id (ties broken the same way);
* ``offsets``: int64 ``[requests + 1]``, request ``i`` is ``flat[offsets[i]:offsets[i+1]]``;
* ``parent``: int32 ``[n_blocks]``, the block before it in the first request that used it
  (``-1`` for a first block): its prefix parent;
* ``next_use``: int64 ``[refs]``, for each reference the index of the next request using
  the same block (``requests`` = never), built on demand (Belady, lookahead).
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


@dataclass
class CompactTrace:
    """A trace as flat arrays (see the module docstring for shapes)."""

    flat: np.ndarray
    offsets: np.ndarray
    n_blocks: int
    parent: np.ndarray
    keys: np.ndarray | None = field(default=None, repr=False)
    """int64 ``[blocks]``: the original id of each dense id (sorted), ``None`` when not kept."""
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


def compact(requests: Sequence[Sequence[int]]) -> CompactTrace:
    """Remap a trace's block ids to dense ids and flatten it.

    Args:
        requests: block id lists (int64 range) in arrival order.

    Returns:
        The :class:`CompactTrace`; dense ids keep the order of the original ids.

    Raises:
        ValueError: a block id is not an integer in int64 range (the message names the request).
    """
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
    return CompactTrace(flat, offsets, n_blocks, _parents(flat, offsets, n_blocks), uniq)


__all__ = ["CompactTrace", "compact"]
