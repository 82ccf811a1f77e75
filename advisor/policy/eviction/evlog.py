"""Eviction logs of the compiled policy kernels, for the expert selector.

The expert selector (:mod:`advisor.policy.eviction.experts`) lets the real tier follow one
policy's decisions (the *leader*) while every policy replays the trace on its own.  For
that each policy kernel can record, for the requests it leads, every block it evicts, and
at the first request of each of its turns as leader, the blocks it holds.

A log is a pair of int64 lists kept in the kernel and returned as arrays:

* evictions: ``(request << 32) | step`` and the block id, where ``step`` is the index,
  in the order the policy serves the request's references, of the one being served when
  the block was evicted (its position in the request, or ``len(request) - 1 - position``
  for a kernel run tail first; ``len(request)`` for a policy that evicts after the whole
  request);
* snapshots: the request index and the block id of every block held just before it.

``want`` (bool ``[requests]``) says which requests to log; a kernel run for hit rates
alone passes all ``False`` and pays one test per eviction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numba
import numpy as np

if TYPE_CHECKING:
    from advisor.policy.eviction.compact import CompactTrace


@numba.njit(cache=True)
def new_log() -> tuple[list[int], list[int]]:
    """An empty log: ``(keys, blocks)`` typed int64 lists."""
    keys = [np.int64(0)]
    keys.pop()
    blocks = [np.int64(0)]
    blocks.pop()
    return keys, blocks


@numba.njit(cache=True, inline="always")
def log_eviction(log: tuple[list[int], list[int]], i: int, pos: int, v: int) -> None:
    """Record that block ``v`` was evicted at step ``pos`` of request ``i`` (module docstring)."""
    log[0].append((np.int64(i) << 32) | np.int64(pos))
    log[1].append(np.int64(v))


@numba.njit(cache=True)
def as_arrays(log: tuple[list[int], list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The log as two int64 arrays ``(keys, blocks)``."""
    n = len(log[0])
    k = np.empty(n, dtype=np.int64)
    b = np.empty(n, dtype=np.int64)
    for t in range(n):
        k[t] = log[0][t]
        b[t] = log[1][t]
    return k, b


@numba.njit(cache=True, inline="always")
def log_resident(log: tuple[list[int], list[int]], i: int, resident: np.ndarray) -> None:
    """Record every block with ``resident[x]`` (bool ``[blocks]``) as held before request
    ``i`` (a snapshot: position 0 of ``i``)."""
    for x in range(resident.shape[0]):
        if resident[x]:
            log_eviction(log, i, 0, x)


@numba.njit(cache=True, inline="always")
def prefix_hit(flat: np.ndarray, a: int, b: int, resident: np.ndarray) -> int:
    """How many of the request's blocks ``flat[a:b]`` are held from its first one on (the
    longest cached prefix, in blocks; docs/traces.md, "Hit")."""
    j = a
    while j < b and resident[flat[j]]:
        j += 1
    return j - a


@numba.njit(cache=True, inline="always")
def served(a: int, b: int, step: int, tail_first: bool) -> int:
    """Index in ``flat`` of the reference a kernel serves at ``step`` (0-based) of the request
    ``flat[a:b]``: block by block (the classic order of the baselines), or with
    ``tail_first`` last block first, the order in which vLLM returns a finished request's
    blocks to its free queue (``KVCacheManager.free``: "so that the tail blocks are evicted
    first"; :mod:`advisor.policy.eviction.experts`, "Tail first")."""
    return b - 1 - step if tail_first else a + step


def no_logging(n_requests: int) -> tuple[np.ndarray, np.ndarray]:
    """``(want_evictions, want_snapshot)`` that log nothing (bool ``[requests]`` each)."""
    z = np.zeros(n_requests, dtype=np.bool_)
    return z, z


def run_kernel(kernel: Callable[..., tuple], trace: CompactTrace, capacity: int, tail_first: bool,
               want_ev: np.ndarray | None = None, want_snap: np.ndarray | None = None) -> tuple:
    """``(hits, evictions, snapshots)`` of a block-level kernel over ``trace``: the calling
    convention of ARC, LFU-DA, LRU and SIEVE, ``kernel(flat, offsets, n_blocks, capacity,
    want_ev, want_snap, tail_first)``; without ``want_ev`` / ``want_snap`` nothing is logged
    (:func:`no_logging`)."""
    if want_ev is None or want_snap is None:
        want_ev, want_snap = no_logging(trace.requests)
    return kernel(trace.flat, trace.offsets, trace.n_blocks, capacity, want_ev, want_snap, tail_first)


__all__ = ["as_arrays", "log_eviction", "log_resident", "new_log", "no_logging", "prefix_hit", "run_kernel", "served"]
