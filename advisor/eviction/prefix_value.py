"""Prefix-value eviction (the default policy), compiled, with lookahead.

priority(block) = last access clock + horizon × value(class of the block at that access);
the lowest priority is evicted, a block's priority never exceeds its parent's within a
request (leaves first), and evicting a block evicts its cached descendants.
"""

from __future__ import annotations

import heapq

import numba
import numpy as np

from advisor.eviction.compact import CompactTrace

BIG = 1.0e18


@numba.njit(cache=True)
def _run(flat: np.ndarray, offsets: np.ndarray, n_blocks: int, capacity: int, parent: np.ndarray,
         next_use: np.ndarray, lookahead: int, params: np.ndarray) -> np.ndarray:
    horizon_mult = params[0]
    initial_horizon = params[1]
    max_seen = int(params[2])
    max_from_end = int(params[3])
    prior = params[4]
    prior_w = params[5]
    mode = int(params[6])
    cascade = params[7] > 0
    promote = params[8] > 0
    n_fe = max_from_end + 1
    n_ib = int(params[9]) + 1 if (mode == 1 or mode == 3) else 1
    ib_scale = params[10]
    n_cls = (max_seen + 1) * n_fe * 2 * n_ib
    if mode == 5:
        n_cls = (max_seen + 1) * n_fe * 4 * 3 * 2
    kids = np.zeros(n_blocks, dtype=np.int32)
    ins = np.zeros(n_cls, dtype=np.float64)
    reu = np.zeros(n_cls, dtype=np.float64)
    cdist = np.zeros(n_cls, dtype=np.float64)
    dist_sum = 0.0
    dist_n = 0
    n_req = offsets.shape[0] - 1
    seen = np.zeros(n_blocks, dtype=np.int32)
    last = np.zeros(n_blocks, dtype=np.int64)
    cls_of = np.zeros(n_blocks, dtype=np.int32)
    prio = np.full(n_blocks, np.nan, dtype=np.float64)  # nan = not cached
    # children lists from the fixed parent array
    first_child = np.full(n_blocks, -1, dtype=np.int32)
    sibling = np.full(n_blocks, -1, dtype=np.int32)
    for x in range(n_blocks):
        p = parent[x]
        if p >= 0:
            sibling[x] = first_child[p]
            first_child[p] = x
    hits = np.zeros(n_req, dtype=np.int64)
    heap = [(0.0, np.int64(0))]
    heap.pop()
    stack = np.empty(n_blocks, dtype=np.int32)
    size = 0
    clock = 0
    for i in range(n_req):
        a, b = offsets[i], offsets[i + 1]
        j = a
        while j < b and not np.isnan(prio[flat[j]]):
            j += 1
        hits[i] = j - a
        # lookahead: blocks of request i+K become visible; cached ones are protected
        if lookahead > 0 and i + lookahead < n_req:
            w = i + lookahead
            for jj in range(offsets[w], offsets[w + 1]):
                x = flat[jj]
                if np.isnan(prio[x]):
                    if not promote or seen[x] == 0:
                        break  # never seen: nothing to promote from a lower tier
                    size += 1
                    prio[x] = BIG - w
                    heapq.heappush(heap, (prio[x], np.int64(x)))
                elif prio[x] < BIG:
                    prio[x] = BIG - w
                    heapq.heappush(heap, (prio[x], np.int64(x)))
        seen_prefix = 0
        for jj in range(a, b):
            if seen[flat[jj]] == 0:
                break
            seen_prefix += 1
        cont = 1 if seen_prefix > 1 else 0
        horizon = initial_horizon if dist_n == 0 else horizon_mult * dist_sum / dist_n
        n = b - a
        parent_prio = np.inf
        for jj in range(a, b):
            x = flat[jj]
            pos = jj - a
            fe = min(n - 1 - pos, max_from_end)
            s = seen[x]
            if s > 0:
                reu[cls_of[x]] += 1.0
                cdist[cls_of[x]] += clock - last[x]
                dist_sum += clock - last[x]
                dist_n += 1
            c = (min(s, max_seen) * n_fe + fe) * 2 + cont
            if mode == 5:
                if jj + 1 < b and seen[flat[jj + 1]] == 0:
                    kids[x] += 1
                lb = 0 if n < 16 else (1 if n < 64 else 2)
                spb = 1 if 2 * seen_prefix >= n else 0
                c = (((min(s, max_seen) * n_fe + fe) * 4 + min(kids[x], 3)) * 3 + lb) * 2 + spb
            if mode == 1 or mode == 3:
                ib = 0
                if s > 0:
                    d = (clock - last[x]) / ib_scale
                    ib = 1
                    while d >= 2.0 and ib < n_ib - 1:
                        d *= 0.5
                        ib += 1
                c = c * n_ib + ib
            ins[c] += 1.0
            seen[x] = s + 1
            last[x] = clock
            cls_of[x] = c
            pr = (reu[c] + prior_w * prior) / (ins[c] + prior_w)
            if mode == 2 or mode == 3:
                dc = cdist[c] / reu[c] if reu[c] > 0 else initial_horizon
                pr = pr * dc * horizon_mult / horizon
            if mode == 6:
                pr = min(s + 1, max_seen + 1) / (max_seen + 1.0)
            if mode == 7:
                pr = 0.0 if s == 0 else 1.0
            if mode == 4:
                pr = 1.0 if next_use[jj] < n_req else 0.0
            nu = next_use[jj]
            if lookahead > 0 and nu <= i + lookahead:
                q = BIG - nu
            else:
                q = clock + horizon * pr - pos * 1e-6
            if q > parent_prio:
                q = parent_prio - 1e-6
            parent_prio = q
            if np.isnan(prio[x]):
                size += 1
            prio[x] = q
            heapq.heappush(heap, (q, np.int64(x)))
        clock += n
        while size > capacity:
            q, v = heapq.heappop(heap)
            if prio[v] != q:
                continue
            prio[v] = np.nan
            size -= 1
            if cascade:
                top = 0
                c2 = first_child[v]
                while c2 >= 0:
                    stack[top] = c2
                    top += 1
                    c2 = sibling[c2]
                while top > 0:
                    top -= 1
                    u = stack[top]
                    if not np.isnan(prio[u]):
                        prio[u] = np.nan
                        size -= 1
                        c2 = first_child[u]
                        while c2 >= 0:
                            stack[top] = c2
                            top += 1
                            c2 = sibling[c2]
        if len(heap) > 4 * capacity + 1024:
            heap = [(prio[v], np.int64(v)) for v in range(n_blocks) if not np.isnan(prio[v])]
            heapq.heapify(heap)
    return hits


DEFAULT_PARAMS = np.array([8.0, 100_000.0, 4, 1, 0.3, 1.0, 0, 1, 1, 12, 64.0], dtype=np.float64)


def simulate(trace: CompactTrace, capacity: int, lookahead: int = 0, params: np.ndarray | None = None) -> np.ndarray:
    """Hit blocks per request (int64 ``[requests]``) under prefix-value eviction."""
    p = DEFAULT_PARAMS if params is None else params
    nu = trace.next_use() if lookahead > 0 else np.zeros(trace.refs, dtype=np.int64)
    if lookahead <= 0:
        nu = nu + trace.requests + 1
    return _run(trace.flat, trace.offsets, trace.n_blocks, capacity, trace.parent, nu, lookahead, p)


__all__ = ["simulate"]
