"""S3-FIFO: three static FIFO queues.

J. Yang, Y. Zhang, Z. Qiu, Y. Yue and K. V. Rashmi, "FIFO queues are all you need for cache
eviction", ACM SOSP 2023, §4 and Algorithm 1.  A small FIFO ``S`` (10 % of the tier), a
main FIFO ``M`` (90 %) and a ghost FIFO ``G`` of evicted ids (as many entries as ``M``).
A hit increments a 2-bit counter (capped at 3).  A miss inserts into ``M`` if the id is in
``G``, else into ``S``, after evicting while the tier is full.  Evicting: if ``|S|`` ≥ 10 %
of the tier, the tail of ``S`` moves to ``M`` if it was accessed while in ``S`` (counter ≥
``move_threshold``; the counter is cleared, and ``M`` evicts if it is over its share), else
it is evicted into ``G``; otherwise the tail of ``M`` is reinserted with its counter
decreased by one if the counter is > 0, else evicted.  ``move_threshold`` = 1 follows the
paper's text and the authors' libCacheSim code ("moved to M if it has been accessed").
"""

from __future__ import annotations

import numba
import numpy as np

from advisor.policy.eviction.compact import CompactTrace
from advisor.policy.eviction.dlist import new_lists, push_head, unlink
from advisor.policy.eviction.evlog import as_arrays, log_eviction, new_log, no_logging, served

S, M, G = 0, 1, 2


@numba.njit(cache=True, inline="always")
def _evict_m(prev: np.ndarray, nxt: np.ndarray, head: np.ndarray, tail: np.ndarray, size: np.ndarray,
             where: np.ndarray, freq: np.ndarray) -> int:
    while size[M] > 0:
        t = tail[M]
        unlink(prev, nxt, head, tail, size, M, t)
        if freq[t] > 0:
            freq[t] -= 1
            push_head(prev, nxt, head, tail, size, M, t)
        else:
            where[t] = -1
            return t
    return -1


@numba.njit(cache=True)
def _run(flat: np.ndarray, offsets: np.ndarray, n_blocks: int, capacity: int, small_ratio: float,
         move_threshold: int, want_ev: np.ndarray, want_snap: np.ndarray, tail_first: bool) -> tuple:
    prev, nxt, head, tail, size = new_lists(n_blocks, 3)
    where = np.full(n_blocks, -1, dtype=np.int8)
    freq = np.zeros(n_blocks, dtype=np.int8)
    s_cap = max(1, int(small_ratio * capacity))
    m_cap = max(1, capacity - s_cap)
    g_cap = m_cap
    n_req = offsets.shape[0] - 1
    hits = np.zeros(n_req, dtype=np.int64)
    evl, snl = new_log(), new_log()
    for i in range(n_req):
        a, b = offsets[i], offsets[i + 1]
        if want_snap[i]:
            for x in range(n_blocks):
                if where[x] == S or where[x] == M:
                    log_eviction(snl, i, 0, x)
        log = want_ev[i]
        j = a
        while j < b and (where[flat[j]] == S or where[flat[j]] == M):
            j += 1
        hits[i] = j - a
        for step in range(b - a):
            j = served(a, b, step, tail_first)
            x = flat[j]
            w = where[x]
            if w == S or w == M:
                if freq[x] < 3:
                    freq[x] += 1
                continue
            if w == G:  # a ghost hit leaves G before room is made (else G's trim could drop it twice)
                unlink(prev, nxt, head, tail, size, G, x)
                where[x] = -1
            while size[S] + size[M] >= capacity:
                if size[S] >= s_cap or size[M] == 0:
                    evicted = False
                    while not evicted and size[S] > 0:
                        t = tail[S]
                        unlink(prev, nxt, head, tail, size, S, t)
                        if freq[t] >= move_threshold:
                            freq[t] = 0
                            push_head(prev, nxt, head, tail, size, M, t)
                            where[t] = M
                            if size[M] > m_cap:
                                v = _evict_m(prev, nxt, head, tail, size, where, freq)
                                if log and v >= 0:
                                    log_eviction(evl, i, step, v)
                        else:
                            freq[t] = 0
                            push_head(prev, nxt, head, tail, size, G, t)
                            where[t] = G
                            if log:
                                log_eviction(evl, i, step, t)
                            if size[G] > g_cap:
                                g = tail[G]
                                unlink(prev, nxt, head, tail, size, G, g)
                                where[g] = -1
                            evicted = True
                else:
                    v = _evict_m(prev, nxt, head, tail, size, where, freq)
                    if log and v >= 0:
                        log_eviction(evl, i, step, v)
            freq[x] = 0
            if w == G:
                push_head(prev, nxt, head, tail, size, M, x)
                where[x] = M
            else:
                push_head(prev, nxt, head, tail, size, S, x)
                where[x] = S
    return hits, as_arrays(evl), as_arrays(snl)


def simulate(trace: CompactTrace, capacity: int, small_ratio: float = 0.1, move_threshold: int = 1,
             tail_first: bool = False) -> np.ndarray:
    """Hit blocks per request (int64 ``[requests]``) under S3-FIFO with ``capacity`` blocks.

    Args:
        small_ratio: share of the tier given to the small FIFO (paper: 0.1).
        move_threshold: accesses in ``S`` that earn a move to ``M`` (paper: 1).
        tail_first: the order of each request's references
            (:func:`~advisor.policy.eviction.evlog.served`); default: block by block.
    """
    return _run(trace.flat, trace.offsets, trace.n_blocks, capacity, small_ratio, move_threshold,
                *no_logging(trace.requests), tail_first)[0]


def replay(trace: CompactTrace, capacity: int, want_ev: np.ndarray, want_snap: np.ndarray,
           tail_first: bool = False) -> tuple:
    """``(hits, evictions, snapshots)`` with the paper's settings and the logs of
    :mod:`advisor.policy.eviction.evlog`; ``tail_first`` as for :func:`simulate`."""
    return _run(trace.flat, trace.offsets, trace.n_blocks, capacity, 0.1, 1, want_ev, want_snap, tail_first)


__all__ = ["replay", "simulate"]
