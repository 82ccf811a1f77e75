"""SIEVE: a FIFO queue with a visited bit and a moving hand.

Y. Zhang, J. Yang, Y. Yue, Y. Vigfusson and K. V. Rashmi, "SIEVE is Simpler than LRU: an
Efficient Turn-Key Eviction Algorithm for Web Caches", USENIX NSDI 2024, Algorithm 1.
New blocks go to the head with ``visited = 0``; a hit sets ``visited = 1`` and moves
nothing.  To evict, the hand (starting at the tail) moves towards the head clearing
visited bits until it finds an unvisited block, evicts it and stays at the block after it
(wrapping to the tail when it passes the head).
"""

from __future__ import annotations

import numba
import numpy as np

from advisor.policy.eviction.compact import CompactTrace
from advisor.policy.eviction.dlist import new_lists, push_head, unlink
from advisor.policy.eviction.evlog import as_arrays, log_eviction, log_resident, new_log, prefix_hit, run_kernel, served


@numba.njit(cache=True)
def _run(flat: np.ndarray, offsets: np.ndarray, n_blocks: int, capacity: int, want_ev: np.ndarray,
         want_snap: np.ndarray, tail_first: bool) -> tuple:
    prev, nxt, head, tail, size = new_lists(n_blocks, 1)
    cached = np.zeros(n_blocks, dtype=np.bool_)
    visited = np.zeros(n_blocks, dtype=np.bool_)
    n_req = offsets.shape[0] - 1
    hits = np.zeros(n_req, dtype=np.int64)
    hand = -1
    evl, snl = new_log(), new_log()
    for i in range(n_req):
        a, b = offsets[i], offsets[i + 1]
        if want_snap[i]:
            log_resident(snl, i, cached)
        hits[i] = prefix_hit(flat, a, b, cached)
        for step in range(b - a):
            j = served(a, b, step, tail_first)
            x = flat[j]
            if cached[x]:
                visited[x] = True
                continue
            if size[0] >= capacity:
                o = hand if hand >= 0 else tail[0]
                while visited[o]:
                    visited[o] = False
                    o = prev[o]  # towards the head (newer)
                    if o < 0:
                        o = tail[0]
                hand = prev[o]
                unlink(prev, nxt, head, tail, size, 0, o)
                cached[o] = False
                if want_ev[i]:
                    log_eviction(evl, i, step, o)
            push_head(prev, nxt, head, tail, size, 0, x)
            cached[x] = True
            visited[x] = False
    return hits, as_arrays(evl), as_arrays(snl)


def simulate(trace: CompactTrace, capacity: int, tail_first: bool = False) -> np.ndarray:
    """Hit blocks per request (int64 ``[requests]``) under SIEVE with ``capacity`` blocks, its
    references in the order of :func:`~advisor.policy.eviction.evlog.served`."""
    return run_kernel(_run, trace, capacity, tail_first)[0]


def replay(trace: CompactTrace, capacity: int, want_ev: np.ndarray, want_snap: np.ndarray,
           tail_first: bool = False) -> tuple:
    """``(hits, evictions, snapshots)`` with the logs of :mod:`advisor.policy.eviction.evlog`;
    ``tail_first`` as for :func:`simulate`."""
    return run_kernel(_run, trace, capacity, tail_first, want_ev, want_snap)


__all__ = ["replay", "simulate"]
