"""Belady's MIN: evict the block whose next use is farthest in the future (offline optimum).

L. A. Belady, "A study of replacement algorithms for a virtual-storage computer", IBM
Systems Journal 5(2), 1966.  Here every block of a request is inserted, then blocks are
evicted down to the capacity, farthest next request first (never-used-again first), ties
by smaller block id.  With prefix hits this is the reference upper bound the evaluator
reports, not a proven optimum of the prefix-hit objective.
"""

from __future__ import annotations

import heapq

import numba
import numpy as np

from advisor.policy.eviction.compact import CompactTrace


@numba.njit(cache=True)
def _run(flat: np.ndarray, offsets: np.ndarray, n_blocks: int, capacity: int, next_use: np.ndarray) -> np.ndarray:
    n_req = offsets.shape[0] - 1
    key_of = np.full(n_blocks, -1, dtype=np.int64)  # current heap key of a cached block, -1 = not cached
    hits = np.zeros(n_req, dtype=np.int64)
    heap = [np.int64(0)]
    heap.pop()
    size = 0
    for i in range(n_req):
        a, b = offsets[i], offsets[i + 1]
        j = a
        while j < b and key_of[flat[j]] >= 0:
            j += 1
        hits[i] = j - a
        for j in range(a, b):
            x = flat[j]
            if key_of[x] < 0:
                size += 1
            # smallest key = farthest next use, then smaller id
            k = ((n_req - next_use[j]) << 32) | x
            key_of[x] = k
            heapq.heappush(heap, k)
        while size > capacity:
            k = heapq.heappop(heap)
            x = k & 0xFFFFFFFF
            if key_of[x] == k:
                key_of[x] = -1
                size -= 1
        if len(heap) > 4 * capacity + 1024:
            heap = [key_of[x] for x in range(n_blocks) if key_of[x] >= 0]
            heapq.heapify(heap)
    return hits


def simulate(trace: CompactTrace, capacity: int) -> np.ndarray:
    """Hit blocks per request (int64 ``[requests]``) under Belady's MIN with ``capacity`` blocks."""
    return _run(trace.flat, trace.offsets, trace.n_blocks, capacity, trace.next_use())


__all__ = ["simulate"]
