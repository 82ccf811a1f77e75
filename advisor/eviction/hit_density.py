"""Prefix hit density: evict the cached block with the lowest expected hits per unit of
space-time, learned online per reuse class and age (the default policy's kernel).

Mechanism after N. Beckmann, H. Chen and A. Cidon, "LHD: Improving Cache Hit Rate by
Maximizing Hit Density", USENIX NSDI 2018, §4: for a block of class ``c`` and age ``a``
(clock ticks since its last reference),

    HD(c, a) = Σ_{x ≥ a} hits_c(x) / Σ_{x ≥ a} Σ_{y ≥ x} events_c(y)

where ``hits_c(x)`` counts re-references of cached blocks of class ``c`` at age ``x`` and
``events_c`` = hits + evictions at that age (the denominator is the expected remaining
lifetime).  Counters decay by ``decay`` at every recomputation (every ``recompute`` ticks),
so the tables follow the trace.  Eviction samples ``samples`` cached blocks at random and
evicts the lowest HD; evicting a block evicts its cached descendants (a block without its
parent can never be hit, docs/traces.md).
"""

from __future__ import annotations

import heapq

import numba
import numpy as np

from advisor.eviction.compact import CompactTrace

BIG = 1.0e18


@numba.njit(cache=True)
def _recompute(hits_t: np.ndarray, ins: np.ndarray, hd: np.ndarray, decay: float) -> None:
    n_cls, n_bins = hits_t.shape
    for c in range(n_cls):
        total_h = 0.0
        for a in range(n_bins):
            total_h += hits_t[c, a]
        never = max(ins[c] - total_h, 0.0)
        cum_h = 0.0
        cum_e = never  # blocks never reused within the span leave at the last age
        life = 0.0
        for a in range(n_bins - 1, -1, -1):
            cum_h += hits_t[c, a]
            cum_e += hits_t[c, a]
            life += cum_e
            hd[c, a] = cum_h / life if life > 0 else 0.0
            hits_t[c, a] *= decay
        ins[c] *= decay


@numba.njit(cache=True)
def _run(flat: np.ndarray, offsets: np.ndarray, n_blocks: int, capacity: int, parent: np.ndarray,
         next_use: np.ndarray, lookahead: int, promote: bool, params: np.ndarray, seed: int) -> np.ndarray:
    max_seen = int(params[0])
    max_from_end = int(params[1])
    n_bins = int(params[2])
    span = params[3]  # ages up to span × capacity ticks are told apart
    samples = int(params[4])
    decay = params[5]
    recompute = max(int(params[6] * capacity), 1024)
    np.random.seed(seed)
    n_fe = max_from_end + 1
    n_cls = (max_seen + 1) * n_fe * 4 * 3 * 2
    kids = np.zeros(n_blocks, dtype=np.int32)
    width = max(1.0, span * capacity / n_bins)
    hits_t = np.zeros((n_cls, n_bins), dtype=np.float64)
    ins = np.zeros(n_cls, dtype=np.float64)
    hd = np.zeros((n_cls, n_bins), dtype=np.float64)
    for c in range(n_cls):
        for a in range(n_bins):
            hd[c, a] = 1.0 / (a + 1.0)  # LRU until the first recomputation
    n_req = offsets.shape[0] - 1
    seen = np.zeros(n_blocks, dtype=np.int32)
    last = np.zeros(n_blocks, dtype=np.int64)
    cls_of = np.zeros(n_blocks, dtype=np.int32)
    prot = np.zeros(n_blocks, dtype=np.float64)  # > 0: protected by lookahead (BIG - next request)
    slot = np.full(n_blocks, -1, dtype=np.int64)  # position in `held`, -1 = not cached
    held = np.empty(n_blocks, dtype=np.int32)
    first_child = np.full(n_blocks, -1, dtype=np.int32)
    sibling = np.full(n_blocks, -1, dtype=np.int32)
    for x in range(n_blocks):
        p = parent[x]
        if p >= 0:
            sibling[x] = first_child[p]
            first_child[p] = x
    stack = np.empty(n_blocks, dtype=np.int32)
    hits = np.zeros(n_req, dtype=np.int64)
    size = 0
    clock = 0
    next_recompute = recompute
    for i in range(n_req):
        a, b = offsets[i], offsets[i + 1]
        j = a
        while j < b and slot[flat[j]] >= 0:
            j += 1
        hits[i] = j - a
        if lookahead > 0 and i + lookahead < n_req:
            w = i + lookahead
            for jj in range(offsets[w], offsets[w + 1]):
                x = flat[jj]
                if slot[x] < 0:
                    if not promote or seen[x] == 0:
                        break
                    slot[x] = size
                    held[size] = x
                    size += 1
                    last[x] = clock
                if prot[x] == 0.0:
                    prot[x] = BIG - w
        seen_prefix = 0
        for jj in range(a, b):
            if seen[flat[jj]] == 0:
                break
            seen_prefix += 1
        cont = 1 if seen_prefix > 1 else 0
        n = b - a
        for jj in range(a, b):
            x = flat[jj]
            fe = min(n - 1 - jj + a, max_from_end)
            s = seen[x]
            if s > 0:
                age = int((clock - last[x]) / width)
                if age < n_bins:
                    hits_t[cls_of[x], age] += 1.0
            if jj + 1 < b and seen[flat[jj + 1]] == 0:
                kids[x] += 1
            lb = 0 if n < 16 else (1 if n < 64 else 2)
            spb = 1 if 2 * seen_prefix >= n else 0
            c = (((min(s, max_seen) * n_fe + fe) * 4 + min(kids[x], 3)) * 3 + lb) * 2 + spb
            seen[x] = s + 1
            last[x] = clock
            cls_of[x] = c
            ins[c] += 1.0
            nu = next_use[jj]
            prot[x] = BIG - nu if (lookahead > 0 and nu <= i + lookahead) else 0.0
            if slot[x] < 0:
                slot[x] = size
                held[size] = x
                size += 1
            clock += 1
        while size > capacity:
            best = -1
            best_v = np.inf
            for _ in range(samples):
                y = held[np.random.randint(0, size)]
                if prot[y] > 0.0:
                    v = prot[y]
                else:
                    age = int((clock - last[y]) / width)
                    v = hd[cls_of[y], min(age, n_bins - 1)]
                if v < best_v:
                    best_v = v
                    best = y
            top = 1
            stack[0] = best
            while top > 0:
                top -= 1
                u = stack[top]
                if slot[u] < 0:
                    continue
                k = slot[u]
                size -= 1
                z = held[size]
                held[k] = z
                slot[z] = k
                slot[u] = -1
                prot[u] = 0.0
                c2 = first_child[u]
                while c2 >= 0:
                    if slot[c2] >= 0:
                        stack[top] = c2
                        top += 1
                    c2 = sibling[c2]
        if clock >= next_recompute:
            _recompute(hits_t, ins, hd, decay)
            next_recompute = clock + recompute
    return hits


DEFAULT_PARAMS = np.array([4, 1, 128, 16.0, 64, 0.9, 1.0], dtype=np.float64)


def simulate(trace: CompactTrace, capacity: int, lookahead: int = 0, params: np.ndarray | None = None,
             promote: bool = True, seed: int = 1) -> np.ndarray:
    """Hit blocks per request (int64 ``[requests]``) under prefix hit density."""
    p = DEFAULT_PARAMS if params is None else params
    nu = trace.next_use() if lookahead > 0 else np.zeros(trace.refs, dtype=np.int64)
    return _run(trace.flat, trace.offsets, trace.n_blocks, capacity, trace.parent, nu, lookahead, promote, p, seed)


__all__ = ["simulate"]
