"""Prefix-aware LRU: evict the least recently used *leaf* of the cached prefix tree.

L. Zheng et al., "SGLang: Efficient Execution of Structured Language Model Programs"
(RadixAttention), NeurIPS 2024, §3: cached prefixes form a tree and the LRU policy
"evicts the least recently used leaf first", so a block is never evicted before a cached
block that extends it (a child without its parent could never be hit).  A block's parent
is the block before it in the first request that used it.  Ties cannot happen: every
reference has its own time.
"""

from __future__ import annotations

import heapq

import numba
import numpy as np

from advisor.policy.eviction.compact import CompactTrace, add_block, drop_leaf
from advisor.policy.eviction.evlog import as_arrays, log_eviction, log_resident, new_log, no_logging, prefix_hit


@numba.njit(cache=True)
def _run(flat: np.ndarray, offsets: np.ndarray, n_blocks: int, capacity: int, parent: np.ndarray,
         want_ev: np.ndarray, want_snap: np.ndarray) -> tuple:
    n_req = offsets.shape[0] - 1
    cached = np.zeros(n_blocks, dtype=np.bool_)
    children = np.zeros(n_blocks, dtype=np.int32)  # cached children
    last = np.zeros(n_blocks, dtype=np.int64)
    hits = np.zeros(n_req, dtype=np.int64)
    heap = [(np.int64(0), np.int64(0))]
    heap.pop()
    size = 0
    clock = 0
    evl, snl = new_log(), new_log()
    for i in range(n_req):
        a, b = offsets[i], offsets[i + 1]
        if want_snap[i]:
            log_resident(snl, i, cached)
        hits[i] = prefix_hit(flat, a, b, cached)
        for j in range(a, b):
            x = flat[j]
            clock += 1
            last[x] = clock
            size += add_block(x, cached, children, parent)
            if children[x] == 0:
                heapq.heappush(heap, (clock, np.int64(x)))
            while size > capacity:
                t, v = heapq.heappop(heap)
                if cached[v] and children[v] == 0 and last[v] == t:
                    size -= 1
                    if want_ev[i]:
                        log_eviction(evl, i, j - a, v)
                    p = drop_leaf(v, cached, children, parent)
                    if p >= 0:
                        heapq.heappush(heap, (last[p], np.int64(p)))
            if len(heap) > 4 * capacity + 1024:
                heap = [(last[v], np.int64(v)) for v in range(n_blocks) if cached[v] and children[v] == 0]
                heapq.heapify(heap)
    return hits, as_arrays(evl), as_arrays(snl)


def simulate(trace: CompactTrace, capacity: int) -> np.ndarray:
    """Hit blocks per request (int64 ``[requests]``) under leaf-first LRU with ``capacity`` blocks."""
    return _run(trace.flat, trace.offsets, trace.n_blocks, capacity, trace.parent, *no_logging(trace.requests))[0]


def replay(trace: CompactTrace, capacity: int, want_ev: np.ndarray, want_snap: np.ndarray) -> tuple:
    """``(hits, evictions, snapshots)`` with the logs of :mod:`advisor.policy.eviction.evlog`."""
    return _run(trace.flat, trace.offsets, trace.n_blocks, capacity, trace.parent, want_ev, want_snap)


__all__ = ["replay", "simulate"]
