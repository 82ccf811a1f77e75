"""ARC: Adaptive Replacement Cache.

N. Megiddo and D. S. Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache", USENIX
FAST 2003, Fig. 4.  Two cached LRU lists, T1 (seen once recently) and T2 (seen at least
twice), and two ghost lists of evicted ids, B1 and B2, with |T1|+|B1| ≤ c and
|T1|+|T2|+|B1|+|B2| ≤ 2c.  A ghost hit in B1 grows the target size ``p`` of T1 by
max(|B2|/|B1|, 1), one in B2 shrinks it by max(|B1|/|B2|, 1); REPLACE evicts the LRU of
T1 into B1 when |T1| > p (or |T1| = p and the reference is in B2), else the LRU of T2
into B2.  Every block reference of a request is one ARC reference.
"""

from __future__ import annotations

import numba
import numpy as np

from advisor.policy.eviction.compact import CompactTrace
from advisor.policy.eviction.dlist import new_lists, push_head, unlink
from advisor.policy.eviction.evlog import as_arrays, log_eviction, new_log, run_kernel, served

T1, T2, B1, B2 = 0, 1, 2, 3


@numba.njit(cache=True, inline="always")
def _replace(prev: np.ndarray, nxt: np.ndarray, head: np.ndarray, tail: np.ndarray, size: np.ndarray,
             where: np.ndarray, p: float, in_b2: bool) -> int:
    t1 = size[T1]
    if t1 >= 1 and ((in_b2 and t1 == p) or t1 > p or size[T2] == 0):
        v = tail[T1]
        unlink(prev, nxt, head, tail, size, T1, v)
        push_head(prev, nxt, head, tail, size, B1, v)
        where[v] = B1
        return v
    v = tail[T2]
    unlink(prev, nxt, head, tail, size, T2, v)
    push_head(prev, nxt, head, tail, size, B2, v)
    where[v] = B2
    return v


@numba.njit(cache=True)
def _run(flat: np.ndarray, offsets: np.ndarray, n_blocks: int, c: int, want_ev: np.ndarray,
         want_snap: np.ndarray, tail_first: bool) -> tuple:
    prev, nxt, head, tail, size = new_lists(n_blocks, 4)
    where = np.full(n_blocks, -1, dtype=np.int8)
    n_req = offsets.shape[0] - 1
    hits = np.zeros(n_req, dtype=np.int64)
    evl, snl = new_log(), new_log()
    p = 0.0
    for i in range(n_req):
        a, b = offsets[i], offsets[i + 1]
        if want_snap[i]:
            for x in range(n_blocks):
                if where[x] == T1 or where[x] == T2:
                    log_eviction(snl, i, 0, x)
        log = want_ev[i]
        j = a
        while j < b and (where[flat[j]] == T1 or where[flat[j]] == T2):
            j += 1
        hits[i] = j - a
        for step in range(b - a):
            j = served(a, b, step, tail_first)
            x = flat[j]
            w = where[x]
            if w == T1 or w == T2:  # case I
                unlink(prev, nxt, head, tail, size, w, x)
            elif w == B1:  # case II
                p = min(float(c), p + max(size[B2] / size[B1], 1.0))
                v = _replace(prev, nxt, head, tail, size, where, p, False)
                if log:
                    log_eviction(evl, i, step, v)
                unlink(prev, nxt, head, tail, size, B1, x)
            elif w == B2:  # case III
                p = max(0.0, p - max(size[B1] / size[B2], 1.0))
                v = _replace(prev, nxt, head, tail, size, where, p, True)
                if log:
                    log_eviction(evl, i, step, v)
                unlink(prev, nxt, head, tail, size, B2, x)
            else:  # case IV
                l1 = size[T1] + size[B1]
                if l1 == c:
                    if size[T1] < c:
                        v = tail[B1]
                        unlink(prev, nxt, head, tail, size, B1, v)
                        where[v] = -1
                        v = _replace(prev, nxt, head, tail, size, where, p, False)
                    else:
                        v = tail[T1]
                        unlink(prev, nxt, head, tail, size, T1, v)
                        where[v] = -1
                    if log:
                        log_eviction(evl, i, step, v)
                else:
                    total = l1 + size[T2] + size[B2]
                    if total >= c:
                        if total == 2 * c:
                            v = tail[B2]
                            unlink(prev, nxt, head, tail, size, B2, v)
                            where[v] = -1
                        v = _replace(prev, nxt, head, tail, size, where, p, False)
                        if log:
                            log_eviction(evl, i, step, v)
                push_head(prev, nxt, head, tail, size, T1, x)
                where[x] = T1
                continue
            push_head(prev, nxt, head, tail, size, T2, x)
            where[x] = T2
    return hits, as_arrays(evl), as_arrays(snl)


def simulate(trace: CompactTrace, capacity: int, tail_first: bool = False) -> np.ndarray:
    """Hit blocks per request (int64 ``[requests]``) under ARC with ``capacity`` blocks, its
    references in the order of :func:`~advisor.policy.eviction.evlog.served`."""
    return run_kernel(_run, trace, capacity, tail_first)[0]


def replay(trace: CompactTrace, capacity: int, want_ev: np.ndarray, want_snap: np.ndarray,
           tail_first: bool = False) -> tuple:
    """``(hits, evictions, snapshots)`` with the logs of :mod:`advisor.policy.eviction.evlog`;
    ``tail_first`` as for :func:`simulate`."""
    return run_kernel(_run, trace, capacity, tail_first, want_ev, want_snap)


__all__ = ["replay", "simulate"]
