"""LFU-DA: least frequently used with dynamic aging.

M. Arlitt, L. Cherkasova, J. Dilley, R. Friedrich and T. Jin, "Evaluating Content
Management Techniques for Web Proxy Caches", ACM SIGMETRICS Performance Evaluation Review
27(4), 2000, §3.  A cached block has key ``K = F + L`` where ``F`` is its reference count
since it entered the tier (1 on insertion) and ``L`` the cache age; the block with the
smallest key is evicted (before a missed block is admitted) and ``L`` becomes its key.  A
reference recomputes ``K`` with the current ``L``.  Ties (not fixed by the paper) go to the least recently referenced block.
"""

from __future__ import annotations

import heapq

import numba
import numpy as np

from advisor.policy.eviction.compact import CompactTrace
from advisor.policy.eviction.evlog import as_arrays, log_eviction, new_log, run_kernel, served


@numba.njit(cache=True)
def _run(flat: np.ndarray, offsets: np.ndarray, n_blocks: int, capacity: int, want_ev: np.ndarray,
         want_snap: np.ndarray, tail_first: bool) -> tuple:
    n_req = offsets.shape[0] - 1
    freq = np.zeros(n_blocks, dtype=np.int64)  # 0 = not cached
    stamp = np.zeros(n_blocks, dtype=np.int64)
    key = np.zeros(n_blocks, dtype=np.int64)
    hits = np.zeros(n_req, dtype=np.int64)
    heap = [(np.int64(0), np.int64(0), np.int64(0))]
    heap.pop()
    age = 0
    size = 0
    clock = 0
    evl, snl = new_log(), new_log()
    for i in range(n_req):
        a, b = offsets[i], offsets[i + 1]
        if want_snap[i]:
            for x in range(n_blocks):
                if freq[x] > 0:
                    log_eviction(snl, i, 0, x)
        j = a
        while j < b and freq[flat[j]] > 0:
            j += 1
        hits[i] = j - a
        for step in range(b - a):
            j = served(a, b, step, tail_first)
            x = flat[j]
            clock += 1
            if freq[x] == 0:
                while size >= capacity:  # the missed block is always admitted: evict first
                    k, s, v = heapq.heappop(heap)
                    if freq[v] > 0 and stamp[v] == s:
                        freq[v] = 0
                        size -= 1
                        age = k
                        if want_ev[i]:
                            log_eviction(evl, i, step, v)
                size += 1
            freq[x] += 1
            stamp[x] = clock
            key[x] = freq[x] + age
            heapq.heappush(heap, (key[x], clock, np.int64(x)))
            if len(heap) > 4 * capacity + 1024:
                heap = [(key[v], stamp[v], np.int64(v)) for v in range(n_blocks) if freq[v] > 0]
                heapq.heapify(heap)
    return hits, as_arrays(evl), as_arrays(snl)


def simulate(trace: CompactTrace, capacity: int, tail_first: bool = False) -> np.ndarray:
    """Hit blocks per request (int64 ``[requests]``) under LFU-DA with ``capacity`` blocks, its
    references in the order of :func:`~advisor.policy.eviction.evlog.served`."""
    return run_kernel(_run, trace, capacity, tail_first)[0]


def replay(trace: CompactTrace, capacity: int, want_ev: np.ndarray, want_snap: np.ndarray,
           tail_first: bool = False) -> tuple:
    """``(hits, evictions, snapshots)`` with the logs of :mod:`advisor.policy.eviction.evlog`;
    ``tail_first`` as for :func:`simulate`."""
    return run_kernel(_run, trace, capacity, tail_first, want_ev, want_snap)


__all__ = ["replay", "simulate"]
